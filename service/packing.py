"""Shared GPUs by memory: how much room a GPU has for one more shared job, now and later, which GPUs
a shared job takes (best fit), what it is charged, and how its wait reads in `gpuq why`.

A shared job asks for ``mem_mib`` on each of its GPUs and is given that plus a reserve for its CUDA
context (``QueueState.shared_context_mib``). A GPU's room is its memory less the shared jobs' shares
and reserves and what processes gpuq did not start use. Whole-GPU and shared jobs never sit on one
GPU together. Pure functions over the policy's types (service/policy.py), no database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types are only named here
    from gpuq.service.queue_state import GpuState, JobRequest, Reservation


def need_mib(job: JobRequest, context_mib: int) -> int:
    """The room a shared job needs on each of its GPUs: its share and its context reserve."""
    assert job.mem_mib is not None  # JobRequest refuses a shared job without one
    return job.mem_mib + context_mib


def charged_fraction(job_mem_mib: int, context_mib: int, gpu_total_mib: int) -> float:
    """The part of a GPU a shared job is charged for (fair share, accounting, the user GPU limit):
    its share and context reserve over the GPU's memory, at most the whole GPU. A whole-GPU job is
    charged 1 per GPU."""
    return min(1.0, (job_mem_mib + context_mib) / gpu_total_mib)


def charged_gpus(job: JobRequest, gpus: Sequence[GpuState], context_mib: int) -> float:
    """GPUs ``job`` counts for on ``gpus`` (its placement): its charged fraction of each for a
    shared job, their number for a whole one. GPU-hours charged = this x hours run."""
    if not job.shared:
        return float(len(gpus))
    assert job.mem_mib is not None
    return sum(charged_fraction(job.mem_mib, context_mib, g.memory_total_mib) for g in gpus)


@dataclass(slots=True, eq=False)
class GpuLoad:
    """A GPU as one decision pass sees it while it places jobs: when its whole-GPU job is expected
    to end, or what its shared jobs hold and until when. Jobs placed in the pass are added, so
    several shared jobs can go to one GPU in one pass and a reservation counts what was placed."""

    gpu: GpuState
    whole_until: float | None  # a whole-GPU job's expected end (inf: no time limit); None: none
    room: int  # memory a shared job may take now (``GpuState.room_mib`` less what the pass placed)
    # (expected end, MiB held) of its shared jobs: one per job there before the pass, then one per job
    # placed in it.
    shares: list[tuple[float, int]] = field(default_factory=list)

    @classmethod
    def of(cls, gpu: GpuState) -> GpuLoad:
        return cls(gpu, gpu.busy_until, gpu.room_mib, list(gpu.shares))

    @property
    def clear(self) -> bool:
        """No gpuq job on it: a whole-GPU job may take it."""
        return self.whole_until is None and not self.shares

    def clear_at(self, now: float) -> float:
        """When no gpuq job holds it any more, by their time limits (inf: not known)."""
        end = now if self.whole_until is None else self.whole_until
        return max([end, *(e for e, _ in self.shares)])

    def room_at(self, t: float) -> int:
        """Its room for shared jobs at ``t``, once the shared jobs expected to end by then left.
        A job expected to end at ``t`` has left at ``t``, as the backfill rule counts it."""
        return self.gpu.memory_total_mib - self.gpu.foreign_mib - sum(m for e, m in self.shares if e > t)

    def ready_at(self, need: int, now: float) -> float:
        """The earliest time it has ``need`` MiB of room and no whole-GPU job (inf: not known)."""
        start = now if self.whole_until is None else self.whole_until
        for t in sorted({start, *(e for e, _ in self.shares if e > start)}):
            if self.room_at(t) >= need:
                return t
        return math.inf

    def take_whole(self, end: float) -> None:
        self.whole_until = end

    def take_share(self, need: int, end: float) -> None:
        self.room -= need
        self.shares.append((end, need))


def could_ever_share(gpu: GpuState, need: int) -> bool:
    """Whether the GPU could hold a shared job needing ``need`` once gpuq's jobs have left it."""
    return gpu.memory_total_mib - gpu.foreign_mib >= need


