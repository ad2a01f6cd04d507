"""Scheduling policy as a pure function over the queue's state: who goes first, on which GPUs, and why the
others wait. No database, no broker: the scheduler reads the state (service/queue_read.py) and applies the decision.

Order: priority, then fair share (the user with fewer recent GPU-hours first), then submission.
A job gets all its GPUs on one node at once (gang) or none. The first job that does not fit gets a
reservation (EASY backfill): later jobs may start only where they cannot delay it, which needs the
running jobs' time limits; without them nothing starts past a waiting gang (past one that asked
for a GPU type, `--gpu-type`, nothing starts on GPUs of that type, and others stay open to later
jobs: it could never use them).

A preemptible job (``JobRequest.preemptible``, `--preemptible`) comes after every other job, is not
held to its user's GPU limit, and is stopped and requeued when a job that is not preemptible
needs its GPUs (service/preemption.py), as SLURM's scavenger QOS.

A shared job (``JobRequest.shared``) takes its share of memory on each of its GPUs beside other
shared jobs, never beside a whole-GPU job; shared jobs are packed best fit by memory
(service/packing.py).
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from gpuq.service import packing, preemption
from gpuq.service.packing import GpuLoad
from gpuq.service.preemption import Preemptible

# Why a pending job waits (the REASON column).
RESOURCES = "resources"  # first in line, but no node has the GPUs it needs free
PRIORITY = "priority"  # jobs ahead of it in the queue wait for resources
DEPENDENCY = "dependency"  # waits for --after jobs
USER_LIMIT = "user limit"  # its user holds the most GPUs allowed at once
HELD = "held"  # `gpuq hold`
NODE_DRAINED = "node drained"  # asked for a node that is drained
BEGIN_TIME = "begin time"  # `--begin`: not before its moment
ARRAY_LIMIT = "array limit"  # its array runs as many tasks at once as `--array ...%N` lets it
PREEMPTING = "preempting"  # waits for the preemptible jobs on its GPUs to stop

# The memory held back on a GPU for each shared job's CUDA context, MiB (GPUQ_SHARED_CONTEXT_MIB's default).
SHARED_CONTEXT_MIB = 512
# Slack for sums of charged fractions against the user GPU limit (floating point).
LIMIT_SLACK = 1e-9


@functools.lru_cache(maxsize=1024)
def is_model(model: str, gpu_type: str) -> bool:
    """Whether a GPU named ``model`` (NVML's name: "NVIDIA A100-SXM4-80GB") is of ``gpu_type``
    (`--gpu-type a100`): the type, its letters and digits lowercased, is one or more consecutive
    words of the name ("a100", "3090", "rtx3090", "RTX 3090"), never part of one: an A10 job on an
    A100 would be another GPU than the one asked for."""
    words = re.findall(r"[a-z0-9]+", model.lower())
    want = "".join(re.findall(r"[a-z0-9]+", gpu_type.lower()))
    for start in range(len(words)):
        joined = ""
        for word in words[start:]:
            joined += word
            if joined == want:
                return True
            if len(joined) >= len(want):
                break
    return False


@dataclass(frozen=True)
class GpuState:
    """A live GPU on a node that takes jobs: free, busy with a whole-GPU job (``busy_until``), or
    partly used by shared jobs (``shares``; never both)."""

    id: int
    node: str
    index: int
    queue: str
    memory_total_mib: int
    memory_used_mib: int = 0
    foreign_mib: int = 0  # used by processes gpuq did not start
    # None: no whole-GPU job. Else the time (epoch s) its job is expected to end; inf when it has no limit.
    busy_until: float | None = None
    # The shared jobs gpuq runs on it, each as (expected end, epoch s, inf with no time limit; MiB of
    # its share and context reserve): room opens as each leaves.
    shares: tuple[tuple[float, int], ...] = ()
    model: str = ""  # NVML's name of it ("NVIDIA H100 80GB HBM3"), what --gpu-type picks by
    # Its whole-GPU job, where that one is preemptible and not asked to stop yet; None: none.
    preemptible: Preemptible | None = None
    # Its whole-GPU job was asked to stop by a preemption: the GPU is free once it has.
    preempted: bool = False

    @property
    def shared_mib(self) -> int:
        """The shares and context reserves of its shared jobs together."""
        return sum(mib for _, mib in self.shares)

    @property
    def shared_jobs(self) -> int:
        return len(self.shares)

    @property
    def shared_until(self) -> float | None:
        """When the last of its shared jobs is expected to end (inf: one has no time limit); None: none."""
        return max((end for end, _ in self.shares), default=None)

    @property
    def free_mib(self) -> int:
        if self.shared_jobs:  # their memory is theirs: what is free once they leave
            return self.memory_total_mib - self.foreign_mib
        return self.memory_total_mib - max(self.memory_used_mib, self.foreign_mib)

    @property
    def room_mib(self) -> int:
        """Memory one more shared job may take now: what neither the shared jobs' shares and
        reserves nor other programs hold."""
        return self.memory_total_mib - self.shared_mib - self.foreign_mib

    def fits(self, job: JobRequest) -> bool:
        """Whether this GPU, once free of gpuq jobs, suits whole-GPU ``job``'s memory request
        (a shared job's room: service/packing.py).

        A GPU that other programs use counts as busy for their memory: a job that did not say how
        much memory it needs is not put beside them.
        """
        if not self.is_of(job):
            return False
        if job.mem_mib is None:
            return self.foreign_mib == 0
        return self.free_mib >= job.mem_mib

    def is_of(self, job: JobRequest) -> bool:
        """Whether this GPU is of the type ``job`` asked for (`--gpu-type`), or it asked for none."""
        return job.gpu_type is None or is_model(self.model, job.gpu_type)


@dataclass(frozen=True)
class JobRequest:
    """A pending job that could start now (not held, dependencies met)."""

    id: int
    user: str
    gpus: int
    priority: int = 0
    submitted: float = 0.0
    mem_mib: int | None = None  # a shared job: its share on each GPU
    node: str | None = None
    time_limit_s: int | None = None
    shared: bool = False  # may share its GPUs with other shared jobs, held to mem_mib on each
    gpu_type: str | None = None  # `--gpu-type`: only GPUs whose model is of it (``is_model``)
    # `--dependency singleton`: placed by a pass alone, which knows its name's other jobs; a worker
    # takes a listed job without looking (``next_up_choice``).
    singleton: bool = False
    exclude: frozenset[str] = frozenset()  # `--exclude`: nodes it may not run on
    array: int | None = None  # a task of an array with a limit (`--array 0-99%4`): its array's id
    preemptible: bool = False  # `--preemptible`: after every other job, past the user limit, stopped for them

    def __post_init__(self) -> None:
        if self.shared and self.mem_mib is None:
            raise ValueError(f"job {self.id}: a shared job needs a memory request (its share)")

    def may_use(self, node: str) -> bool:
        """Whether it may run on ``node``: the one it asked for (`--node`), if any, and not one it
        excluded (`--exclude`)."""
        return (self.node is None or node == self.node) and node not in self.exclude


@dataclass(frozen=True)
class Placement:
    job_id: int
    gpus: tuple[GpuState, ...]  # rank order; gpus[0]'s worker runs the job (as the pass found them)
    shared: bool = False  # the job shares these GPUs (its share: its mem_mib)


@dataclass
class QueueState:
    now: float
    jobs: list[JobRequest]
    gpus: list[GpuState]
    gpu_hours: dict[str, float] = field(default_factory=dict)  # recent GPU-hours per user, decayed (fair share)
    # GPUs each user's jobs hold now: a shared job counts its charged fraction of each of its GPUs
    # (packing.charged_gpus), as fair share charges it.
    gpus_in_use: dict[str, float] = field(default_factory=dict)
    user_gpu_limit: int = 0  # 0: unlimited
    # Each user's running jobs, (expected end, GPUs charged), where the reader knows them: what the
    # expected starts count down to under the limit (service/forecast.py). Empty: not known.
    user_holds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    shared_context_mib: int = SHARED_CONTEXT_MIB  # held back on a GPU for each shared job's CUDA context


@dataclass(frozen=True)
class Reservation:
    job_id: int
    node: str
    start: float  # when the job can start at the latest (the shadow time)
    gpu_ids: frozenset[int]
    shared_mib: int | None = None  # a shared job's: the room it needs on each GPU; None: whole GPUs


@dataclass
class Decision:
    placements: list[Placement]
    waiting: dict[int, str]  # job id -> reason
    reservation: Reservation | None = None
    # The eligible jobs in queue order, as decide walked them.
    order: list[JobRequest] = field(default_factory=list)
    # Running preemptible jobs to stop and requeue: job id -> the waiting job that takes its GPUs.
    preemptions: dict[int, int] = field(default_factory=dict)


def order_key(job: JobRequest, gpu_hours: dict[str, float]) -> tuple[bool, int, float, float, int]:
    """Where ``job`` stands in the queue: preemptible jobs after all others, then priority, then
    its user's fair share, then submission."""
    return job.preemptible, -job.priority, gpu_hours.get(job.user, 0.0), job.submitted, job.id


def queue_order(state: QueueState) -> list[JobRequest]:
    hours = state.gpu_hours
    return sorted(state.jobs, key=lambda j: order_key(j, hours))


def decide(state: QueueState) -> Decision:
    """Place what can start now and say why everything else waits."""
    gpus = _Gpus(state)
    in_use = dict(state.gpus_in_use)
    limit = state.user_gpu_limit
    decision = Decision([], {}, order=queue_order(state))
    blocked = False  # a job waits and no reservation can protect it: nothing else may start
    for job in decision.order:
        if limit and limit_reached(job, in_use.get(job.user, 0), limit):
            decision.waiting[job.id] = USER_LIMIT
            continue
        if blocked or (decision.reservation is not None and not job.shared and gpus.free_count < job.gpus
                       and not gpus.may_preempt_for(job)):
            # Behind a waiting job, with too few GPUs free anywhere: no need to look (a full
            # cluster with a long queue is the common case, and it must stay cheap).
            decision.waiting[job.id] = PRIORITY
            continue
        if gpus.all_fenced_for(job):
            decision.waiting[job.id] = PRIORITY  # behind a waiting job of its type
            continue
        chosen = gpus.choose(job, decision.reservation)
        if chosen is not None:
            charge = packing.charged_gpus(job, [load.gpu for load in chosen], state.shared_context_mib)
            if limit and not job.preemptible and in_use.get(job.user, 0) + charge > limit + LIMIT_SLACK:
                decision.waiting[job.id] = USER_LIMIT
                continue
            decision.placements.append(gpus.take(job, chosen))
            if not job.preemptible:
                in_use[job.user] = in_use.get(job.user, 0) + charge
            continue
        plan = gpus.preempt(job, decision.reservation)
        if plan is not None:
            # Its GPUs are its own from now on in this pass and the next ones, until they are free.
            decision.preemptions.update(dict.fromkeys(plan.victims, job.id))
            decision.waiting[job.id] = PREEMPTING
            in_use[job.user] = in_use.get(job.user, 0) + packing.charged_gpus(
                job, [load.gpu for load in plan.gpus], state.shared_context_mib)
            continue
        if decision.reservation is not None:
            decision.waiting[job.id] = PRIORITY
            continue
        decision.waiting[job.id] = RESOURCES
        if not gpus.could_ever_fit(job):
            continue  # waits for memory others use; holding the queue for it could hold it forever
        decision.reservation = gpus.reserve(job)
        gpus.failed.clear()  # what could not start may start now under the reservation, and the reverse
        if decision.reservation is None:
            if job.gpu_type is None:
                blocked = True
            else:
                gpus.fence(job)
    return decision


def limit_reached(job: JobRequest, held: float, limit: int) -> bool:
    """Whether ``job``'s user may not take it, holding ``held`` GPUs: a whole job's GPUs would pass
    the limit; a shared job's charge is known once its GPUs are chosen, so here only whether its user
    is at the limit already (``decide`` checks the charge after choosing). A preemptible job is
    held to none."""
    if job.preemptible:
        return False
    if job.shared:
        return held >= limit - LIMIT_SLACK
    return held + job.gpus > limit + LIMIT_SLACK


class _Gpus:
    """The GPUs as one ``decide`` pass places jobs on them."""

    def __init__(self, state: QueueState) -> None:
        self.now = state.now
        self.context_mib = state.shared_context_mib
        self.by_node: dict[str, list[GpuLoad]] = defaultdict(list)
        self.free: dict[str, list[GpuLoad]] = defaultdict(list)  # no gpuq job: whole-GPU jobs' GPUs
        self.shareable: dict[str, list[GpuLoad]] = defaultdict(list)  # no whole-GPU job: shared jobs' GPUs
        for g in sorted(state.gpus, key=lambda g: (g.node, g.index)):
            load = GpuLoad.of(g)
            self.by_node[g.node].append(load)
            if load.clear:
                self.free[g.node].append(load)
            if load.whole_until is None:
                self.shareable[g.node].append(load)
        self.free_count = sum(len(gs) for gs in self.free.values())
        # What preemption may take, by node: each preemptible job's GPUs, and GPUs being freed by
        # an earlier preemption that no job of this pass claimed yet (service/preemption.py).
        self.held: dict[str, dict[Preemptible, list[GpuLoad]]] = defaultdict(lambda: defaultdict(list))
        self.freeing: dict[str, list[GpuLoad]] = defaultdict(list)
        for loads in self.by_node.values():
            for load in loads:
                if load.gpu.preemptible is not None:
                    self.held[load.gpu.node][load.gpu.preemptible].append(load)
                elif load.gpu.preempted:
                    self.freeing[load.gpu.node].append(load)
        self.preemptible_gpus = sum(len(gs) for by_job in self.held.values() for gs in by_job.values()) + \
            sum(len(gs) for gs in self.freeing.values())
        # The kinds of job (as ``failed``'s) that found no GPUs to take by preemption: taking GPUs
        # never gives any back within a pass, so these stay so until it ends.
        self.cannot_preempt: set[tuple[object, ...]] = set()
        # The kinds of job (shared or not, GPUs, memory, node, whether it ends before the reserved
        # start) that found no GPUs since the last placement or reservation: a job of the same
        # kind finds none either (most of a long queue, behind a waiting job).
        self.failed: set[tuple[object, ...]] = set()
        # GPU types of waiting jobs no reservation protects (`--gpu-type`, no time limits to reserve
        # by): no later job starts on a GPU of theirs, as no later job at all starts behind an untyped
        # one; GPUs of other models, which they could never use, stay open.
        self.fenced: list[JobRequest] = []
        # ``all_fenced_for``'s answer by GPU type (it depends on nothing else), until the next fence:
        # a long queue behind a fenced job would ask it once per job.
        self.fenced_for: dict[str | None, bool] = {}

    def fence(self, job: JobRequest) -> None:
        """Keep the GPUs typed ``job`` could use for it: later jobs start on others only."""
        self.fenced.append(job)
        self.failed.clear()
        self.fenced_for.clear()

    def open_to_later(self, gpu: GpuState) -> bool:
        """Whether a job behind the fenced ones may start on ``gpu``."""
        return not any(gpu.is_of(waiting) for waiting in self.fenced)

    def all_fenced_for(self, job: JobRequest) -> bool:
        """Whether every GPU of ``job``'s type is kept for a typed job ahead of it."""
        if not self.fenced:
            return False
        if job.gpu_type not in self.fenced_for:
            self.fenced_for[job.gpu_type] = not any(g.gpu.is_of(job) and self.open_to_later(g.gpu)
                                                    for loads in self.by_node.values() for g in loads)
        return self.fenced_for[job.gpu_type]

    def nodes_for(self, job: JobRequest) -> list[str]:
        return [n for n in self.by_node if job.may_use(n)]

    def ends(self, job: JobRequest) -> float:
        """When ``job`` would end by its time limit if it started now (inf without one)."""
        return math.inf if job.time_limit_s is None else self.now + job.time_limit_s

    def choose(self, job: JobRequest, reservation: Reservation | None) -> tuple[GpuLoad, ...] | None:
        """The GPUs ``job`` gets now without delaying ``reservation``, or None."""
        ends_in_time = reservation is not None and self.ends(job) <= reservation.start
        shape = (job.shared, job.gpus, job.mem_mib, job.node, job.exclude, job.gpu_type, ends_in_time)
        if shape in self.failed:
            return None
        if job.shared:
            shareable = self.shareable if not self.fenced else \
                {n: [g for g in loads if self.open_to_later(g.gpu)] for n, loads in self.shareable.items()}
            chosen = packing.choose_shared(job, packing.need_mib(job, self.context_mib), shareable,
                                           self.nodes_for(job), reservation, self.ends(job))
        else:
            chosen = self._choose_whole(job, reservation, ends_in_time)
        if chosen is None:
            self.failed.add(shape)
        return chosen

    def _choose_whole(self, job: JobRequest, reservation: Reservation | None,
                      ends_in_time: bool) -> tuple[GpuLoad, ...] | None:
        """Best fit for a whole-GPU job: the node with the fewest suitable GPUs free of gpuq jobs."""
        options = []
        for node in self.nodes_for(job):
            usable = [g for g in self.free[node] if g.gpu.fits(job) and (not self.fenced or self.open_to_later(g.gpu))]
            if reservation is not None and node == reservation.node and not ends_in_time:
                usable = [g for g in usable if g.gpu.id not in reservation.gpu_ids]
            if len(usable) >= job.gpus:
                # Unreserved GPUs first, so a backfilled job leaves the reserved ones alone if it can.
                reserved = reservation.gpu_ids if reservation is not None else frozenset()
                usable.sort(key=lambda g: (g.gpu.id in reserved, g.gpu.index))
                options.append((len(usable), node, tuple(usable[: job.gpus])))
        if not options:
            return None
        return min(options, key=lambda o: (o[0], o[1]))[2]

    def take(self, job: JobRequest, chosen: tuple[GpuLoad, ...]) -> Placement:
        """Place ``job`` on ``chosen``: they hold it from now on in this pass."""
        node = chosen[0].gpu.node
        end = self.ends(job)
        for load in chosen:
            if load.clear:
                self.free[node].remove(load)
                self.free_count -= 1
            if job.shared:
                load.take_share(packing.need_mib(job, self.context_mib), end)
            else:
                load.take_whole(end)
                self.shareable[node].remove(load)
        self.failed.clear()
        return Placement(job.id, tuple(load.gpu for load in chosen), shared=job.shared)

    def may_preempt_for(self, job: JobRequest) -> bool:
        """Whether ``job`` might still take GPUs by preemption in this pass."""
        return not job.preemptible and self.preemptible_gpus > 0

    def preempt(self, job: JobRequest, reservation: Reservation | None) -> preemption.Plan | None:
        """The GPUs ``job`` takes by stopping preemptible jobs (or waiting for those being stopped),
        claimed for it in this pass; None if it cannot. GPUs kept for a reservation or a fenced job
        ahead of it are not taken."""
        if not self.may_preempt_for(job):
            return None
        shape = (job.shared, job.gpus, job.mem_mib, job.node, job.exclude, job.gpu_type)
        if shape in self.cannot_preempt:
            return None
        reserved = reservation.gpu_ids if reservation is not None else frozenset()

        def usable(load: GpuLoad) -> bool:
            return (load.gpu.id not in reserved and (not self.fenced or self.open_to_later(load.gpu))
                    and preemption.fits_once_clear(load.gpu, job, self.context_mib))

        def held(node: str) -> dict[Preemptible, list[GpuLoad]]:
            return {victim: usable_loads for victim, loads in self.held[node].items()
                    if (usable_loads := [g for g in loads if usable(g)])}

        plan = preemption.plan(job, self.nodes_for(job),
                               lambda node: [g for g in (*self.freeing[node], *self.free[node]) if usable(g)], held)
        if plan is None:
            self.cannot_preempt.add(shape)
            return None
        self._claim(job, plan)
        return plan

    def _claim(self, job: JobRequest, plan: preemption.Plan) -> None:
        """Hold ``plan``'s GPUs for ``job`` in this pass; its victims' other GPUs are being freed."""
        node, end = plan.node, self.ends(job)
        for victim in [v for v in self.held[node] if v.job_id in plan.victims]:
            loads = self.held[node].pop(victim)
            self.freeing[node] += [g for g in loads if g not in plan.gpus]
        for load in plan.gpus:
            if load in self.freeing[node]:
                self.freeing[node].remove(load)
            if load in self.free[node]:
                self.free[node].remove(load)
                self.free_count -= 1
            if load in self.shareable[node]:
                self.shareable[node].remove(load)
            load.take_whole(end)
        self.preemptible_gpus = sum(len(gs) for by_job in self.held.values() for gs in by_job.values()) + \
            sum(len(gs) for gs in self.freeing.values())

    def could_ever_fit(self, job: JobRequest) -> bool:
        if job.shared:
            need = packing.need_mib(job, self.context_mib)
            return any(sum(g.gpu.is_of(job) and packing.could_ever_share(g.gpu, need) for g in self.by_node[n])
                       >= job.gpus
                       for n in self.nodes_for(job))
        return any(sum(1 for g in self.by_node[n] if g.gpu.fits(job)) >= job.gpus for n in self.nodes_for(job))

    def reserve(self, job: JobRequest) -> Reservation | None:
        """The earliest start ``job`` can count on, from the running jobs' time limits (those
        placed in this pass included); None if unknown. The GPUs kept for a typed job ahead of it
        (``fence``) count for nothing: that job takes them first, at a time no one knows."""
        need = packing.need_mib(job, self.context_mib) if job.shared else None
        best: Reservation | None = None
        for node in self.nodes_for(job):
            loads = [g for g in self.by_node[node] if not self.fenced or self.open_to_later(g.gpu)]
            if need is not None:
                suitable = sorted((g.ready_at(need, self.now), g.gpu.index, g.gpu.id) for g in loads
                                  if g.gpu.is_of(job) and packing.could_ever_share(g.gpu, need))
            else:
                suitable = sorted((g.clear_at(self.now), g.gpu.index, g.gpu.id) for g in loads if g.gpu.fits(job))
            if len(suitable) < job.gpus:
                continue
            needed = suitable[: job.gpus]
            start = needed[-1][0]
            if math.isinf(start):
                continue
            if best is None or start < best.start:
                best = Reservation(job.id, node, start, frozenset(gpu_id for _, _, gpu_id in needed), need)
        return best
