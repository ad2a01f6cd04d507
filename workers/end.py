"""A job's end on its worker: what state it ended in when it was stopped, and writing that end
(with its last output, device readings and usage summary, and the GPU's next job) in one
transaction, retried while the database is away."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import handover, samples, usage
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.dialect import savepoint
from gpuq.service.display import time_limit
from gpuq.service.errors import Unreachable
from gpuq.service.inventory import drain_gpu
from gpuq.service.kept_jobs import lost_reason
from gpuq.service.leases import Lease
from gpuq.service.lifecycle import end_attempt
from gpuq.service.models import utcnow
from gpuq.service.next_up import anything_waits, list_runs_short, take_next
from gpuq.workers.job import JobRun, Started, job_run
from gpuq.workers.output import OutputSink
from gpuq.workers.state import WorkerState
from gpuq.workers.watch import StopWatcher

log = logging.getLogger("gpuq.worker")

# A command's end carries what it used of its node (``usage.HostUse``: its CPU seconds and host
# memory's peak, from ``CommandOutcome``) under this key: for its usage summary, not a column
# ``end_attempt`` writes (``host_use_of`` takes it out).
HOST_USE = "host_use"


def host_use_of(end: dict[str, Any]) -> tuple[dict[str, Any], usage.HostUse | None]:
    """``end`` without what it used of its node, and that (None: not known)."""
    if HOST_USE not in end:
        return end, None
    rest = dict(end)
    return rest, rest.pop(HOST_USE)


def write_end(state: WorkerState, job: JobRun, lease: Lease, end: dict[str, Any],
              sink: OutputSink, flush_mark: int | None = None) -> tuple[bool, Started | None, bool]:
    """Write the job's end under its lease, with the rest of its output, its last device readings
    and its usage summary, and take the GPU's next job, all in one transaction; retried while the
    database is away: an end is never dropped. Returns whether the end was ours to write (False:
    the reaper took the job back meanwhile), the next job started here (None: the GPU is free),
    and whether to wake the scheduler."""
    end, host = host_use_of(end)
    readings = state.sampler.end_rows(lease.job_id) if state.sampler is not None else []
    in_hand = _totals_in_hand(state, job, readings, flush_mark)
    mark = state.flush_mark()  # before the next job is taken
    last_words = True
    delay = 0.2
    while True:
        try:
            done, following, wake = _end_transaction(state, job, lease, end, sink, last_words, readings, in_hand,
                                                     mark, host)
            if last_words:
                sink.rest_stored()
            if not done:
                log.warning("%s: job %s was taken back (lease lost); its end here is not recorded",
                            state.name, lease.job_id)
            return done, following, wake
        except Unreachable as exc:
            if gave_up_waiting(state, lease, readings, delay, exc):
                return False, None, True
            delay = min(delay * 2, 5.0)
        except SQLAlchemyError:
            if not last_words:
                raise
            # Not an outage: a row of its output, readings or usage summary the database refuses.
            # The end matters more; it is written again without them.
            log.exception("%s: job %s: could not store the rest of its output, its last device readings or "
                          "its usage summary", state.name, lease.job_id)
            last_words = False


def _end_transaction(state: WorkerState, job: JobRun, lease: Lease, end: dict[str, Any], sink: OutputSink,
                     last_words: bool, readings: list[dict[str, Any]], in_hand: usage.Totals | None,
                     mark: int | None, host: usage.HostUse | None = None) -> tuple[bool, Started | None, bool]:
    """One try at ``write_end``'s transaction, returning what it returns; without ``last_words``
    (the database refused them) the rest of the job's output, its last ``readings`` and its usage
    summary are left out (``gpuq stats JOB`` then sums its samples when asked)."""
    with write_scope(state.settings) as session:
        if last_words:
            sink.store_rest(session)
            samples.record(session, state.gpu_id, readings)
        now = utcnow()
        if _hands_over(state, session, job, end, last_words, in_hand):
            done, taken = _hand_over(state, session, job, lease, end, now, in_hand if last_words else None, host)
        else:
            done = end_attempt(session, lease.job_id, token=lease.token, max_requeues=state.settings.max_requeues,
                               now=now, host=host, **end)
            if done and last_words:
                # No savepoint of its own (two statements fewer at every end on PostgreSQL): a summary
                # the database refuses fails this try, and the end is written again without it.
                _store_usage(state, session, ended_of(job, now, host), in_hand)
            taken = _take_next(state, session) if done else None
        if not done:
            return False, None, True
        following = None
        if taken is not None:
            row, token = taken
            following = Started.read(session, job_run(row, (state.gpu_index,), (state.queue,)), token, mark)
        # A GPU that fell free wakes the scheduler only if some job waits: a pass over
        # an empty queue would just hold up the next submit's message. A GPU that runs
        # on wakes it, now and then, when its next-up list runs short.
        wake = (anything_waits(session) if following is None
                else state.wake_due() and list_runs_short(session, state.gpu_id))
        return True, following, wake


def _hands_over(state: WorkerState, session: Session, job: JobRun, end: dict[str, Any], last_words: bool,
                in_hand: usage.Totals | None) -> bool:
    """Whether this end is written as one statement with the next job's take (service/handover.py):
    the common end on PostgreSQL, a whole job's success whose summary is in hand (or not stored),
    on a worker that takes its next job with no GPU limit per user to check."""
    return (end["state"] == State.SUCCEEDED and not job.shared and (in_hand is not None or not last_words)
            and not state.settings.gpu_limited and state.may_take_next() and handover.hands_over(session))


def _hand_over(state: WorkerState, session: Session, job: JobRun, lease: Lease, end: dict[str, Any],
               now: datetime, in_hand: usage.Totals | None, host: usage.HostUse | None = None
               ) -> tuple[bool, tuple[Any, str] | None]:
    """The end and the take as one statement: whether the end was written, and what was taken."""
    summary = None
    if in_hand is not None:
        try:
            summary = usage.summary(ended_of(job, now, host), in_hand)
        except Exception:  # as ``_store_usage``: a summary that cannot be made is no reason to lose the end
            log.exception("%s: job %s: could not sum its usage", state.name, job.id)
    return handover.end_and_take(session, job_id=lease.job_id, token=lease.token, now=now,
                                 exit_code=end.get("exit_code"), result=end.get("result"), reason=end.get("reason"),
                                 summary=summary, gpu_id=state.gpu_id, worker=state.name, node=state.node,
                                 lease_s=state.settings.lease_timeout)


def ended_of(job: JobRun, now: datetime, host: usage.HostUse | None = None) -> usage.Ended:
    """What this worker knows of a job it ended, for its usage summary (``host``: what a command
    used of its node, where it knows)."""
    host = host or usage.HostUse()
    return usage.Ended(job.id, len(job.gpu_indices), job.started_at, now, job.ran_before, job.gpu_share,
                       job.gpu_indices, host.cpu_s, host.host_mem_peak_mib)


def _take_next(state: WorkerState, session: Session) -> tuple[Any, str] | None:
    """Start this GPU's next job from its next-up list, in the transaction that ends the last one
    (its row and lease token); None if the worker stops taking jobs or the list has none that may
    start."""
    if not state.may_take_next():
        return None
    settings = state.settings
    return take_next(session, state.gpu_id, state.name, state.node, settings.lease_timeout,
                     settings.gpu_limit_of if settings.gpu_limited else None)


def gave_up_waiting(state: WorkerState, lease: Lease, readings: list[dict[str, Any]], delay: float,
                     exc: Unreachable) -> bool:
    """Wait ``delay`` seconds for the database to come back; True if the worker is stopping
    meanwhile: the end is given up, and the job's readings go back to the sampler."""
    log.warning("%s: job %s: cannot record its end yet (%s); retrying", state.name, lease.job_id, exc)
    if not state.interrupt.wait(delay):
        return False
    log.error("%s: job %s: end not recorded: the worker is stopping; the reaper will take "
              "it back when its lease runs out", state.name, lease.job_id)
    if state.sampler is not None:
        state.sampler.put_back(readings)
    return True


