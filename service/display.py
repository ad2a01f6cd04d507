"""How a job and a span of time read in any front-end: the CLI's tables and the dashboard's pages
say it the same way."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from gpuq.service import constants as c
from gpuq.service.constants import State

if TYPE_CHECKING:  # the client renders the server's JSON with these too, and imports no SQLAlchemy
    from gpuq.service.models import Job


def duration(d: timedelta | None) -> str:
    if d is None:
        return "-"
    s = max(d.total_seconds(), 0.0)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    days, h = divmod(h, 24)
    return (f"{days}-" if days else "") + (f"{h}:{m:02d}:{sec:02d}" if h or days else f"{m}:{sec:02d}")


def printable(text: str) -> str:
    """``text`` with its control characters (newlines, escape sequences) written as escapes, so a
    job's name or command cannot move the cursor, recolour the terminal or forge a line (of a
    table, or of the server's log)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


# A pending job an admin held (``jobs.admin_hold``): only an admin may release it.
ADMIN_HELD = "held by an admin"


def held(job: Job | Any) -> str:
    """How a held job reads: held by its owner, or by an admin (whom alone it waits for)."""
    return ADMIN_HELD if getattr(job, "admin_hold", False) else "held"


def time_limit(seconds: int) -> str:
    """A time limit as `--time` takes it back and every front-end and end reason writes it:
    H:MM:SS, hours past a day going on counting (100:00:00)."""
    h, rest = divmod(int(seconds), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def idle_note(window_s: float, limit_s: int | None) -> str:
    """What `gpuq status` and the dashboard say of a running job whose GPUs sat idle through the
    idle window (GPUQ_IDLE_WINDOW), and when GPUQ_IDLE_LIMIT, where set, cancels it."""
    window = f"{window_s / 60:g} min" if window_s >= 60 else f"{window_s:g} s"
    return (f"idle GPU: mostly under {c.IDLE_UTILIZATION}% for the last {window}"
            + (f"; cancelled at {time_limit(limit_s)} idle" if limit_s else ""))


def utc(moment: datetime) -> str:
    """A moment as the server names it to a user, whose clock and zone may not be its own:
    ``2026-11-28 05:10:00 UTC``."""
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"


def expected_at(start: float, now: float) -> str:
    """An expected moment (epoch s) and how long until it, as `gpuq why` and `--test-only` give a
    start: ``2026-11-28 05:10:00 UTC, in 1:12:00`` (whole seconds, rounded up)."""
    return f"{utc(datetime.fromtimestamp(start, UTC))}, in {time_limit(math.ceil(start - now))}"


def exit_status(code: int | None) -> str:
    """A command's exit as a shell and `gpuq run` give it: its status, or for one killed by a
    signal 128+N and the signal's name (-9 is "137 (SIGKILL)"; Python's -N read as a bug)."""
    if code is None:
        return "-"
    if code >= 0:
        return str(code)
    from gpuq.service.failures import signal_name

    return f"{128 - code} ({signal_name(-code)})"


def result_summary(job: Job | Any) -> str:
    """One cell's worth of what a job produced, or why it waits or failed."""
    r = job.result or {}
    if job.state == State.SUCCEEDED:
        if "gflops" in r:
            return f"{r['gflops']:.1f} GFLOP/s"
        if "test_acc" in r:
            return f"test acc {r['test_acc']:.3f}"
        if job.kind in (c.KIND_COMMAND, c.KIND_INTERACTIVE):
            return "exit 0"
        return "done"
    if job.state == State.PENDING:
        return held(job) if job.held else (job.reason or "waiting for GPUs")
    if job.state == State.RUNNING and job.cancel_requested_at:
        # Preempted: by which job, which the listing shows waiting for "preempting".
        return str(job.reason) if preemption_asked(job.reason) else stopping(job)
    if job.state == State.RUNNING and job.kind == c.KIND_INTERACTIVE:
        return "interactive (gpuq alloc)"
    return job.reason or ""


def stopping(job: Job | Any) -> str:
    """What a running job its worker was asked to stop is doing: cancelling, requeueing (`gpuq
    requeue`, whose reason says so) or being preempted (the scheduler's, for a waiting job)."""
    if preemption_asked(job.reason):
        return c.BEING_PREEMPTED
    return c.REQUEUEING if requeue_asked(job.reason) else c.CANCELLING


def requeue_asked(reason: str | None) -> bool:
    """Whether the reason of a running job whose stop was asked says it goes back to the queue once
    stopped (`gpuq requeue`, or a preemption), not a cancel."""
    return (reason or "").startswith((c.REQUEUED_BY, c.REQUEUED_HELD_BY, c.PREEMPTED_BY))


def preemption_asked(reason: str | None) -> bool:
    """Whether the reason of a running job whose stop was asked says the scheduler asked it for a
    waiting job (``preempted_by``): requeued as preempted, with GPUQ_PREEMPT_GRACE to stop."""
    return (reason or "").startswith(c.PREEMPTED_BY)


def preempted_by(job_id: int, user: str) -> str:
    """A preempted job's reason: the waiting job its GPUs go to."""
    return f"{c.PREEMPTED_BY}job {job_id} of {user}"


def array_name(task_name: str) -> str:
    """An array's name from a task's: a task's is the array's with its index or sweep values
    (train[5], train[lr=0.1])."""
    return task_name[:task_name.rindex("[")] if task_name.endswith("]") and "[" in task_name else task_name


def share(part: float) -> str:
    """A share in whole percent, where a small one is not rounded to nothing: 7%, under 1%."""
    return "under 1%" if 0 < part < 0.005 else f"{part:.0%}"


def state_counts(counts: dict[str, int]) -> str:
    """How many jobs ended each way, the most first: "3 failed, 2 succeeded" (`gpuq history`)."""
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def drained(gpus: list[dict[str, Any]], nodes: dict[str, str | None]) -> list[tuple[str, str]]:
    """What is drained and why, as `sinfo -R` lists it under the GPUs of every front-end: each
    drained node (``nodes``: name -> reason), then each GPU drained on its own (its
    ``own_drain_reason`` in `gpuq status`'s JSON, its ``drain_reason`` in `gpuq devices`'), as (where,
    why)."""
    out = [(f"node {node}", why or "no reason given") for node, why in sorted(nodes.items())]
    # A GPU's own reason (lost, its worker did not start) also under a drained node: resuming the
    # node lifts both, and the admin should know the GPU's before they do.
    own = [(g, g["own_drain_reason"] if "own_drain_reason" in g else g.get("drain_reason")) for g in gpus]
    return out + [(f"{g['node']} GPU {g['index']}", why) for g, why in own if why]


def window_span(at: datetime | str, until: datetime | str | None) -> str:
    """A maintenance window's start and end (datetimes, or ISO times as the server's JSON gives
    them): ``at 2026-12-24 09:00:00 UTC until 2026-12-24 12:00:00 UTC`` (no end: until resumed)."""
    def moment(t: datetime | str) -> str:
        return utc(datetime.fromisoformat(t) if isinstance(t, str) else t)

    return f"at {moment(at)}" + (f" until {moment(until)}" if until else "")


def drain_ahead(node: str, window: dict[str, Any]) -> str:
    """A node's maintenance window to come (``window``: its ``at``, ``until`` and ``note``, ISO
    times, as `gpuq status`'s JSON gives it), as every front-end says it under the GPUs: when, why,
    and what it means until then."""
    return (f"node {node} drains {window_span(window['at'], window.get('until'))} "
            f"({window.get('note') or 'no reason given'}): only jobs whose time limit ends by then start there")


def ranges(numbers: list[int], most: int = 4) -> str:
    """Sorted whole numbers as squeue writes an array's tasks: runs as ``a-b``, the rest by commas,
    at most ``most`` pieces and then ``…`` (``0-3,7,9-12``)."""
    pieces: list[str] = []
    start = prev = None
    for n in [*sorted(set(numbers)), None]:  # an array swept has each index once per combination
        if n is not None and prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            pieces.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    return ",".join(pieces[:most]) + (",…" if len(pieces) > most else "")


def in_queue_order(rows: list[dict[str, Any]], arrays: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's queue (active jobs by id, then the ended ones) with its collapsed arrays'
    entries (``arrays``, see ``jobs.pending_tasks``) among the active jobs, each at its first task's place."""
    active = [j for j in rows if j["state"] in c.ACTIVE_STATES]
    merged = sorted([*active, *arrays], key=lambda j: j.get("first_id") or j["id"])
    return merged + [j for j in rows if j["state"] not in c.ACTIVE_STATES]


def with_tasks(j: dict[str, Any], why: str) -> str:
    """A collapsed array's reason with how many of its tasks wait for it; a job's as it is."""
    return why if "count" not in j else f"{why} ({j['count']} task{'s' if j['count'] != 1 else ''})"


def gpu_hours_text(h: float) -> str:
    """GPU-hours as fair share weighs them: a tenth, or two figures below one (two users' minutes
    read "0.0 and 0.0", the figures that decided)."""
    if h == 0 or h >= 0.1:
        return "0" if h == 0 else f"{h:.1f}"
    return f"{h:.{1 - math.floor(math.log10(h))}f}"  # two figures, no exponent: 0.015, 0.000040


def reserved_lines(gpus: list[dict[str, Any]]) -> list[str]:
    """A line for each node of ``gpus`` (each GPU with its node's ``NodeReserved`` figures) whose
    started jobs reserve CPU cores or host memory (`--cpus`, `--host-mem`): how much of its offer,
    as `gpuq status`, `gpuq devices` and the dashboard say it."""
    lines = []
    for node, r in sorted({g["node"]: g for g in gpus}.items()):
        if r.get("node_cpus") is not None and r.get("node_cpus_reserved"):
            lines.append(f"node {node}: {r['node_cpus_reserved']:g} of its {r['node_cpus']} CPU cores reserved by "
                         "jobs (--cpus)")
        if r.get("node_host_mem_mib") is not None and r.get("node_host_mem_reserved_mib"):
            lines.append(f"node {node}: {r['node_host_mem_reserved_mib']} of its {r['node_host_mem_mib']} MiB of host "
                         "memory reserved by jobs (--host-mem)")
    return lines
