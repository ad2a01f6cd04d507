"""Placing: the GPUs as one ``policy.decide`` pass places jobs on them, free, shared, reserved for
the first job in line, fenced for a typed one, or taken by preemption (service/preemption.py). A
GPU whose node is to drain (``GpuState.closes_at``) takes only jobs that end by then. A job that
reserves CPU cores or host memory (`--cpus`, `--host-mem`) goes only where its node has them free
(service/node_use.py), and a job placed past the reserved start leaves the first job in line its
node's share of them as well as its GPUs."""

from __future__ import annotations

import math
from collections import defaultdict

from gpuq.service import packing, preemption
from gpuq.service.node_use import SLACK, needs
from gpuq.service.packing import GpuLoad
from gpuq.service.queue_state import GpuState, JobRequest, Placement, Preemptible, QueueState, Reservation


class Gpus:
    """The GPUs as one ``decide`` pass places jobs on them."""

    def __init__(self, state: QueueState) -> None:
        self.now = state.now
        self.context_mib = state.shared_context_mib
        # Each node's cores and host memory, by kind: the jobs placed in this pass hold theirs too.
        self.use = {kind: use.copy() for kind, use in state.node_use.items()}
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
        # When nodes drain (`gpuq drain --at`): which of them a job ends before is part of its kind.
        self.drain_times = sorted({g.closes_at for g in state.gpus if g.closes_at is not None})
        # What preemption may take, by node: each preemptible job's GPUs, and GPUs being freed by
        # an earlier preemption that no job of this pass claimed yet (service/preemption.py).
        self.held: dict[str, dict[Preemptible, list[GpuLoad]]] = defaultdict(lambda: defaultdict(list))
        self.freeing: dict[str, list[GpuLoad]] = defaultdict(list)
        # And on GPUs shared jobs use, the shares preemption may take, (job, MiB), and the room
        # earlier preemptions are freeing, MiB, by GPU id.
        self.share_victims: dict[int, list[tuple[Preemptible, int]]] = {}
        self.freeing_mib: dict[int, int] = {}
        # The preemptible whole-GPU job on each GPU that has one, by GPU id (``held``'s, GPU by GPU).
        self.victim_on: dict[int, Preemptible] = {}
        for loads in self.by_node.values():
            for load in loads:
                if load.gpu.preemptible is not None:
                    self.held[load.gpu.node][load.gpu.preemptible].append(load)
                    self.victim_on[load.gpu.id] = load.gpu.preemptible
                elif load.gpu.preempted:
                    self.freeing[load.gpu.node].append(load)
                if load.gpu.preemptible_shares:
                    self.share_victims[load.gpu.id] = sorted(((v, mib) for v, _, mib in load.gpu.preemptible_shares),
                                                             key=lambda s: preemption.victim_order(s[0]))
                if load.gpu.preempted_shares:
                    self.freeing_mib[load.gpu.id] = load.gpu.freeing_mib
        self.preemptible_gpus = self._preemptible_left()
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

    def _node_has(self, wants: dict[str, float], node: str, reservation: Reservation | None,
                  ends_in_time: bool) -> bool:
        """Whether ``node`` has what a job reserves of it (``wants``: cores, host memory) free now
        and, on the reserved node for a job that would still run at the reserved start, what the
        reserved job needs of it free beside that then."""
        for kind, amount in wants.items():
            if not self.use[kind].fit(amount, node, self.now):
                return False
        if reservation is None or node != reservation.node or ends_in_time:
            return True
        return all(self.use[kind].fit(wants.get(kind), node, reservation.start, also=kept)
                   for kind, kept in reservation.needs)

    def ends(self, job: JobRequest) -> float:
        """When ``job`` would end by its time limit if it started now (inf without one)."""
        return math.inf if job.time_limit_s is None else self.now + job.time_limit_s

    def _drains_met(self, job: JobRequest) -> int:
        """How many of the planned drains ``job`` would end before if it started now."""
        return sum(self.ends(job) <= t for t in self.drain_times) if self.drain_times else 0

    def choose(self, job: JobRequest, reservation: Reservation | None) -> tuple[GpuLoad, ...] | None:
        """The GPUs ``job`` gets now without delaying ``reservation``, or None."""
        ends_in_time = reservation is not None and self.ends(job) <= reservation.start
        shape = (job.shared, job.gpus, job.mem_mib, job.node, job.exclude, job.gpu_type, ends_in_time,
                 self._drains_met(job), job.cpus, job.host_mem_mib)
        if shape in self.failed:
            return None
        nodes = self.nodes_for(job)
        wants = needs(job)
        if wants:
            nodes = [n for n in nodes if self._node_has(wants, n, reservation, ends_in_time)]
        if job.shared:
            shareable = self.shareable if not self.fenced else \
                {n: [g for g in loads if self.open_to_later(g.gpu)] for n, loads in self.shareable.items()}
            chosen = packing.choose_shared(job, packing.need_mib(job, self.context_mib), shareable,
                                           nodes, reservation, self.ends(job))
        else:
            chosen = self._choose_whole(job, nodes, reservation, ends_in_time)
        if chosen is None:
            self.failed.add(shape)
        return chosen

    def _choose_whole(self, job: JobRequest, nodes: list[str], reservation: Reservation | None,
                      ends_in_time: bool) -> tuple[GpuLoad, ...] | None:
        """Best fit for a whole-GPU job: the node of ``nodes`` with the fewest suitable GPUs free of gpuq jobs."""
        options = []
        for node in nodes:
            usable = [g for g in self.free[node] if g.gpu.fits(job) and g.gpu.open_until(self.ends(job))
                      and (not self.fenced or self.open_to_later(g.gpu))]
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
        wants = needs(job)
        for kind, amount in wants.items():
            self.use[kind].hold(node, job.id, end, amount)
        self.failed.clear()
        return Placement(job.id, tuple(load.gpu for load in chosen), shared=job.shared, needs=tuple(wants.items()))

    def may_preempt_for(self, job: JobRequest) -> bool:
        """Whether ``job`` might still take GPUs by preemption in this pass."""
        return not job.preemptible and self.preemptible_gpus > 0

    def preempt(self, job: JobRequest, reservation: Reservation | None) -> preemption.Plan | None:
        """The GPUs ``job`` takes by stopping preemptible jobs (or waiting for those being stopped),
        claimed for it in this pass; None if it cannot. GPUs kept for a reservation or a fenced job
        ahead of it are not taken."""
        if not self.may_preempt_for(job):
            return None
        shape = (job.shared, job.gpus, job.mem_mib, job.node, job.exclude, job.gpu_type, self._drains_met(job),
                 job.cpus, job.host_mem_mib)
        if shape in self.cannot_preempt:
            return None
        reserved = reservation.gpu_ids if reservation is not None else frozenset()

        ends = self.ends(job)

        def usable(load: GpuLoad) -> bool:
            return (load.gpu.id not in reserved and load.gpu.open_until(ends)
                    and (not self.fenced or self.open_to_later(load.gpu))
                    and preemption.fits_once_clear(load.gpu, job, self.context_mib))

        need = packing.need_mib(job, self.context_mib) if job.shared else None

        def options(node: str) -> list[tuple[GpuLoad, tuple[Preemptible, ...]]]:
            return [(load, stop) for load in self.by_node[node]
                    if usable(load) and (stop := self._to_stop(load, need)) is not None]

        wants = needs(job)

        def node_short(node: str, victims: list[int]) -> bool:
            """Whether ``node`` lacks ``job``'s cores or host memory even once ``victims`` let theirs go."""
            return any(self.use[kind].counts(amount, node) and self.use[kind].free_at(node, self.now)
                       + self.use[kind].held_by(node, victims) < amount - SLACK for kind, amount in wants.items())

        def others(node: str) -> list[Preemptible]:
            """The node's preemptible jobs, whole-GPU and shared: any of them may stop for its cores and memory."""
            shares = (v for load in self.by_node[node] for v, _ in self.share_victims.get(load.gpu.id, []))
            return [*self.held[node], *shares]

        plan = preemption.plan(job, self.nodes_for(job), options, node_short, others)
        if plan is None:
            self.cannot_preempt.add(shape)
            return None
        self._claim(job, plan)
        return plan

    def _to_stop(self, load: GpuLoad, need: int | None) -> tuple[Preemptible, ...] | None:
        """The preemptible jobs to stop before a job needing ``need`` MiB of room (None: the whole GPU)
        may have ``load``: none where it is free or being freed; its whole-GPU job; or of the shared
        jobs on it, the fewest (lowest priority, latest started first) whose shares make the room (all
        of them for the whole GPU, where none is firm). None where it cannot be had so."""
        if load.clear or load in self.freeing[load.gpu.node]:  # clear: in ``free`` (filled ones leave it)
            return ()
        if load.gpu.id in self.victim_on:
            return (self.victim_on[load.gpu.id],)
        if load.whole_until is not None:
            return None  # a firm whole-GPU job, or claimed by another in this pass
        victims = self.share_victims.get(load.gpu.id, [])
        freeing = self.freeing_mib.get(load.gpu.id, 0)
        if need is None:
            firm = sum(mib for _, mib in load.shares) - sum(mib for _, mib in victims) - freeing
            return tuple(v for v, _ in victims) if firm <= 0 else None
        if load.room >= need:
            return None  # room now: the pass placed it there if it could
        room, stop = load.room + freeing, []
        for victim, mib in victims:
            if room >= need:
                break
            stop.append(victim)
            room += mib
        return tuple(stop) if room >= need else None

    def _claim(self, job: JobRequest, plan: preemption.Plan) -> None:
        """Hold ``plan``'s GPUs for ``job`` in this pass; its victims' other GPUs (and shares) are being freed."""
        node, end = plan.node, self.ends(job)
        for kind, use in self.use.items():
            use.release(node, plan.victims)
            use.hold(node, job.id, end, getattr(job, kind))
        for victim in [v for v in self.held[node] if v.job_id in plan.victims]:
            loads = self.held[node].pop(victim)
            self.freeing[node] += [g for g in loads if g not in plan.gpus]
            for g in loads:
                del self.victim_on[g.gpu.id]
        for load in self.by_node[node]:
            stopped = [(v, mib) for v, mib in self.share_victims.get(load.gpu.id, []) if v.job_id in plan.victims]
            if stopped:
                self.share_victims[load.gpu.id] = [s for s in self.share_victims[load.gpu.id] if s not in stopped]
                self.freeing_mib[load.gpu.id] = self.freeing_mib.get(load.gpu.id, 0) + sum(mib for _, mib in stopped)
        for load in plan.gpus:
            if job.shared and load.whole_until is None and load.shares:
                # Room made on a GPU shared jobs use: it holds the job's share, and stays shareable.
                load.take_share(packing.need_mib(job, self.context_mib), end)
                continue
            if load in self.freeing[node]:
                self.freeing[node].remove(load)
            if load in self.free[node]:
                self.free[node].remove(load)
                self.free_count -= 1
            if load in self.shareable[node]:
                self.shareable[node].remove(load)
            load.take_whole(end)
        self.preemptible_gpus = self._preemptible_left()

    def _preemptible_left(self) -> int:
        """GPUs preemption may still take in this pass (kept as ``preemptible_gpus``: every job of a
        long queue asks whether there are any)."""
        return (sum(len(gs) for by_job in self.held.values() for gs in by_job.values())
                + sum(len(gs) for gs in self.freeing.values())
                + sum(1 for shares in self.share_victims.values() if shares)
                + sum(1 for mib in self.freeing_mib.values() if mib))

    def could_ever_fit(self, job: JobRequest, past_drains: bool = False) -> bool:
        """Whether ``job`` fits a node's GPUs once they are free; ``past_drains``: only GPUs whose
        node is not to drain for good (a job that fits none of those waits for a resume, not for
        the queue)."""
        def counts(g: GpuLoad) -> bool:
            return not past_drains or g.gpu.closes_at is None or g.gpu.reopens_at is not None

        nodes = [n for n in self.nodes_for(job)
                 if all(self.use[kind].ever_fits(amount, n) for kind, amount in needs(job).items())]
        if job.shared:
            need = packing.need_mib(job, self.context_mib)
            return any(sum(counts(g) and g.gpu.is_of(job) and packing.could_ever_share(g.gpu, need)
                           for g in self.by_node[n]) >= job.gpus
                       for n in nodes)
        return any(sum(1 for g in self.by_node[n] if counts(g) and g.gpu.fits(job)) >= job.gpus
                   for n in nodes)

    def reserve(self, job: JobRequest) -> Reservation | None:
        """The earliest start ``job`` can count on, from the running jobs' time limits (those
        placed in this pass included); None if unknown. The GPUs kept for a typed job ahead of it
        (``fence``) count for nothing: that job takes them first, at a time no one knows."""
        need = packing.need_mib(job, self.context_mib) if job.shared else None
        length = math.inf if job.time_limit_s is None else job.time_limit_s
        wants = needs(job)
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
            # Its GPUs' moment, or later where its node's cores or memory are held past it (what is
            # free of each only grows: the latest of their moments has them all).
            start = max([needed[-1][0], *(self.use[kind].ready_at(amount, node, needed[-1][0])
                                          for kind, amount in wants.items())])
            # A node's window (its GPUs share it): a job that could not end before it starts after it.
            # GPUs clear (or with room) at ``start`` stay so: nothing else is planned on them.
            start = loads[0].gpu.open_from(start, length) if loads else start
            if math.isinf(start):
                continue
            if best is None or start < best.start:
                best = Reservation(job.id, node, start, frozenset(gpu_id for _, _, gpu_id in needed), need,
                                   tuple((kind, amount) for kind, amount in wants.items()
                                         if self.use[kind].counts(amount, node)))
        return best
