"""`gpuq share`: each user's standing in the fair share, as SLURM's sshare shows it: the recent
GPU-hours (each counting half after the half-life) that put users in order at equal priority,
their jobs and GPUs now, and the GPUs each may hold at once where anyone is held to a limit.
Everyone sees everyone's, as `gpuq status` shows everyone's jobs."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuq.cli.client import Client
from gpuq.cli.render import print_json
from gpuq.cli.table import colours_wanted, render
from gpuq.service.display import gpu_hours_text

app = typer.Typer()


@app.command()
def share(as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False) -> None:
    """Each user's recent GPU-hours and place in the fair share: at equal priority, the user who
    used fewer goes first."""
    answer = Client().get("/share")
    if as_json:
        print_json(answer)
        return
    users = answer["users"]
    if not users:
        typer.echo("no recent GPU-hours and no jobs: every user starts even")
        return
    # Each user's GPU limit beside the GPUs they hold, where anyone has one (a server from before
    # per-user limits sends neither).
    limited = bool(answer.get("limited"))
    rows = [[str(u["order"]), u["user"], gpu_hours_text(u["gpu_hours"]), f"{u['gpus']:g}",
             *([str(u["gpu_limit"]) if u["gpu_limit"] else "-"] if limited else []), str(u["running"]),
             str(u["pending"])] for u in users]
    header = ("ORDER", "USER", "GPU-HOURS", "GPUS", *(("LIMIT",) if limited else ()), "RUNNING", "PENDING")
    typer.echo(render("fair share", header, rows, frozenset({"ORDER", "GPU-HOURS", "GPUS", "LIMIT", "RUNNING",
                                                             "PENDING"}), colours_wanted()))
    typer.echo(f"GPU-hours: recent use, each hour counting half after {answer['half_life_h']:g} h. At equal "
               "priority the user with fewer goes first; `gpuq why ID` names the job that goes before one.")
