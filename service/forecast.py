"""When each pending job is expected to start (`gpuq status --start`, `gpuq why`), as SLURM's
`squeue --start` gives it: a pure function over the queue's state, as ``policy.decide`` is.

The queue is walked in its order (priority, fair share, submit). What the scheduler places now
starts now; every other job is planned at the earliest moment its GPUs (all on one node, of its
type and memory) are free for its whole time limit, given the running jobs' limits and the plan of
the jobs ahead of it: a conservative backfill, in which a job may go before one ahead of it only
where it ends before that job's planned start. So it is an estimate and says so: jobs that end
before their limits bring it forward, jobs of a higher priority or a lighter user submitted later
push it back.

A shared job is planned by its share: it may start beside other shared jobs wherever its GPUs'
memory holds them all for its whole limit, as each running one's share frees at its limit, and a
whole-GPU job waits until no job is on the GPU.

Under a GPU limit per user (``GPUQ_USER_GPU_LIMIT``, or a user's own in ``GPUQ_USER_GPU_LIMITS``)
each user's GPUs are planned over time too: a job starts no earlier than its user's running and
planned jobs leave it room under the limit.

A job that is not preemptible is planned as if the preemptible jobs were not there (running or
planned): whenever its turn comes it stops them (service/preemption.py), so a GPU a scavenger
holds without a time limit is no "for ever" to it; one that started less than GPUQ_PREEMPT_EXEMPT
ago holds its GPUs firmly until it may be preempted. A preemptible job waits for every job, as it
does in the queue, and counts against no user's limit.

A job that reserves CPU cores or host memory (`--cpus`, `--host-mem`) is planned where its node has
them free beside the running and planned jobs' for its whole limit too (service/node_use.py); for
a job that is not preemptible, beside those of jobs that are not preemptible alone, as for GPUs:
it would stop the scavengers of the node for them (one within GPUQ_PREEMPT_EXEMPT holds them until it
may be preempted).

A job that waits for other jobs (``Awaiting``: --after, afterany, aftercorr, or after: their
start) is planned after every job that may start now, from the moment the jobs it waits for are
expected to end (or start): a running one's by its time limit, a pending one's by its own plan,
each as if it succeeded. squeue --start gives such a job none.

Unknown (None) where no such moment can be counted on: a job ahead on those GPUs (or of its user,
under the limit) has no time limit (or the job itself has none and something is planned after
it), the job is behind one the scheduler lets nothing pass (``Decision.blocked_by``: a gang with
no moment to reserve, behind a running job without a limit) and that one has no start either, it
asks more GPUs than its user may hold, its user's limit holds it and their running jobs are not
known, a job it waits for has no expected end (held, no time limit, itself unknown), or it is past
the first ``depth`` jobs of the queue.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpuq.service import packing, policy
from gpuq.service.node_use import SLACK, needs
from gpuq.service.queue_state import Decision, GpuState, JobRequest, QueueState
from gpuq.service.timeline import Timeline

# How many of the queue's eligible jobs are planned (SLURM's backfill too looks only so far down the
# queue: bf_max_job_test).
DEPTH = 500
# Why ``start_times`` counts on no moment for a job it planned, as `gpuq why` and `--test-only` say it.
NO_START = (f"a job before it on the GPUs it needs has no time limit, or waits behind one that has none, or it is "
            f"past the first {DEPTH} jobs of the queue")


@dataclass(frozen=True)
class Awaiting:
    """A job that waits for other jobs, as a forecast plans it."""

    job: JobRequest
    after: tuple[int, ...]  # the jobs not ended it waits for (an array's id read as its tasks)
    start: bool  # for their start (after:), not their end
    not_before: float  # its begin time, or now (epoch s)


class _Plan:
    """Each GPU's memory held over time by the running jobs and the jobs planned so far, under a
    user GPU limit each user's GPUs (their charge, as ``policy.decide`` counts it), and each
    limited array's tasks."""

    def __init__(self, state: QueueState, arrays: Mapping[int, tuple[int, Sequence[float]]],
                 freed: frozenset[int] = frozenset()) -> None:
        """``freed``: GPUs whose whole-GPU job is being preempted for a waiting job: held by that one."""
        # Each limited array's tasks over time, its running ones from now to their ends.
        self.arrays: dict[int, Timeline] = {}
        for array_id, (most, ends) in arrays.items():
            tasks = self.arrays[array_id] = Timeline(most)
            for end in ends:
                if end > state.now:
                    tasks.hold(state.now, end, 1)
        self.limit_of = state.limit_of
        self.users: dict[str, Timeline] = {}
        # Users holding GPUs whose jobs' ends were not read: their room under the limit is unknown.
        self.unknown = {u for u, n in state.gpus_in_use.items() if n > 0 and u not in state.user_holds}
        for user, held in state.user_holds.items():
            usage = self.user(user)
            for end, charge in held:
                if end > state.now and usage is not None:
                    usage.hold(state.now, end, charge)
        # Each GPU's holds a job that is not preemptible counts (none of the preemptible jobs': it
        # would stop them), and every hold, which a preemptible job counts.
        self.usage: dict[int, Timeline] = {}
        self.every: dict[int, Timeline] = {}
        for g in state.gpus:
            room = g.memory_total_mib - g.foreign_mib
            self.usage[g.id], self.every[g.id] = Timeline(room), Timeline(room)
            load = packing.GpuLoad.of(g)
            if load.whole_until is not None and load.whole_until > state.now and g.id not in freed:
                # A preemptible job still within GPUQ_PREEMPT_EXEMPT holds it as any job does until
                # it may be preempted, and as a scavenger from then on.
                firm = state.now if g.exempt_until is None else min(max(g.exempt_until, state.now), load.whole_until)
                if firm > state.now:
                    self.hold([g], state.now, firm, None)
                if load.whole_until > firm:
                    scavenger = g.preemptible is not None or g.exempt_until is not None
                    self.hold([g], firm, load.whole_until, None, scavenger)
            # Shares being preempted are left out, as a GPU being freed is: the job they make room for holds it.
            for end, mib in g.firm_shares:
                if end > state.now:
                    self.hold([g], state.now, end, mib)
            for _, end, mib in g.preemptible_shares:
                if end > state.now:
                    self.hold([g], state.now, end, mib, preemptible=True)
            if g.closes_at is not None:  # its node's window: to its end, or a resume no one can foresee
                self.hold([g], max(g.closes_at, state.now), math.inf if g.reopens_at is None else g.reopens_at, None)
        # Each node's CPU cores and host memory over time, by (kind, node), where it counts them: the
        # running jobs' reservations, then the planned jobs'; every one's (``node_use``, which a
        # preemptible job counts), and those of jobs that are not preemptible (``node_firm``): a
        # preemptible job's until it may be preempted (GPUQ_PREEMPT_EXEMPT), as for its GPUs.
        scavengers = {g.preemptible.job_id for g in state.gpus if g.preemptible is not None} | {
            v.job_id for g in state.gpus for v, _, _ in g.preemptible_shares}
        self.node_use: dict[tuple[str, str], Timeline] = {}
        self.node_firm: dict[tuple[str, str], Timeline] = {}
        for kind, use in state.node_use.items():
            for node, offered in use.offer.items():
                usage = self.node_use[kind, node] = Timeline(offered + SLACK)
                firm_use = self.node_firm[kind, node] = Timeline(offered + SLACK)
                for job_id, (end, amount) in use.holds.get(node, {}).items():
                    if end > state.now:
                        usage.hold(state.now, end, amount)
                        firm = state.now if job_id in scavengers else min(end, state.exempt_until.get(job_id, end))
                        if firm > state.now:
                            firm_use.hold(state.now, firm, amount)

    def next_free(self, gpu: int, t: float, length: float, need: float | None, past: float = math.inf,
                  preemptible: bool = False) -> float:
        """The first moment from ``t`` at which a job needing ``need`` MiB of ``gpu`` (None: all of
        it) has it for ``length`` seconds; inf: never, or not before ``past``. A job that is not
        ``preemptible`` counts no preemptible job's hold: it would stop them."""
        return (self.every if preemptible else self.usage)[gpu].next_free(t, length, need, past)

    def hold(self, gpus: list[GpuState], start: float, end: float, need: float | None,
             preemptible: bool = False) -> None:
        """``gpus`` held from ``start`` to ``end`` (``need`` MiB of each; None: all of it), by a
        ``preemptible`` job or not."""
        for g in gpus:
            held = math.inf if need is None else need
            self.every[g.id].hold(start, end, held)
            if not preemptible:
                self.usage[g.id].hold(start, end, held)

    def node_from(self, node: str, t: float, length: float, job: JobRequest, past: float = math.inf) -> float:
        """The first moment from ``t`` at which ``node`` has what ``job`` reserves of it (cores, host
        memory) free for ``length`` seconds (``t`` where it reserves none or the node counts none;
        inf: never, or not before ``past``): each kind's first moment in turn, until one suits all.
        A job that is not preemptible counts no preemptible job's reservation: it would stop them."""
        counted = self.node_use if job.preemptible else self.node_firm
        wants = [(counted[kind, node], amount) for kind, amount in needs(job).items() if (kind, node) in counted]
        moved = True
        while moved:
            moved = False
            for usage, amount in wants:
                at = usage.next_free(t, length, amount, past)
                if math.isinf(at):
                    return at
                moved, t = moved or at != t, at
        return t

    def hold_node(self, node: str, start: float, end: float, job: JobRequest) -> None:
        for kind, amount in needs(job).items():
            if (kind, node) in self.node_use:
                self.node_use[kind, node].hold(start, end, amount)
                if not job.preemptible:
                    self.node_firm[kind, node].hold(start, end, amount)

    def array(self, job: JobRequest) -> Timeline | None:
        """The tasks of ``job``'s array over time, where it is a task of a limited array."""
        return None if job.array is None else self.arrays.get(job.array)

    def user(self, name: str) -> Timeline | None:
        """``name``'s GPUs held over time under their limit; None without one or where unknown."""
        limit = self.limit_of(name)
        if not limit or name in self.unknown:
            return None
        if name not in self.users:
            self.users[name] = Timeline(limit + policy.LIMIT_SLACK)
        return self.users[name]


