"""Preemption, as SLURM's scavenger QOS with PreemptMode=REQUEUE does it: a job submitted
`--preemptible` runs on GPUs nobody else is waiting for, past its user's GPU limit, and goes back to
the queue (requeued, its attempt kept as preempted) when a job that is not preemptible needs its
GPUs. The choice is a pure function over one pass's view of the GPUs, as ``policy.decide`` is.

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


def plan(job: JobRequest, nodes: Iterable[str], ready: Callable[[str], list[GpuLoad]],
         held: Callable[[str], dict[Preemptible, list[GpuLoad]]],
         node_short: Callable[[str, list[int]], bool] = lambda node, victims: False) -> Plan | None:
    """The node and preemptible jobs that let ``job`` start once they stopped, fewest stopped first
    (then fewest GPUs taken from them, then the node's name); None if no node has enough.

    ``ready(node)``: the GPUs there ``job`` could take without stopping anyone (free, or being
    freed by an earlier preemption); ``held(node)``: each preemptible job there and its GPUs that
    ``job`` could use; ``node_short(node, victims)``: whether the node lacks the CPU cores or host
    memory ``job`` reserves (`--cpus`, `--host-mem`) even once those jobs let theirs go, so that more
    of them stop for theirs. A plan with no victims waits for GPUs that are being freed already."""
    best: tuple[tuple[int, int, str], Plan] | None = None
    for node in nodes:
        # Being freed first: a free GPU taken here is one another job could have had.
        gpus = sorted(ready(node), key=lambda g: g.clear)[: job.gpus]
        victims: list[int] = []
        stopped = 0
        for victim, loads in sorted(held(node).items(), key=lambda item: victim_order(item[0])):
            if len(gpus) >= job.gpus and not node_short(node, victims):
                break
            taken = loads[: max(job.gpus - len(gpus), 0)]
            gpus += taken
            victims.append(victim.job_id)
            stopped += len(taken)
        if len(gpus) < job.gpus or node_short(node, victims) or (not victims and all(g.clear for g in gpus)):
            continue  # too few; or free already, where the pass would have placed it if it could
        rank = (len(victims), stopped, node)
        if best is None or rank < best[0]:
            best = (rank, Plan(node, tuple(gpus), tuple(victims)))
    return best[1] if best is not None else None
