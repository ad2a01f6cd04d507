"""One job at a time: `gpuq show`, `gpuq logs`, `gpuq wait`, `gpuq cancel`."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Annotated, Optional

import typer

from gpuq.cli.render import duration, job_dict, print_json, result_summary, timestamp
from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.db import require_schema, session_scope
from gpuq.service.errors import InvalidSpec, StateConflict
from gpuq.service.settings import get_settings

app = typer.Typer()

JobId = Annotated[int, typer.Argument(help="The job's id.", min=1)]


@app.command()
def show(job_id: Annotated[Optional[int], typer.Argument(help="The job's id.", min=1)] = None,
         array: Annotated[Optional[int], typer.Option(help="A line for each job of this array.")] = None,
         as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
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
    for n, attempt in enumerate(job.attempts or [], 1):
        kind = f" [{attempt['failure']}]" if attempt.get("failure") else ""
        lines.append((f"attempt {n}", f"{attempt.get('state')}{kind}: {attempt.get('reason')} on {attempt.get('worker')}"))
    if job.failure:
        lines.append(("failure", job.failure))
    if job.exit_code is not None:
        lines.append(("exit code", str(job.exit_code)))
    for key, value in lines:
        typer.echo(f"{key:>10}  {value}")
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
         ) -> None:
    """A job's output (stdout and stderr as written)."""
    settings = get_settings()
    require_schema(settings)
    seq = -1
    while True:
        with session_scope(settings) as session:
            state = jobs.get_job(session, job_id).state
            chunks = jobs.read_output(session, job_id, seq)
        for seq, data in chunks:
            sys.stdout.write(data)
        sys.stdout.flush()
        if not follow or (state in c.END_STATES and not chunks):
            return
        time.sleep(c.CLIENT_POLL_SECONDS)


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


def _until_ended(settings, job_ids: list[int], timeout: float | None) -> dict[int, str]:
    """The jobs' states once all have ended, or as they are when ``timeout`` seconds ran out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with session_scope(settings) as session:
            states = jobs.wait_states(session, job_ids)
        if all(s in c.END_STATES for s in states.values()):
            return states
        if deadline is not None and time.monotonic() >= deadline:
            return states
        time.sleep(c.CLIENT_POLL_SECONDS)


@app.command()
def wait(job_ids: Annotated[Optional[list[int]], typer.Argument(help="Job ids.", min=1)] = None,
         array: Annotated[Optional[int], typer.Option(help="Every job of this array.")] = None,
         timeout: Annotated[Optional[float], typer.Option(help="Give up after this many seconds.")] = None,
         quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False) -> None:
    """Block until the jobs end; exit 0 only if all of them succeeded."""
    settings = get_settings()
    require_schema(settings)
    job_ids = _selected(settings, job_ids, array)
    states = _until_ended(settings, job_ids, timeout)
    if not all(s in c.END_STATES for s in states.values()):
        waiting = ", ".join(f"{j} ({s})" for j, s in states.items() if s not in c.END_STATES)
        typer.echo(f"gpuq: still waiting after {timeout:g} s: job {waiting}", err=True)
        raise typer.Exit(c.EXIT_TIMEOUT)
    if not quiet:
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
