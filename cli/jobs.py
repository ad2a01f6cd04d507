"""One job at a time: `gpuq show`, `gpuq logs`, `gpuq wait`, `gpuq cancel`, `gpuq resubmit`."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client, Overdue, Refused
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
from gpuq.service.errors import InvalidSpec

app = typer.Typer()

JobId = Annotated[int, typer.Argument(help="The job's id.", parser=numbers.job_id)]


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
    lines = [
        ("job", f"{j.id}  {j.name}"),
        ("user", j.user),
        ("state", j.state + (f" ({c.CANCELLING}: {j.reason})" if j.state == State.RUNNING and j.cancel_requested_at
                             else f" ({j.reason})" if j.reason else "")),
        ("runs", what),
        ("directory", j.cwd or "-"),
        ("gpus", f"{j.gpus}" + (f" on {j.node}: {', '.join(map(str, gpus))}" if gpus else
                                (f" on {j.node}" if j.node else ""))),
        ("worker", j.worker or "-"),
        ("submitted", timestamp(j.submitted_at)),
        ("started", timestamp(j.started_at)),
        ("ended", timestamp(j.ended_at)),
        ("elapsed", duration(seconds(j.elapsed_s))),
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
            f"time limit {time_limit(j.time_limit_s)}" if j.time_limit_s else "",
            f"{j.max_retries} retries" if j.max_retries else "",
            (f"after {'any end of' if j.after_any else ''} job {', '.join(map(str, j.after))}"
             .replace("  ", " ") if j.after else ""),
            f"priority {j.priority}" if j.priority else "",
            held(j) if j.held else "",
            f"host memory limit {j.host_mem_mib} MiB" if j.host_mem_mib else ""]
    if any(asks):
        lines.append(("asks", "; ".join(a for a in asks if a)))
    if j.array_id is not None:
        at_once = getattr(j, "array_limit", None)  # a server from before array limits sends none
        lines.append(("array", f"{j.array_id}, task {j.array_index}"
                      + (f"; at most {at_once} of its tasks at once" if at_once else "")))
    copied = _copied_to(getattr(j, "output_file", None), getattr(j, "error_file", None))
    if copied:
        lines.append(("copied", copied))
    if j.git_commit or j.git_dirty:
        lines.append(("commit", (j.git_commit or "none yet") + (f" (dirty: `gpuq show --diff {j.id}`)"
                                                                if j.git_dirty else "")))
    if j.snapshot:
        removed = getattr(j, "snapshot_removed_at", None)  # a server from before retention sends none
        lines.append(("snapshot", j.snapshot + (f" (removed {timestamp(removed)}, past its retention)"
                                                if removed else "")))
    for n, attempt in enumerate(j.attempts or [], 1):
        kind = f" [{attempt['failure']}]" if attempt.get("failure") else ""
        lines.append((f"attempt {n}",
                      f"{attempt.get('state')}{kind}: {attempt.get('reason')} on {attempt.get('worker')}"))
    if j.failure:
        lines.append(("failure", j.failure))
    if j.exit_code is not None:
        lines.append(("exit code", exit_status(j.exit_code)))
    return lines


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


def selected(client: Client, job_ids: list[int] | None, array: int | None, mine: bool = False,
             ride_out: bool = False, deadline: float | None = None) -> list[int]:
    """The jobs a command acts on: ids, an array's jobs, or (cancel) the caller's active jobs.
    ``ride_out`` and ``deadline`` as for ``Client.get``."""
    if mine and (job_ids or array is not None):
        # scancel -u USER ID narrows to that user's; a union here would cancel every job of theirs.
        raise InvalidSpec("--user cancels all your jobs: give it alone, without job ids or --array")
    chosen = list(job_ids or [])
    if chosen:
        states_of(client, chosen, ride_out, deadline)  # every id must exist
    if array is not None:
        chosen += [r["id"] for r in client.get(f"/arrays/{array}", ride_out=ride_out, deadline=deadline)["jobs"]]
    if mine:
        chosen += client.get("/jobs/active")["ids"]
    if not chosen and not mine:
        raise InvalidSpec("name the jobs: ids, --array ID")
    return list(dict.fromkeys(chosen))


# Jobs `gpuq wait` names when it gives up: the line stays one line for an array of 10,000.
WAITING_SHOWN = 5
# Job ids asked about in one request: a query string of 500 ids stays under the server's 8 KiB
# request line (an array of 10,000 tasks is 20 requests a look).
STATES_PER_REQUEST = 500


def states_of(client: Client, job_ids: list[int], ride_out: bool = False,
              deadline: float | None = None) -> dict[int, str]:
    """Each job's state; Refused (exit 3) if one does not exist. ``ride_out``: wait for a server
    that restarts, until ``deadline`` at most (``Client.get``)."""
    states: dict[int, str] = {}
    for start in range(0, len(job_ids), STATES_PER_REQUEST):
        chunk = job_ids[start:start + STATES_PER_REQUEST]
        answer = client.get("/jobs/states", ride_out=ride_out, deadline=deadline,
                            ids=",".join(map(str, chunk)))["states"]
        states.update((int(k), v) for k, v in answer.items())
    return states


def _until_ended(client: Client, job_ids: list[int], deadline: float | None,
                 advance: Callable[[int, str], None] | None = None) -> dict[int, str]:
    """The jobs' states once all have ended, or as last seen when ``deadline`` (time.monotonic())
    passed; ``advance(ended, text)`` is told how many have ended after each look. A server that
    restarts meanwhile is waited for (client.RIDE_OUT_SECONDS), but not past the deadline: the
    jobs go on without it, and the caller's timeout is its own. A job never seen has no state."""
    states: dict[int, str] = {}
    while True:
        # An end state is final: each look asks only about the jobs that had not ended.
        try:
            states.update(states_of(client, [j for j in job_ids if states.get(j) not in c.END_STATES],
                                    ride_out=True, deadline=deadline))
        except Overdue:
            return states
        if advance is not None:
            ended = sum(s in c.END_STATES for s in states.values())
            advance(ended, f"{ended} of {len(job_ids)} jobs ended")
        if all(s in c.END_STATES for s in states.values()):
            return states
        if deadline is not None and time.monotonic() >= deadline:
            return states
        time.sleep(c.CLIENT_POLL_SECONDS)


