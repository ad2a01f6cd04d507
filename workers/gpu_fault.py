"""Whether a job that failed was failed by its GPU: NVML reads one of its GPUs lost, or unhealthy
in a way it was not when the job started (its memory's counters: ``NvmlDevices.health``).

The heartbeat drains such a GPU within an interval (workers/heartbeat.py), but a job that dies of
an uncorrectable ECC error dies at once, and its failure read as its own: an exit of 1 that used up
a retry, or ended a job that asked for none. Its end is judged here instead, from a reading taken
as it ends: the GPU's failure (``gpu_error``, or ``gpu_lost`` for one gone), requeued without using
a retry as the machinery's failures are, and the GPU drained before the worker takes its next job,
so the job does not come straight back to it.

Only a failure the job could owe to the GPU is judged (a command's exit, a workload's error or a
GPU error its output named); a success, a cancel, a time limit or an out-of-memory stays as it is.
A GPU already unhealthy for the same reason when the job started (as the heartbeat last read it;
resumed by an admin before its reset) explains nothing new: a job that failed there failed on its
own. For a job's other GPUs (several-GPU jobs) this worker has no earlier reading: any fault counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import Unreachable
from gpuq.service.inventory import drain_gpu, gpu_id_of, health_drain
from gpuq.workers.job import JobRun
from gpuq.workers.state import WorkerState

log = logging.getLogger("gpuq.worker")

# The failures a GPU's fault may be behind: those of the job's own program.
JUDGED = (c.FAILURE_EXIT, c.FAILURE_ERROR, c.FAILURE_GPU_ERROR)


@dataclass(frozen=True)
class GpuFault:
    """One of the job's GPUs failed while it ran: its index on this node, and NVML's word for it."""

    index: int
    lost: str | None = None
    unhealthy: str | None = None

    def said(self, node: str) -> str:
        """What befell the GPU, in a job's words: "gpu 1 on node3 went unhealthy while it ran (...)"."""
        what = "was lost" if self.lost else "went unhealthy"
        return f"gpu {self.index} on {node} {what} while it ran ({self.lost or self.unhealthy})"

    @property
    def drain_reason(self) -> str:
        """The reason the GPU is drained with, the heartbeat's own words for the same reading."""
        return health_drain(self.lost, self.unhealthy)


def fault_under(state: WorkerState, job: JobRun, end: dict[str, Any], health_at_start: str | None) -> GpuFault | None:
    """The fault of one of the job's GPUs that its failed ``end`` is owed to, or None: it succeeded,
    stopped for another reason, or every GPU of it reads as it did (``health_at_start``: this
    worker's own GPU's unhealthy reason as the heartbeat last read it before the job started)."""
    if end.get("state") != State.FAILED or end.get("failure") not in JUDGED or state.devices is None:
        return None
    for index in job.gpu_indices:
        try:
            reading = state.devices.read(index)
        except Exception:  # a reading that fails is no verdict: the job's end matters more
            log.exception("%s: job %s: could not read GPU %s at its end", state.name, job.id, index)
            continue
        if reading.lost:
            return GpuFault(index, lost=reading.lost)
        if reading.unhealthy and not (index == state.gpu_index and reading.unhealthy == health_at_start):
            return GpuFault(index, unhealthy=reading.unhealthy)
    return None


def blamed_on_gpu(state: WorkerState, job: JobRun, end: dict[str, Any], fault: GpuFault) -> dict[str, Any]:
    """``end`` as its GPU's failure: its class and reason say so, its exit code and what it used stay."""
    failure = c.FAILURE_GPU_LOST if fault.lost else c.FAILURE_GPU_ERROR
    return end | {"failure": failure,
                  "reason": f"GPU error: {fault.said(state.node)}; the job's own end: {end.get('reason')}"[:2000]}


def drain_faulty(state: WorkerState, job: JobRun, fault: GpuFault) -> None:
    """Drain the GPU before the job's end takes the GPU's next job (it would run on the same bad
    GPU, and this job, requeued, might come back to it); the heartbeat drains it anyway at its next
    beat, so a database away now loses nothing."""
    try:
        with write_scope(state.settings) as session:
            gpu_id = state.gpu_id if fault.index == state.gpu_index else gpu_id_of(session, state.node, fault.index)
            drained = gpu_id is not None and drain_gpu(session, gpu_id, fault.drain_reason)
    except Unreachable:
        log.exception("%s: could not drain GPU %s", state.name, fault.index)
        return
    if drained:
        log.error("%s: job %s failed as GPU %s %s (%s): the GPU is drained until an admin resumes its node",
                  state.name, job.id, fault.index, "was lost" if fault.lost else "went unhealthy",
                  fault.lost or fault.unhealthy)
