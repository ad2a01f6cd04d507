"""The worker's heartbeat: every interval, tell SQL it is alive and how its GPU looks."""

from __future__ import annotations

import logging
import os
import threading

import psutil

from gpuq.service import inventory
from gpuq.service.db import session_scope
from gpuq.service.devices import Devices, GpuReading
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.worker")


class Heartbeat(threading.Thread):
    """Beats until stopped. A failed beat (database down) is logged and retried next interval."""

    def __init__(self, settings: Settings, gpu_id: int, devices: Devices, index: int) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.settings, self.gpu_id, self.devices, self.index = settings, gpu_id, devices, index
        self.stopped = threading.Event()
        self._me = psutil.Process(os.getpid())
        self._baseline_rss = self._me.memory_info().rss
        self._procs: dict[int, psutil.Process] = {}

    def run(self) -> None:
        # Beat at once, then every interval: a new worker shows its readings straight away.
        while True:
            try:
                reading = self.reading()
                with session_scope(self.settings) as session:
                    inventory.beat(session, self.gpu_id, reading, self._own_pids())
            except Exception:  # noqa: BLE001 - keep beating; the reaper decides when we are lost
                log.exception("heartbeat failed")
            if self.stopped.wait(self.settings.heartbeat_interval):
                return

    def _own_pids(self) -> set[int]:
        try:
            return {self._me.pid, *(p.pid for p in self._me.children(recursive=True))}
        except psutil.Error:
            return {self._me.pid}

    def reading(self) -> GpuReading:
        if self.devices.kind != "simulated":
            return self.devices.read(self.index)
        foreign = self.devices.read(self.index).processes
        # A simulated GPU shows the load of the worker and its job's processes on the CPU.
        # Keep the Process objects between beats: cpu_percent measures since the previous call.
        current = {p.pid: p for p in [self._me, *self._me.children(recursive=True)]}
        self._procs = {pid: self._procs.get(pid, p) for pid, p in current.items()}
        cpu = rss = 0.0
        for p in self._procs.values():
            try:
                cpu += p.cpu_percent(None)
                rss += p.memory_info().rss
            except psutil.Error:
                continue
        used = max(rss - self._baseline_rss, 0) / 2**20 + sum(p.mib or 0 for p in foreign)
        return GpuReading(memory_used_mib=int(used), utilization=int(min(cpu, 100.0)), processes=foreign)

    def stop(self) -> None:
        self.stopped.set()
