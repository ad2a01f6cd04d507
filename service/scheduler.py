"""The scheduler: reads a snapshot of SQL, lets the policy (``policy.decide``, a pure function)
place pending jobs on free GPUs, sends each to its first GPU's worker, records why the others wait,
and notices workers that went silent. ``run`` loops, woken by Redis on submit and on job end.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import broker, db, jobs, policy
from gpuq.service import constants as c
from gpuq.service.db import read_scope, session_scope
from gpuq.service.inventory import live_cutoff
from gpuq.service.models import Allocation, Gpu, Job, NextUp, Node, utcnow
from gpuq.service.prepared import Prepared
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.scheduler")


class FairShare:
    """Each user's recent GPU-hours, a GPU-hour ``h`` half-lives ago counting 2**-h, kept pass
    after pass without reading the whole job history each time.

    A job that ran from ``start`` to ``end`` adds ``gpus * (e**(r*end) - e**(r*start)) / r`` to its
    user's sum, measured from an anchor; scaled by ``e**(-r*now)`` that is the integral of the decay
    over its run, in closed form. Jobs that ended are folded into the sums once; each pass reads
    only the running jobs and those that ended in the last few seconds (their end may still be
    committing: SETTLE seconds).
    """

    SETTLE = timedelta(seconds=2)

    def __init__(self, settings: Settings) -> None:
        self.rate = math.log(2) / (settings.fairshare_half_life_h * 3600.0)
        self.horizon = timedelta(seconds=10 * settings.fairshare_half_life_h * 3600.0)
        self.anchor: datetime | None = None
        self.folded: dict[str, float] = defaultdict(float)
        # Jobs that ended before this are in ``folded``; later ones are read each pass.
        self.until: datetime | None = None

    def _weight(self, start: datetime, end: datetime) -> float:
        assert self.anchor is not None
        return (math.exp(self.rate * (end - self.anchor).total_seconds())
                - math.exp(self.rate * (start - self.anchor).total_seconds()))

    @staticmethod
    def _ended(session: Session, since: datetime, before: datetime | None = None):
        query = select(Job.user, Job.gpus, Job.started_at, Job.ended_at).where(
            Job.ended_at >= since, Job.started_at.is_not(None))
        return session.execute(query.where(Job.ended_at < before) if before is not None else query)

    def usage(self, session: Session, now: datetime) -> dict[str, float]:
        settled = now - self.SETTLE
        if self.anchor is None or self.until is None:
            self.anchor, self.until = now, now - self.horizon
        if settled - self.until >= self.SETTLE:
            for user, gpus, started, ended in self._ended(session, self.until, settled):
                self.folded[user] += gpus * self._weight(started, ended)
            self.until = settled
        decay = math.exp(-self.rate * (now - self.anchor).total_seconds()) / self.rate / 3600.0
        usage = {user: total * decay for user, total in self.folded.items()}
        fresh = list(session.execute(select(Job.user, Job.gpus, Job.started_at, Job.ended_at)
                                     .where(Job.state == c.RUNNING, Job.started_at.is_not(None))))
        fresh += self._ended(session, self.until)
        for user, gpus, started, ended in fresh:
            usage[user] = usage.get(user, 0.0) + gpus * self._weight(started, ended or now) * decay
        return usage


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


def read_snapshot(session: Session, settings: Settings, fair_share: FairShare | None = None,
                  head: int | None = None) -> Snapshot:
    """What one pass needs from SQL. With ``head``, only each user's first ``head`` pending jobs
    that are not held (a quick pass; see ``_pending``), else every pending job."""
    now = utcnow()
    conn = session.connection()  # Prepared statements: a submit reads this to place its job
    drained = {name for name, in _DRAINED.run(conn, {})}
    busy: dict[int, float] = {}
    held: dict[str, int] = defaultdict(int)
    for gpu_id, user, started, limit in _ALLOCATED.run(conn, {}):
        held[user] += 1
        busy[gpu_id] = (started or now).timestamp() + limit if limit else math.inf
    gpus = [policy.GpuState(id=g.id, node=g.node, index=g.index, queue=g.queue, memory_total_mib=g.memory_total_mib,
                            memory_used_mib=g.memory_used_mib or 0, foreign_mib=g.foreign_mib or 0,
                            busy_until=busy.get(g.id))
            for g in _LIVE_GPUS.run(conn, {"cutoff": live_cutoff(settings)})
            if g.node not in drained]
    pending, last = _pending(session, head)
    # Fair share orders users against each other: a quick pass over one user's queue needs none
    # (the whole pass, which also explains every wait, always reads it).
    users = {row.user for row in pending}
    usage = (fair_share or FairShare(settings)).usage(session, now) if head is None or len(users) > 1 else {}
    cut = min((policy.order_key(_request(r), usage) for r in last), default=None) if head is not None else None
    deps = {d for row in pending for d in (row.after or [])}
    dep_state = dict(conn.execute(_STATES_OF, {"ids": list(deps)}).all()) if deps else {}
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
        job = _request(row)
        if cut is None or policy.order_key(job, usage) <= cut:
            jobs.append(job)
    snap = policy.Snapshot(now=now.timestamp(), jobs=jobs, gpus=gpus, usage=usage,
                           held_gpus=dict(held), user_gpu_limit=settings.user_gpu_limit)
    return Snapshot(snap, not_eligible, doomed, {row.id: row.reason for row in pending})


def _request(row) -> policy.JobRequest:
    """The policy's view of a pending job row (``_PENDING_COLUMNS``)."""
    return policy.JobRequest(id=row.id, user=row.user, gpus=row.gpus, priority=row.priority,
                             submitted=row.submitted_at.timestamp(), mem_mib=row.mem_mib, node=row.on_node,
                             time_limit_s=row.time_limit_s)