@app.command()
def wait(job_ids: Annotated[list[int] | None, typer.Argument(help="Job ids.", parser=numbers.job_id)] = None,
         array: Annotated[int | None, typer.Option(help="Every job of this array.", parser=numbers.job_id)] = None,
         timeout: Annotated[float | None, typer.Option(min=0, help="Give up after this many seconds.")] = None,
         quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
         progress: Annotated[bool | None, typer.Option("--progress/--no-progress", show_default=False,
                                                       help="A bar of jobs ended (default: on a terminal).")]
         = None,
         as_json: Annotated[bool, typer.Option("--json", help="The jobs' end states as JSON.")] = False) -> None:
    """Block until the jobs end; exit 0 only if all of them succeeded."""
    # The timeout is the whole command's: a server away meanwhile does not stretch it.
    deadline = None if timeout is None else time.monotonic() + timeout
    client = Client()
    try:
        # A wait is a follower from its first read: a server restarting as it begins is waited for.
        job_ids = selected(client, job_ids, array, ride_out=True, deadline=deadline)
    except Overdue:
        # Timed out before the server answered once: the jobs, if named, with no state seen.
        if as_json:
            print_json({str(j): None for j in job_ids or []})
        _timed_out(timeout or 0.0, _still_waiting(list(job_ids or []), {}) or f"the jobs of array {array}")
    show = not quiet and not as_json and wanted(progress, sys.stderr)
    with bar(len(job_ids), f"0 of {len(job_ids)} jobs ended", show=show, stream=sys.stderr) as advance:
        states = _until_ended(client, job_ids, deadline, advance)
    if as_json:
        print_json({str(j): states.get(j) for j in job_ids})
    left = _still_waiting(job_ids, states)
    if left:
        _timed_out(timeout or 0.0, left)
    if not quiet and not as_json:
        for job_id in job_ids:
            typer.echo(f"job {job_id} {states[job_id]}")
    if any(s != State.SUCCEEDED for s in states.values()):
        raise typer.Exit(c.EXIT_JOB_FAILED)


def _still_waiting(job_ids: list[int], states: dict[int, str]) -> str:
    """The jobs not ended, as the timed-out line names them ("job 4 (running), 5 (unknown)"); "" if none."""
    left = [f"{j} ({states.get(j, 'unknown')})" for j in job_ids if states.get(j) not in c.END_STATES]
    more = f" and {len(left) - WAITING_SHOWN} more" if len(left) > WAITING_SHOWN else ""
    return f"job {', '.join(left[:WAITING_SHOWN])}{more}" if left else ""


def _timed_out(timeout: float, left: str) -> NoReturn:
    """End as a wait whose --timeout ran out ends: one line naming what it still waited for, exit 5."""
    typer.echo(f"gpuq: still waiting after {timeout:g} s: {left}", err=True)
    raise typer.Exit(c.EXIT_TIMEOUT)


