"""Steering the queue: `gpuq why`, `gpuq hold` and `gpuq release` (through the server), `gpuq drain`
and `gpuq resume` (admin commands on the database, like the services they steer)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuq.cli.client import Client
from gpuq.cli.render import print_json

app = typer.Typer()

JobIds = Annotated[list[int], typer.Argument(help="Job ids.", min=1)]


@app.command()
def why(job_id: Annotated[int, typer.Argument(help="The job's id.", min=1)],
        as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Why a job waits (or how it ended), in a sentence with the figures."""
    answer = Client().get(f"/jobs/{job_id}/why")
    if as_json:
        print_json(answer)
    else:
        typer.echo(answer["why"])


@app.command()
def hold(job_ids: JobIds) -> None:
    """Keep pending jobs from starting until `gpuq release`."""
    client = Client()
    for job_id in job_ids:
        client.post(f"/jobs/{job_id}/hold")
        typer.echo(f"job {job_id} held")


@app.command()
def release(job_ids: JobIds) -> None:
    """Let held jobs start again."""
    client = Client()
    for job_id in job_ids:
        client.post(f"/jobs/{job_id}/release")
        typer.echo(f"job {job_id} released")


@app.command()
def drain(node: Annotated[str, typer.Argument(help="The node's name.")],
          reason: Annotated[str | None, typer.Option(help="Why, for `gpuq why` and `gpuq status`.")] = None,
          ) -> None:
    """Let a node's running jobs finish and start nothing new there (an admin command: it uses the database)."""
    _set_drained(node, True, reason)
    typer.echo(f"node {node} drained: running jobs finish, nothing new starts there")


@app.command()
def resume(node: Annotated[str, typer.Argument(help="The node's name.")]) -> None:
    """Undo `gpuq drain` (an admin command: it uses the database)."""
    _set_drained(node, False, None)
    typer.echo(f"node {node} resumed")


def _set_drained(node: str, drained: bool, reason: str | None) -> None:
    from gpuq.service import broker, inventory
    from gpuq.service.db import require_schema, write_scope
    from gpuq.service.settings import get_settings

    settings = get_settings()
    require_schema(settings)
    with write_scope(settings) as session:
        inventory.set_drained(session, node, drained, reason)
    if not drained:
        broker.wake_scheduler(settings)