def _pending(session: Session, head: int | None):
    """The pending jobs a pass looks at, and []; or, with ``head``, each user's first ``head``
    jobs that are not held (in their queue order) and each user's ``head``-th job (the last one
    read of a user whose jobs were cut short).

    A user's queue order is their own jobs' (priority, then submission): every job of theirs
    left out comes after their ``head``-th one. So up to the earliest such last-read job of any
    user (``read_snapshot``'s cut), the head holds every eligible job, and ``policy.decide`` over
    those decides as over the whole queue. Reading it costs a few index seeks per user
    (``ix_jobs_queue_order``), however long the queue: a window over every pending job cost
    about 35 ms at 10,000, on every submit and job end."""
    conn = session.connection()
    if head is None:
        return conn.execute(_ALL_PENDING).all(), []
    rows, last = [], []
    for user, in _WAITING_USERS.run(conn, {}):
        got = _USER_HEAD.run(conn, {"user": user, "head": head})
        rows += got
        if len(got) == head:
            last.append(got[-1])
    return rows, last


# Core rows, and statements built once: the ORM's per-row bookkeeping is most of the cost at
# 10,000 jobs, and building the statement most of it for a submit's few. What a quick pass (many a
# second under a flood) and a submit read is Prepared; a whole pass's read of every pending job is
# not (SQLAlchemy makes its rows in C).
_t = Job.__table__.c
_PENDING_COLUMNS = (_t.id, _t.user, _t.gpus, _t.priority, _t.submitted_at, _t.mem_mib, _t.on_node, _t.time_limit_s,
                    _t.held, _t.after, _t.after_any, _t.reason)
_ALL_PENDING = select(*_PENDING_COLUMNS).where(_t.state == c.PENDING)
_DRAINED = Prepared(select(Node.__table__.c.name).where(Node.__table__.c.drained.is_(True)))
_ALLOCATED = Prepared(select(Allocation.__table__.c.gpu_id, _t.user, _t.started_at, _t.time_limit_s).join_from(
    Allocation.__table__, Job.__table__, Allocation.__table__.c.job_id == _t.id))
_g = Gpu.__table__.c
_LIVE_GPUS = Prepared(select(_g.id, _g.node, _g.index, _g.queue, _g.memory_total_mib, _g.memory_used_mib,
                             _g.foreign_mib).where(_g.heartbeat_at >= bindparam("cutoff"), _g.drain_reason.is_(None)))
_STATES_OF = select(_t.id, _t.state).where(_t.id.in_(bindparam("ids", expanding=True)))


