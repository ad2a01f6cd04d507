"""`gpuq status` (the queue and the GPUs) and `gpuq workloads` (what can be submitted)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from gpuq.cli.client import Client
from gpuq.cli.render import duration, job, mib, one_line, print_json, result_summary, seconds
from gpuq.service import constants as c

app = typer.Typer()


@app.command()
def status(
    ended: Annotated[int, typer.Option("--ended", "-n", min=0, help="How many ended jobs to show.")] = 10,
    mine: Annotated[bool, typer.Option("--me", help="Only my jobs.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The queue (waiting, running and recently ended jobs) and the GPUs."""
    answer = Client().get("/jobs", ended=ended, mine=1 if mine else None)
    rows, gpus = answer["jobs"], answer["gpus"]
    if as_json:
        print_json({"jobs": rows, "gpus": gpus})
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    queue = Table(title="jobs", title_justify="left", box=None, header_style="bold")
    for col in ("ID", "USER", "NAME", "STATE", "GPUS", "NODE", "ELAPSED", "RESULT / REASON"):
        queue.add_column(col, no_wrap=col != "RESULT / REASON", justify="right" if col in ("ID", "GPUS") else "left")
    idle_note = _idle(answer["idle_window_s"])
    for j in rows:
        # Users' text is escaped for rich: a name like "[/]" must print, not break the table.
        queue.add_row(str(j["id"]), escape(j["user"]), escape(one_line(j["name"], 30)), _state(j["state"]),
                      str(j["gpus"]), escape(j["node"] or "-"), duration(seconds(j["elapsed_s"])),
                      idle_note if j["idle"] else escape(one_line(result_summary(job(j)), 50)))
    devices = Table(title="gpus", title_justify="left", box=None, header_style="bold")
    for col in ("NODE", "GPU", "NAME", "MEMORY", "UTIL", "STATE", "JOB"):
        devices.add_column(col, justify="right" if col in ("GPU", "UTIL") else "left")
    for g in gpus:
        devices.add_row(escape(g["node"]), str(g["index"]), escape(g["name"]),
                        f"{mib(g['memory_used_mib'])} / {mib(g['memory_total_mib'])}",
                        "n/a" if g["utilization"] is None else f"{g['utilization']}%", _state(_gpu_state(g)),
                        f"{g['job_id']} ({escape(g['job_user'] or '')})" if g["job_id"] else "-")
    # Piped output (grep, watch, a test) gets whole lines instead of columns squeezed into 80.
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    console.print(queue if rows else "no jobs")
    console.print()
    console.print(devices if gpus else "no GPUs registered: start the workers with `gpuq up`")


def _gpu_state(g: dict[str, Any]) -> str:
    state = "offline" if not g["online"] else ("busy" if g["job_id"] else "idle")
    if g["drained"]:
        state += " (drained)"
    if g["foreign_mib"]:
        state += f" +{mib(g['foreign_mib'])} foreign"
    return state


def _state(state: str) -> str:
    colour = {"running": "green", "busy": "green", "succeeded": "bold green", "failed": "red",
              "offline": "red", "cancelled": "yellow", "timed_out": "red", "pending": "cyan"}.get(state)
    return f"[{colour}]{state}[/]" if colour else state


def _idle(window_s: float) -> str:
    return f"[yellow]idle GPU: mostly under {c.IDLE_UTILIZATION}% for the last {window_s / 60:g} min[/]"


@app.command()
def workloads(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The built-in workloads, with their parameters and defaults."""
    catalogue = Client().get("/workloads")
    if as_json:
        print_json({name: w | {"params": {p: {k: v for k, v in spec.items() if k != "flag"}
                                          for p, spec in w["params"].items()}}
                    for name, w in catalogue.items()})
        return
    for name, w in catalogue.items():
        lo, hi = w["min_gpus"], w["max_gpus"]
        gpus = f"{lo}" if hi == lo else f"{lo}-{hi or 'any'}"
        typer.echo(f"{name}  ({gpus} GPU{'s' if gpus != '1' else ''})\n    {w['summary']}")
        for p in w["params"].values():
            extra = f" [{'|'.join(p['choices'])}]" if p["choices"] else ""
            typer.echo(f"    {p['flag']:<18} {p['help']}{extra} (default {p['default']})")
        typer.echo("")
