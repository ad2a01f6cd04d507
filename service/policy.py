"""Scheduling policy as a pure function over the queue's state: who goes first, on which GPUs, and why the
others wait. No database, no broker: the scheduler reads the state (service/queue_read.py) and applies the decision.

Order: priority, then fair share (the user with fewer recent GPU-hours first), then submission.
A job gets all its GPUs on one node at once (gang) or none. The first job that does not fit gets a
reservation (EASY backfill): later jobs may start only where they cannot delay it, which needs the
running jobs' time limits; without them nothing starts past a waiting gang.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

# Why a pending job waits (the REASON column).
RESOURCES = "resources"  # first in line, but no node has the GPUs it needs free
PRIORITY = "priority"  # jobs ahead of it in the queue wait for resources
DEPENDENCY = "dependency"  # waits for --after jobs
USER_LIMIT = "user limit"  # its user holds the most GPUs allowed at once
HELD = "held"  # `gpuq hold`
NODE_DRAINED = "node drained"  # asked for a node that is drained


@dataclass(frozen=True)
class GpuState:
    """A live GPU on a node that takes jobs."""

    id: int
    node: str
    index: int
    queue: str
    memory_total_mib: int
    memory_used_mib: int = 0
    foreign_mib: int = 0  # used by processes gpuq did not start
    # None: free now. Else the time (epoch s) its job is expected to end; inf when it has no limit.
    busy_until: float | None = None

    @property
    def free_mib(self) -> int:
        return self.memory_total_mib - max(self.memory_used_mib, self.foreign_mib)

    def fits(self, job: JobRequest) -> bool:
        """Whether this GPU, once free of gpuq jobs, suits ``job``'s memory request.

        A GPU that other programs use counts as busy for their memory: a job that did not say how
        much memory it needs is not put beside them.
        """
        if job.mem_mib is None:
            return self.foreign_mib == 0
        return self.free_mib >= job.mem_mib


@dataclass(frozen=True)
class JobRequest:
    """A pending job that could start now (not held, dependencies met)."""

    id: int
    user: str
    gpus: int
    priority: int = 0
    submitted: float = 0.0
    mem_mib: int | None = None
    node: str | None = None
    time_limit_s: int | None = None


@dataclass(frozen=True)
class Placement:
    job_id: int
    gpus: tuple[GpuState, ...]  # rank order; gpus[0]'s worker runs the job


@dataclass
class QueueState:
    now: float
    jobs: list[JobRequest]
    gpus: list[GpuState]
    gpu_hours: dict[str, float] = field(default_factory=dict)  # recent GPU-hours per user, decayed (fair share)
    gpus_in_use: dict[str, int] = field(default_factory=dict)  # GPUs each user's jobs hold now
    user_gpu_limit: int = 0  # 0: unlimited


@dataclass(frozen=True)
class Reservation:
    job_id: int
    node: str
    start: float  # when the job can start at the latest (the shadow time)
    gpu_ids: frozenset[int]


@dataclass
class Decision:
    placements: list[Placement]
    waiting: dict[int, str]  # job id -> reason
    reservation: Reservation | None = None
    # The eligible jobs in queue order, as decide walked them.
    order: list[JobRequest] = field(default_factory=list)


def order_key(job: JobRequest, gpu_hours: dict[str, float]) -> tuple[int, float, float, int]:
    """Where ``job`` stands in the queue: priority, then its user's fair share, then submission."""
    return -job.priority, gpu_hours.get(job.user, 0.0), job.submitted, job.id


def queue_order(state: QueueState) -> list[JobRequest]:
    hours = state.gpu_hours
    return sorted(state.jobs, key=lambda j: order_key(j, hours))


def decide(state: QueueState) -> Decision:
    """Place what can start now and say why everything else waits."""
    now = state.now
    free: dict[str, list[GpuState]] = defaultdict(list)
    by_node: dict[str, list[GpuState]] = defaultdict(list)
    for g in sorted(state.gpus, key=lambda g: (g.node, g.index)):
        by_node[g.node].append(g)
        if g.busy_until is None:
            free[g.node].append(g)
    in_use = dict(state.gpus_in_use)
    limit = state.user_gpu_limit
    free_count = sum(len(gs) for gs in free.values())
    decision = Decision([], {}, order=queue_order(state))
    blocked = False  # a job waits and no reservation can protect it: nothing else may start
    for job in decision.order:
        if limit and in_use.get(job.user, 0) + job.gpus > limit:
            decision.waiting[job.id] = USER_LIMIT
            continue
        if blocked or (decision.reservation is not None and free_count < job.gpus):
            # Behind a waiting job, with too few GPUs free anywhere: no need to look (a full
            # cluster with a long queue is the common case, and it must stay cheap).
            decision.waiting[job.id] = PRIORITY
            continue
        chosen = _choose(job, free, decision.reservation, now)
        if chosen is not None:
            decision.placements.append(Placement(job.id, chosen))
            taken = {g.id for g in chosen}
            free[chosen[0].node] = [g for g in free[chosen[0].node] if g.id not in taken]
            in_use[job.user] = in_use.get(job.user, 0) + job.gpus
            free_count -= job.gpus
            continue
        if decision.reservation is not None:
            decision.waiting[job.id] = PRIORITY
            continue
        decision.waiting[job.id] = RESOURCES
        if not _could_ever_fit(job, by_node):
            continue  # waits for memory others use; holding the queue for it could hold it forever
        decision.reservation = _reserve(job, by_node, now)
        if decision.reservation is None:
            blocked = True
    return decision


