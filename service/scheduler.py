"""The scheduler: reads the queue from SQL (service/queue_read.py), lets the policy (``policy.decide``, a pure function)
place pending jobs on free GPUs, sends each to its first GPU's worker, records why the others wait,
and notices workers that went silent. ``run`` loops, woken by Redis on submit and on job end.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from dataclasses import replace

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import (
    allocating,
    broker,
    db,
    display,
    idle_limit,
    kept_jobs,
    leases,
    lifecycle,
    mail,
    next_up,
    next_up_choice,
    node_drains,
    policy,
    snapshot_retention,
)
from gpuq.service import constants as c
from gpuq.service.db import read_scope, write_scope
from gpuq.service.fair_share import FairShare
from gpuq.service.models import utcnow
from gpuq.service.queue_read import QueueRead, read_queue
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.scheduler")
# How many jobs of a GPU's next-up list a pass tries in place of a placement that lost its job
# (``_stand_in``): each try that finds its job gone is one statement in the pass's write.
STAND_INS = 8


def _stand_in(session: Session, p: policy.Placement, lists: dict[int, list[int]],
              placed: set[int]) -> policy.Placement | None:
    """For a one-GPU placement whose job left the queue since the pass read it (``try_allocate`` said
    JOB_MOVED), the first job of that GPU's next-up list (as this pass wrote it) that still waits,
    placed there instead; None if none of the first STAND_INS does, or the GPU was taken.

    Under a flood on a node whose other GPUs run their lists, the job a pass places on a GPU that
    fell free is the queue's head, the very job the other GPUs' workers take next: in the ten-odd
    milliseconds between the pass's read and its write they took it, pass after pass, and the GPU
    sat idle up to the next whole pass (a second). Its list is what its worker would take if it
    were busy: the job the policy wants there next."""
    if p.shared or len(p.gpus) != 1:
        return None
    for job_id in [j for j in lists.get(p.gpus[0].id, []) if j not in placed][:STAND_INS]:
        stand_in = replace(p, job_id=job_id)
        why = allocating.try_allocate(session, stand_in)
        if why is None:
            return stand_in
        if why != allocating.JOB_MOVED:
            return None  # the GPU was taken: no job of its list goes there now
    return None


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
        self.lists = next_up.Lists()
        # When the last whole pass ended (time.monotonic()) and how long it took.
        self.last_full, self.full_took = -math.inf, 0.0

    def schedule_once(self, quick: bool = False) -> list[policy.Placement]:
        """One pass: reap lost workers (a whole pass), read the queue, decide, then in one short
        write allocate, record why the rest waits and what each busy GPU runs next, and send the
        messages; a quick pass with nothing to change writes nothing.

        The queue is read without the write lock (SQLite), so workers claim and end jobs while
        the policy thinks; every write re-checks what it changes, and the allocation's unique key
        keeps a GPU from going to two jobs whatever happened in between.

        A ``quick`` pass reads only the head of each user's queue (what a job's end or a submit
        usually needs: it decides for those jobs what a whole pass would) and writes no waiting
        reasons. A job past the head that would fit a GPU left free waits for the next whole pass,
        as SLURM's backfill pass picks up what its quick main pass did not look at."""
        started = time.monotonic()
        if not quick:
            self._reap()
        head = c.HEAD_PER_USER if quick else None
        with read_scope(self.settings) as session:
            queue = read_queue(session, self.settings, self.fair_share, head)
        decision = policy.decide(queue.policy)
        lists = next_up_choice.choose(queue.policy, decision, c.NEXT_UP_PER_GPU, c.NEXT_UP_SCAN)
        changes = self.lists.changes(lists, decision.order)
        if quick and self.lists.written is not None and not (queue.doomed or decision.placements or changes
                                                             or decision.preemptions):
            return []  # the lists are as they should be: no write lock taken for nothing
        try:
            placements = self._write(queue, decision, lists, changes, quick)
        except IntegrityError:
            # Another scheduler took one of these GPUs first; the next pass sees the new state.
            log.info("allocation raced with another scheduler; retrying next pass")
            self.lists.forget()
            return []
        except BaseException:
            self.lists.forget()  # not written: rewrite the lists whole next time
            raise
        self.lists.committed(changes)
        for p in placements:
            self._send(p.job_id, p.gpus[0].queue)
        if not quick:
            self.last_full, self.full_took = time.monotonic(), time.monotonic() - started
        return placements

    def _reap(self) -> None:
        # Lost workers and lost messages are found in seconds anyway (leases, resend_after):
        # whole passes, at least one an interval, look for them, and the quick ones, many a
        # second under a flood of short jobs, spare a write transaction and a Redis round trip.
        restarted = self._redis_restarted()
        with write_scope(self.settings) as session:
            leases.reap(session, self.settings)
            lost = leases.take_unclaimed(session, self.settings, everything=restarted)
            kept_jobs.abandon_waiting(session, self.settings, utcnow())
            node_drains.end_windows(session)  # nodes whose maintenance window ended: in service again
            ranks = leases.ranks_to_send_again(session) if restarted else []
        for job_id, queue in lost:
            self._send(job_id, queue, again=True)
        for job_id, rank, queue in ranks:
            self._send_rank(job_id, rank, queue)

    def _write(self, queue: QueueRead, decision: policy.Decision, lists: dict[int, list[int]],
               changes: next_up.Changes, quick: bool) -> list[policy.Placement]:
        """A pass's one write: cancel the doomed, allocate, explain the waits, rewrite the lists."""
        with write_scope(self.settings) as session:
            for job_id, why in queue.doomed.items():
                session.execute(lifecycle.DOOM, {"job_id": job_id, "now": utcnow(), "reason": why})
            held = allocating.shares_held(queue.policy, decision.placements)
            placed = {p.job_id for p in decision.placements}
            placements = []
            for p in decision.placements:
                missed = allocating.try_allocate(session, p, share_mib=held.get(p.job_id))
                if missed is None:
                    placements.append(p)
                elif missed == allocating.JOB_MOVED and (stand_in := _stand_in(session, p, lists, placed)) is not None:
                    placements.append(stand_in)
                    placed.add(stand_in.job_id)
            self._preempt(session, queue, decision)
            if not quick:
                self._record_reasons(session, queue, decision)
            self.lists.write(session, changes)
        return placements

    @staticmethod
    def _preempt(session: Session, queue: QueueRead, decision: policy.Decision) -> None:
        """Ask the workers of the preemptible jobs the decision stops to requeue them (they poll
        their row, as for a cancel): the job they make room for is their reason."""
        if not decision.preemptions:
            return
        user_of = {j.id: j.user for j in queue.policy.jobs}
        now = utcnow()
        for victim, by in decision.preemptions.items():
            asked = session.execute(lifecycle.ASK_TO_PREEMPT, {"job_id": victim, "now": now,
                                                               "reason": display.preempted_by(by, user_of[by])})
            if db.rows_changed(asked):
                log.info("job %s: preempted for job %s of %s", victim, by, user_of[by])

    def _redis_restarted(self) -> bool:
        """Whether Redis restarted since the last pass (a new run id), maybe empty of our messages."""
        run_id = self.redis.info("server").get("run_id")
        restarted = self._redis_run_id is not None and run_id != self._redis_run_id
        self._redis_run_id = run_id
        if restarted:
            log.warning("Redis restarted (run id %s); sending every dispatched job again", run_id)
        return restarted

    @staticmethod
    def _record_reasons(session: Session, queue: QueueRead, decision: policy.Decision) -> None:
        reasons = {**queue.not_eligible, **decision.waiting}
        changed: dict[str, list[int]] = defaultdict(list)
        for job_id, why in reasons.items():
            if queue.shown.get(job_id) != why:
                changed[why].append(job_id)
        for why, ids in changed.items():
            session.execute(lifecycle.WHY_WAITING, {"ids": ids, "reason": why})

    def _send(self, job_id: int, queue: str, again: bool = False) -> None:
        from gpuq.service.celery_app import send_run_job

        try:
            send_run_job(self.app, queue, job_id)
            log.info("job %s: %s %s", job_id, "not claimed yet; sent again to" if again else "sent to", queue)
        except Exception as exc:  # noqa: BLE001 - any broker failure means: not sent, try again later
            log.warning("job %s: could not send to %s (%s); back to pending", job_id, queue, exc)
            with write_scope(self.settings) as session:
                lifecycle.undispatch(session, job_id)

    def _send_rank(self, job_id: int, rank: int, queue: str) -> None:
        from gpuq.service.celery_app import send_run_rank

        try:
            send_run_rank(self.app, queue, job_id, rank)
            log.info("job %s: rank %s sent again to %s (Redis restarted)", job_id, rank, queue)
        except Exception as exc:  # noqa: BLE001 - Redis down again: rank 0 times out, the job may retry
            log.warning("job %s: could not send rank %s to %s again (%s)", job_id, rank, queue, exc)

    def send_dispatched(self, entries: list[str]) -> None:
        """Send the messages of jobs placed at submit (``allocating.place_at_submit``), as the submitter
        handed them over: "JOB_ID QUEUE" each. A malformed entry is dropped; a message for a job
        that is not dispatched to that queue's GPU changes nothing (the worker's claim checks)."""
        for entry in entries:
            try:
                job_id, queue = entry.split(" ", 1)
                self._send(int(job_id), queue)
            except ValueError:
                log.warning("dropped a malformed dispatch entry: %r", entry[:100])

    def _prune_snapshots(self, stop: threading.Event) -> None:
        """Remove snapshots past their retention at start and then every SNAPSHOT_PRUNE_EVERY
        seconds, beside the passes: removing a large tree takes seconds no pass should wait for."""
        if self.settings.snapshot_retention_days > 0 and not self.settings.snapshots.is_dir():
            # Said once: a retention that removes nothing is otherwise silent (a scheduler in a
            # container without the snapshots volume, or on another node than the copies).
            log.warning("GPUQ_SNAPSHOT_RETENTION_DAYS is %g but this scheduler does not see the snapshot directory "
                        "%s: it removes no snapshot", self.settings.snapshot_retention_days, self.settings.snapshots)
        while True:
            try:
                done = snapshot_retention.prune(self.settings, utcnow())
                if done.removed or done.incoming:
                    log.info("removed %d snapshot(s) past %g days and %d half-made copies: %.1f MiB freed",
                             len(done.removed), self.settings.snapshot_retention_days, done.incoming,
                             done.freed_bytes / 2**20)
            except Exception:
                log.exception("removing snapshots past their retention failed; trying again later")
            if stop.wait(c.SNAPSHOT_PRUNE_EVERY):
                return

    def _mail(self, stop: threading.Event) -> None:
        """Mail about the jobs that asked for it (service/mail.py) every MAIL_EVERY seconds, beside
        the passes: a mail program that takes its time holds up no pass."""
        while not stop.wait(c.MAIL_EVERY):
            try:
                mail.send_due(self.settings)
            except Exception:
                log.exception("mailing about jobs failed; trying again later")

    def _end_idle(self, stop: threading.Event) -> None:
        """Cancel the jobs idle past GPUQ_IDLE_LIMIT (service/idle_limit.py), beside the passes: a
        look sums the samples of every running job over the whole limit."""
        every = idle_limit.check_every(self.settings.idle_limit_s)
        while not stop.wait(every):
            try:
                idle_limit.end_idle_jobs(self.settings)
            except Exception:
                log.exception("looking for jobs idle past the idle limit failed; trying again later")

    def run(self, stop: threading.Event) -> None:
        """Schedule until ``stop`` is set: a quick pass after every wake-up (a submit, a job's end,
        a new worker), and a whole pass at least every interval, which also writes why each job
        waits. A whole pass over a long queue is spaced to at most a tenth of the time. Jobs
        placed at submit are sent as soon as they are handed over, with no pass before or after."""
        log.info("scheduler started (node %s)", self.settings.node)
        threading.Thread(target=self._prune_snapshots, args=(stop,), name="snapshots", daemon=True).start()
        threading.Thread(target=self._mail, args=(stop,), name="mail", daemon=True).start()
        if self.settings.idle_limit_s:
            threading.Thread(target=self._end_idle, args=(stop,), name="idle-limit", daemon=True).start()
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
            except Exception:
                log.exception("scheduler pass failed; retrying")
                why = broker.TIMEOUT
                stop.wait(self.settings.scheduler_interval)
        log.info("scheduler stopped")
