"""The worker's heartbeat: every interval, tell SQL it is alive and how its GPU looks, and renew
the running job's lease.

A worker that cannot renew the lease for most of its length stops the job itself, so the job is
gone before the reaper can give it to another worker. A GPU that NVML says is lost is drained and
its job stopped; one whose memory needs a reset or a repair (``GpuReading.unhealthy``) is drained,
and its job runs on. The history of readings is the sampler's (workers/sampler.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from gpuq.service import inventory
from gpuq.service.db import write_scope
from gpuq.service.leases import Lease, renew
from gpuq.service.settings import Settings
from gpuq.workers.probe import GpuProbe

if TYPE_CHECKING:
    from gpuq.workers.state import WorkerState

log = logging.getLogger("gpuq.worker")


class Heartbeat(threading.Thread):
    """Beats until stopped. A failed beat (database down) is logged and retried next interval."""

    def __init__(self, settings: Settings, gpu_id: int, probe: GpuProbe, state: WorkerState | None = None) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.settings, self.gpu_id, self.probe, self.state = settings, gpu_id, probe, state
        self.stopped = threading.Event()

    def run(self) -> None:
        # Beat at once, then every interval: a new worker shows its readings straight away.
        while True:
            self.beat()
            if self.stopped.wait(self.settings.heartbeat_interval):
                return

    def beat(self) -> None:
        # The leases to renew: the whole-GPU job's and each shared job's (workers/shared.py).
        runs = list(self.state.shared.values()) if self.state is not None else []
        whole = self.state.lease if self.state is not None else None
        held = [*([whole] if whole is not None else []), *(run.lease for run in runs)]
        try:
            # A reading the sampler took within the last sample interval serves as well.
            reading = self.probe.read(max_age=self.settings.sample_interval)
            if self.state is not None:
                self.state.gpu_health = reading.unhealthy
            with write_scope(self.settings) as session:
                inventory.beat(session, self.gpu_id, reading)
                if reading.lost and inventory.drain_gpu(session, self.gpu_id,
                                                        inventory.health_drain(reading.lost, None)):
                    log.error("GPU %s lost (%s): drained until an admin resumes its node", self.probe.index,
                              reading.lost)
                # Unhealthy (its memory needs a reset or a repair): no new job, its own runs on. Still
                # so after an admin's resume (not reset yet), it is drained again at the next beat.
                if reading.unhealthy and inventory.drain_gpu(session, self.gpu_id,
                                                             inventory.health_drain(None, reading.unhealthy)):
                    log.error("GPU %s unhealthy (%s): drained until an admin resumes its node; a job on it runs on",
                              self.probe.index, reading.unhealthy)
                # Back: NVML reads it again and an admin resumed it (`gpuq resume`, which clears the
                # drain). Until then every job it took failed as gpu_lost at once.
                back = (not reading.lost and self.state is not None and self.state.gpu_lost.is_set()
                        and inventory.gpu_drain_reason(session, self.gpu_id) is None)
                renewed = [renew(session, h.job_id, h.token, self.settings.lease_timeout) for h in held]
                if runs:
                    inventory.record_share_use(session, self.gpu_id, {r.lease.job_id: r.used_mib for r in runs})
            if reading.lost and self.state is not None:
                self.state.gpu_lost.set()
            elif back and self.state is not None:
                log.warning("GPU %s is back (it reads again and was resumed): taking jobs again", self.probe.index)
                self.state.gpu_lost.clear()
            for lease, kept in zip(held, renewed, strict=True):
                if kept:
                    lease.renewed = time.monotonic()
                elif self._still_running(lease):  # not merely ended meanwhile
                    log.warning("job %s: lease no longer ours (taken back); stopping it", lease.job_id)
                    lease.lost.set()
            if self.state is not None and self.state.guard is not None:
                self.state.guard.renewed([lease for lease, kept in zip(held, renewed, strict=True) if kept])
        except Exception:
            log.exception("heartbeat failed")
            for lease in held:
                if lease.overdue(self.settings.lease_timeout):
                    log.error("job %s: lease not renewed for %.0f s; stopping the job before it is reaped",
                              lease.job_id, time.monotonic() - lease.renewed)
                    lease.lost.set()

    def _still_running(self, lease: Lease) -> bool:
        """Whether ``lease``'s job still runs here: the worker's whole-GPU job, or a shared one."""
        return self.state is not None and (self.state.lease is lease or lease.job_id in self.state.shared)

    def stop(self) -> None:
        self.stopped.set()