def start_times(state: QueueState, decision: Decision | None = None, depth: int = DEPTH,
                later: Sequence[tuple[JobRequest, float]] = (),
                where: dict[int, list[GpuState]] | None = None, throttled: Sequence[JobRequest] = (),
                arrays: Mapping[int, tuple[int, Sequence[float]]] | None = None,
                awaiting: Sequence[Awaiting] = (), awaited_ends: Mapping[int, float] | None = None
                ) -> dict[int, float | None]:
    """Each eligible job's expected start (epoch seconds; ``state.now`` for those placed now), or
    None where it cannot be counted on. ``decision``: this state's ``policy.decide``, if made.
    ``later``: jobs that may not start before a moment (their ``--begin``), planned from then on,
    after the jobs that may start now. ``where``, if given, is told each started or planned job's
    GPUs. ``throttled``: tasks their array's limit holds back, planned in queue order as the limit
    lets them run, by ``arrays``: each limited array's limit and its running tasks' ends (a task
    of one is a ``JobRequest`` whose ``array`` is set). ``awaiting``: jobs that wait for others,
    planned last, from those jobs' expected ends (or starts), given ``awaited_ends``: the expected
    end of each started one they wait for (epoch s; inf without a time limit)."""
    if decision is None:
        decision = policy.decide(state)
    plan = _Plan(state, arrays or {}, frozenset(g.id for p in decision.claims for g in p.gpus))
    jobs = {j.id: j for j in state.jobs}
    found: dict[int, float | None] = {}
    # A job that preempts starts once its victims stopped (within GPUQ_PREEMPT_GRACE): as one placed now.
    for p in [*decision.placements, *decision.claims]:
        found[p.job_id] = state.now
        if where is not None:
            where[p.job_id] = list(p.gpus)
        placed, ends = jobs[p.job_id], state.now + _length(jobs[p.job_id])
        plan.hold(list(p.gpus), state.now, ends, _need(placed, state), placed.preemptible)
        plan.hold_node(p.gpus[0].node, state.now, ends, placed)
        user = None if placed.preemptible else plan.user(placed.user)
        if user is not None:
            user.hold(state.now, ends, packing.charged_gpus(placed, list(p.gpus), state.shared_context_mib))
        array = plan.array(placed)
        if array is not None:
            array.hold(state.now, ends, 1)
    by_node: dict[str, list[GpuState]] = defaultdict(list)
    for g in sorted(state.gpus, key=lambda g: (g.node, g.index)):
        by_node[g.node].append(g)
    # A job waiting for its begin time is planned after every job that may start now: until that
    # moment the scheduler holds nothing for it, and starts whatever fits (its start is the latest).
    not_before = {job.id: at for job, at in later}
    waiting = [j for j in decision.order if j.id not in found]
    if throttled:  # in their places in the queue (decide's order is the queue's)
        waiting = sorted([*waiting, *throttled], key=lambda j: policy.order_key(j, state.gpu_hours))
    order = [*waiting, *sorted((job for job, _ in later), key=lambda j: policy.order_key(j, state.gpu_hours))]
    blocker = jobs.get(decision.blocked_by) if decision.blocked_by is not None else None
    blocker_key = policy.order_key(blocker, state.gpu_hours) if blocker is not None else None

    def behind(job: JobRequest, first: float) -> float | None:
        """``first``, or for a job after the one the scheduler lets nothing pass (``blocked_by``)
        the moment that one starts, before which the scheduler starts it nowhere; None if unknown."""
        if blocker is None or blocker_key is None or policy.order_key(job, state.gpu_hours) <= blocker_key:
            return first
        start = found.get(blocker.id)
        return None if start is None else max(first, start)

    def earliest(job: JobRequest, first: float) -> float | None:
        first_here = behind(job, max(state.now, first))
        return None if first_here is None else _earliest(job, state, by_node, plan, first_here, where)

    for looked, job in enumerate(order):
        if looked >= depth or (decision.waiting.get(job.id) == policy.USER_LIMIT and plan.user(job.user) is None):
            found[job.id] = None
            continue
        found[job.id] = earliest(job, not_before.get(job.id, state.now))
    if awaiting:
        lengths = {j.id: _length(j) for j in [*state.jobs, *throttled, *(job for job, _ in later)]}
        in_order = sorted(awaiting, key=lambda a: policy.order_key(a.job, state.gpu_hours))
        _plan_awaiting(in_order, awaited_ends or {}, lengths, found, len(order), depth, earliest)
    return found