def _nodes_for(job: JobRequest, gpus_by_node: dict[str, list[GpuState]]) -> list[str]:
    return [n for n in gpus_by_node if job.node is None or n == job.node]


def _choose(job: JobRequest, free: dict[str, list[GpuState]], reservation: Reservation | None,
            now: float) -> tuple[GpuState, ...] | None:
    """The GPUs ``job`` gets now, or None. Best fit: the node with the fewest suitable free GPUs."""
    ends_in_time = job.time_limit_s is not None and reservation is not None and \
        now + job.time_limit_s <= reservation.start
    options = []
    for node in _nodes_for(job, free):
        usable = [g for g in free[node] if g.fits(job)]
        if reservation is not None and node == reservation.node and not ends_in_time:
            usable = [g for g in usable if g.id not in reservation.gpu_ids]
        if len(usable) >= job.gpus:
            # Unreserved GPUs first, so a backfilled job leaves the reserved ones alone if it can.
            reserved = reservation.gpu_ids if reservation is not None else frozenset()
            usable.sort(key=lambda g: (g.id in reserved, g.index))
            options.append((len(usable), node, tuple(usable[: job.gpus])))
    if not options:
        return None
    return min(options, key=lambda o: (o[0], o[1]))[2]


def _could_ever_fit(job: JobRequest, by_node: dict[str, list[GpuState]]) -> bool:
    return any(sum(1 for g in by_node[n] if g.fits(job)) >= job.gpus for n in _nodes_for(job, by_node))


def _reserve(job: JobRequest, by_node: dict[str, list[GpuState]], now: float) -> Reservation | None:
    """The earliest start ``job`` can count on, from the running jobs' time limits; None if unknown."""
    best: Reservation | None = None
    for node in _nodes_for(job, by_node):
        suitable = sorted((now if g.busy_until is None else g.busy_until, g.index, g)
                          for g in by_node[node] if g.fits(job))
        if len(suitable) < job.gpus:
            continue
        needed = suitable[: job.gpus]
        start = needed[-1][0]
        if math.isinf(start):
            continue
        if best is None or start < best.start:
            best = Reservation(job.id, node, start, frozenset(g.id for _, _, g in needed))
    return best


def next_up(state: QueueState, decision: Decision, per_gpu: int, scan: int) -> dict[int, list[int]]:
    """For each busy GPU, the pending one-GPU jobs it should start, best first, if its job ends
    before the scheduler looks again (their order in the queue ranks them across GPUs).

    The queue is walked past the jobs just placed. A job is listed for every busy GPU it fits, so
    whichever of them frees first takes it, and never ahead of a job that could use that GPU:
    a gang that could use a GPU, on a node where it could ever run, closes that GPU's list (when
    it frees, the scheduler decides, as the gang may need it), and a job over its user's limit is
    passed over as ``decide`` does.
    The GPUs of a node share their jobs, so each lists ``per_gpu`` times its node's busy GPUs
    (enough for all of them to take several before the scheduler's next pass); the walk looks at
    most ``scan`` jobs.
    """
    placed = {p.job_id for p in decision.placements}
    taken = {g.id for p in decision.placements for g in p.gpus}
    open_gpus = [g for g in state.gpus if g.busy_until is not None or g.id in taken]
    busy_on: dict[str, int] = defaultdict(int)
    for g in open_gpus:
        busy_on[g.node] += 1
    lists: dict[int, list[int]] = {g.id: [] for g in open_gpus}
    in_use = dict(state.gpus_in_use)
    limit = state.user_gpu_limit
    if limit:
        user_of = {j.id: j.user for j in state.jobs}
        for p in decision.placements:
            in_use[user_of[p.job_id]] = in_use.get(user_of[p.job_id], 0) + len(p.gpus)
    order = decision.order or queue_order(state)
    for looked, job in enumerate(j for j in order if j.id not in placed):
        if not open_gpus or looked >= scan:
            break
        if limit and in_use.get(job.user, 0) + job.gpus > limit:
            continue
        usable = [g for g in open_gpus if (job.node is None or g.node == job.node) and g.fits(job)]
        if job.gpus > 1:
            # Where it could ever run, it may need the GPU when it frees: the scheduler decides.
            could = {g.node for g in usable if sum(h.node == g.node and h.fits(job) for h in state.gpus) >= job.gpus}
            open_gpus = [g for g in open_gpus if g.node not in could or g not in usable]
            continue
        for g in usable:
            lists[g.id].append(job.id)
        if usable and limit:
            in_use[job.user] = in_use.get(job.user, 0) + 1
        open_gpus = [g for g in open_gpus if len(lists[g.id]) < per_gpu * busy_on[g.node]]
    return {gpu: jobs for gpu, jobs in lists.items() if jobs}
