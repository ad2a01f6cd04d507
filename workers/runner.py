"""Running one job on this worker, from claim to end state: a plain function, no Celery in sight."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.exc import SQLAlchemyError

from gpuq.service import broker, failures, samples, usage
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import read_scope, write_scope
from gpuq.service.dialect import savepoint
from gpuq.service.errors import JobCancelled, JobNotFound, Unreachable
from gpuq.service.inventory import drain_gpu
from gpuq.service.celery_app import send_run_rank
from gpuq.service.jobs import cancel_requested, next_output_seq, rank_to_run, record_metric, set_rendezvous
from gpuq.service.leases import Lease, claim
from gpuq.service.lifecycle import end_attempt
from gpuq.service.next_up import TAKEN_COLUMNS, anything_waits, listed_left, take_next
from gpuq.service.models import Allocation, Gpu, Job, utcnow
from gpuq.service.settings import Settings
from gpuq.service.workloads import get_workload
from gpuq.workers.cgroup import JobCgroup
from gpuq.workers.command import run_command
from gpuq.workers.identity import Identity, run_as
from gpuq.workers.output import OutputSink

log = logging.getLogger("gpuq.worker")


@dataclass
class WorkerState:
    """Who this worker is: its settings, node, GPU, and whether it was told to stop."""

    settings: Settings
    node: str
    gpu_index: int
    gpu_id: int
    name: str
    # Its GPU's Celery queue (what a job taken from the next-up list records as its first GPU's).
    queue: str = ""
    # The Celery app, to ask the job's other GPUs' workers to run their ranks.
    app: Any = None
    # Set on the second shutdown request: stop the running job now instead of letting it finish.
    interrupt: threading.Event = field(default_factory=threading.Event)
    # The job (or rank of one) running here now, which the device sampler tags its readings with.
    job_id: int | None = None
    # The device sampler (workers/sampler.py), if sampling is on.
    sampler: Any = None
    # The lease of the job running here; the heartbeat renews it.
    lease: Lease | None = None
    # Set by the heartbeat when NVML says this GPU is lost: the running job stops.
    gpu_lost: threading.Event = field(default_factory=threading.Event)
    # Set on the first shutdown request: the running job finishes, and no next one is taken.
    stopping: threading.Event = field(default_factory=threading.Event)
    # When it last woke the scheduler for a list that runs short (time.monotonic()).
    _woke: float = -math.inf
    # Looks whether the running job must stop (started with the first job).
    watch: Watch = field(default_factory=lambda: Watch())

    def wake_due(self) -> bool:
        """Whether to look if the next-up list runs short (and wake the scheduler if so): once per
        NEXT_UP_WAKE_SPACING at most, as the scheduler needs one wake-up, not one per job."""
        now = time.monotonic()
        if now - self._woke < c.NEXT_UP_WAKE_SPACING:
            return False
        self._woke = now
        return True

    def may_take_next(self) -> bool:
        return not (self.stopping.is_set() or self.interrupt.is_set() or self.gpu_lost.is_set())

    def job_started(self, job_id: int) -> None:
        self.job_id = job_id

    def job_ended(self, job_id: int) -> None:
        """The job's last device readings are written before anything reads them for its summary."""
        if self.sampler is not None:
            self.sampler.job_ended(job_id)
        self.job_id = None




@dataclass(frozen=True)
class JobRun:
    """The parts of a job row a run needs, read once after the claim."""

    id: int
    name: str
    kind: str
    workload: str | None
    params: dict[str, Any]
    argv: list[str] | None
    cwd: str | None
    gpu_indices: tuple[int, ...]
    gpu_queues: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    # When the job must be stopped (its start plus its --time), epoch seconds; None: no limit.
    deadline: float | None = None
    time_limit_s: int | None = None
    host_mem_mib: int | None = None
    user: str = ""
    started_at: datetime | None = None
    # Whether it ran before (a retry, a requeue): its output and usage go on from the earlier attempts'.
    ran_before: bool = False