def _plan_awaiting(awaiting: Sequence[Awaiting], ends: Mapping[int, float], lengths: dict[int, float],
                   found: dict[int, float | None], looked: int, depth: int,
                   earliest: Callable[[JobRequest, float], float | None]) -> None:
    """Plan each of ``awaiting`` (in queue order, none before a job it waits for is planned) from
    the moment the jobs it waits for are expected to end or start, into ``found``."""
    lengths.update((a.job.id, _length(a.job)) for a in awaiting)
    left = list(awaiting)
    while left:
        planned_now = False
        for a in list(left):
            unplanned = {b.job.id for b in left}
            if any(j in unplanned for j in a.after):
                continue  # it waits for a job of ``left`` not planned yet
            first = _awaited(a, ends, lengths, found)
            left.remove(a)
            planned_now = True
            found[a.job.id] = None if first is None or looked >= depth else earliest(a.job, first)
            looked += 1
        if not planned_now:  # (a loop of dependencies cannot be made; were one there, none starts)
            found.update((a.job.id, None) for a in left)
            return


def _awaited(a: Awaiting, ends: Mapping[int, float], lengths: Mapping[int, float],
             found: Mapping[int, float | None]) -> float | None:
    """When the jobs ``a`` waits for are expected to have ended (started), from its own begin time;
    None where one of them has no expected moment."""
    first = a.not_before
    for j in a.after:
        if j in ends:  # started: it ends by its time limit (and has started already)
            at = a.not_before if a.start else ends[j]
        elif found.get(j) is not None:
            start = found[j]
            assert start is not None
            at = start if a.start else start + lengths.get(j, math.inf)
        else:  # held, drained, past the depth, or with no start itself
            return None
        first = max(first, at)
    return None if math.isinf(first) else first


