"""Running one job on this worker, from claim to end state: a plain function, no Celery in sight.

The run loop: ``run_job`` claims a job and runs it, then each job the GPU takes from its next-up
list as the previous one ends. Its parts: the worker's state (``state``), the watch over the
running job (``watch``), the job as read (``job``), its body (``execute``, ``ranks``) and its end
(``end``).
"""

from __future__ import annotations

import logging

from gpuq.service import broker
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.display import printable
from gpuq.service.leases import claim
from gpuq.workers.end import write_end
from gpuq.workers.execute import end_of, execute
from gpuq.workers.job import Started, claimed
from gpuq.workers.output import OutputSink
from gpuq.workers.state import WorkerState
from gpuq.workers.watch import StopWatcher

log = logging.getLogger("gpuq.worker")


def run_job(state: WorkerState, job_id: int) -> str | None:
    """Claim and run job ``job_id``, then each job this GPU takes from its next-up list as the
    previous one ends; returns the last one's end state, or None if ``job_id`` was not ours to run.

    A message for a job that is not dispatched to this GPU (a duplicate, a cancelled job, a
    forged id) changes nothing.
    """
    settings = state.settings
    mark = state.flush_mark()
    with write_scope(settings) as session:
        ours = claim(session, job_id, state.gpu_id, state.name, settings.lease_timeout)
        started = (Started.read(session, claimed(session, ours[0], state.gpu_index, state.queue), ours[1], mark)
                   if ours is not None else None)
    if started is None:
        log.info("%s: job %s is not dispatched to this GPU; message dropped", state.name, job_id)
        return None
    if started.job.shared:
        # Beside the other shared jobs, in a thread of its own: the worker takes its next message.
        from gpuq.workers.shared import start_shared

        start_shared(state, started)
        return State.RUNNING
    end_state = None
    while started is not None:
        end_state, started = _run(state, started)
    return end_state


def _run(state: WorkerState, started: Started) -> tuple[str, Started | None]:
    """Run one started job to its end; returns its end state and the next job started here."""
    settings, job = state.settings, started.job
    lease = state.lease = started.lease
    state.job_started(job.id, job.started_at)
    # The program's name is the user's: escaped, so a newline in it cannot forge a line of the log.
    log.info("%s: job %s started (%s)", state.name, job.id, printable(job.workload or (job.argv or ["?"])[0]))
    state.wait_gpu_back()
    sink = OutputSink(settings, job.id, started.output_seq)
    watcher = state.watch.watch(StopWatcher(settings, job.id, state.interrupt, lease, state.gpu_lost,
                                            job.started_s, job.time_limit_s, job.signal_before_s))
    try:
        end = end_of(state, job, sink, watcher, lambda: execute(state, job, sink, watcher))
    finally:
        # Readings from here on are not the job's: its last one is taken as its end is written.
        state.job_id = None
    ended, following, wake = write_end(state, job, lease, end, sink, started.flush_mark)
    state.lease = None
    if wake:
        broker.wake_scheduler(settings)  # on the process's one broker client: no handshake per job
    log.info("%s: job %s %s", state.name, job.id, end["state"] if ended else "taken back before it ended here")
    return end["state"], following
