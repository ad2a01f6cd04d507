"""The fields `gpuq status -o/--format` and `gpuq history -o` may show of a job, as squeue's -o and
sacct's --format pick theirs: ``gpuq status -o id,user,state,cpus,time_left``. Each field is a column with a header,
read from the job's line as the server gives it (service/display.py's helpers format it as the
default columns do); a field a line does not have (an array's pending tasks, one line for many)
shows "-"."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpuq.cli.render import duration, job, job_name, mib, one_line, result_summary, seconds, timestamp
from gpuq.cli.table import Cell
from gpuq.service.display import exit_status, time_limit, with_tasks
from gpuq.service.errors import InvalidSpec

Row = dict[str, Any]


def _get(key: str) -> Callable[[Row], str]:
    return lambda j: "-" if j.get(key) is None else str(j[key])


def _time(key: str) -> Callable[[Row], str]:
    return lambda j: timestamp(j.get(key))


def _time_left(j: Row) -> str:
    """A running job's time to its limit (squeue's %L); "-" where it has none or is not running."""
    if j.get("state") != "running" or not j.get("time_limit_s") or j.get("elapsed_s") is None:
        return "-"
    return time_limit(max(0, int(j["time_limit_s"] - j["elapsed_s"])))


def _command(j: Row, width: int = 60) -> str:
    if j.get("argv"):
        return one_line(" ".join(j["argv"]), width)
    return str(j.get("workload") or "-")


def gpus_cell(j: Row) -> str:
    """The GPUS cell: how many, and for a shared job its share of each (``share 3.0G``, ``2×share
    3.0G``), as squeue's TRES tells a GPU from a shard; then the type asked for (``2 a100``)."""
    typed = f" {j['gpu_type']}" if j.get("gpu_type") else ""  # a server from before --gpu-type sends none
    if not (j.get("shared") and j.get("mem_mib")):
        return f"{j['gpus']}{typed}"
    share = f"share {j['mem_mib'] / 1024:.1f}G"
    return (share if j["gpus"] == 1 else f"{j['gpus']}×{share}") + typed


def coloured(state: str) -> tuple[str, str | None]:
    """A job's or a GPU's state with the colour it is shown in on a terminal."""
    return state, {"running": "green", "busy": "green", "succeeded": "bold green", "failed": "red",
                   "offline": "red", "cancelled": "yellow", "timed_out": "red",
                   "pending": "cyan"}.get(state.split(" ")[0])


def _array(j: Row) -> str:
    """The array task as squeue writes it (12_3); "-" for a job of no array."""
    if j.get("array_id") is None:
        return "-"
    return f"{j['array_id']}_{j['array_index']}" if j.get("array_index") is not None else str(j["array_id"])


def _waited(j: Row) -> str:
    """How long it waited to start: from its submit to its start, or to now while it is pending
    ("-" for one that ended without starting)."""
    if j.get("waited_s") is not None:  # `gpuq history`'s lines carry it
        return duration(seconds(j["waited_s"]))
    if not j.get("submitted_at"):
        return "-"
    submitted = datetime.fromisoformat(j["submitted_at"])
    if j.get("started_at"):
        return duration(datetime.fromisoformat(j["started_at"]) - submitted)
    return duration(datetime.now(UTC) - submitted) if j.get("state") == "pending" else "-"


# name: (header, right-aligned, the cell of a job's line); durations left-aligned, as the default tables have them.
FIELDS: dict[str, tuple[str, bool, Callable[[Row], Cell]]] = {
    "id": ("ID", True, lambda j: str(j.get("ids") or j["id"])),
    "array": ("ARRAY", False, _array),
    "name": ("NAME", False, lambda j: job_name(j["name"])),
    "user": ("USER", False, _get("user")),
    "state": ("STATE", False, lambda j: coloured(j["state"])),
    "reason": ("REASON", False, lambda j: one_line(j.get("reason") or "-", 50)),
    "result": ("RESULT / REASON", False, lambda j: one_line(with_tasks(j, result_summary(job(j))), 50)),
    "gpus": ("GPUS", True, gpus_cell),
    "gpu_type": ("GPU TYPE", False, _get("gpu_type")),
    "cpus": ("CPUS", True, lambda j: "-" if j.get("cpus") is None else f"{j['cpus']:g}"),
    "host_mem": ("HOST MEM", True, lambda j: "-" if j.get("host_mem_mib") is None else mib(j["host_mem_mib"])),
    "node": ("NODE", False, _get("node")),
    "priority": ("PRIORITY", True, _get("priority")),
    "preemptible": ("PREEMPTIBLE", False, lambda j: "yes" if j.get("preemptible") else "-"),
    # Its word on a requeue after a failure of the machinery ("-": as its retries say).
    "requeue": ("REQUEUE", False, lambda j: "-" if j.get("requeue") is None else "yes" if j["requeue"] else "no"),
    # Why it failed, in one word (exit, cuda_oom, gpu_error, ...): gpuq's own, which sacct has not.
    "failure": ("FAILURE", False, lambda j: j.get("failure") or "-"),
    "submitted": ("SUBMITTED", False, _time("submitted_at")),
    "started": ("STARTED", False, _time("started_at")),
    "ended": ("ENDED", False, _time("ended_at")),
    "waited": ("WAITED", False, _waited),
    "elapsed": ("ELAPSED", False, lambda j: duration(seconds(j.get("elapsed_s")))),
    "time_limit": ("TIME LIMIT", True, lambda j: time_limit(j["time_limit_s"]) if j.get("time_limit_s") else "-"),
    "time_left": ("TIME LEFT", True, _time_left),
    "exit_code": ("EXIT", True, lambda j: exit_status(j.get("exit_code"))),
    "after": ("AFTER", False, lambda j: ",".join(map(str, j["after"])) if j.get("after") else "-"),
    "workdir": ("WORKDIR", False, _get("cwd")),
    "command": ("COMMAND", False, _command),
}


