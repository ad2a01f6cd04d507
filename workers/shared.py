"""Shared jobs (`--shared`) on a worker: several at once on its GPU beside each other, each in a
thread of its own with its own lease (renewed by the heartbeat), output, time limit, cancel,
cgroup, end and failure class; its body in processes of its own (a built-in workload too, held to
its share by torch there), so one that fails or is cancelled leaves the others running.

The warm worker's whole-GPU path is untouched: a shared job's message is taken by the same Celery
task, which starts the job here and returns, so the worker takes the next message at once. What
each job uses of the GPU's memory is read per process, at every look, by the share watchdog
(workers/share_watch.py); a job over its share past ``shared_mem_grace`` is stopped as
gpu_mem_exceeded. A worker SIGKILLed with shared jobs running loses their processes with it (each
dies with the thread that started it); their leases run out and the reaper requeues or fails each,
as for any job.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psutil

from gpuq.service import broker, usage
from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.errors import Unreachable
from gpuq.service.leases import Lease
from gpuq.service.lifecycle import end_attempt
from gpuq.service.models import utcnow
from gpuq.workers.end import ended_of, gave_up_waiting, host_use_of, record_usage
from gpuq.workers.execute import end_of, execute
from gpuq.workers.job import JobRun, Started
from gpuq.workers.job_processes import is_process_of
from gpuq.workers.output import OutputSink
from gpuq.workers.share_watch import ShareWatch
from gpuq.workers.state import SharedRun, WorkerState
from gpuq.workers.watch import StopWatcher

log = logging.getLogger("gpuq.worker")
# How often a shared job's memory is read per process (an NVML call for each of its GPUs).
MEMORY_LOOK_SECONDS = 0.5


def start_shared(state: WorkerState, started: Started) -> None:
    """Run the shared job ``started`` in a thread of its own, beside the others."""
    job = started.job
    thread = threading.Thread(target=_run, args=(state, started), name=f"shared-{job.id}", daemon=True)
    state.shared[job.id] = SharedRun(started.lease, thread)
    log.info("%s: shared job %s started (%s MiB; %d shared here)", state.name, job.id, job.mem_mib,
             len(state.shared))
    thread.start()


def wait_for_shared(state: WorkerState, timeout: float | None = None) -> None:
    """Wait for the shared jobs running here to end (a worker shutting down lets them finish, as it
    does its whole-GPU job; a second shutdown request stops them)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for run in list(state.shared.values()):
        run.thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))


def _run(state: WorkerState, started: Started) -> None:
    settings, job, lease = state.settings, started.job, started.lease
    state.wait_gpu_back()
    sink = OutputSink(settings, job.id, started.output_seq)
    watcher = StopWatcher(settings, job.id, state.interrupt, lease, state.gpu_lost, job.started_s, job.time_limit_s,
                          job.signal_before_s)
    pids: set[int] = set()
    memory = _share_watch(state, job, pids)
    looking = threading.Thread(target=_look, args=(state, job, watcher, memory), name=f"shared-watch-{job.id}",
                               daemon=True)
    looking.start()
    end = end_of(state, job, sink, watcher, lambda: execute(state, job, sink, watcher, pids.add))
    try:
        ended = _write_end(state, job, lease, end, sink, memory.peak_mib if memory is not None else None)
    finally:
        state.shared.pop(job.id, None)
    log.info("%s: shared job %s %s", state.name, job.id, end["state"] if ended else "taken back before it ended here")
    broker.wake_scheduler(settings)  # its share of the GPU is free for the next job


def _look(state: WorkerState, job: JobRun, watcher: StopWatcher, memory: ShareWatch | None) -> None:
    """The job's own watch: whether it must stop (cancel, time limit, shutdown, lease or GPU lost)
    every CANCEL_POLL_SECONDS, and whether it keeps to its share of the GPU's memory."""
    looked = -MEMORY_LOOK_SECONDS
    while not watcher.done.wait(c.CANCEL_POLL_SECONDS):
        try:
            watcher.look()
            over = None
            if memory is not None and time.monotonic() - looked >= MEMORY_LOOK_SECONDS:
                looked = time.monotonic()
                over = memory.look(looked)
                run = state.shared.get(job.id)
                if run is not None:
                    run.used_mib = memory.used_mib
        except Exception:
            log.exception("shared job %s: could not look whether it must stop", job.id)
            continue
        if over:
            log.warning("shared job %s: %s; stopping it", job.id, over)
            watcher.stop(c.FAILURE_GPU_MEM_EXCEEDED, over)


def _share_watch(state: WorkerState, job: JobRun, started: set[int]) -> ShareWatch | None:
    """The watchdog over the job's GPU memory: what its processes (every process of its command,
    or those of an allocation and their children) use on each of its GPUs, from the per-process
    list NVML gives (or simulated GPUs' registry), against its share and the context reserve it
    was placed with."""
    if job.mem_mib is None or state.devices is None:
        return None
    devices, gpus = state.devices, job.gpu_indices

    def owns(pid: int) -> bool:
        for main in list(started):
            # A command's every process, as its stop finds them (one that left its tree too); an
            # allocation's processes come one by one, each with its tree.
            mine = is_process_of(main, pid)
            if mine is None:
                mine = _in_tree(main, pid, started)
            if mine:
                return True
        return False

    return ShareWatch(job.mem_mib + state.settings.shared_context_mib, state.settings.shared_mem_grace, owns,
                      lambda: {i: devices.read(i).processes for i in gpus})


def _in_tree(main: int, pid: int, started: set[int]) -> bool:
    """Whether ``pid`` is process ``main`` or a child of it, of any depth. A ``main`` gone is
    forgotten before its pid can be given to a process that is not the job's."""
    if not psutil.pid_exists(main):
        started.discard(main)
        return False
    if pid == main:
        return True
    try:
        return any(parent.pid == main for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _write_end(state: WorkerState, job: JobRun, lease: Lease, end: dict[str, Any], sink: OutputSink,
               peak_mib: int | None) -> bool:
    """Write the job's end under its lease with the rest of its output and its usage summary (its
    peak GPU memory, as the watchdog measured it), in one transaction, retried while the database is
    away (given up when the worker is stopped for good: the reaper takes the job back when its
    lease runs out)."""
    delay = 0.2
    settings = state.settings
    end, host = host_use_of(end)
    while True:
        try:
            with write_scope(settings) as session:
                sink.store_rest(session)
                now = utcnow()
                done = end_attempt(session, job.id, token=lease.token, max_requeues=settings.max_requeues, now=now,
                                   host=host, **end)
                if done:
                    ended = ended_of(job, now, host)
                    record_usage(state, session, ended, usage.Totals(memory_used_max=peak_mib))
            sink.rest_stored()
            return done
        except Unreachable as exc:
            if gave_up_waiting(state, lease, [], delay, exc):  # no readings of its own to hand back
                return False
            delay = min(delay * 2, 5.0)
