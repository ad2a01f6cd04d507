"""The scheduler: places pending jobs on free GPUs, sends each to its first GPU's worker, and
notices workers that went silent.

``place`` is a pure function over a snapshot, so policy is tested without a database or broker;
``schedule_once`` applies it to SQL and Celery; ``run`` loops, woken by Redis on submit and on job end.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import broker
from gpuq.service import constants as c
from gpuq.service.celery_app import make_app, send_run_job
from gpuq.service.db import session_scope
from gpuq.service.inventory import live_cutoff
from gpuq.service.models import Allocation, Gpu, Job, utcnow
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.scheduler")


@dataclass(frozen=True)
class FreeGpu:
    id: int
    node: str
    index: int
    queue: str


@dataclass(frozen=True)
class PendingJob:
    id: int
    gpus: int


@dataclass(frozen=True)
class Placement:
    job_id: int
    gpus: tuple[FreeGpu, ...]  # rank order; gpus[0]'s worker runs the job


def place(pending: list[PendingJob], free: list[FreeGpu]) -> list[Placement]:
    """Place jobs in queue order, each on ``gpus`` free GPUs of one node (gang), or not at all.

    The queue is strict: when the first waiting job does not fit, nothing behind it starts, so a
    big job is never starved by a stream of small ones.
    """
    by_node: dict[str, list[FreeGpu]] = defaultdict(list)
    for g in sorted(free, key=lambda g: (g.node, g.index)):
        by_node[g.node].append(g)
    out = []
    for job in pending:
        # Best fit: the node with the fewest free GPUs that still fits keeps bigger holes open.
        fits = [n for n, gs in by_node.items() if len(gs) >= job.gpus]
        if not fits:
            break
        node = min(fits, key=lambda n: (len(by_node[n]), n))
        chosen, by_node[node] = by_node[node][: job.gpus], by_node[node][job.gpus:]
        out.append(Placement(job.id, tuple(chosen)))
    return out


def free_gpus(session: Session, settings: Settings) -> list[FreeGpu]:
    """GPUs whose worker heart-beats and that no job holds."""
    rows = session.scalars(select(Gpu).outerjoin(Allocation)
                           .where(Allocation.id.is_(None), Gpu.heartbeat_at >= live_cutoff(settings)))
    return [FreeGpu(g.id, g.node, g.index, g.queue) for g in rows]


def pending_jobs(session: Session) -> list[PendingJob]:
    rows = session.execute(select(Job.id, Job.gpus).where(Job.state == c.PENDING)
                           .order_by(Job.priority.desc(), Job.id))
    return [PendingJob(r.id, r.gpus) for r in rows]


def reap_lost(session: Session, settings: Settings) -> list[int]:
    """Jobs whose worker stopped heart-beating: a running one fails, a dispatched one waits again."""
    cutoff = live_cutoff(settings)
    lost = session.execute(
        select(Job.id, Job.state, Gpu.worker).join(Allocation, Allocation.job_id == Job.id)
        .join(Gpu, Gpu.id == Allocation.gpu_id)
        .where(Allocation.rank == 0, Job.state.in_((c.DISPATCHED, c.RUNNING)),
               (Gpu.heartbeat_at < cutoff) | Gpu.heartbeat_at.is_(None))
    ).all()
    now = utcnow()
    for job_id, state, worker in lost:
        if state == c.RUNNING:
            why = f"worker lost: {worker} sent no heartbeat for {settings.worker_timeout:g} s"
            session.execute(update(Job).where(Job.id == job_id, Job.state == c.RUNNING)
                            .values(state=c.FAILED, ended_at=now, reason=why))
        else:
            session.execute(update(Job).where(Job.id == job_id, Job.state == c.DISPATCHED)
                            .values(state=c.PENDING, dispatched_at=None, node=None))
        session.execute(delete(Allocation).where(Allocation.job_id == job_id))
        log.warning("job %s: worker %s lost while %s", job_id, worker, state)
    return [j for j, _, _ in lost]


class Scheduler:
    """One scheduler process's state: its settings, Celery app and Redis connection."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = make_app(settings)
        self.redis = broker.client(settings)

    def schedule_once(self) -> list[Placement]:
        """One pass: reap lost workers, place what fits, send the messages. Returns the placements."""
        with session_scope(self.settings) as session:
            reap_lost(session, self.settings)
        try:
            with session_scope(self.settings) as session:
                placements = place(pending_jobs(session), free_gpus(session, self.settings))
                placements = [p for p in placements if self._allocate(session, p)]
        except IntegrityError:
            # Another scheduler took one of these GPUs first; the next pass sees the new state.
            log.info("allocation raced with another scheduler; retrying next pass")
            return []
        for p in placements:
            self._send(p)
        return placements

    def _allocate(self, session: Session, p: Placement) -> bool:
        moved = session.execute(
            update(Job).where(Job.id == p.job_id, Job.state == c.PENDING)
            .values(state=c.DISPATCHED, dispatched_at=utcnow(), node=p.gpus[0].node)
        ).rowcount
        if not moved:
            return False  # cancelled meanwhile
        session.add_all(Allocation(job_id=p.job_id, gpu_id=g.id, rank=r) for r, g in enumerate(p.gpus))
        session.flush()
        return True

    def _send(self, p: Placement) -> None:
        try:
            send_run_job(self.app, p.gpus[0].queue, p.job_id)
            log.info("job %s: sent to %s", p.job_id, p.gpus[0].queue)
        except Exception as exc:  # noqa: BLE001 - any broker failure means: not sent, try again later
            log.warning("job %s: could not send to %s (%s); back to pending", p.job_id, p.gpus[0].queue, exc)
            with session_scope(self.settings) as session:
                session.execute(update(Job).where(Job.id == p.job_id, Job.state == c.DISPATCHED)
                                .values(state=c.PENDING, dispatched_at=None, node=None))
                session.execute(delete(Allocation).where(Allocation.job_id == p.job_id))

    def run(self, stop: threading.Event) -> None:
        """Schedule until ``stop`` is set; a pass after every wake-up and at least every interval."""
        log.info("scheduler started (node %s)", self.settings.node)
        while not stop.is_set():
            try:
                self.schedule_once()
                broker.wait_for_wake(self.redis, self.settings, self.settings.scheduler_interval)
            except Exception:  # noqa: BLE001 - a scheduler must outlive a database or Redis blip
                log.exception("scheduler pass failed; retrying")
                stop.wait(self.settings.scheduler_interval)
        log.info("scheduler stopped")