def _totals_in_hand(state: WorkerState, job: JobRun, readings: list[dict[str, Any]],
                    flush_mark: int | None) -> usage.Totals | None:
    """The job's device totals from the readings in hand, if they are all its readings: a first
    attempt on this one GPU, started when the sampler had taken as many batches to write as now
    (so none of its readings was written before); else None, and its summary reads SQL.

    Its readings are those ``samples.record`` gives it: tagged with it, or untagged and taken
    after it started (the sampler had not seen it start yet)."""
    if len(job.gpu_indices) != 1 or job.ran_before or job.started_at is None:
        return None
    if state.sampler is not None and state.sampler.flushes != flush_mark:
        return None
    return usage.Totals.of_samples([r for r in readings if r["job_id"] == job.id
                                    or (r["job_id"] is None and r["sampled_at"] >= job.started_at)])


def _store_usage(state: WorkerState, session: Session, ended: usage.Ended, totals: usage.Totals | None) -> None:
    """Store the job's usage summary among its last words: a statement the database refuses is
    raised (``write_end`` writes the end again without them); anything else is logged."""
    try:
        usage.record_usage(session, ended.id, ended, state.settings.sample_retention_days, totals)
    except SQLAlchemyError:
        raise
    except Exception:
        log.exception("%s: job %s: could not sum its usage", state.name, ended.id)


