"""The worker's heartbeat: every interval, tell SQL it is alive and how its GPU looks.

Liveness only; the history of readings is the sampler's (workers/sampler.py).
"""

from __future__ import annotations

import logging
import threading

from gpuq.service import inventory
from gpuq.service.db import session_scope
from gpuq.service.settings import Settings
from gpuq.workers.probe import GpuProbe

log = logging.getLogger("gpuq.worker")


class Heartbeat(threading.Thread):
    """Beats until stopped. A failed beat (database down) is logged and retried next interval."""

    def __init__(self, settings: Settings, gpu_id: int, probe: GpuProbe) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.settings, self.gpu_id, self.probe = settings, gpu_id, probe
        self.stopped = threading.Event()

    def run(self) -> None:
        # Beat at once, then every interval: a new worker shows its readings straight away.
        while True:
            try:
                # A reading the sampler took within the last sample interval serves as well.
                reading = self.probe.read(max_age=self.settings.sample_interval)
                with session_scope(self.settings) as session:
                    inventory.beat(session, self.gpu_id, reading)
            except Exception:  # noqa: BLE001 - keep beating; the reaper decides when we are lost
                log.exception("heartbeat failed")
            if self.stopped.wait(self.settings.heartbeat_interval):
                return

    def stop(self) -> None:
        self.stopped.set()
