"""How the CLI shows things: durations, sizes, job summaries, JSON. Printing only, no queries."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import typer

from gpuq.service.display import duration, result_summary  # noqa: F401 - the CLI's names for them
from gpuq.service.models import Job


def mib(v: int | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1024:.1f}G" if v >= 1024 else f"{v}M"


def timestamp(t: datetime | None) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def job_dict(job: Job, gpus: list[int] | None = None) -> dict[str, Any]:
    """The job as JSON-ready data (the --json output)."""
    return {
        "id": job.id, "name": job.name, "user": job.user, "kind": job.kind, "workload": job.workload,
        "params": job.params, "argv": job.argv, "cwd": job.cwd, "gpus": job.gpus, "priority": job.priority,
        "state": job.state, "reason": job.reason, "node": job.node, "worker": job.worker,
        "gpu_indices": gpus, "exit_code": job.exit_code, "result": job.result,
        "mem_mib": job.mem_mib, "on_node": job.on_node, "time_limit_s": job.time_limit_s,
        "max_retries": job.max_retries, "attempts": job.attempts, "held": job.held, "after": job.after,
        "after_any": job.after_any, "array_id": job.array_id, "array_index": job.array_index,
        "failure": job.failure, "requeues": job.requeues, "host_mem_mib": job.host_mem_mib,
        "submitted_at": _iso(job.submitted_at), "dispatched_at": _iso(job.dispatched_at),
        "started_at": _iso(job.started_at), "ended_at": _iso(job.ended_at),
        "git_commit": job.git_commit, "git_dirty": job.git_dirty, "git_diff_cut": job.git_diff_cut,
        "snapshot": job.snapshot,
    }


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str, ensure_ascii=False))


def printable(text: str) -> str:
    """``text`` with its control characters (newlines, escape sequences) written as escapes, so a
    job's name or command cannot move the cursor, recolour the terminal or forge a line."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def one_line(text: str, width: int = 60) -> str:
    """Text made safe for a table cell: control characters shown, long text cut."""
    flat = printable(text)
    return flat if len(flat) <= width else flat[: width - 1] + "…"
