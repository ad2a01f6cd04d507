"""How well jobs used what they asked for, as SLURM's seff tells it: the share of its time limit a
job ran, and over an array's tasks, their GPUs' use summed and the longest task against the limit.

The time limit matters beyond the job itself: the backfill starts a job in a gap only if its limit
ends before the gap does, so a limit far above what a job needs keeps it (and its next copies)
waiting. Where a job that succeeded ran a small share of its limit, the summary suggests a nearer
one, which is what a user would tune before submitting the array again.

Pure: the client renders these from the server's JSON, and imports no SQLAlchemy for it."""

from __future__ import annotations

import math
from collections import Counter
from datetime import timedelta
from typing import Any

from gpuq.service.constants import END_STATES, State
from gpuq.service.display import duration, share, time_limit

# A nearer limit is suggested where the longest successful run took at most this share of its limit...
HINT_SHARE = 1 / 3
# ...and the suggestion is this many times that run, rounded up to a whole minute: room for a slower
# node or a busier GPU, as a lab would give it.
HINT_ROOM = 1.5


def time_used(wall_s: float | None, limit_s: int | None) -> float | None:
    """The share of its time limit a job ran (1.0: all of it); None without a limit or a start."""
    if not limit_s or wall_s is None:
        return None
    return wall_s / limit_s


def suggested_limit(longest_s: float, limit_s: int | None) -> int | None:
    """A time limit nearer a successful run of ``longest_s`` seconds than ``limit_s``, in whole
    minutes; None where the limit is near enough already (or there is none)."""
    if not limit_s or longest_s > HINT_SHARE * limit_s:
        return None
    return max(60, math.ceil(HINT_ROOM * longest_s / 60) * 60)


def limit_hint(longest_s: float | None, limit_s: int | None, what: str = "it") -> str | None:
    """The sentence that suggests a nearer limit, or None: ``it ran 4:10 of its 1:00:00 limit
    (7%): a limit nearer that (-t 0:07:00) lets the backfill start such jobs sooner``."""
    if longest_s is None:
        return None
    nearer = suggested_limit(longest_s, limit_s)
    if nearer is None or limit_s is None:
        return None
    return (f"{what} ran {duration(timedelta(seconds=longest_s))} of its {time_limit(limit_s)} limit "
            f"({share(longest_s / limit_s)}): a limit nearer that (-t {time_limit(nearer)}) lets the backfill "
            "start such jobs sooner")


def array_summary(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """An array's tasks summed (``tasks``: each with ``job_id``, ``index``, ``state``,
    ``time_limit_s`` and, for one that started, its usage summary's fields): their states, wall
    times (mean, longest), GPU-hours, utilisation (the mean of their samples), memory peak (the
    highest, and whose), energy and idle GPU-seconds, commands' CPU seconds (summed) and host memory
    peak (the highest, and whose), and the longest successful task against its limit."""
    started = [t for t in tasks if t.get("wall_s") is not None]
    succeeded = [t for t in started if t["state"] == State.SUCCEEDED]
    sampled = [t for t in started if t.get("utilization_mean") is not None and t.get("samples")]
    peaks = [t for t in started if t.get("memory_peak_mib") is not None]
    energies = [t["energy_j"] for t in started if t.get("energy_j") is not None]
    longest = max(started, key=lambda t: t["wall_s"], default=None)
    longest_ok = max(succeeded, key=lambda t: t["wall_s"], default=None)
    peak = max(peaks, key=lambda t: t["memory_peak_mib"], default=None)
    cpu = [t["cpu_s"] for t in started if t.get("cpu_s") is not None]  # commands' (cpu_use)
    host_peak = max((t for t in started if t.get("host_mem_peak_mib") is not None),
                    key=lambda t: t["host_mem_peak_mib"], default=None)
    limits = {t["time_limit_s"] for t in tasks}
    samples = sum(t["samples"] for t in sampled)
    states = Counter(t["state"] for t in tasks)
    # A nearer limit only once every task ended, none of them by its limit: a task still running may
    # run longer than the longest so far, and one that timed out needed more, not less.
    settled = all(state in END_STATES and state != State.TIMED_OUT for state in states)
    return {
        "tasks": len(tasks),
        "states": dict(states),
        "started": len(started),
        # One limit for the whole array, as a submit gives it (None: none); several after `gpuq update
        # -t` of some tasks, and then ``time_limits`` counts them.
        "time_limit_s": next(iter(limits)) if len(limits) == 1 else None,
        "time_limits": len(limits),
        "wall_mean_s": sum(t["wall_s"] for t in started) / len(started) if started else None,
        "wall_longest_s": longest["wall_s"] if longest else None,
        "longest_task": longest["job_id"] if longest else None,
        "time_used_max": max((u for t in started if (u := time_used(t["wall_s"], t["time_limit_s"])) is not None),
                             default=None),
        "gpu_hours": sum(t["gpu_hours"] for t in started),
        "utilization_mean": (sum(t["utilization_mean"] * t["samples"] for t in sampled) / samples
                             if samples else None),
        "memory_peak_mib": peak["memory_peak_mib"] if peak else None,
        "memory_peak_task": peak["job_id"] if peak else None,
        "energy_j": sum(energies) if energies else None,
        "idle_s": sum(t["idle_s"] for t in started),
        "samples": sum(t.get("samples") or 0 for t in started),
        "cpu_s": sum(cpu) if cpu else None,
        "host_mem_peak_mib": host_peak["host_mem_peak_mib"] if host_peak else None,
        "host_mem_peak_task": host_peak["job_id"] if host_peak else None,
        "limit_hint": limit_hint(longest_ok["wall_s"], longest_ok["time_limit_s"], "the longest successful task")
        if settled and longest_ok else None,
    }


def job_hint(state: str, wall_s: float | None, limit_s: int | None) -> str | None:
    """A nearer limit for a job that succeeded (``limit_hint``), else None."""
    return limit_hint(wall_s, limit_s) if state == State.SUCCEEDED else None


def cpu_use(u: Any) -> list[tuple[str, str]]:
    """A command's CPU line of its stats (``GET /v1/jobs/ID/stats``), as seff gives it: CPU seconds
    and the cores used on average (against its --cpus). None for a workload, an allocation, a
    running job or a server from before it."""
    cpu_s = getattr(u, "cpu_s", None)
    if cpu_s is None:
        return []
    cores = cpu_s / u.wall_s if u.wall_s else None
    cpu = f"{cpu_s:.1f} s" + ("" if cores is None else f", {cores:.2f} cores on average")
    if cores is not None and getattr(u, "cpus", None):
        cpu += f" ({share(cores / u.cpus)} of its --cpus {u.cpus:g})"
    return [("CPU", cpu)]


def host_memory_use(u: Any) -> list[tuple[str, str]]:
    """A command's host memory line of its stats, as seff's Memory Utilized and Efficiency: the
    most its processes were seen to hold (against its --host-mem). None where that is not known."""
    peak = getattr(u, "host_mem_peak_mib", None)
    if peak is None:
        return []
    text = f"{peak} MiB at its peak"
    if getattr(u, "host_mem_mib", None):
        text += f" ({share(peak / u.host_mem_mib)} of its --host-mem {u.host_mem_mib} MiB)"
    return [("host memory", text)]