def job_env(job: JobRun, node: str, identity: Identity | None = None) -> dict[str, str]:
    """The environment a job runs with: the variables recorded at submit (the submitter's chosen
    ones, array and sweep values) and gpuq's own, nothing of the worker's (no database or broker
    URL, no password); HOME, USER, LOGNAME and SHELL from ``identity``'s passwd entry if given."""
    env = dict(job.env)
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(str(i) for i in job.gpu_indices),
        # NVML numbers GPUs in PCI bus order; without this CUDA may number them differently.
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        GPUQ_JOB_ID=str(job.id),
        GPUQ_JOB_NAME=job.name,
        GPUQ_GPUS=str(len(job.gpu_indices)),
        GPUQ_NODE=node,
    )
    if identity is not None:
        env.update(identity.env())
    return env


class CancelWatcher:
    """Sets ``cancelled`` when the running job must stop, and ``why``: someone cancelled it (seen in
    SQL), its time limit passed, the worker is shutting down for good, its lease is lost, or its
    GPU is. The worker's one watch thread (``Watch``) looks every CANCEL_POLL_SECONDS until
    ``done`` is set."""

    def __init__(self, settings: Settings, job_id: int, interrupt: threading.Event,
                 deadline: float | None = None, lease: Lease | None = None,
                 gpu_lost: threading.Event | None = None) -> None:
        self.settings, self.job_id, self.interrupt, self.deadline = settings, job_id, interrupt, deadline
        self.lease, self.gpu_lost = lease, gpu_lost
        self.cancelled = threading.Event()
        self.why = ""
        self.done = threading.Event()

    def look(self) -> None:
        """One look; sets ``cancelled`` and ``why`` if the job must stop."""
        if self.done.is_set() or self.cancelled.is_set():
            return
        why = self._why()
        if why:
            self.why = why
            self.cancelled.set()

    def _why(self) -> str:
        if self.interrupt.is_set():
            return c.FAILURE_INTERRUPTED
        if self.lease is not None and self.lease.lost.is_set():
            return c.FAILURE_WORKER_LOST
        if self.gpu_lost is not None and self.gpu_lost.is_set():
            return c.FAILURE_GPU_LOST
        if self.deadline is not None and time.time() >= self.deadline:
            return c.FAILURE_TIMEOUT
        try:
            with read_scope(self.settings) as session:
                if cancel_requested(session, self.job_id):
                    return c.FAILURE_CANCELLED
        except Exception:  # noqa: BLE001 - a database blip must not stop the job
            log.warning("job %s: could not check for a cancel request", self.job_id)
        return ""


class Watch:
    """The worker's watch over its running job: one thread that looks whether the job must stop,
    kept while jobs run, not one started per job (that cost about a tenth of a millisecond each).
    It ends after WATCH_IDLE_SECONDS without a job, and the next job starts another."""

    def __init__(self) -> None:
        self.watching: CancelWatcher | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, watcher: CancelWatcher) -> CancelWatcher:
        """Look after ``watcher``'s job from now on, until its ``done`` is set."""
        with self._lock:
            self.watching = watcher
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
                self.thread.start()
        return watcher

    def _run(self) -> None:
        idle_since = None
        while True:
            time.sleep(c.CANCEL_POLL_SECONDS)
            with self._lock:
                watcher = self.watching
                if watcher is None or watcher.done.is_set():
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since >= c.WATCH_IDLE_SECONDS:
                        self.thread = None  # decided under the lock: watch() starts the next one
                        return
                    continue
            idle_since = None
            try:
                watcher.look()
            except Exception:  # noqa: BLE001 - the next look, and the next job, must still happen
                log.exception("job %s: could not look whether it must stop", watcher.job_id)


def load(session, job_id: int) -> JobRun:
    """The job as its run needs it."""
    job = session.connection().execute(_JOB_TO_RUN, {"job_id": job_id}).one_or_none()
    if job is None:
        raise JobNotFound(f"no job {job_id}")
    gpus = session.connection().execute(_JOB_GPUS, {"job_id": job_id}).all()
    return job_run(job, tuple(g.index for g in gpus), tuple(g.queue for g in gpus))


