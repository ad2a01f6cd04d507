"""`gpuq devices`: every GPU now, as nvitop and gpustat show it, once or refreshing with --watch."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client
from gpuq.cli.render import drain_reasons, job, mib, print_json, printable, reserved_lines
from gpuq.service import constants as c

if TYPE_CHECKING:
    from rich.table import Table

app = typer.Typer()

BAR_WIDTH = 10


def bar(percent: float | None, width: int = BAR_WIDTH) -> str:
    """``████░░░░░░ 40%``, or ``n/a`` when not available."""
    if percent is None:
        return "n/a"
    filled = round(max(0.0, min(percent, 100.0)) / 100 * width)
    colour = "green" if percent < 50 else "yellow" if percent < 80 else "red"
    return f"[{colour}]{'█' * filled}[/][dim]{'░' * (width - filled)}[/] {percent:3.0f}%"


def _processes(procs: list[dict[str, Any]]) -> str:
    if not procs:
        return "-"
    # A process's name is whatever it set (prctl): escaped, as a job's name is, before a terminal sees it.
    return ", ".join(f"{printable(p.get('name') or '?')}[{p['pid']}]"
                     + (f" {mib(p['memory_mib'])}" if p.get("memory_mib") else "") for p in procs)


def _shares(shares: list[dict[str, Any]] | None) -> str:
    """A shared GPU's jobs, each with what it uses of its share (the share includes its context reserve)."""
    return ", ".join(f"{s['job_id']} {mib(s['used_mib'])}/{mib(s['share_mib'])}" for s in shares or []) or "-"


def table(devices: list[dict[str, Any]], drained: dict[str, str | None] | None = None) -> Table:
    """The Rich table of the GPUs (``drained``: the drained nodes, each with its reason)."""
    from rich.markup import escape
    from rich.table import Table

    rows = [job(d) for d in devices]
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("NODE", "GPU", "NAME", "UTIL", "MEMORY", "TEMP", "POWER", "JOB", "USER", "FOREIGN PROCESSES"):
        t.add_column(col, no_wrap=True, justify="right" if col in ("GPU", "TEMP", "POWER") else "left")
    for d in rows:
        mem_pct = None if d.memory_used_mib is None else 100.0 * d.memory_used_mib / max(d.memory_total_mib, 1)
        memory = f"{bar(mem_pct)} {mib(d.memory_used_mib)}/{mib(d.memory_total_mib)}" if mem_pct is not None else "n/a"
        where = escape(d.node) + ("" if d.online else " [red](offline)[/]")
        index = str(d.index)
        if d.node in (drained or {}):
            where += " [yellow](drained)[/]"
        elif getattr(d, "drain_reason", None):
            index += " [yellow](drained)[/]"  # this GPU alone, not its node
        t.add_row(where, index, escape(d.name),
                  bar(d.utilization),
                  memory, "n/a" if d.temperature_c is None else f"{d.temperature_c}C",
                  "n/a" if d.power_w is None else f"{d.power_w:.0f}W",
                  escape(f"{d.job_id} {d.job_name}" if d.job_id else _shares(d.shares)),
                  escape(d.user or ", ".join(sorted({s["user"] or "?" for s in d.shares})) or "-"),
                  escape(_processes(d.foreign)))
    return t


def _read(client: Client) -> tuple[list[dict[str, Any]], dict[str, str | None]]:
    """Every GPU, each with whether its node is drained and why (``node_drained``,
    ``node_drain_reason``: its own ``drain_reason`` is the GPU's alone; ``node_drain_ahead``, a
    maintenance window to come), and the drained nodes."""
    answer = client.get("/devices")
    drained, ahead = answer.get("drained") or {}, answer.get("drains_ahead") or {}
    return [d | {"node_drained": d["node"] in drained, "node_drain_reason": drained.get(d["node"]),
                 "node_drain_ahead": ahead.get(d["node"])}
            for d in answer["devices"]], drained


@app.command()
def devices(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until interrupted.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, max=86400, help="Seconds between refreshes.")
                        ] = c.DEVICES_WATCH_SECONDS,
    count: Annotated[int | None, typer.Option(help="With --watch: stop after this many.",
                                              parser=numbers.whole(1))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON (with --watch: one document a line).")] = False,
) -> None:
    """Every GPU now: utilisation, memory, temperature, power, the job and user on it, foreign processes."""
    client = Client()
    if not watch:
        rows, drained = _read(client)
        if as_json:
            print_json(rows)
            return
        _print(rows, drained)
        return
    from rich.console import Console
    from rich.live import Live

    shown = 0
    try:
        if as_json or not sys.stdout.isatty():
            while count is None or shown < count:
                rows, drained = _read(client)
                if as_json:
                    typer.echo(json.dumps(rows, default=str))
                else:
                    _print(rows, drained)
                shown += 1
                if count is None or shown < count:
                    time.sleep(interval)
            return
        with Live(table(*_read(client)), console=Console(), auto_refresh=False) as live:
            shown = 1
            while count is None or shown < count:
                time.sleep(interval)
                live.update(table(*_read(client)), refresh=True)
                shown += 1
    except KeyboardInterrupt:
        pass


def _print(rows: list[dict[str, Any]], drained: dict[str, str | None]) -> None:
    from rich.console import Console

    # Piped output gets whole lines instead of columns squeezed into 80.
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 220)
    if rows:
        console.print(table(rows, drained))
        for line in drain_reasons(rows, drained, {r["node"]: r["node_drain_ahead"] for r in rows
                                                   if r.get("node_drain_ahead")}):
            console.print(line, markup=False, highlight=False)
        for line in reserved_lines(rows):
            console.print(line, markup=False, highlight=False)
    else:
        console.print("no GPUs registered: start the workers with `gpuq up`")