def choose_shared(job: JobRequest, need: int, shareable: dict[str, list[GpuLoad]], nodes: Iterable[str],
                  reservation: Reservation | None, ends: float) -> tuple[GpuLoad, ...] | None:
    """The GPUs shared ``job`` gets now, or None: on one node, each with ``need`` MiB of room.

    Best fit: on each node its ``job.gpus`` GPUs with the least room that still fits, and the node
    whose chosen GPUs have the least room left between them; so GPUs already shared fill up first and
    empty GPUs stay free for whole-GPU jobs. ``shareable``: each node's GPUs without a whole-GPU job;
    ``ends``: when the job would end by its time limit (inf without one).
    """
    best: tuple[int, str, tuple[GpuLoad, ...]] | None = None
    for node in nodes:
        fitting = [(load.room - need, load.gpu.index, load) for load in shareable[node]
                   if load.room >= need and load.gpu.is_of(job) and load.gpu.open_until(ends)
                   and not _would_delay(load, need, ends, reservation)]
        if len(fitting) < job.gpus:
            continue
        if job.gpus == 1:
            left, _, load = min(fitting, key=lambda f: (f[0], f[1]))
            pick: tuple[GpuLoad, ...] = (load,)
        else:
            fitting.sort(key=lambda f: (f[0], f[1]))
            left = sum(f[0] for f in fitting[: job.gpus])
            pick = tuple(f[2] for f in fitting[: job.gpus])
        if best is None or (left, node) < best[:2]:
            best = (left, node, pick)
    return None if best is None else best[2]


def _would_delay(load: GpuLoad, need: int, ends: float, reservation: Reservation | None) -> bool:
    """Whether a shared job of ``need`` MiB ending at ``ends`` on this GPU could delay the
    reservation (EASY backfill's promise to the first waiting job).

    Only the reserved GPUs matter. A job that ends by the reserved start cannot delay it. Else, for
    a reserved whole-GPU job, it would (the GPU would not be clear at the start); for a reserved
    shared job, it would unless the room left at the start, with it still running, still holds the
    reserved job: all that can be counted on, as jobs may end early but never late.
    """
    if reservation is None or load.gpu.id not in reservation.gpu_ids or ends <= reservation.start:
        return False
    if reservation.shared_mib is None:
        return True
    return load.room_at(reservation.start) - need < reservation.shared_mib


def _gib(mib: float) -> str:
    """MiB as GiB with one decimal, or none for a whole number of GiB (a GPU's size: "16")."""
    gib = mib / 1024
    return f"{gib:.0f}" if gib == int(gib) else f"{gib:.1f}"


def room_lines(job: JobRequest, gpus: Iterable[GpuState], context_mib: int) -> list[str]:
    """`gpuq why`'s figures for a waiting shared job: for each GPU it could use (on its node, if it
    asked for one), the room left and what the job needs, e.g.
    "GPU 1 on node a: 5.5 GiB left of 16, job needs 6.0 + 0.5"."""
    assert job.mem_mib is not None
    needs = f"job needs {job.mem_mib / 1024:.1f} + {context_mib / 1024:.1f}"
    lines = []
    for g in sorted(gpus, key=lambda g: (g.node, g.index)):
        if not job.may_use(g.node):
            continue
        head = f"GPU {g.index} on node {g.node}"
        if g.busy_until is not None:
            lines.append(f"{head} runs a whole-GPU job: no room to share until it ends")
            continue
        held = []
        if g.shared_jobs:
            held.append(f"{g.shared_jobs} shared job{'s' if g.shared_jobs != 1 else ''} hold {g.shared_mib / 1024:.1f}")
        if g.foreign_mib:
            held.append(f"other programs {g.foreign_mib / 1024:.1f}")
        detail = f" ({', '.join(held)})" if held else ""
        lines.append(f"{head}: {max(g.room_mib, 0) / 1024:.1f} GiB left of {_gib(g.memory_total_mib)}{detail}, {needs}")
    return lines
