"""When each pending job is expected to start (`gpuq status --start`, `gpuq why`), as SLURM's
`squeue --start` gives it: a pure function over the queue's state, as ``policy.decide`` is.

The queue is walked in its order (priority, fair share, submit). What the scheduler places now
starts now; every other job is planned at the earliest moment its GPUs (all on one node, of its
type and memory) are free for its whole time limit, given the running jobs' limits and the plan of
the jobs ahead of it: a conservative backfill, in which a job may go before one ahead of it only
where it ends before that job's planned start. So it is an estimate and says so: jobs that end
before their limits bring it forward, jobs of a higher priority or a lighter user submitted later
push it back.

Unknown (None) where no such moment can be counted on: a job ahead on those GPUs has no time limit
(or the job itself has none and something is planned after it), its user's GPU limit holds it, or
it is past the first ``depth`` jobs of the queue. A shared job is planned as a whole GPU: its share
is known, but not which of its neighbours leaves first, so its time is the latest it could be.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence

from gpuq.service import packing, policy
from gpuq.service.policy import Decision, GpuState, JobRequest, QueueState

# How many of the queue's eligible jobs are planned (SLURM's backfill too looks only so far down the
# queue: bf_max_job_test).
DEPTH = 500


class _Plan:
    """Each GPU's busy intervals (start, end) in epoch seconds, sorted and never overlapping; an end
    is inf without a time limit."""

    def __init__(self, state: QueueState) -> None:
        self.busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for g in state.gpus:
            clear = packing.GpuLoad.of(g).clear_at(state.now)
            if clear > state.now:
                self.busy[g.id].append((state.now, clear))

    def next_free(self, gpu: int, t: float, length: float, past: float = math.inf) -> float:
        """The first moment from ``t`` at which ``gpu`` is free for ``length`` seconds (inf: never, or
        not before ``past``, where the caller stops looking)."""
        intervals = self.busy[gpu]
        # From the first interval that ends after t: the ones before it are past.
        at = bisect.bisect_right(intervals, (t, math.inf))
        if at > 0 and intervals[at - 1][1] > t:
            at -= 1
        start = t
        for s, e in intervals[at:]:
            if s >= start + length:
                break
            start = max(start, e)
            if start > past:
                return math.inf
        return start

    def hold(self, gpus: list[GpuState], start: float, end: float) -> None:
        for g in gpus:
            bisect.insort(self.busy[g.id], (start, end))


def start_times(state: QueueState, decision: Decision | None = None, depth: int = DEPTH,
                later: Sequence[tuple[JobRequest, float]] = ()) -> dict[int, float | None]:
    """Each eligible job's expected start (epoch seconds; ``state.now`` for those placed now), or
    None where it cannot be counted on. ``decision``: this state's ``policy.decide``, if made.
    ``later``: jobs that may not start before a moment (their ``--begin``), planned from then on,
    after the jobs that may start now."""
    if decision is None:
        decision = policy.decide(state)
    plan = _Plan(state)
    jobs = {j.id: j for j in state.jobs}
    found: dict[int, float | None] = {}
    for p in decision.placements:
        # A shared job placed now holds its GPUs too, as far as a whole-GPU job is concerned.
        found[p.job_id] = state.now
        plan.hold(list(p.gpus), state.now, state.now + _length(jobs[p.job_id]))
    by_node: dict[str, list[GpuState]] = defaultdict(list)
    for g in sorted(state.gpus, key=lambda g: (g.node, g.index)):
        by_node[g.node].append(g)
    # A job waiting for its begin time is planned after every job that may start now: until that
    # moment the scheduler holds nothing for it, and starts whatever fits (its start is the latest).
    not_before = {job.id: at for job, at in later}
    order = [*(j for j in decision.order if j.id not in found),
             *sorted((job for job, _ in later), key=lambda j: policy.order_key(j, state.gpu_hours))]
    for looked, job in enumerate(order):
        if looked >= depth or decision.waiting.get(job.id) == policy.USER_LIMIT:
            found[job.id] = None
            continue
        found[job.id] = _earliest(job, state, by_node, plan, max(state.now, not_before.get(job.id, state.now)))
    return found


def _length(job: JobRequest) -> float:
    """How long ``job`` may hold its GPUs: its time limit, or for ever without one."""
    return math.inf if job.time_limit_s is None else job.time_limit_s


def _earliest(job: JobRequest, state: QueueState, by_node: dict[str, list[GpuState]], plan: _Plan,
              first: float) -> float | None:
    """The first moment from ``first`` that ``job``'s GPUs are free for its whole limit on one node;
    it holds them then."""
    need = packing.need_mib(job, state.shared_context_mib) if job.shared else None
    length = _length(job)
    best: tuple[float, str, list[GpuState]] | None = None
    for node, gpus in by_node.items():
        if job.node is not None and node != job.node:
            continue
        suits = [g for g in gpus if (g.is_of(job) and packing.could_ever_share(g, need) if need is not None
                                     else g.fits(job))]
        if len(suits) < job.gpus:
            continue
        found = _on_node(suits, job.gpus, length, first, plan, best[0] if best is not None else math.inf)
        if found is not None and (best is None or (found[0], node) < best[:2]):
            best = (found[0], node, found[1])
    if best is None:
        return None
    start, _, chosen = best
    plan.hold(chosen, start, start + length)
    return start


def _on_node(gpus: list[GpuState], count: int, length: float, first: float, plan: _Plan,
             past: float) -> tuple[float, list[GpuState]] | None:
    """The first moment ``count`` of ``gpus`` are free together for ``length`` seconds, and those
    GPUs; None if never, or not before ``past`` (another node's). The count-th soonest moment each
    GPU is free is a lower bound of it: if fewer are free together then, the bound moves there, and
    grows until they are."""
    at = first
    while True:
        soonest = sorted(plan.next_free(g.id, at, length, past) for g in gpus)[count - 1]
        if math.isinf(soonest):
            return None
        free = [g for g in gpus if plan.next_free(g.id, soonest, length) == soonest]
        if len(free) >= count:
            return soonest, free[:count]
        at = soonest