def record_usage(state: WorkerState, session: Session, ended: usage.Ended, totals: usage.Totals | None) -> None:
    """Store the job's usage summary in the transaction that ends it, so nobody sees one without
    the other, where the end is written once (a shared job's): a failure here never undoes the end
    (PostgreSQL: in a savepoint; SQLite undoes just the failed statement)."""
    try:
        with savepoint(session):
            _store_usage(state, session, ended, totals)
    except SQLAlchemyError:
        log.exception("%s: job %s: could not store its usage summary", state.name, ended.id)


def stopped_end(state: WorkerState, job: JobRun, watcher: StopWatcher) -> dict[str, Any]:
    """The end of a job that was stopped: timed out, interrupted by shutdown, lease, GPU or the
    client that kept it lost, or cancelled."""
    why = watcher.why or (c.FAILURE_INTERRUPTED if state.interrupt.is_set() else c.FAILURE_CANCELLED)
    if why == c.FAILURE_TIMEOUT:
        limit = time_limit(watcher.time_limit_s or 0)  # as the watch last read it: `gpuq update` may have changed it
        return {"state": State.TIMED_OUT, "failure": why, "reason": f"time limit of {limit} reached"}
    if why == c.FAILURE_INTERRUPTED:
        return {"state": State.FAILED, "failure": why, "reason": "interrupted: the worker was shut down"}
    if why == c.FAILURE_WORKER_LOST:
        return {"state": State.FAILED, "failure": why, "reason": "worker lost: it could not renew the job's lease"}
    if why == c.FAILURE_GPU_LOST:
        return {"state": State.FAILED, "failure": why, "reason": f"GPU lost: gpu {state.gpu_index} on {state.node}"}
    if why == c.FAILURE_GPU_MEM_EXCEEDED:
        return {"state": State.FAILED, "failure": why, "reason": watcher.detail or "over its GPU memory share"}
    if why == c.FAILURE_CLIENT_LOST:
        return {"state": State.FAILED, "failure": why, "reason": lost_reason(state.settings, job.kind)}
    return {"state": State.CANCELLED, "failure": why, "reason": "cancelled by user"}


def drain_if_left(state: WorkerState, job: JobRun, leftover: tuple[int, ...]) -> None:
    """Processes of the job that outlived SIGKILL may still hold the GPU: it is not given out
    again until an admin has looked (`gpuq resume NODE`)."""
    if not leftover:
        return
    why = f"processes of job {job.id} did not exit: pids {', '.join(map(str, leftover[:8]))}"
    log.error("%s: %s; GPU drained", state.name, why)
    try:
        with write_scope(state.settings) as session:
            drain_gpu(session, state.gpu_id, why)
    except Unreachable:
        log.exception("%s: could not drain the GPU", state.name)
