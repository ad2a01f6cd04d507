"""Preemption, as SLURM's scavenger QOS with PreemptMode=REQUEUE does it: a job submitted
`--preemptible` runs on GPUs nobody else is waiting for, past its user's GPU limit, and goes back to
the queue (requeued, its attempt kept as preempted) when a job that is not preemptible needs its
GPUs, or the room its share holds on a GPU (a `--shared` one). The choice is a pure function over
one pass's view of the GPUs, as ``policy.decide`` is.

Which jobs are stopped: on the one node where the waiting job fits with the fewest of them (a
gang's GPUs on one node, as always), the lowest priority first, then the latest started (the least
work lost, as SLURM's preempt ordering by start time). GPUs already being freed by an earlier
preemption count as free: a job is never preempted twice for one waiting job, or for another one
while the GPUs it frees are claimed by none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuq.service import packing

if TYPE_CHECKING:
    from gpuq.service.packing import GpuLoad
    from gpuq.service.queue_state import GpuState, JobRequest, Preemptible


@dataclass(frozen=True)
class Plan:
    """What a waiting job takes by preemption on ``node``: ``gpus`` (free, being freed, or held by
    ``victims``, which are to be stopped)."""

    node: str
    gpus: tuple[GpuLoad, ...]
    victims: tuple[int, ...]


def fits_once_clear(gpu: GpuState, job: JobRequest, context_mib: int) -> bool:
    """Whether ``job`` could run on ``gpu`` once gpuq's jobs have left it (its type, and its memory
    beside what other programs hold there)."""
    if not gpu.is_of(job):
        return False
    if job.shared:
        return packing.could_ever_share(gpu, packing.need_mib(job, context_mib))
    if job.mem_mib is None:
        return gpu.foreign_mib == 0
    return gpu.memory_total_mib - gpu.foreign_mib >= job.mem_mib


def victim_order(victim: Preemptible) -> tuple[int, float, int]:
    """Which preemptible job goes first: the lowest priority, then the latest started."""
    return victim.priority, -victim.started, victim.job_id


def plan(job: JobRequest, nodes: Iterable[str], options: Callable[[str], list[tuple[GpuLoad, tuple[Preemptible, ...]]]],
         node_short: Callable[[str, list[int]], bool] = lambda node, victims: False,
         others: Callable[[str], Iterable[Preemptible]] = lambda node: ()) -> Plan | None:
    """The node and preemptible jobs that let ``job`` start once they stopped, fewest stopped first
    (then fewest GPUs taken from them, then the node's name); None if no node has enough.

    ``options(node)``: each GPU there ``job`` could use, with the preemptible jobs that must stop
    before it can: none where it is free or being freed by an earlier preemption; the whole-GPU job
    on it; or, for a GPU that shared jobs use, those of them whose shares make the room ``job`` needs
    (a whole-GPU job: all of them, none of them firm). ``node_short(node, victims)``: whether the node
    lacks the CPU cores or host memory ``job`` reserves (`--cpus`, `--host-mem`) even once those
    jobs let theirs go, so that more of them stop for theirs: those of ``options`` and the node's
    other preemptible jobs (``others(node)``, on GPUs ``job`` could not use: another model, too
    little memory beside other programs, a GPU kept for a reservation). Jobs stop in
    ``victim_order`` until enough GPUs are usable, then until the node has the cores and memory,
    and only those the chosen GPUs (or the node's cores and memory) need are kept. A plan with no
    victims waits for GPUs that are being freed already."""
    best: tuple[tuple[int, int, str], Plan] | None = None
    for node in nodes:
        opts = options(node)
        needs_of = dict(opts)
        # Being freed first: a free GPU taken here is one another job could have had.
        gpus = sorted((load for load, needs in opts if not needs), key=lambda g: g.clear)[: job.gpus]
        locked = [(load, set(needs)) for load, needs in opts if needs]
        pool = sorted({v for _, needs in locked for v in needs}, key=victim_order)
        chosen: list[Preemptible] = []
        for victim in pool:  # for GPUs
            if len(gpus) >= job.gpus:
                break
            chosen.append(victim)
            for item in [x for x in locked if x[1] <= set(chosen)]:
                locked.remove(item)
                if len(gpus) < job.gpus:
                    gpus.append(item[0])
        if len(gpus) >= job.gpus and node_short(node, [v.job_id for v in chosen]):  # for its cores and memory
            for victim in sorted({*pool, *others(node)} - set(chosen), key=victim_order):
                chosen.append(victim)
                if not node_short(node, [v.job_id for v in chosen]):
                    break
        if len(gpus) < job.gpus or node_short(node, [v.job_id for v in chosen]) or (
                not chosen and all(g.clear for g in gpus)):
            continue  # too few; or free already, where the pass would have placed it if it could
        # Only those its GPUs (or its node's cores and memory) need: one stopped for room on a GPU
        # that another stop then freed whole, or that is not chosen, goes on.
        needed = {v for g in gpus for v in needs_of[g]}
        victims = [v for v in chosen if v in needed]
        for v in chosen:
            if not node_short(node, [k.job_id for k in victims]):
                break
            if v not in victims:
                victims.append(v)
        victims.sort(key=victim_order)
        rank = (len(victims), sum(1 for g in gpus if needs_of[g]), node)
        if best is None or rank < best[0]:
            best = (rank, Plan(node, tuple(gpus), tuple(v.job_id for v in victims)))
    return best[1] if best is not None else None
