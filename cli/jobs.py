"""One job at a time: `gpuq show`, `gpuq logs`, `gpuq wait`, `gpuq cancel`."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Annotated, Optional

import typer

from gpuq.cli.progress import bar, wanted
from gpuq.cli.render import duration, job_dict, print_json, printable, result_summary, timestamp
from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.db import require_schema, session_scope
from gpuq.service.errors import InvalidSpec, NotAllowed, StateConflict
from gpuq.service.settings import get_settings

app = typer.Typer()

JobId = Annotated[int, typer.Argument(help="The job's id.", min=1)]


@app.command()
def show(job_id: Annotated[Optional[int], typer.Argument(help="The job's id.", min=1)] = None,
         array: Annotated[Optional[int], typer.Option(help="A line for each job of this array.")] = None,
         as_json: Annotated[bool, typer.Option("--json")] = False,
         diff: Annotated[bool, typer.Option("--diff", help="Print the uncommitted changes recorded at submit.")]
         = False) -> None:
    """Everything about one job: its spec, state, GPUs, timing and result (or an array's jobs)."""
    settings = get_settings()
    require_schema(settings)
    if array is not None:
        _show_array(settings, array, as_json)
        return
    if job_id is None:
        raise InvalidSpec("name a job id, or --array ID")
    with session_scope(settings) as session:
        job = jobs.get_job(session, job_id)
        gpus = [g.index for g in jobs.job_gpus(session, job_id)]
        metrics = jobs.read_metrics(session, job_id)
        explains = job.failure not in (None, c.FAILURE_CANCELLED, c.FAILURE_TIMEOUT)
        tail = jobs.output_tail(session, job_id, c.FAILURE_TAIL_LINES) if explains else []
    data = job_dict(job, gpus or None)
    data["metrics"] = metrics
    data["last_output"] = tail
    if diff:
        _print_diff(job, as_json)
        return
    if as_json:
        print_json(data)
        return
    what = job.workload + " " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in job.params.items()) \
        if job.kind == c.KIND_WORKLOAD else " ".join(job.argv or [])
    lines = [
        ("job", f"{job.id}  {job.name}"),
        ("user", job.user),
        ("state", job.state + (f" ({job.reason})" if job.reason else "")),
        ("runs", what),
        ("directory", job.cwd or "-"),
        ("gpus", f"{job.gpus}" + (f" on {job.node}: {', '.join(map(str, gpus))}" if gpus else
                                  (f" on {job.node}" if job.node else ""))),
        ("worker", job.worker or "-"),
        ("submitted", timestamp(job.submitted_at)),
        ("started", timestamp(job.started_at)),
        ("ended", timestamp(job.ended_at)),
        ("elapsed", duration(jobs.elapsed(job))),
    ]
    asks = [f"{job.mem_mib} MiB free per GPU" if job.mem_mib else "",
            f"node {job.on_node}" if job.on_node else "",
            f"time limit {duration(timedelta(seconds=job.time_limit_s))}" if job.time_limit_s else "",
            f"{job.max_retries} retries" if job.max_retries else "",
            (f"after {'any end of' if job.after_any else ''} job {', '.join(map(str, job.after))}"
             .replace("  ", " ") if job.after else ""),
            f"priority {job.priority}" if job.priority else "", "held" if job.held else "",
            f"host memory limit {job.host_mem_mib} MiB" if job.host_mem_mib else ""]
    if any(asks):
        lines.append(("asks", "; ".join(a for a in asks if a)))
    if job.array_id is not None:
        lines.append(("array", f"{job.array_id}, task {job.array_index}"))
    if job.git_commit or job.git_dirty:
        lines.append(("commit", (job.git_commit or "none yet") + (" (dirty: `gpuq show --diff "
                                                                 f"{job.id}`)" if job.git_dirty else "")))
    if job.snapshot:
        lines.append(("snapshot", job.snapshot))
    for n, attempt in enumerate(job.attempts or [], 1):
        kind = f" [{attempt['failure']}]" if attempt.get("failure") else ""
        lines.append((f"attempt {n}", f"{attempt.get('state')}{kind}: {attempt.get('reason')} on {attempt.get('worker')}"))
    if job.failure:
        lines.append(("failure", job.failure))
    if job.exit_code is not None:
        lines.append(("exit code", str(job.exit_code)))
    for key, value in lines:
        typer.echo(f"{key:>10}  {printable(value)}")
    if job.result:
        typer.echo("    result")
        for key, value in job.result.items():
            shown = f"{value:.6g}" if isinstance(value, float) else value
            typer.echo(f"{key:>20}  {shown}")
    if tail:
        typer.echo(" last output")
        for line in tail:
            typer.echo("            " + line)
    if metrics:
        typer.echo("   metrics")
        for row in metrics:
            typer.echo("            " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in row.items()))


