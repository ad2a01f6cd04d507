"""Steering the queue: `gpuq why`, `gpuq hold`, `gpuq release`, `gpuq drain`, `gpuq resume`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gpuq.cli.render import print_json
from gpuq.service import broker, inventory, jobs
from gpuq.service.db import require_schema, session_scope
from gpuq.service.settings import get_settings

app = typer.Typer()

JobIds = Annotated[list[int], typer.Argument(help="Job ids.", min=1)]


@app.command()
def why(job_id: Annotated[int, typer.Argument(help="The job's id.", min=1)],
        as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Why a job waits (or how it ended), in a sentence with the figures."""
    from gpuq.service.explain import why as explain

    settings = get_settings()
    require_schema(settings)
    with session_scope(settings) as session:
        text = explain(session, settings, job_id)
        state = jobs.get_job(session, job_id).state
    if as_json:
        print_json({"id": job_id, "state": state, "why": text})
    else:
        typer.echo(text)


@app.command()
def hold(job_ids: JobIds) -> None:
    """Keep pending jobs from starting until `gpuq release`."""
    settings = get_settings()
    for job_id in job_ids:
        jobs.set_held(settings, job_id, True)
        typer.echo(f"job {job_id} held")


@app.command()
def release(job_ids: JobIds) -> None:
    """Let held jobs start again."""
    settings = get_settings()
    for job_id in job_ids:
        jobs.set_held(settings, job_id, False)
        typer.echo(f"job {job_id} released")


@app.command()
def drain(node: Annotated[str, typer.Argument(help="The node's name.")],
          reason: Annotated[Optional[str], typer.Option(help="Why, for `gpuq why` and `gpuq status`.")] = None,
          ) -> None:
    """Let a node's running jobs finish and start nothing new there."""
    _set_drained(node, True, reason)
    typer.echo(f"node {node} drained: running jobs finish, nothing new starts there")


@app.command()
def resume(node: Annotated[str, typer.Argument(help="The node's name.")]) -> None:
    """Undo `gpuq drain`."""
    _set_drained(node, False, None)
    typer.echo(f"node {node} resumed")


def _set_drained(node: str, drained: bool, reason: str | None) -> None:
    settings = get_settings()
    require_schema(settings)
    with session_scope(settings) as session:
        inventory.set_drained(session, node, drained, reason)
    if not drained:
        broker.wake_scheduler(settings)