def _length(job: JobRequest) -> float:
    """How long ``job`` may hold its GPUs: its time limit, or for ever without one."""
    return math.inf if job.time_limit_s is None else job.time_limit_s


def _need(job: JobRequest, state: QueueState) -> int | None:
    """The memory a shared job holds on each of its GPUs (its share and context reserve); None for a
    whole-GPU job, which holds all of each."""
    return packing.need_mib(job, state.shared_context_mib) if job.shared else None


def _earliest(job: JobRequest, state: QueueState, by_node: dict[str, list[GpuState]], plan: _Plan,
              first: float, where: dict[int, list[GpuState]] | None = None) -> float | None:
    """The first moment from ``first`` that ``job``'s GPUs are free for its whole limit on one node,
    and under a user limit its user has room for them that long; it holds them then (and tells
    ``where`` which)."""
    need, length, array = _need(job, state), _length(job), plan.array(job)
    user = None if job.preemptible else plan.user(job.user)  # held to no user limit
    # What it counts against its user's limit: a whole job its GPUs; a shared one its share of
    # them, known once they are chosen (until then, none).
    charge = 0.0 if job.shared else float(job.gpus)
    at = first
    while True:
        if array is not None:  # from the first moment its array runs fewer tasks than its limit
            at = array.next_free(at, length, 1, math.inf)
            if math.isinf(at):
                return None
        if user is not None:
            at = user.next_free(at, length, charge, math.inf)
            if math.isinf(at):
                return None
        found = _gpus_from(job, need, length, by_node, plan, at)
        if found is None:
            return None
        start, chosen = found
        if array is not None and array.next_free(start, length, 1, start) != start:
            at = start  # its array is at its limit then: from its next moment with room
            continue
        if user is not None:
            charge = packing.charged_gpus(job, chosen, state.shared_context_mib)
            if user.next_free(start, length, charge, start) != start:
                at = start  # the user has no room then: from their next moment with room
                continue
            user.hold(start, start + length, charge)
        plan.hold(chosen, start, start + length, need, job.preemptible)
        plan.hold_node(chosen[0].node, start, start + length, job)
        if array is not None:
            array.hold(start, start + length, 1)
        if where is not None:
            where[job.id] = chosen
        return start