def job_run(job: Any, gpu_indices: tuple[int, ...], gpu_queues: tuple[str, ...]) -> JobRun:
    """A JobRun from a job row with ``TAKEN_COLUMNS`` (a claim's read, or a take's RETURNING)."""
    deadline = job.started_at.timestamp() + job.time_limit_s if job.time_limit_s and job.started_at else None
    return JobRun(id=job.id, name=job.name, kind=job.kind, workload=job.workload, params=dict(job.params),
                  argv=job.argv, cwd=job.cwd, gpu_indices=gpu_indices, gpu_queues=gpu_queues,
                  env=dict(job.env or {}), deadline=deadline, time_limit_s=job.time_limit_s,
                  host_mem_mib=job.host_mem_mib, user=job.user, started_at=job.started_at,
                  ran_before=bool(job.attempts))


_JOB_TO_RUN = select(*TAKEN_COLUMNS).where(Job.__table__.c.id == bindparam("job_id"))
_JOB_GPUS = (select(Gpu.__table__.c.index, Gpu.__table__.c.queue)
             .join_from(Allocation.__table__, Gpu.__table__, Gpu.__table__.c.id == Allocation.__table__.c.gpu_id)
             .where(Allocation.__table__.c.job_id == bindparam("job_id")).order_by(Allocation.__table__.c.rank))


@dataclass(frozen=True)
class Started:
    """A job this worker started (claimed, or took from its next-up list), as read in that transaction."""

    job: JobRun
    lease: Lease
    # The number its first output chunk gets (after earlier attempts' output).
    output_seq: int
    # The device sampler's count of batches taken to write (``Sampler.flushes``) before the job
    # started; None without a sampler.
    flush_mark: int | None = None


def _started(session, job: JobRun, token: str, flush_mark: int | None) -> Started:
    # A retried job's output goes on after its earlier attempts'.
    return Started(job, Lease(job.id, token), next_output_seq(session, job.id) if job.ran_before else 0,
                   flush_mark)


def _flush_mark(state: WorkerState) -> int | None:
    return state.sampler.flushes if state.sampler is not None else None


def run_job(state: WorkerState, job_id: int) -> str | None:
    """Claim and run job ``job_id``, then each job this GPU takes from its next-up list as the
    previous one ends; returns the last one's end state, or None if ``job_id`` was not ours to run.

    A message for a job that is not dispatched to this GPU (a duplicate, a cancelled job, a
    forged id) changes nothing.
    """
    settings = state.settings
    mark = _flush_mark(state)
    with write_scope(settings) as session:
        token = claim(session, job_id, state.gpu_id, state.name, settings.lease_timeout)
        started = _started(session, load(session, job_id), token, mark) if token is not None else None
    if started is None:
        log.info("%s: job %s is not dispatched to this GPU; message dropped", state.name, job_id)
        return None
    end_state = None
    while started is not None:
        end_state, started = _run(state, started)
    return end_state