def _users_waiting():
    """The users with a waiting job that is not held, in name order: a skip from each user to the
    next through the index (a recursive query), where DISTINCT would read every waiting job."""
    j = Job.__table__.alias("j")
    first = select(func.min(_t.user).label("user")).where(*jobs.waiting()).cte("waiting_users", recursive=True)
    after = first.alias("previous")
    following = select(func.min(j.c.user)).where(*jobs.waiting(j), j.c.user > after.c.user).scalar_subquery()
    users = first.union_all(select(following).where(after.c.user.is_not(None)))
    return select(users.c.user).where(users.c.user.is_not(None))


_WAITING_USERS = Prepared(_users_waiting())
_USER_HEAD = Prepared(select(*_PENDING_COLUMNS).where(*jobs.waiting(), _t.user == bindparam("user"))
                      .order_by(_t.priority.desc(), _t.submitted_at, _t.id).limit(bindparam("head")))


def allocate(session: Session, p: policy.Placement, now: datetime | None = None) -> bool:
    """Dispatch the placed job, unless it changed since the snapshot (cancelled, held, or taken
    by a worker from its next-up list) or one of its GPUs was taken meanwhile."""
    conn = session.connection()  # Core: a submit places its job in its own transaction
    try:
        with session.begin_nested():
            if _DISPATCH.run(conn, {"job_id": p.job_id, "now": now or utcnow(), "node": p.gpus[0].node}) != 1:
                return False
            _ALLOCATE.run(conn, [{"job_id": p.job_id, "gpu_id": g.id, "rank": r} for r, g in enumerate(p.gpus)])
        return True
    except IntegrityError:
        log.info("job %s: a GPU it was placed on was taken meanwhile; next pass", p.job_id)
        return False


_n = NextUp.__table__.c
_UNLIST = Prepared(NextUp.__table__.delete().where(_n.gpu_id == bindparam("gpu_id"), _n.job_id == bindparam("job_id")))
_LIST = Prepared(NextUp.__table__.insert())
_DISPATCH = Prepared(Job.__table__.update()
                     .where(_t.id == bindparam("job_id"), *jobs.waiting())
                     .values(state=c.DISPATCHED, dispatched_at=bindparam("now"), node=bindparam("node"), reason=None))
_ALLOCATE = Prepared(Allocation.__table__.insert())


# A submission of more jobs than this is left to the scheduler whole (see ``place_at_submit``).
PLACE_AT_SUBMIT_MAX = 64


def place_at_submit(session: Session, settings: Settings,
                    job_ids: list[int]) -> list[tuple[int, str, str, datetime]]:
    """Place jobs just submitted (in the submit's transaction), as SLURM tries each job once at
    submit: (job id, queue of its first GPU, node, when) for each placed, whose message the
    scheduler sends.

    Only when no other job waits (pending and not held): then the new jobs, one user's, are the
    whole queue, and ``policy.decide`` over them places what the scheduler's next pass would, a
    whole scheduler pass and its wake-up sooner. Otherwise, or for a submission of more than
    PLACE_AT_SUBMIT_MAX jobs, the scheduler decides, with every waiting job in view."""
    if not settings.place_at_submit or not job_ids or len(job_ids) > PLACE_AT_SUBMIT_MAX:
        return []
    if jobs.anything_waits(session, besides=job_ids):
        return []
    snap = read_snapshot(session, settings, head=c.HEAD_PER_USER)
    if not snap.policy.jobs:
        return []
    now = utcnow()
    placed = [p for p in policy.decide(snap.policy).placements if allocate(session, p, now)]
    return [(p.job_id, p.gpus[0].queue, p.gpus[0].node, now) for p in placed]


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
        _undispatch(session, job_id)
        log.warning("job %s: worker %s lost before it started the job; waiting again", job_id, worker)
    return [j for j, _, _ in expired] + [j for j, _ in stranded]


