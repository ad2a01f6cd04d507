"""One job at a time: `gpuq show`, `gpuq logs`, `gpuq resubmit`."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client
from gpuq.cli.progress import bar, wanted
from gpuq.cli.render import (
    duration,
    exit_status,
    held,
    job,
    print_json,
    printable,
    result_lines,
    result_summary,
    seconds,
    time_limit,
    timestamp,
)
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.display import stopping
from gpuq.service.errors import InvalidSpec
from gpuq.service.units import AFTER_ANY, AFTER_OK, AFTER_SHOWN

app = typer.Typer()

JobId = Annotated[int, typer.Argument(help="The job's id.", parser=numbers.job_id)]


# A job's own word on a failure of the machinery (`--requeue`, `--no-requeue`) as `gpuq show` says it.
_REQUEUE_SHOWN: dict[bool | None, str] = {True: "requeue on a failure of its worker or GPU", False: "no requeue"}


@app.command()
def show(job_id: Annotated[int | None, typer.Argument(help="The job's id.", parser=numbers.job_id)] = None,
         array: Annotated[int | None, typer.Option(help="A line for each job of this array.",
                                                   parser=numbers.job_id)] = None,
         as_json: Annotated[bool, typer.Option("--json")] = False,
         diff: Annotated[bool, typer.Option("--diff", help="Print the uncommitted changes recorded at submit.")]
         = False) -> None:
    """Everything about one job: its spec, state, GPUs, timing and result (or an array's jobs)."""
    if array is not None and (job_id is not None or diff):
        raise InvalidSpec("give a job id or --array ID, not both" if job_id is not None else
                          "--diff is one job's: give its id, not --array")
    client = Client()
    if array is not None:
        _show_array(client, array, as_json)
        return
    if job_id is None:
        raise InvalidSpec("name a job id, or --array ID")
    if diff:
        _print_diff(client.get(f"/jobs/{job_id}/diff"), as_json)
        return
    data = client.get(f"/jobs/{job_id}")
    if as_json:
        print_json({k: v for k, v in data.items() if k not in ("elapsed_s", "output_readable")})
        return
    lines = _lines(job(data), data.get("context_mib"))
    kept = data.get("kept")  # a server from before kept runs sends none
    if kept:
        lines.append(("kept by", f"its {kept['client']}, heard from {kept['silent_s']:g} s ago; silent for "
                                 f"{kept['limit_s']:g} s, it ends the job (client_lost)"))
    # Names only: the values may be secrets, and a terminal is read over shoulders (--json has them).
    # The umask gpuq passes the job on is its own, not one the user set: it is left out.
    names = sorted(name for name in data.get("env") or () if name != c.UMASK_VARIABLE)
    if names:
        lines.append(("env", ", ".join(names) + " (values: gpuq show --json)"))
    for key, value in lines:
        typer.echo(f"{key:>10}  {printable(value)}")
    if data["result"]:
        typer.echo("\n".join(result_lines(data["result"])))
    if data["last_output"]:
        typer.echo(" last output")
        for line in data["last_output"]:
            typer.echo("            " + line)
    if data["metrics"]:
        typer.echo("   metrics")
        for row in data["metrics"]:
            typer.echo("            " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in row.items()))