def _run(state: WorkerState, started: Started) -> tuple[str, Started | None]:
    """Run one started job to its end; returns its end state and the next job started here."""
    settings, job = state.settings, started.job
    lease = state.lease = started.lease
    state.job_started(job.id)
    log.info("%s: job %s started (%s)", state.name, job.id, job.workload or job.argv[0])
    sink = OutputSink(settings, job.id, started.output_seq)
    watcher = state.watch.watch(CancelWatcher(settings, job.id, state.interrupt, job.deadline, lease,
                                              state.gpu_lost))
    end: dict[str, Any]
    try:
        end = _execute(state, job, sink, watcher)
    except JobCancelled:
        end = _stopped_end(state, job, watcher)
    except Exception as exc:  # noqa: BLE001 - any failure of the job is the job's result
        sink.write(traceback.format_exc())
        end = {"state": State.FAILED, "failure": failures.from_exception(exc),
               "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        watcher.done.set()
        sink.stop()
        # Readings from here on are not the job's: its last one is taken as its end is written.
        state.job_id = None
    ended, following, wake = _write_end(state, job, lease, end, sink, started.flush_mark)
    state.lease = None
    if wake:
        broker.wake_scheduler(settings)  # on the process's one broker client: no handshake per job
    log.info("%s: job %s %s", state.name, job.id, end["state"] if ended else "taken back before it ended here")
    return end["state"], following


def _write_end(state: WorkerState, job: JobRun, lease: Lease, end: dict[str, Any],
               sink: OutputSink, flush_mark: int | None = None) -> tuple[bool, Started | None, bool]:
    """Write the job's end under its lease, with the rest of its output, its last device readings
    and its usage summary, and take the GPU's next job, all in one transaction; retried while the
    database is away: an end is never dropped. Returns whether the end was ours to write (False:
    the reaper took the job back meanwhile), the next job started here (None: the GPU is free),
    and whether to wake the scheduler."""
    readings = state.sampler.end_rows(lease.job_id) if state.sampler is not None else []
    in_hand = _totals_in_hand(state, job, readings, flush_mark)
    mark = _flush_mark(state)  # before the next job is taken
    last_words = True
    delay = 0.2
    while True:
        try:
            following = None
            with write_scope(state.settings) as session:
                if last_words:
                    sink.store_rest(session)
                    samples.record(session, state.gpu_id, readings)
                now = utcnow()
                done = end_attempt(session, lease.job_id, token=lease.token, max_requeues=state.settings.max_requeues,
                              now=now, **end)
                wake = True
                if done:
                    _record_usage(state, session, usage.Ended(job.id, len(job.gpu_indices), job.started_at, now,
                                                              job.ran_before), in_hand if last_words else None)
                    if state.may_take_next():
                        taken = take_next(session, state.gpu_id, state.name, state.node,
                                          state.settings.lease_timeout, state.settings.user_gpu_limit)
                        if taken is not None:
                            row, token = taken
                            following = _started(session, job_run(row, (state.gpu_index,), (state.queue,)), token,
                                                 mark)
                    # A GPU that fell free wakes the scheduler only if some job waits: a pass over
                    # an empty queue would just hold up the next submit's message. A GPU that runs
                    # on wakes it, now and then, when its next-up list runs short.
                    wake = (anything_waits(session) if following is None
                            else state.wake_due() and listed_left(session, state.gpu_id) <= c.NEXT_UP_PER_GPU // 2)
            if last_words:
                sink.rest_stored()
            if not done:
                log.warning("%s: job %s was taken back (lease lost); its end here is not recorded",
                            state.name, lease.job_id)
            return done, following, wake
        except Unreachable as exc:
            log.warning("%s: job %s: cannot record its end yet (%s); retrying", state.name, lease.job_id, exc)
            if state.interrupt.wait(delay):
                log.error("%s: job %s: end not recorded: the worker is stopping; the reaper will take "
                          "it back when its lease runs out", state.name, lease.job_id)
                if state.sampler is not None:
                    state.sampler.put_back(readings)
                return False, None, True
            delay = min(delay * 2, 5.0)
        except SQLAlchemyError:
            if not last_words:
                raise
            # Not an outage: a row of its output or readings the database refuses. The end
            # matters more; it is written again without them.
            log.exception("%s: job %s: could not store the rest of its output or its last device readings",
                          state.name, lease.job_id)
            last_words = False


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


def _record_usage(state: WorkerState, session, ended: usage.Ended, totals: usage.Totals | None) -> None:
    """Store the job's usage summary in the transaction that ends it, so nobody sees one without
    the other; a failure here never undoes the end (PostgreSQL: in a savepoint; SQLite undoes
    just the failed statement)."""
    try:
        with savepoint(session):
            usage.record_usage(session, ended.id, ended, state.settings.sample_retention_days, totals)
    except Exception:  # noqa: BLE001 - `gpuq stats JOB` computes a missing summary from the samples
        log.exception("%s: job %s: could not store its usage summary", state.name, ended.id)


def _stopped_end(state: WorkerState, job: JobRun, watcher: CancelWatcher) -> dict[str, Any]:
    """The end of a job that was stopped: timed out, interrupted by shutdown, lease or GPU lost,
    or cancelled."""
    why = watcher.why or (c.FAILURE_INTERRUPTED if state.interrupt.is_set() else c.FAILURE_CANCELLED)
    if why == c.FAILURE_TIMEOUT:
        return {"state": State.TIMED_OUT, "failure": why, "reason": f"time limit of {_hms(job.time_limit_s or 0)} reached"}
    if why == c.FAILURE_INTERRUPTED:
        return {"state": State.FAILED, "failure": why, "reason": "interrupted: the worker was shut down"}
    if why == c.FAILURE_WORKER_LOST:
        return {"state": State.FAILED, "failure": why, "reason": "worker lost: it could not renew the job's lease"}
    if why == c.FAILURE_GPU_LOST:
        return {"state": State.FAILED, "failure": why, "reason": f"GPU lost: gpu {state.gpu_index} on {state.node}"}
    return {"state": State.CANCELLED, "failure": why, "reason": "cancelled by user"}


def _hms(seconds: int) -> str:
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _execute(state: WorkerState, job: JobRun, sink: OutputSink, watcher: CancelWatcher) -> dict[str, Any]:
    settings = state.settings
    cancelled = watcher.cancelled
    if job.kind == c.KIND_COMMAND:
        assert job.argv is not None and job.cwd is not None
        identity = run_as(job.user, state.node)  # UnknownUser fails the job with its reason
        cgroup = JobCgroup.create(f"gpuq-{state.name.replace('@', '-')}-job{job.id}-{uuid.uuid4().hex[:6]}",
                                  job.host_mem_mib)
        try:
            env = job_env(job, state.node, identity)
            env["GPUQ_WORKER"] = worker_mark(state)  # a restarted worker finds what an earlier run left
            outcome = run_command(job.argv, job.cwd, env, sink, cancelled, settings.kill_grace, cgroup,
                                  run_as=identity)
        finally:
            if cgroup is not None:
                cgroup.remove()
        _drain_if_left(state, job, outcome.leftover)
        if outcome.cancelled:
            return _stopped_end(state, job, watcher)
        if outcome.exit_code == 0:
            return {"state": State.SUCCEEDED, "exit_code": 0}
        failure = failures.from_exit(outcome.exit_code, outcome.oom_killed, sink.tail)
        return {"state": State.FAILED, "failure": failure, "exit_code": outcome.exit_code,
                "reason": failures.explain(failure, outcome.exit_code, job.host_mem_mib)}
    from gpuq.workers.builtin import run_workload  # torch: imported where it runs

    def on_metric(values: dict[str, Any]) -> None:
        with write_scope(settings) as session:
            record_metric(session, job.id, values)

    gpus = len(job.gpu_indices)
    if gpus == 1:
        result = run_workload(job.id, job.workload, job.params, 1, sink.line, cancelled, on_metric)
    elif get_workload(job.workload).runs_rank_per_gpu(job.params, gpus):
        rank0 = _start_ranks(state, job)
        result = run_workload(job.id, job.workload, job.params, gpus, sink.line, cancelled, on_metric, rank0)
    else:
        return _execute_in_child(state, job, sink, watcher)
    return {"state": State.SUCCEEDED, "result": result}


def _start_ranks(state: WorkerState, job: JobRun):
    """Set where the job's ranks meet and ask each of its other GPUs' workers to run its rank.

    Each rank then runs in the warm worker pinned to its own GPU; this worker runs rank 0.
    """
    from gpuq.workers.builtin import Rank

    init_method = f"tcp://{advertise_addr(state.settings)}:{free_port()}"
    with write_scope(state.settings) as session:
        set_rendezvous(session, job.id, init_method)
    for rank, queue in enumerate(job.gpu_queues[1:], start=1):
        send_run_rank(state.app, queue, job.id, rank)
    return Rank(0, len(job.gpu_queues), init_method)


def run_rank(state: WorkerState, job_id: int, rank: int) -> bool:
    """Run rank ``rank`` of a running job on this worker's GPU; False if it is not ours to run.

    Only rank 0 (the job's own worker) writes output, metrics and the end state; a failing rank
    here makes rank 0's collectives fail, and so the job.
    """
    from gpuq.workers.builtin import Rank, run_workload

    with write_scope(state.settings) as session:
        job = rank_to_run(session, job_id, state.gpu_id, rank)
        if job is None:
            log.info("%s: rank %s of job %s is not this GPU's to run; message dropped", state.name, rank, job_id)
            return False
        workload, params, gpus, meet = job.workload, dict(job.params), job.gpus, job.rendezvous
    log.info("%s: job %s rank %s/%s started", state.name, job_id, rank, gpus)
    state.job_started(job_id)
    watcher = state.watch.watch(CancelWatcher(state.settings, job_id, state.interrupt))
    try:
        run_workload(job_id, workload, params, gpus, lambda line: log.info("job %s rank %s: %s", job_id, rank, line),
                     watcher.cancelled, None, Rank(rank, gpus, meet))
    except JobCancelled:
        log.info("%s: job %s rank %s stopped: job cancelled or ended", state.name, job_id, rank)
    except Exception:  # noqa: BLE001 - rank 0 reports the job's failure
        log.exception("%s: job %s rank %s failed", state.name, job_id, rank)
    finally:
        watcher.done.set()
        state.job_ended(job_id)
    log.info("%s: job %s rank %s done", state.name, job_id, rank)
    return True


def advertise_addr(settings: Settings) -> str:
    """The address other nodes reach this one at (GPUQ_ADVERTISE_ADDR, else the host name's)."""
    if settings.advertise_addr:
        return settings.advertise_addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _execute_in_child(state: WorkerState, job: JobRun, sink: OutputSink, watcher: CancelWatcher) -> dict[str, Any]:
    """A workload on several GPUs runs in a child that sees all of them (this worker sees one)."""
    with tempfile.TemporaryDirectory(prefix=f"gpuq-job{job.id}-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env = dict(os.environ)  # gpuq's own code: it keeps the worker's settings
        env.update(job_env(job, state.node))
        env["GPUQ_WORKER"] = worker_mark(state)
        argv = [sys.executable, "-m", "gpuq.workers.child", str(job.id), result_path]
        outcome = run_command(argv, job.cwd or tmp, env, sink, watcher.cancelled, state.settings.kill_grace)
        if outcome.cancelled:
            return _stopped_end(state, job, watcher)
        _drain_if_left(state, job, outcome.leftover)
        if outcome.exit_code != 0 or not os.path.exists(result_path):
            failure = failures.from_exit(outcome.exit_code, outcome.oom_killed, sink.tail)
            if failure == c.FAILURE_EXIT and outcome.exit_code and outcome.exit_code > 0:
                failure = c.FAILURE_ERROR  # the child printed the workload's traceback
            return {"state": State.FAILED, "failure": failure, "exit_code": outcome.exit_code,
                    "reason": failures.explain(failure, outcome.exit_code)}
        with open(result_path) as f:
            return {"state": State.SUCCEEDED, "result": json.load(f)}


def worker_mark(state: WorkerState) -> str:
    """What every process of this worker's jobs carries in GPUQ_WORKER: the installation (its key
    prefix) and the worker, so a restarted worker finds its predecessor's leftovers and nobody else's."""
    return f"{state.settings.key_prefix}/{state.name}"


def _drain_if_left(state: WorkerState, job: JobRun, leftover: tuple[int, ...]) -> None:
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
