"""`gpuq status` (the queue and the GPUs) and `gpuq workloads` (what can be submitted)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuq.cli.render import duration, job_dict, mib, one_line, print_json, result_summary
from gpuq.service import constants as c
from gpuq.service import inventory, jobs, usage
from gpuq.service.db import require_schema, session_scope
from gpuq.service.models import utcnow
from gpuq.service.settings import get_settings
from gpuq.service.workloads import CATALOGUE

app = typer.Typer()


@app.command()
def status(
    ended: Annotated[int, typer.Option("--ended", "-n", min=0, help="How many ended jobs to show.")] = 10,
    mine: Annotated[bool, typer.Option("--me", help="Only my jobs.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The queue (waiting, running and recently ended jobs) and the GPUs."""
    settings = get_settings()
    require_schema(settings)
    from gpuq.service.spec import current_user

    with session_scope(settings) as session:
        rows = jobs.list_jobs(session, ended_limit=ended, user=current_user() if mine else None)
        gpus = inventory.view(session, settings)
        idle = usage.idle_jobs(session, settings)
    now = utcnow()
    if as_json:
        print_json({"jobs": [job_dict(j) | {"elapsed_s": _secs(jobs.elapsed(j, now)), "idle": j.id in idle}
                             for j in rows],
                    "gpus": [g.__dict__ for g in gpus]})
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    queue = Table(title="jobs", title_justify="left", box=None, header_style="bold")
    for col in ("ID", "USER", "NAME", "STATE", "GPUS", "NODE", "ELAPSED", "RESULT / REASON"):
        queue.add_column(col, no_wrap=col != "RESULT / REASON", justify="right" if col in ("ID", "GPUS") else "left")
    for j in rows:
        # Users' text is escaped for rich: a name like "[/]" must print, not break the table.
        queue.add_row(str(j.id), escape(j.user), escape(one_line(j.name, 30)), _state(j.state), str(j.gpus),
                      escape(j.node or "-"), duration(jobs.elapsed(j, now)),
                      _idle(settings) if j.id in idle else escape(one_line(result_summary(j), 50)))
    devices = Table(title="gpus", title_justify="left", box=None, header_style="bold")
    for col in ("NODE", "GPU", "NAME", "MEMORY", "UTIL", "STATE", "JOB"):
        devices.add_column(col, justify="right" if col in ("GPU", "UTIL") else "left")
    for g in gpus:
        state = "offline" if not g.online else ("busy" if g.job_id else "idle")
        if g.drained:
            state += " (drained)"
        if g.foreign_mib:
            state += f" +{mib(g.foreign_mib)} foreign"
        devices.add_row(g.node, str(g.index), g.name, f"{mib(g.memory_used_mib)} / {mib(g.memory_total_mib)}",
                        "n/a" if g.utilization is None else f"{g.utilization}%", _state(state),
                        f"{g.job_id} ({g.job_user})" if g.job_id else "-")
    import sys

    # Piped output (grep, watch, a test) gets whole lines instead of columns squeezed into 80.
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    if rows:
        console.print(queue)
    else:
        console.print("no jobs")
    console.print()
    if gpus:
        console.print(devices)
    else:
        console.print("no GPUs registered: start the workers with `gpuq up`")


def _state(state: str) -> str:
    colour = {"running": "green", "busy": "green", "succeeded": "bold green", "failed": "red",
              "offline": "red", "cancelled": "yellow", "timed_out": "red", "pending": "cyan"}.get(state)
    return f"[{colour}]{state}[/]" if colour else state


def _idle(settings) -> str:
    return f"[yellow]idle GPU: mostly under {c.IDLE_UTILIZATION}% for the last {settings.idle_window / 60:g} min[/]"


def _secs(d) -> float | None:
    return None if d is None else round(d.total_seconds(), 3)


@app.command()
def workloads(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The built-in workloads, with their parameters and defaults."""
    if as_json:
        print_json({w.name: {"summary": w.summary, "min_gpus": w.min_gpus, "max_gpus": w.max_gpus,
                             "params": {p.name: {"type": p.type.__name__, "default": p.default, "help": p.help,
                                                 "choices": p.choices, "min": p.min, "max": p.max}
                                        for p in w.params}}
                    for w in CATALOGUE.values()})
        return
    for w in CATALOGUE.values():
        gpus = f"{w.min_gpus}" if w.max_gpus == w.min_gpus else f"{w.min_gpus}-{w.max_gpus or 'any'}"
        typer.echo(f"{w.name}  ({gpus} GPU{'s' if gpus != '1' else ''})\n    {w.summary}")
        for p in w.params:
            extra = f" [{'|'.join(p.choices)}]" if p.choices else ""
            typer.echo(f"    {p.flag:<18} {p.help}{extra} (default {p.default})")
        typer.echo("")
