"""How the CLI shows things: durations, sizes, job summaries, JSON. Printing only: the data is the
server's JSON."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import typer

from gpuq.service.display import (  # noqa: F401 - the CLI's names for them
    drain_ahead,
    drained,
    duration,
    exit_status,
    held,
    printable,
    reserved_lines,
    result_summary,
    time_limit,
)


def mib(v: int | float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1024:.1f}G" if v >= 1024 else f"{v:.0f}M"


def when(text: str | None) -> datetime | None:
    """An ISO time from the server, or None."""
    return datetime.fromisoformat(text) if text else None


def timestamp(t: datetime | str | None) -> str:
    if isinstance(t, str):
        t = when(t)
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def seconds(s: float | None) -> timedelta | None:
    return None if s is None else timedelta(seconds=s)


def job(data: dict[str, Any]) -> SimpleNamespace:
    """A job from the server's JSON, with attributes as the shared display functions read them."""
    return SimpleNamespace(**data)


def result_lines(result: dict[str, Any]) -> list[str]:
    """A job's result as `gpuq show` prints it (and `gpuq run` after a built-in workload)."""
    return ["    result"] + [f"{key:>20}  {f'{value:.6g}' if isinstance(value, float) else value}"
                             for key, value in result.items()]


def print_json(data: Any) -> None:
    typer.echo(json_text(data))


def json_text(data: Any) -> str:
    """JSON as every command prints it: indented, non-ASCII kept."""
    return json.dumps(data, indent=2, default=str, ensure_ascii=False)


def one_line(text: str, width: int = 60) -> str:
    """Text made safe for a table cell: control characters shown, long text cut."""
    flat = printable(text)
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def job_name(name: str, width: int = 30) -> str:
    """A job's name for a table cell: an array task's ``[index]`` (or a collapsed array's
    ``[5-9999]``) is kept whole, and the name before it is cut instead."""
    flat = printable(name)
    cut = flat.rfind("[")
    if len(flat) <= width or not flat.endswith("]") or cut <= 0 or len(flat) - cut > width // 2:
        return one_line(name, width)
    tail = flat[cut:]
    return flat[: width - len(tail) - 1] + "…" + tail


def drain_reasons(gpus: list[dict[str, Any]], nodes: dict[str, str | None],
                  ahead: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Why each drained node or GPU is drained (``display.drained``), a line each, then each drain
    planned (``ahead``: node -> ``{"at", "until", "note"}``): under the GPUs of `gpuq status` and
    `gpuq devices`."""
    return ([f"drained: {where}: {one_line(why, 160)}" for where, why in drained(gpus, nodes)]
            + [one_line(drain_ahead(node, d), 240) for node, d in sorted((ahead or {}).items())])
