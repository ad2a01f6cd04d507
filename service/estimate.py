"""A submission tried without queueing it (`gpuq submit --test-only`, as sbatch's): the submit's own
checks, then the queue as a whole pass reads it with the new jobs in it, and when each would start
(``forecast.start_times``, the estimate `gpuq status --start` gives). Nothing is written.

The new jobs are read as pending rows of ids no job has (negative, in submission order), submitted
now: they wait behind every job of their priority and their user's fair share as a submit's would,
through the pass's own rules (held, dependencies, --begin, an array's limit, a singleton's name,
drained nodes), not a copy of them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from gpuq.service import policy
from gpuq.service.db import read_scope
from gpuq.service.forecast import NO_START
from gpuq.service.models import utcnow
from gpuq.service.queue_read import pending_row, planned_starts, read_queue
from gpuq.service.settings import Settings
from gpuq.service.spec import JobSpec
from gpuq.service.submitting import checked, job_row


@dataclass(frozen=True)
class Estimate:
    """When one job of the submission would start: now, by ``start``, or not known (None); where
    (``node``, and ``gpus``, its GPUs' indices, as planned: other GPUs may free first); and why it
    would wait (a pass's reason)."""

    index: int | None  # its array index (None: not an array's)
    start: datetime | None
    now: bool
    node: str | None
    gpus: list[int]
    reason: str | None


def estimate(settings: Settings, specs: list[JobSpec]) -> list[Estimate]:
    """When each of ``specs`` would start if submitted now, after the checks a submit makes
    (InvalidSpec, NotAllowed, OverLimit, StateConflict as it raises them). Reads only."""
    specs, _ = checked(settings, specs)
    now = utcnow()
    rows = [job_row(s, now, position) for position, s in enumerate(specs)]
    first = -len(rows)  # ids below every real one, rising in submission order (the queue's tie-break)
    array = len(rows) > 1 or specs[0].array_index is not None
    for position, row in enumerate(rows):
        row.update(id=first + position, array_id=first if array else None)
    with read_scope(settings) as session:
        read = read_queue(session, settings, also=[pending_row(r) for r in rows])
        decision = policy.decide(read.policy)
        gpus: dict[int, list[policy.GpuState]] = {}
        starts = planned_starts(session, read, decision, where=gpus)
    placed = {p.job_id for p in decision.placements}
    out = []
    for spec, row in zip(specs, rows, strict=True):
        job_id, at_once = row["id"], row["id"] in placed
        start, on = starts.get(job_id), gpus.get(job_id, [])
        out.append(Estimate(
            index=spec.array_index, now=at_once, start=None if start is None else datetime.fromtimestamp(start, UTC),
            node=on[0].node if on else None, gpus=[g.index for g in on],
            reason=None if at_once else read.not_eligible.get(job_id) or decision.waiting.get(job_id)))
    return out


# What a job the estimate cannot plan waits for first, as a sentence's end.
_WAITS = {policy.HELD: "it is held: it waits for `gpuq release`",
          policy.DEPENDENCY: "it waits for its dependency first",
          # Planned from its begin time, unless a dependency waits too: then this is why it is not.
          policy.BEGIN_TIME: "it waits for its dependency, and its begin time",
          policy.NODE_DRAINED: "its node is drained",
          policy.NODE_DRAINING: "the nodes it fits drain before it could end there (`gpuq drain --at`)",
          policy.ARRAY_LIMIT: "its array runs no more tasks at once than its limit, --array ...%N",
          policy.USER_LIMIT: "its user holds the most GPUs allowed at once"}


def sentence(e: Estimate, now: datetime) -> str:
    """``e`` in words, as `gpuq why` says a start: ``would start now on n1 (GPU 0)``."""
    from gpuq.service.display import expected_at

    if e.now:
        return f"would start now on {e.node} (GPU {','.join(map(str, e.gpus))})"
    if e.start is None:
        return f"has no start time to count on ({_WAITS.get(e.reason or '', NO_START)})"
    if e.start <= now:
        return "would start at the scheduler's next pass"
    on = f" on {e.node} (GPU {','.join(map(str, e.gpus))})" if e.node is not None else ""
    return (f"would start by {expected_at(e.start.timestamp(), now.timestamp())}{on}, if the jobs before it run to "
            "their time limits")