def _print_diff(job, as_json: bool) -> None:
    """The diff against the job's commit recorded at submit; nothing (exit 0) when there was none."""
    if as_json:
        print_json({"id": job.id, "git_commit": job.git_commit, "git_dirty": job.git_dirty,
                    "git_diff": job.git_diff, "git_diff_cut": job.git_diff_cut})
        return
    if job.git_commit is None and job.git_dirty is None:
        typer.echo(f"gpuq: job {job.id} recorded no git state (not submitted from a git work tree)", err=True)
        return
    sys.stdout.write(job.git_diff or "")
    sys.stdout.flush()


@app.command()
def resubmit(job_id: JobId, as_json: Annotated[bool, typer.Option("--json", help="Print the new job as JSON.")]
             = False) -> None:
    """Run a job again as a new job of yours: same command or workload, parameters, options,
    environment and snapshot."""
    from gpuq.service.resubmit import resubmit as again

    job = again(get_settings(), job_id)
    if as_json:
        print_json(job_dict(job))
    else:
        typer.echo(f"submitted job {job.id} (resubmit of {job_id})")


def _show_array(settings, array: int, as_json: bool) -> None:
    with session_scope(settings) as session:
        rows = [jobs.get_job(session, j) for j in jobs.array_jobs(session, array)]
    if as_json:
        print_json([job_dict(j) for j in rows])
        return
    for j in rows:
        typer.echo(f"{j.id:>6}  [{j.array_index}]  {j.state:<10} {duration(jobs.elapsed(j)):>8}  {result_summary(j)}")


@app.command()
def logs(job_id: JobId,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
         as_json: Annotated[bool, typer.Option("--json", help="The output as JSON (with -f: one chunk a line).")]
         = False,
         progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", show_default=False,
                                                          help="With -f, a training job's epoch bar (default: "
                                                               "on a terminal).")] = None,
         ) -> None:
    """A job's output (stdout and stderr as written)."""
    settings = get_settings()
    require_schema(settings)
    with session_scope(settings) as session:
        job = jobs.get_job(session, job_id)
        _check_reader(settings, job)
        epochs = job.params.get("epochs") if job.workload == "train" else None
    if as_json and not follow:
        with session_scope(settings) as session:
            state = jobs.get_job(session, job_id).state
            output = "".join(data for _, data in jobs.read_output(session, job_id))
        print_json({"id": job_id, "state": state, "output": output})
        return
    show = follow and not as_json and bool(epochs) and wanted(progress, sys.stdout, sys.stderr)
    with bar(epochs or 0, "epoch 0/" + str(epochs), show=show, stream=sys.stdout) as advance:
        _print_output(settings, job_id, follow, as_json, advance, epochs)


def _epochs_done(metrics: list[dict]) -> int:
    # The last row's epoch number, not the row count: a job resumed from a checkpoint starts past 0.
    return int(metrics[-1].get("epoch", len(metrics))) if metrics else 0