def _gpus_from(job: JobRequest, need: int | None, length: float, by_node: dict[str, list[GpuState]],
               plan: _Plan, first: float) -> tuple[float, list[GpuState]] | None:
    """The first moment from ``first`` that ``job``'s GPUs are free for ``length`` on one node, and
    those GPUs; None if never."""
    best: tuple[float, str, list[GpuState]] | None = None
    for node, gpus in by_node.items():
        if not job.may_use(node):
            continue
        suits = [g for g in gpus if (g.is_of(job) and packing.could_ever_share(g, need) if need is not None
                                     else g.fits(job))]
        if len(suits) < job.gpus:
            continue
        found = _on_node(suits, job, need, length, first, plan, best[0] if best is not None else math.inf)
        if found is not None and (best is None or (found[0], node) < best[:2]):
            best = (found[0], node, found[1])
    return None if best is None else (best[0], best[2])


def _on_node(gpus: list[GpuState], job: JobRequest, need: int | None, length: float, first: float, plan: _Plan,
             past: float) -> tuple[float, list[GpuState]] | None:
    """The first moment ``job.gpus`` of ``gpus`` each have ``need`` (None: all of it) together for
    ``length`` seconds, and those GPUs; None if never, or not before ``past`` (another node's). The
    count-th soonest moment each GPU is free is a lower bound of it: if fewer are free together
    then, the bound moves there, and grows until they are."""
    at, count, preemptible = first, job.gpus, job.preemptible
    while True:
        soonest = sorted(plan.next_free(g.id, at, length, need, past, preemptible) for g in gpus)[count - 1]
        if math.isinf(soonest):
            return None
        free = [g for g in gpus if plan.next_free(g.id, soonest, length, need, preemptible=preemptible) == soonest]
        if len(free) >= count:
            ready = plan.node_from(gpus[0].node, soonest, length, job, past)
            if ready == soonest:
                return soonest, free[:count]
            if math.isinf(ready):
                return None
            soonest = ready  # its GPUs then, once its node's cores and memory are free
        at = soonest