@app.command()
def cancel(job_ids: Annotated[list[int] | None, typer.Argument(help="Job ids.", parser=numbers.job_id)] = None,
           array: Annotated[int | None, typer.Option(help="Every job of this array (one summary line).",
                                                     parser=numbers.job_id)]
           = None,
           user: Annotated[bool, typer.Option("--user", help="All my waiting and running jobs.")] = False,
           no_wait: Annotated[bool, typer.Option("--no-wait", help="Do not wait for running jobs to stop.")] = False,
           ) -> None:
    """Cancel jobs: a waiting one at once, a running one by stopping its whole process tree."""
    if not job_ids and array is None and not user:
        raise InvalidSpec("name the jobs: ids, --array ID, or --user for all of yours")
    client = Client()
    targets = selected(client, job_ids, array, user)
    if not targets:
        typer.echo("no active jobs to cancel")
        return
    # One request for them all: the server checks every job before it cancels any.
    answer = client.post("/jobs/cancel", {"ids": targets})
    grace = answer["kill_grace_s"]
    ended = [o for o in answer["jobs"] if o["ended"]]
    if len(targets) == 1 and ended:
        raise Refused(f"job {ended[0]['id']} already ended ({ended[0]['state']})", c.EXIT_CONFLICT)
    # An array's tasks are counted in one line (10,000 of them were 10,000 lines); jobs named by id,
    # or --user's, a line each.
    named = set(targets) if array is None else set(job_ids or [])
    tasks: dict[int, str] = {}  # an array's task → what became of it: its state, or "ended" before the cancel
    stopping = []
    for outcome in answer["jobs"]:
        job_id, state = outcome["id"], outcome["state"]
        if job_id not in named:
            tasks[job_id] = "ended" if outcome["ended"] else state
        elif outcome["ended"]:
            typer.echo(f"job {job_id}: already ended ({state})")
        elif state == State.CANCELLED:
            typer.echo(f"job {job_id} cancelled")
        if not outcome["ended"] and state != State.CANCELLED:
            stopping.append(job_id)
    # Every job had ended, named by id or an array's: nothing was cancelled, as for one such job
    # (exit 4), and as `hold --array` says of an array none of whose tasks changed. Some ended among
    # others is no error.
    conflict = len(ended) == len(targets)
    if stopping and no_wait:
        for job_id in stopping:
            if job_id in named:
                typer.echo(f"job {job_id} cancelling")
    elif stopping:
        # The worker sends SIGTERM, waits kill_grace, then SIGKILLs: wait a little longer than that.
        states = _until_ended(client, stopping, time.monotonic() + grace + 15)
        for job_id in stopping:
            state = states.get(job_id)
            if job_id not in named:
                tasks[job_id] = state if state in c.END_STATES else "stopping"
            else:
                typer.echo(f"job {job_id} {state}" if state in c.END_STATES else
                           f"job {job_id} still stopping: its worker has not confirmed yet")
    if array is not None:
        typer.echo(array_cancelled(array, list(tasks.values())))
    if conflict:
        raise typer.Exit(c.EXIT_CONFLICT)


def array_cancelled(array: int, outcomes: list[str]) -> str:
    """The line `gpuq cancel --array` prints: how many of the array's tasks were cancelled, and
    what became of the others. ``outcomes``: each task's state after the cancel, "ended" for one
    that had ended before it, "stopping" for one whose worker has not confirmed its stop."""
    counts = Counter(outcomes)
    if counts["ended"] == len(outcomes):
        which = "its job" if len(outcomes) == 1 else f"all {len(outcomes):,} of its jobs"
        return f"nothing to cancel in array {array}: {which} had already ended"
    cancelled = counts.pop(State.CANCELLED, 0)
    line = f"cancelled {cancelled:,} job{'' if cancelled == 1 else 's'} of array {array}"
    others = []
    if counts[c.CANCELLING]:
        others.append(f"{counts.pop(c.CANCELLING):,} running, being stopped")
    if counts["stopping"]:
        others.append(f"{counts.pop('stopping'):,} still stopping: their worker has not confirmed yet")
    before = counts.pop("ended", 0)
    # A running task that ended on its own while its worker was being asked to stop it.
    others += [f"{n:,} {state} meanwhile" for state, n in sorted(counts.items()) if n]
    if before:
        others.append(f"{before:,} had already ended")
    return "; ".join([line, *others])