def _lines(j: Any, context_mib: int | None = None) -> list[tuple[str, str]]:
    # As a shell would take it back: an empty value reads '' (not two spaces), a space stays in one word.
    what = j.workload + " " + " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in j.params.items()) \
        if j.kind == c.KIND_WORKLOAD else " ".join(j.argv or [])
    gpus = j.gpu_indices or []
    # As squeue's TIME_LEFT: a running job's time until its limit stops it (a watch looks every 0.2 s).
    left = j.time_limit_s - j.elapsed_s if j.state == State.RUNNING and j.time_limit_s and j.elapsed_s is not None \
        else None
    lines = [
        ("job", f"{j.id}  {j.name}"),
        ("user", j.user),
        ("state", j.state + (f" ({stopping(j)}: {j.reason})" if j.state == State.RUNNING and j.cancel_requested_at
                             else f" ({j.reason})" if j.reason else "")),
        ("runs", what),
        ("directory", j.cwd or "-"),
        ("gpus", f"{j.gpus}" + (f" on {j.node}: {', '.join(map(str, gpus))}" if gpus else
                                (f" on {j.node}" if j.node else ""))),
        # The CPU cores a running command is bound to (--cpus; SLURM's CPU_IDs); a server from before sends none.
        *([("cores", f"{j.cores} of {j.node}")] if getattr(j, "cores", None) else []),
        ("worker", j.worker or "-"),
        ("submitted", timestamp(j.submitted_at)),
        ("started", timestamp(j.started_at)),
        ("ended", timestamp(j.ended_at)),
        ("elapsed", duration(seconds(j.elapsed_s)) + (f" ({time_limit(max(left, 0))} left of its time limit)"
                                                      if left is not None else "")),
    ]
    # A shared job's --mem is its share of each GPU (packing.need_mib), a whole-GPU job's the free
    # memory a GPU must have: the same number, two meanings. A server from before "shared" sends none.
    shared = getattr(j, "shared", False)
    if shared and j.mem_mib:
        # In the GiB `gpuq why` gives a shared job's need in (packing.room_lines); the reserve is the
        # server's setting (a server from before it sent it: named, not guessed).
        reserve = f"{context_mib / 1024:.1f} GiB " if context_mib is not None else ""
        lines.append(("shares", f"{j.mem_mib / 1024:.1f} GiB of each GPU, plus its {reserve}CUDA context reserve "
                                "(GPUQ_SHARED_CONTEXT_MIB)"))
    asks = [f"{j.mem_mib} MiB free per GPU" if j.mem_mib and not shared else "",
            f"node {j.on_node}" if j.on_node else "",
            f"not on {', '.join(j.exclude_nodes)}" if getattr(j, "exclude_nodes", None) else "",
            "preemptible" if getattr(j, "preemptible", False) else "",
            f"GPU type {j.gpu_type}" if getattr(j, "gpu_type", None) else "",
            f"time limit {time_limit(j.time_limit_s)}" if j.time_limit_s else "",
            _signal_ahead(getattr(j, "signal", None)),  # a server from before --signal sends none
            f"not before {timestamp(j.begin_at)}" if getattr(j, "begin_at", None) else "",
            # A server from before --deadline sends none.
            f"deadline {timestamp(j.deadline_at)}" if getattr(j, "deadline_at", None) else "",
            f"{j.max_retries} retries" if j.max_retries else "",
            # Its own word on a failure of the machinery (none: as its retries say); a server from before sends none.
            _REQUEUE_SHOWN.get(getattr(j, "requeue", None), ""),
            # A server from before the kinds sends after_any alone.
            (f"{AFTER_SHOWN[getattr(j, 'after_kind', None) or (AFTER_ANY if j.after_any else AFTER_OK)]} job "
             f"{', '.join(_after_job(i, getattr(j, 'after_tasks', None)) for i in j.after)}" if j.after else ""),
            # A server from before singleton sends none.
            f"one job named {j.name!r} at a time (singleton)" if getattr(j, "singleton", False) else "",
            f"priority {j.priority}" if j.priority else "",
            held(j) if j.held else "",
            f"host memory limit {j.host_mem_mib} MiB" if j.host_mem_mib else "",
            # A server from before --cpus sends none.
            f"{j.cpus:g} CPU cores" if getattr(j, "cpus", None) else ""]
    if any(asks):
        lines.append(("asks", "; ".join(a for a in asks if a)))
    if j.array_id is not None:
        at_once = getattr(j, "array_limit", None)  # a server from before array limits sends none
        lines.append(("array", f"{j.array_id}, task {j.array_index}"
                      + (f"; at most {at_once} of its tasks at once" if at_once else "")))
    copied = _copied_to(getattr(j, "output_file", None), getattr(j, "error_file", None))
    if copied:
        lines.append(("copied", copied))
    asked = getattr(j, "mail", None)  # a server from before job mail sends none
    if asked:
        lines.append(("mail", asked["events"] + (f" to {asked['to']}" if asked.get("to") else "")))
    if j.git_commit or j.git_dirty:
        lines.append(("commit", (j.git_commit or "none yet") + (f" (dirty: `gpuq show --diff {j.id}`)"
                                                                if j.git_dirty else "")))
    if j.snapshot:
        removed = getattr(j, "snapshot_removed_at", None)  # a server from before retention sends none
        lines.append(("snapshot", j.snapshot + (f" (removed {timestamp(removed)}, past its retention)"
                                                if removed else "")))
    for n, attempt in enumerate(j.attempts or [], 1):
        kind = f" [{attempt['failure']}]" if attempt.get("failure") else ""
        said = f"{attempt.get('reason')}"
        # "requeued by alice" says its state already.
        said = said if said.startswith(f"{attempt.get('state')} ") else f"{attempt.get('state')}{kind}: {said}"
        lines.append((f"attempt {n}", f"{said} on {attempt.get('worker')}{_attempt_use(attempt)}"))
    if j.failure:
        lines.append(("failure", j.failure))
    if j.exit_code is not None:
        lines.append(("exit code", exit_status(j.exit_code)))
    return lines