def _undispatch(session: Session, job_id: int) -> None:
    """A dispatched job that never started waits again, its GPUs freed."""
    session.execute(update(Job).where(Job.id == job_id, Job.state == c.DISPATCHED)
                    .values(state=c.PENDING, dispatched_at=None, node=None))
    session.execute(delete(Allocation).where(Allocation.job_id == job_id))


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
        from gpuq.service.celery_app import make_app  # Celery only where messages are sent

        self.settings = settings
        self.app = make_app(settings)
        self.redis = broker.client(settings)
        # The Redis server's run id: a new one means Redis restarted, maybe empty of our messages.
        self._redis_run_id: str | None = None
        self.fair_share = FairShare(settings)
        # The next-up rows this scheduler wrote last, {(gpu id, job id): rank}; None: not known.
        self._listed: dict[tuple[int, int], int] | None = None
        # When the last whole pass ended (time.monotonic()) and how long it took.
        self.last_full, self.full_took = -math.inf, 0.0

    def schedule_once(self, quick: bool = False) -> list[policy.Placement]:
        """One pass: reap lost workers (a whole pass), read a snapshot, decide, then in one short
        write allocate, record why the rest waits and what each busy GPU runs next, and send the
        messages; a quick pass with nothing to change writes nothing.

        The snapshot is read without the write lock (SQLite), so workers claim and end jobs while
        the policy thinks; every write re-checks what it changes, and the allocation's unique key
        keeps a GPU from going to two jobs whatever happened in between.

        A ``quick`` pass reads only the head of each user's queue (what a job's end or a submit
        usually needs: it decides for those jobs what a whole pass would) and writes no waiting
        reasons. A job past the head that would fit a GPU left free waits for the next whole pass,
        as SLURM's backfill pass picks up what its quick main pass did not look at."""
        started = time.monotonic()
        if not quick:
            # Lost workers and lost messages are found in seconds anyway (leases, resend_after):
            # whole passes, at least one an interval, look for them, and the quick ones, many a
            # second under a flood of short jobs, spare a write transaction and a Redis round trip.
            restarted = self._redis_restarted()
            with session_scope(self.settings) as session:
                reap_lost(session, self.settings)
                lost = self._take_unclaimed(session, restarted)
            for job_id, queue in lost:
                self._send(job_id, queue, again=True)
        head = c.HEAD_PER_USER if quick else None
        with read_scope(self.settings) as session:
            snap = read_snapshot(session, self.settings, self.fair_share, head)
        decision = policy.decide(snap.policy)
        lists = policy.next_up(snap.policy, decision, c.NEXT_UP_PER_GPU, c.NEXT_UP_SCAN)
        wanted, stale, changed = self._list_changes(lists, decision.order)
        if quick and self._listed is not None and not (snap.doomed or decision.placements or stale or changed):
            return []  # the lists are as they should be: no write lock taken for nothing
        try:
            with session_scope(self.settings) as session:
                for job_id, why in snap.doomed.items():
                    session.execute(update(Job).where(Job.id == job_id, Job.state == c.PENDING)
                                    .values(state=c.CANCELLED, ended_at=utcnow(), reason=why))
                placements = [p for p in decision.placements if allocate(session, p)]
                if not quick:
                    self._record_reasons(session, snap, decision)
                self._write_next_up(session, wanted, stale, changed)
        except IntegrityError:
            # Another scheduler took one of these GPUs first; the next pass sees the new state.
            log.info("allocation raced with another scheduler; retrying next pass")
            self._listed = None
            return []
        except BaseException:
            self._listed = None  # not written: rewrite the lists whole next time
            raise
        self._listed = wanted
        for p in placements:
            self._send(p.job_id, p.gpus[0].queue)
        if not quick:
            self.last_full, self.full_took = time.monotonic(), time.monotonic() - started
        return placements

    def _list_changes(self, lists: dict[int, list[int]], order: list[policy.JobRequest]):
        """The next-up rows wanted now, {(gpu id, job id): rank}, and as changes to what this
        scheduler wrote last (``self._listed``): the rows to delete and those to insert. A pass
        usually moves a few jobs, not the hundreds of rows of 64 GPUs' lists. A worker that takes
        a job leaves its rows on the other GPUs' lists; they go here, as the job is no longer
        pending."""
        rank = {j.id: r for r, j in enumerate(order)}
        listed = self._listed or {}
        # Ranks only order the lists. Under a flood the jobs ahead leave and new ones join at the
        # tail, which moves every rank by the same amount: the rows written stay, shifted, and
        # only the jobs taken and the jobs new to the lists are written.
        written = {job: r for (_, job), r in listed.items()}
        shifts = {written[job] - rank[job] for jobs in lists.values() for job in jobs if job in written}
        shift = shifts.pop() if len(shifts) == 1 else 0
        wanted = {(gpu, job): rank[job] + shift for gpu, jobs in lists.items() for job in jobs}
        changed = [key for key, r in wanted.items() if listed.get(key) != r]
        stale = [key for key in listed if key not in wanted] + changed
        return wanted, stale, changed

    def _write_next_up(self, session: Session, wanted: dict[tuple[int, int], int],
                       stale: list[tuple[int, int]], changed: list[tuple[int, int]]) -> None:
        # Prepared, row by row: a quick pass under a flood writes a few rows every 20 ms inside
        # the write lock, where the ORM's bulk statements cost a millisecond a pass.
        conn = session.connection()
        if self._listed is None:
            conn.execute(delete(NextUp))  # not known what is there: rewrite the lists whole
        elif stale:
            _UNLIST.run(conn, [{"gpu_id": g, "job_id": j} for g, j in stale])
        if changed:
            _LIST.run(conn, [{"gpu_id": g, "job_id": j, "rank": wanted[g, j]} for g, j in changed])

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

    def _send(self, job_id: int, queue: str, again: bool = False) -> None:
        from gpuq.service.celery_app import send_run_job

        try:
            send_run_job(self.app, queue, job_id)
            log.info("job %s: %s %s", job_id, "not claimed yet; sent again to" if again else "sent to", queue)
        except Exception as exc:  # noqa: BLE001 - any broker failure means: not sent, try again later
            log.warning("job %s: could not send to %s (%s); back to pending", job_id, queue, exc)
            with session_scope(self.settings) as session:
                _undispatch(session, job_id)

    def send_dispatched(self, entries: list[str]) -> None:
        """Send the messages of jobs placed at submit (``place_at_submit``), as the submitter
        handed them over: "JOB_ID QUEUE" each. A malformed entry is dropped; a message for a job
        that is not dispatched to that queue's GPU changes nothing (the worker's claim checks)."""
        for entry in entries:
            try:
                job_id, queue = entry.split(" ", 1)
                self._send(int(job_id), queue)
            except ValueError:
                log.warning("dropped a malformed dispatch entry: %r", entry[:100])

    def run(self, stop: threading.Event) -> None:
        """Schedule until ``stop`` is set: a quick pass after every wake-up (a submit, a job's end,
        a new worker), and a whole pass at least every interval, which also writes why each job
        waits. A whole pass over a long queue is spaced to at most a tenth of the time. Jobs
        placed at submit are sent as soon as they are handed over, with no pass before or after."""
        log.info("scheduler started (node %s)", self.settings.node)
        why, last_pass, last_checkpoint = broker.TIMEOUT, -math.inf, time.monotonic()
        while not stop.is_set():
            try:
                interval = self.settings.scheduler_interval
                if why != broker.HANDED or time.monotonic() - last_pass >= interval:
                    # Wake-ups that come while a pass runs are answered together, after a short
                    # pause: under a flood of short jobs a pass per wake-up kept the scheduler
                    # busy (and in the write lock) for lists that one pass refills.
                    if why == broker.WOKEN and stop.wait(c.QUICK_PASS_SPACING - (time.monotonic() - last_pass)):
                        break
                    due = max(interval, c.FULL_PASS_SHARE * self.full_took)
                    self.schedule_once(quick=why == broker.WOKEN and time.monotonic() - self.last_full < due)
                    last_pass = time.monotonic()
                if last_pass - last_checkpoint >= c.CHECKPOINT_EVERY:
                    db.checkpoint(self.settings)  # here, not in a worker's commit (SQLite)
                    last_checkpoint = time.monotonic()
                why, handed = broker.wait_for_wake(self.redis, self.settings, interval)
                self.send_dispatched(handed)
            except Exception:  # noqa: BLE001 - a scheduler must outlive a database or Redis blip
                log.exception("scheduler pass failed; retrying")
                why = broker.TIMEOUT
                stop.wait(self.settings.scheduler_interval)
        log.info("scheduler stopped")
