"""The worker's heartbeat: every interval, tell SQL it is alive and how its GPU looks, and renew
the running job's lease.

A worker that cannot renew the lease for most of its length stops the job itself, so the job is
gone before the reaper can give it to another worker. A GPU that NVML says is lost is drained and
its job stopped. The history of readings is the sampler's (workers/sampler.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from gpuq.service import inventory
from gpuq.service.db import write_scope
from gpuq.service.leases import renew
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
        lease = self.state.lease if self.state is not None else None
        shared = [run.lease for run in list(self.state.shared.values())] if self.state is not None else []
        try:
            # A reading the sampler took within the last sample interval serves as well.
            reading = self.probe.read(max_age=self.settings.sample_interval)
            renewed = None
            with write_scope(self.settings) as session:
                inventory.beat(session, self.gpu_id, reading)
                if reading.lost and inventory.drain_gpu(session, self.gpu_id, f"GPU lost: {reading.lost}"):
                    log.error("GPU %s lost (%s): drained until an admin resumes its node", self.gpu_id, reading.lost)
                if lease is not None:
                    renewed = renew(session, lease.job_id, lease.token, self.settings.lease_timeout)
                kept = {s.job_id: renew(session, s.job_id, s.token, self.settings.lease_timeout) for s in shared}
                if self.state is not None and self.state.shared:
                    inventory.record_share_use(session, self.gpu_id, {job_id: run.used_mib for job_id, run
                                                                      in list(self.state.shared.items())})
            for s in shared:
                if kept[s.job_id]:
                    s.renewed = time.monotonic()
                elif self.state is not None and s.job_id in self.state.shared:
                    log.warning("job %s: lease no longer ours (taken back); stopping it", s.job_id)
                    s.lost.set()
            if reading.lost and self.state is not None:
                self.state.gpu_lost.set()
            if lease is None or self.state is None:
                return
            if renewed:
                lease.renewed = time.monotonic()
            elif renewed is False and self.state.lease is lease:  # not merely ended meanwhile
                log.warning("job %s: lease no longer ours (taken back); stopping it", lease.job_id)
                lease.lost.set()
        except Exception:
            log.exception("heartbeat failed")
            for held in [lease, *shared]:
                if held is not None and held.overdue(self.settings.lease_timeout):
                    log.error("job %s: lease not renewed for %.0f s; stopping the job before it is reaped",
                              held.job_id, time.monotonic() - held.renewed)
                    held.lost.set()

    def stop(self) -> None:
        self.stopped.set()