def _attempt_use(attempt: dict[str, Any]) -> str:
    """What an earlier attempt's command used of its node, as its worker measured it: " (CPU 3.1 s,
    host memory 2048 MiB at its peak)", or nothing where neither is known."""
    use = ([f"CPU {attempt['cpu_s']:.1f} s"] if attempt.get("cpu_s") is not None else []) + (
        [f"host memory {attempt['host_mem_peak_mib']} MiB at its peak"]
        if attempt.get("host_mem_peak_mib") is not None else [])
    return f" ({', '.join(use)})" if use else ""


def _print_diff(data: dict[str, Any], as_json: bool) -> None:
    """The diff against the job's commit recorded at submit; nothing (exit 0) when there was none."""
    if as_json:
        print_json(data)
        return
    if data["git_commit"] is None and data["git_dirty"] is None:
        typer.echo(f"gpuq: job {data['id']} recorded no git state (not submitted from a git work tree)", err=True)
        return
    sys.stdout.write(data["git_diff"] or "")
    sys.stdout.flush()


@app.command()
def resubmit(job_id: JobId, as_json: Annotated[bool, typer.Option("--json", help="Print the new job as JSON.")]
             = False) -> None:
    """Run a job again as a new job of yours: same command or workload, parameters, options,
    environment and snapshot."""
    made = Client().post(f"/jobs/{job_id}/resubmit")["job"]
    if as_json:
        print_json(made)
    else:
        typer.echo(f"submitted job {made['id']} (resubmit of {job_id})")


def _after_job(job_id: int, tasks: dict[str, list[int]] | None) -> str:
    """A job waited for, with the array and index it is a task of where ``tasks`` names them (an
    aftercorr task's: it waits for the task of its index alone, whose id is not the one typed)."""
    task = (tasks or {}).get(str(job_id))
    return f"{job_id} (task {task[1]} of array {task[0]})" if task else str(job_id)


def _signal_ahead(text: str | None) -> str:
    """A job's --signal as `gpuq show` says it: "SIGUSR1 120 s before its time limit"."""
    if not text:
        return ""
    main_only, _, rest = text.rpartition(":")
    name, _, before = rest.partition("@")
    return f"SIG{name} {before} s before its time limit" + (" (main process)" if main_only else "")