def _used(key: str, shown: Callable[[Any], str]) -> Callable[[Row], str]:
    """The cell of an ended job's usage summary field ``key`` ("-" where it has none)."""
    def cell(j: Row) -> str:
        value = (j.get("usage") or {}).get(key)
        return "-" if value is None else shown(value)
    return cell


# An ended job's usage, as `gpuq stats ID` summarises it and sacct's TotalCPU, MaxRSS and TRES
# usage give it: `gpuq history -o` only (a job in the queue has no summary yet).
USAGE_FIELDS: dict[str, tuple[str, bool, Callable[[Row], Cell]]] = {
    "gpu_hours": ("GPU-HOURS", True, _used("gpu_hours", lambda v: f"{v:.2f}")),
    "gpu_util": ("GPU UTIL", True, _used("utilization_mean", lambda v: f"{v:.0f}%")),
    "gpu_mem_peak": ("GPU MEM PEAK", True, _used("memory_peak_mib", mib)),
    "energy_kwh": ("ENERGY KWH", True, _used("energy_j", lambda v: f"{v / 3.6e6:.3f}")),
    "cpu_time": ("CPU TIME", True, _used("cpu_s", lambda v: duration(seconds(v)))),
    "host_mem_peak": ("HOST MEM PEAK", True, _used("host_mem_peak_mib", mib)),
}


# `gpuq status`'s job table without -o.
STATUS_DEFAULT = ["id", "user", "name", "state", "gpus", "node", "elapsed", "result"]


def parse(text: str, used: bool = False) -> list[str]:
    """``-o``'s field names, in order (case and spaces aside); InvalidSpec naming the first unknown one.
    ``used``: an ended job's usage fields too (`gpuq history`)."""
    names = [part.strip().lower() for part in text.split(",")]
    if not names or any(not n for n in names):
        raise InvalidSpec(f"--format takes field names separated by commas, e.g. id,user,state; got {text[:60]!r}")
    known = [*FIELDS, *(USAGE_FIELDS if used else ())]
    for n in names:
        if n not in known:
            hint = "" if used or n not in USAGE_FIELDS else f" ({n} is an ended job's: `gpuq history -o {n}`)"
            raise InvalidSpec(f"--format: no field {n[:40]!r}{hint}; the fields are {', '.join(known)}")
    return names


def columns(names: list[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """The headers of these fields and those aligned right."""
    field = {**FIELDS, **USAGE_FIELDS}
    return tuple(field[n][0] for n in names), frozenset(field[n][0] for n in names if field[n][1])


# The fields a table cuts to keep its columns narrow, whole: for lines a script splits (`-P`).
WHOLE = 10**6
_UNCUT: dict[str, Callable[[Row], Cell]] = {
    "name": lambda j: job_name(j["name"], WHOLE),
    "reason": lambda j: one_line(j.get("reason") or "-", WHOLE),
    "result": lambda j: one_line(with_tasks(j, result_summary(job(j))), WHOLE),
    "command": lambda j: _command(j, WHOLE),
}


def cells(names: list[str], j: Row, whole: bool = False) -> list[Cell]:
    """A job's cells of these fields; ``whole``: none cut to a column's width."""
    return [_UNCUT[n](j) if whole and n in _UNCUT else (FIELDS.get(n) or USAGE_FIELDS[n])[2](j) for n in names]
