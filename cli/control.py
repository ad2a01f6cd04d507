"""Steering the queue: `gpuq why`, `gpuq hold` and `gpuq release` (through the server), `gpuq drain`
and `gpuq resume` (admin commands on the database, like the services they steer)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuq.cli.client import Client
from gpuq.cli.jobs import selected
from gpuq.cli.render import print_json
from gpuq.service import constants as c

app = typer.Typer()

JobIds = Annotated[list[int] | None, typer.Argument(help="Job ids.", min=1)]
Array = Annotated[int | None, typer.Option(help="Every job of this array.", min=1)]


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
def hold(job_ids: JobIds = None, array: Array = None) -> None:
    """Keep pending jobs from starting until `gpuq release`."""
    _set_held(job_ids, array, "hold", "held")


@app.command()
def release(job_ids: JobIds = None, array: Array = None) -> None:
    """Let held jobs start again."""
    _set_held(job_ids, array, "release", "released")


def _set_held(job_ids: list[int] | None, array: int | None, move: str, done: str) -> None:
    """One request for all the jobs (an array's too). A job named by its id that cannot be held
    (it runs, or is held already) is an error: a line on stderr and, once the others are done,
    exit 4, as scontrol exits non-zero when one job of its list fails. An array's task that cannot
    is a line of the output and no error: its running and ended tasks are expected."""
    client = Client()
    targets = selected(client, job_ids, array)
    named = set(job_ids or [])
    answer = client.post(f"/jobs/{move}", {"ids": targets})["jobs"]
    refused = []
    for outcome in answer:
        if outcome["not"] is None:
            typer.echo(f"job {outcome['id']} {done}")
        elif outcome["id"] in named:
            refused.append(outcome["not"])
        else:
            typer.echo(outcome["not"])
    for why in refused:
        typer.echo(f"gpuq: {why}", err=True)
    if refused:
        raise typer.Exit(c.EXIT_CONFLICT)


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