def _print_output(settings, job_id: int, follow: bool, as_json: bool, advance, epochs: int | None) -> None:
    seq = -1
    while True:
        with session_scope(settings) as session:
            state = jobs.get_job(session, job_id).state
            chunks = jobs.read_output(session, job_id, seq)
            done = _epochs_done(jobs.read_metrics(session, job_id)) if epochs else 0
        for seq, data in chunks:
            if as_json:
                sys.stdout.write(json.dumps({"id": job_id, "seq": seq, "data": data}, ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(data)
        sys.stdout.flush()
        advance(done, f"epoch {done}/{epochs}")
        if not follow or (state in c.END_STATES and not chunks):
            return
        time.sleep(c.CLIENT_POLL_SECONDS)


def _check_reader(settings, job) -> None:
    """A job's output is its owner's (and the admins'), unless GPUQ_SHARED_LOGS opens it to all."""
    from gpuq.service.spec import current_user

    me = current_user()
    if settings.shared_logs or job.user == me or me in settings.admin_users:
        return
    raise NotAllowed(f"job {job.id} belongs to {job.user}; only they or an admin may read its output")


def _selected(settings, job_ids: list[int] | None, array: int | None, user: str | None = None) -> list[int]:
    """The jobs a command acts on: ids, an array's jobs, or (cancel) a user's active jobs."""
    chosen = list(job_ids or [])
    with session_scope(settings) as session:
        for job_id in chosen:
            jobs.get_job(session, job_id)
        if array is not None:
            chosen += jobs.array_jobs(session, array)
        if user is not None:
            chosen += jobs.active_jobs_of(session, user)
    if not chosen and user is None:
        raise InvalidSpec("name the jobs: ids, --array ID" + (" or --user" if user is not None else ""))
    return list(dict.fromkeys(chosen))


def _until_ended(settings, job_ids: list[int], timeout: float | None,
                 advance=None) -> dict[int, str]:
    """The jobs' states once all have ended, or as they are when ``timeout`` seconds ran out;
    ``advance(ended, text)`` is told how many have ended after each look."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with session_scope(settings) as session:
            states = jobs.wait_states(session, job_ids)
        if advance is not None:
            ended = sum(s in c.END_STATES for s in states.values())
            advance(ended, f"{ended} of {len(job_ids)} jobs ended")
        if all(s in c.END_STATES for s in states.values()):
            return states
        if deadline is not None and time.monotonic() >= deadline:
            return states
        time.sleep(c.CLIENT_POLL_SECONDS)


@app.command()
def wait(job_ids: Annotated[Optional[list[int]], typer.Argument(help="Job ids.", min=1)] = None,
         array: Annotated[Optional[int], typer.Option(help="Every job of this array.")] = None,
         timeout: Annotated[Optional[float], typer.Option(help="Give up after this many seconds.")] = None,
         quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
         progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", show_default=False,
                                                          help="A bar of jobs ended (default: on a terminal).")]
         = None,
         as_json: Annotated[bool, typer.Option("--json", help="The jobs' end states as JSON.")] = False) -> None:
    """Block until the jobs end; exit 0 only if all of them succeeded."""
    settings = get_settings()
    require_schema(settings)
    job_ids = _selected(settings, job_ids, array)
    show = not quiet and not as_json and wanted(progress, sys.stderr)
    with bar(len(job_ids), f"0 of {len(job_ids)} jobs ended", show=show, stream=sys.stderr) as advance:
        states = _until_ended(settings, job_ids, timeout, advance)
    if as_json:
        print_json({str(j): states.get(j) for j in job_ids})
    if not all(s in c.END_STATES for s in states.values()):
        waiting = ", ".join(f"{j} ({s})" for j, s in states.items() if s not in c.END_STATES)
        typer.echo(f"gpuq: still waiting after {timeout:g} s: job {waiting}", err=True)
        raise typer.Exit(c.EXIT_TIMEOUT)
    if not quiet and not as_json:
        for job_id in job_ids:
            typer.echo(f"job {job_id} {states[job_id]}")
    if any(s != c.SUCCEEDED for s in states.values()):
        raise typer.Exit(c.EXIT_JOB_FAILED)


@app.command()
def cancel(job_ids: Annotated[Optional[list[int]], typer.Argument(help="Job ids.", min=1)] = None,
           array: Annotated[Optional[int], typer.Option(help="Every job of this array.")] = None,
           user: Annotated[bool, typer.Option("--user", help="All my waiting and running jobs.")] = False,
           no_wait: Annotated[bool, typer.Option("--no-wait", help="Do not wait for running jobs to stop.")] = False,
           ) -> None:
    """Cancel jobs: a waiting one at once, a running one by stopping its whole process tree."""
    settings = get_settings()
    require_schema(settings)
    from gpuq.service.spec import current_user

    targets = _selected(settings, job_ids, array, current_user() if user else None)
    if not targets:
        typer.echo("no active jobs to cancel")
        return
    stopping = []
    for job_id in targets:
        try:
            outcome = jobs.cancel(settings, job_id)
        except StateConflict as exc:
            if len(targets) == 1:
                raise
            typer.echo(f"job {job_id}: {exc}")  # in an array, ended tasks are no error
            continue
        if outcome.state == c.CANCELLED:
            typer.echo(f"job {job_id} cancelled")
        else:
            stopping.append(job_id)
    if not stopping:
        return
    if no_wait:
        for job_id in stopping:
            typer.echo(f"job {job_id} cancelling")
        return
    # The worker sends SIGTERM, waits kill_grace, then SIGKILLs: wait a little longer than that.
    states = _until_ended(settings, stopping, settings.kill_grace + 15)
    for job_id in stopping:
        state = states.get(job_id)
        typer.echo(f"job {job_id} {state}" if state in c.END_STATES else
                   f"job {job_id} still stopping: its worker has not confirmed yet")