def _copied_to(output: str | None, error: str | None) -> str:
    """Where `--output` and `--error` copy a command's output (as given: %j and the rest unfilled)."""
    if output and (error is None or error == output):
        return f"stdout and stderr to {output}"
    return "; ".join(part for part in (f"stdout to {output}" if output else "",
                                       f"stderr to {error}" if error else "") if part)


def _show_array(client: Client, array: int, as_json: bool) -> None:
    rows = client.get(f"/arrays/{array}")["jobs"]
    if as_json:
        print_json([{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows])
        return
    for r in rows:
        typer.echo(f"{r['id']:>6}  [{r['array_index']}]  {r['state']:<10} {duration(seconds(r['elapsed_s'])):>8}  "
                   f"{result_summary(job(r))}")


@app.command()
def logs(job_id: JobId,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
         as_json: Annotated[bool, typer.Option("--json", help="The output as JSON (with -f: one chunk a line).")]
         = False,
         progress: Annotated[bool | None, typer.Option("--progress/--no-progress", show_default=False,
                                                       help="With -f, a training job's epoch bar (default: "
                                                            "on a terminal).")] = None,
         stdout_only: Annotated[bool, typer.Option("--stdout", help="Its stdout alone.")] = False,
         stderr_only: Annotated[bool, typer.Option("--stderr", help="Its stderr alone (gpuq's own lines about "
                                                                    "the job are there).")] = False,
         ) -> None:
    """A job's output (stdout and stderr as written, or one of them)."""
    if stdout_only and stderr_only:
        raise InvalidSpec("give --stdout or --stderr, not both (neither: both streams, as written)")
    streams = {c.STDOUT} if stdout_only else {c.STDERR} if stderr_only else {c.STDOUT, c.STDERR}
    client = Client()
    # -f waits by nature: its first read, too, rides out a server restarting (client.Client._restarting).
    first = client.get(f"/jobs/{job_id}/output", ride_out=follow, after=-1)
    if as_json and not follow:
        print_json({"id": job_id, "state": first["state"],
                    "output": "".join(ch[1] for ch in first["chunks"] if ch[2] in streams)})
        return
    if first["state"] in (State.PENDING, State.DISPATCHED) and not first["chunks"] and not as_json:
        # Nothing to print yet: said on stderr, so that an empty answer does not read as a job that
        # printed nothing (as `gpuq attach` says why it waits).
        why = f" ({first['reason']})" if first.get("reason") else ""
        typer.echo(f"gpuq: job {job_id} has not started: {first['state']}{why}; "
                   + ("its output follows once it runs" if follow else "no output yet"), err=True)
    epochs = first["epochs"]
    show = follow and not as_json and bool(epochs) and wanted(progress, sys.stdout, sys.stderr)
    with bar(epochs or 0, f"epoch 0/{epochs}", show=show, stream=sys.stdout) as advance:
        _print_output(client, job_id, first, follow, as_json, advance, streams)


def _print_output(client: Client, job_id: int, answer: dict[str, Any], follow: bool, as_json: bool,
                  advance: Callable[[int, str], None], streams: set[int]) -> None:
    seq = -1
    while True:
        for seq, data, stream in answer["chunks"]:
            if stream not in streams:
                continue
            if as_json:
                sys.stdout.write(json.dumps({"id": job_id, "seq": seq, "data": data,
                                             "stream": "stderr" if stream == c.STDERR else "stdout"},
                                            ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(data)
        sys.stdout.flush()
        advance(answer["epochs_done"], f"epoch {answer['epochs_done']}/{answer['epochs']}")
        if not follow or (answer["state"] in c.END_STATES and not answer["chunks"]):
            return
        # The server answers as soon as there is news (a line, the job's end), or after the wait.
        # A server that restarts meanwhile is waited for (client.RIDE_OUT_SECONDS): the job goes on.
        answer = client.get(f"/jobs/{job_id}/output", ride_out=True, after=seq, wait=c.FOLLOW_WAIT_SECONDS,
                            state=answer["state"])
