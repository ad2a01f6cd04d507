"""The scheduler: reads a snapshot of SQL, lets the policy (``policy.decide``, a pure function)
place pending jobs on free GPUs, sends each to its first GPU's worker, records why the others wait,
and notices workers that went silent. ``run`` loops, woken by Redis on submit and on job end.
"""

from __future__ import annotations

import logging
import threading
import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import broker, jobs, policy
from gpuq.service import constants as c
from gpuq.service.celery_app import make_app, send_run_job
from gpuq.service.db import session_scope
from gpuq.service.inventory import live_cutoff
from gpuq.service.models import Allocation, Gpu, Job, Node, utcnow
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.scheduler")


def fair_share_usage(session: Session, settings: Settings, now: datetime) -> dict[str, float]:
    """Each user's recent GPU-hours, a GPU-hour ``h`` half-lives ago counting 2**-h.

    The integral of the decay over each job's run, in closed form: no per-interval bookkeeping.
    """
    half = settings.fairshare_half_life_h * 3600.0
    horizon = now - timedelta(seconds=10 * half)
    rows = session.execute(select(Job.user, Job.gpus, Job.started_at, Job.ended_at)
                            .where(Job.started_at.is_not(None),
                                   (Job.ended_at.is_(None)) | (Job.ended_at >= horizon)))
    usage: dict[str, float] = defaultdict(float)
    rate = math.log(2) / half
    for user, gpus, started, ended in rows:
        age_end = (now - (ended or now)).total_seconds()
        age_start = (now - started).total_seconds()
        usage[user] += gpus * (math.exp(-rate * age_end) - math.exp(-rate * age_start)) / rate / 3600.0
    return dict(usage)


@dataclass
class Snapshot:
    """What the scheduler read from SQL for one pass."""

    policy: policy.Snapshot
    # Pending jobs that cannot be considered, and why (held, dependency, drained node).
    not_eligible: dict[int, str]
    # Pending jobs whose dependency can never be met: cancelled with this reason.
    doomed: dict[int, str]
    # The reason each pending job shows now, to write only those that change.
    shown: dict[int, str | None]


def read_snapshot(session: Session, settings: Settings) -> Snapshot:
    now = utcnow()
    drained = set(session.scalars(select(Node.name).where(Node.drained)))
    busy: dict[int, float] = {}
    held: dict[str, int] = defaultdict(int)
    for gpu_id, user, started, limit in session.execute(
            select(Allocation.gpu_id, Job.user, Job.started_at, Job.time_limit_s).join(Job)):
        held[user] += 1
        busy[gpu_id] = (started or now).timestamp() + limit if limit else math.inf
    gpus = [policy.GpuState(id=g.id, node=g.node, index=g.index, queue=g.queue, memory_total_mib=g.memory_total_mib,
                            memory_used_mib=g.memory_used_mib or 0, foreign_mib=g.foreign_mib or 0,
                            busy_until=busy.get(g.id))
            for g in session.scalars(select(Gpu).where(Gpu.heartbeat_at >= live_cutoff(settings),
                                                       Gpu.drain_reason.is_(None)))
            if g.node not in drained]
    pending = session.execute(
        select(Job.id, Job.user, Job.gpus, Job.priority, Job.submitted_at, Job.mem_mib, Job.on_node,
               Job.time_limit_s, Job.held, Job.after, Job.after_any, Job.reason)
        .where(Job.state == c.PENDING)).all()
    deps = {d for row in pending for d in (row.after or [])}
    dep_state = dict(session.execute(select(Job.id, Job.state).where(Job.id.in_(deps))).all()) if deps else {}
    jobs, not_eligible, doomed = [], {}, {}
    for row in pending:
        if row.held:
            not_eligible[row.id] = policy.HELD
            continue
        if row.after:
            states = [(d, dep_state.get(d, c.CANCELLED)) for d in row.after]
            failed = [(d, st) for d, st in states if st in c.END_STATES and st != c.SUCCEEDED]
            if failed and not row.after_any:
                doomed[row.id] = f"dependency never satisfied: job {failed[0][0]} {failed[0][1]}"
                continue
            if any(st not in c.END_STATES for _, st in states):
                not_eligible[row.id] = policy.DEPENDENCY
                continue
        if row.on_node in drained:
            not_eligible[row.id] = policy.NODE_DRAINED
            continue
        jobs.append(policy.JobRequest(id=row.id, user=row.user, gpus=row.gpus, priority=row.priority,
                                      submitted=row.submitted_at.timestamp(), mem_mib=row.mem_mib,
                                      node=row.on_node, time_limit_s=row.time_limit_s))
    snap = policy.Snapshot(now=now.timestamp(), jobs=jobs, gpus=gpus, usage=fair_share_usage(session, settings, now),
                           held_gpus=dict(held), user_gpu_limit=settings.user_gpu_limit)
    return Snapshot(snap, not_eligible, doomed, {row.id: row.reason for row in pending})


