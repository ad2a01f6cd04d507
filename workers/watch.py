"""Whether the running job must stop: ``StopWatcher`` decides it for one job, and ``Watch`` is the
worker's one thread that asks it every CANCEL_POLL_SECONDS."""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING

from gpuq.service import constants as c
from gpuq.service.db import read_scope
from gpuq.service.jobs import stop_asked
from gpuq.service.kept_jobs import lapsed
from gpuq.service.settings import Settings
from gpuq.service.units import JobSignal

if TYPE_CHECKING:
    from gpuq.service.leases import Lease

log = logging.getLogger("gpuq.worker")


class StopWatcher:
    """Sets ``stopped`` when the running job must stop, and ``why`` (a FAILURE_* constant): someone
    cancelled it (seen in SQL), its time limit passed, the worker is shutting down for good, its
    lease is lost, or its GPU is, or the `gpuq run` that keeps it is gone (service/kept_jobs.py).
    The worker's one watch thread (``Watch``) looks every CANCEL_POLL_SECONDS until ``done`` is set."""

    def __init__(self, settings: Settings, job_id: int, interrupt: threading.Event,
                 lease: Lease | None = None, gpu_lost: threading.Event | None = None,
                 started: float | None = None, time_limit_s: int | None = None,
                 signal_before_s: int | None = None, rank: bool = False) -> None:
        self.settings, self.job_id, self.interrupt = settings, job_id, interrupt
        # A gang's other rank leaves a lost client to rank 0's watch, whose end stops it: stopping
        # first would fail rank 0's collectives, and end the job as failed by its workload.
        self.rank = rank
        self.lease, self.gpu_lost = lease, gpu_lost
        # When the job started (epoch seconds) and its time limit as last read: with a start, each
        # look reads the limit again (`gpuq update --time` may have changed it), and ``deadline``
        # follows it.
        self.started, self.time_limit_s = started, time_limit_s
        self.stopped = threading.Event()
        self.why = ""
        self.detail = ""  # the figures behind ``why``, where there are some (a share's overrun)
        self.done = threading.Event()
        # `--signal SIG@N`: set once the job is within N seconds of its deadline (as the limit then
        # reads); the command's run sends the signal, from the thread that holds its pid.
        self.signal_before_s = signal_before_s
        self.signal_due = threading.Event()
        # `gpuq cancel --signal`: each signal asked after the job's start, once, for the thread that
        # runs the command to send (workers/command.py); ``asked_at``, the last ask taken.
        self.asked: queue.SimpleQueue[JobSignal] = queue.SimpleQueue()
        self.asked_at: datetime | None = None
        self.since = started if started is not None else time.time()
        # Seconds from SIGTERM to SIGKILL when the job is stopped: a preemption's own, once seen.
        self.grace = settings.kill_grace

    @property
    def deadline(self) -> float | None:
        """When the job must stop (its start plus its time limit), epoch seconds; None: no limit."""
        return self.started + self.time_limit_s if self.started is not None and self.time_limit_s else None

    def stop(self, why: str, detail: str = "") -> None:
        """Stop the job for a reason found outside ``look`` (the share watchdog's)."""
        if not self.stopped.is_set():
            self.why, self.detail = why, detail
            self.stopped.set()

    def look(self) -> None:
        """One look; sets ``stopped`` and ``why`` if the job must stop."""
        if self.done.is_set() or self.stopped.is_set():
            return
        why = self._why()
        if why:
            self.why = why
            self.stopped.set()

    def _why(self) -> str:
        if self.interrupt.is_set():
            return c.FAILURE_INTERRUPTED
        if self.lease is not None and self.lease.lost.is_set():
            return c.FAILURE_WORKER_LOST
        if self.gpu_lost is not None and self.gpu_lost.is_set():
            return c.FAILURE_GPU_LOST
        cancelled = client_lost = False
        try:
            with read_scope(self.settings) as session:
                row = stop_asked(session, self.job_id)
            cancelled, limit = row.stop, row.time_limit_s
            client_lost = row.kept_at is not None and not self.rank and lapsed(self.settings, row.kept_at)
            if row.preempted:
                self.grace = self.settings.preempt_grace
            if row.signal is not None and row.signal_at is not None and row.signal_at != self.asked_at:
                self.asked_at = row.signal_at
                if row.signal_at.timestamp() >= self.since:  # an earlier attempt's ask is not this one's
                    self.asked.put(JobSignal.parse_now(row.signal))
            if self.started is not None and limit != self.time_limit_s and not cancelled:
                self.time_limit_s = limit
                log.info("job %s: its time limit is now %s s", self.job_id, limit)
                deadline = self.deadline
                if self.signal_before_s is not None and (deadline is None or
                                                         time.time() < deadline - self.signal_before_s):
                    # A limit raised past the signal's moment asks for it again before the new one:
                    # a run given more time saves its checkpoint again before that limit too.
                    self.signal_due.clear()
        except Exception:  # noqa: BLE001 - a database blip must not stop the job
            log.warning("job %s: could not check for a cancel request", self.job_id)
        now = time.time()
        if self.deadline is not None and now >= self.deadline:
            return c.FAILURE_TIMEOUT
        if self.signal_before_s is not None and self.deadline is not None and \
                now >= self.deadline - self.signal_before_s:
            self.signal_due.set()
        if cancelled:
            return c.FAILURE_CANCELLED
        return c.FAILURE_CLIENT_LOST if client_lost else ""


class Watch:
    """The worker's watch over its running job: one thread that looks whether the job must stop,
    kept while jobs run, not one started per job (that cost about a tenth of a millisecond each).
    It ends after WATCH_IDLE_SECONDS without a job, and the next job starts another.

    ``_lock`` guards ``watching`` and ``thread`` between the task thread (``watch``) and the watch
    thread (``_run``)."""

    def __init__(self) -> None:
        self.watching: StopWatcher | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, watcher: StopWatcher) -> StopWatcher:
        """Look after ``watcher``'s job from now on, until its ``done`` is set."""
        with self._lock:
            self.watching = watcher
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
                self.thread.start()
        return watcher

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            time.sleep(c.CANCEL_POLL_SECONDS)
            with self._lock:
                watcher = self.watching
                if watcher is None or watcher.done.is_set():
                    watcher, idle_since = None, idle_since or time.monotonic()
                else:
                    idle_since = None
                if idle_since is not None and time.monotonic() - idle_since >= c.WATCH_IDLE_SECONDS:
                    self.thread = None  # decided under the lock: watch() starts the next one
                    return
            if watcher is not None:
                try:
                    watcher.look()
                except Exception:
                    log.exception("job %s: could not look whether it must stop", watcher.job_id)