def reap_lost(session: Session, settings: Settings) -> list[int]:
    """Take back what lost workers held.

    A running job whose lease ran out (its worker was SIGKILLed, lost its node or the database)
    is requeued if it asked for retries, else failed "worker lost". A dispatched job whose GPU's
    worker stopped heart-beating waits again: it never started, so this costs it nothing.
    """
    now = utcnow()
    expired = session.execute(
        select(Job.id, Job.worker, Job.lease_expires_at)
        .where(Job.state == c.RUNNING, Job.lease_expires_at < now)).all()
    for job_id, worker, expires in expired:
        late = (now - expires).total_seconds() + settings.lease_timeout
        why = f"worker lost: {worker} did not renew the job's lease for {late:.0f} s"
        if jobs.finish(session, job_id, c.FAILED, failure=c.FAILURE_WORKER_LOST, reason=why,
                       max_requeues=settings.max_requeues, expired_before=now):
            log.warning("job %s: %s", job_id, why)
    cutoff = live_cutoff(settings)
    stranded = session.execute(
        select(Job.id, Gpu.worker).join(Allocation, Allocation.job_id == Job.id)
        .join(Gpu, Gpu.id == Allocation.gpu_id)
        .where(Allocation.rank == 0, Job.state == c.DISPATCHED,
               (Gpu.heartbeat_at < cutoff) | Gpu.heartbeat_at.is_(None))
    ).all()
    for job_id, worker in stranded:
        session.execute(update(Job).where(Job.id == job_id, Job.state == c.DISPATCHED)
                        .values(state=c.PENDING, dispatched_at=None, node=None))
        session.execute(delete(Allocation).where(Allocation.job_id == job_id))
        log.warning("job %s: worker %s lost before it started the job; waiting again", job_id, worker)
    return [j for j, _, _ in expired] + [j for j, _ in stranded]


def unclaimed(session: Session, settings: Settings, everything: bool = False) -> list[tuple[int, str]]:
    """Dispatched jobs whose message may be lost (Redis restarted empty, a send that vanished):
    those dispatched over ``resend_after`` seconds ago, or all of them; (job id, queue) each."""
    query = (select(Job.id, Gpu.queue).join(Allocation, Allocation.job_id == Job.id)
             .join(Gpu, Gpu.id == Allocation.gpu_id).where(Allocation.rank == 0, Job.state == c.DISPATCHED))
    if not everything:
        query = query.where(Job.dispatched_at < utcnow() - timedelta(seconds=settings.resend_after))
    return [(r.id, r.queue) for r in session.execute(query)]


class Scheduler:
    """One scheduler process's state: its settings, Celery app and Redis connection."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = make_app(settings)
        self.redis = broker.client(settings)
        # The Redis server's run id: a new one means Redis restarted, maybe empty of our messages.
        self._redis_run_id: str | None = None

    def schedule_once(self) -> list[policy.Placement]:
        """One pass: reap lost workers, decide, allocate, record why the rest waits, send messages."""
        restarted = self._redis_restarted()
        with session_scope(self.settings) as session:
            reap_lost(session, self.settings)
            lost = self._take_unclaimed(session, restarted)
        for job_id, queue in lost:
            send_run_job(self.app, queue, job_id)
            log.info("job %s: not claimed yet; sent to %s again", job_id, queue)
        try:
            with session_scope(self.settings) as session:
                snap = read_snapshot(session, self.settings)
                for job_id, why in snap.doomed.items():
                    session.execute(update(Job).where(Job.id == job_id, Job.state == c.PENDING)
                                    .values(state=c.CANCELLED, ended_at=utcnow(), reason=why))
                decision = policy.decide(snap.policy)
                placements = [p for p in decision.placements if self._allocate(session, p)]
                self._record_reasons(session, snap, decision)
        except IntegrityError:
            # Another scheduler took one of these GPUs first; the next pass sees the new state.
            log.info("allocation raced with another scheduler; retrying next pass")
            return []
        for p in placements:
            self._send(p)
        return placements

    def _redis_restarted(self) -> bool:
        """Whether Redis restarted since the last pass (a new run id), maybe empty of our messages."""
        run_id = self.redis.info("server").get("run_id")
        restarted = self._redis_run_id is not None and run_id != self._redis_run_id
        self._redis_run_id = run_id
        if restarted:
            log.warning("Redis restarted (run id %s); sending every dispatched job again", run_id)
        return restarted

    def _take_unclaimed(self, session: Session, everything: bool) -> list[tuple[int, str]]:
        """Dispatched jobs nobody claimed, to send again: all of them right after Redis restarted,
        else those waiting past ``resend_after``. A duplicate is harmless: only one claim of a job
        can succeed."""
        lost = unclaimed(session, self.settings, everything=everything)
        if lost:
            session.execute(update(Job).where(Job.id.in_([j for j, _ in lost]), Job.state == c.DISPATCHED)
                            .values(dispatched_at=utcnow()))
        return lost

    @staticmethod
    def _record_reasons(session: Session, snap: Snapshot, decision: policy.Decision) -> None:
        reasons = {**snap.not_eligible, **decision.waiting}
        changed: dict[str, list[int]] = defaultdict(list)
        for job_id, why in reasons.items():
            if snap.shown.get(job_id) != why:
                changed[why].append(job_id)
        for why, ids in changed.items():
            session.execute(update(Job).where(Job.id.in_(ids), Job.state == c.PENDING).values(reason=why))

    def _allocate(self, session: Session, p: policy.Placement) -> bool:
        moved = session.execute(
            update(Job).where(Job.id == p.job_id, Job.state == c.PENDING)
            .values(state=c.DISPATCHED, dispatched_at=utcnow(), node=p.gpus[0].node, reason=None)
        ).rowcount
        if not moved:
            return False  # cancelled meanwhile
        session.add_all(Allocation(job_id=p.job_id, gpu_id=g.id, rank=r) for r, g in enumerate(p.gpus))
        session.flush()
        return True

    def _send(self, p: policy.Placement) -> None:
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
