"""The worker's view of its own GPU: one reading, from NVML or, on a simulated GPU, from the work
its job really does on the CPU.

A simulated GPU's utilisation is the CPU use of the worker's main thread (where a built-in
workload runs) and its job's processes (capped at 100%), its memory the tree's resident memory
above the worker's own at start (for a process that declared simulated GPU memory, what it
declared) plus that of the other processes the simulated GPU lists, and power, clock and
temperature follow the utilisation the way a real GPU's do, so every reading is plausible.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import psutil

from gpuq.service.devices import Devices, GpuProcess, GpuReading
from gpuq.workers.job_processes import descendants

# A simulated GPU's power draw idle and at full load (watts), and its SM clock likewise (MHz):
# roughly an A100 PCIe's, so summaries in joules look like a lab's.
SIM_IDLE_W, SIM_FULL_W = 30.0, 250.0
SIM_IDLE_MHZ, SIM_FULL_MHZ = 210, 1410
# A simulated GPU's temperature idle and at full load (C), and the share of the way to its target
# it moves per reading: a GPU heats and cools over seconds, not at once.
SIM_IDLE_C, SIM_FULL_C, SIM_THERMAL_STEP = 32.0, 78.0, 0.3


class GpuProbe:
    """Reads GPU ``index`` for the worker whose pid is ``root`` (default: this process).

    ``read(max_age)`` returns a reading no older than ``max_age`` seconds, so the heartbeat and the
    sampler can share one without reading the device twice. Safe to call from several threads.
    """

    def __init__(self, devices: Devices, index: int, root: int | None = None) -> None:
        self.devices, self.index = devices, index
        self._root = psutil.Process(root or os.getpid())
        self._baseline_rss = self._root.memory_info().rss
        self._procs: dict[int, psutil.Process] = {}
        self._temperature = SIM_IDLE_C
        self._main_last: tuple[float, float] | None = None
        info = next((g for g in devices.list() if g.index == index), None)
        self._memory_total_mib = info.memory_total_mib if info else None
        self._lock = threading.Lock()
        self._last: tuple[float, GpuReading] | None = None
        self._name = self._root.name()
        # The CPU clock of this process's main thread, where the probe watches its own process.
        self._main_clock = None
        main = threading.main_thread().ident
        if self._root.pid == os.getpid() and hasattr(time, "pthread_getcpuclockid") and main is not None:
            self._main_clock = time.pthread_getcpuclockid(main)

    def read(self, max_age: float = 0.0) -> GpuReading:
        """The GPU's state now (or at most ``max_age`` seconds ago); None where not available."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] <= max_age:
                return self._last[1]
            reading = self._simulated() if self.devices.kind == "simulated" else self._device()
            self._last = (now, reading)
            return reading

    def _tree(self) -> dict[int, psutil.Process]:
        # Keep the Process objects between readings: cpu_percent measures since the previous call.
        pids = descendants(self._root.pid)
        if pids is None:  # no /proc/PID/task/TID/children here: psutil's scan of every process
            try:
                pids = [p.pid for p in self._root.children(recursive=True)]
            except psutil.Error:
                pids = []
        procs = {self._root.pid: self._root}
        for pid in pids:
            try:
                procs[pid] = self._procs.get(pid) or psutil.Process(pid)
            except psutil.Error:
                continue
        self._procs = procs
        return procs

    def _device(self) -> GpuReading:
        reading = self.devices.read(self.index)
        if not reading.processes:
            return reading
        ours = set(self._tree())
        named = tuple(GpuProcess(pid=p.pid, memory_mib=p.memory_mib, name=_name(p.pid), gpuq=p.pid in ours,
                                 user=_user(p.pid))
                      for p in reading.processes)
        return dataclasses.replace(reading, processes=named)

    def _main_thread_cpu(self) -> float:
        """CPU percent of the worker's main thread since the last reading.

        Its main thread is where a built-in workload runs; the worker's other threads (this
        sampler, the heartbeat, the cancel watcher) are bookkeeping, not "GPU" work.
        """
        if self._main_clock is not None:
            used = time.clock_gettime(self._main_clock)  # one system call, not a read of every thread
        else:
            try:
                main = next((t for t in self._root.threads() if t.id == self._root.pid), None)
            except psutil.Error:
                return 0.0
            if main is None:
                return 0.0
            used = main.user_time + main.system_time
        now = time.monotonic()
        last, self._main_last = self._main_last, (now, used)
        if last is None or now <= last[0]:
            return 0.0
        return 100.0 * (used - last[1]) / (now - last[0])

    def _simulated(self) -> GpuReading:
        # The simulated GPU's per-process list: foreign processes it was told to show, and processes
        # that declared simulated GPU memory (service/simulated_memory.py), at their word.
        device = self.devices.read(self.index)
        listed = tuple(device.processes or ())
        declared = {p.pid for p in listed}
        own = 0.0  # the resident memory of the worker's tree above the worker's at start
        procs = []
        known = set(self._procs)
        cpu = self._main_thread_cpu()
        tree = self._tree()
        for p in tree.values():
            try:
                if p.pid != self._root.pid:
                    cpu += p.cpu_percent(None) if p.pid in known else _cpu_since_start(p)
                if p.pid in declared:
                    continue  # its simulated GPU memory is what it declared, not its resident memory
                mem = p.memory_info().rss
                name = self._name if p.pid == self._root.pid else p.name()
            except psutil.Error:
                continue
            if p.pid == self._root.pid:
                own += max(mem - self._baseline_rss, 0)
            else:
                own += mem
                procs.append(GpuProcess(pid=p.pid, memory_mib=mem // 2**20, name=name, gpuq=True))
        others = tuple(dataclasses.replace(p, gpuq=True) if p.pid in tree else p
                       for p in listed if p.pid != self._root.pid)
        used = int(own / 2**20) + sum(p.memory_mib or 0 for p in listed)
        util = int(min(cpu, 100.0))
        load = util / 100.0
        target = SIM_IDLE_C + load * (SIM_FULL_C - SIM_IDLE_C)
        self._temperature += (target - self._temperature) * SIM_THERMAL_STEP
        worker = GpuProcess(pid=self._root.pid, memory_mib=used, name=self._name, gpuq=True)
        return GpuReading(
            memory_used_mib=used, utilization=util, memory_utilization=int(util * 0.6),
            memory_total_mib=self._memory_total_mib,
            temperature_c=int(round(self._temperature)),
            power_w=round(SIM_IDLE_W + load * (SIM_FULL_W - SIM_IDLE_W), 1),
            sm_clock_mhz=int(SIM_IDLE_MHZ + load * (SIM_FULL_MHZ - SIM_IDLE_MHZ)),
            energy_mj=None, processes=(worker, *procs, *others), lost=device.lost,
            unhealthy=device.unhealthy,
        )


def _cpu_since_start(p: psutil.Process) -> float:
    """A new process's CPU percent over its life so far (its first cpu_percent call says 0)."""
    p.cpu_percent(None)  # sets the baseline for the next reading
    times = p.cpu_times()
    alive = max(time.time() - p.create_time(), 1e-3)
    return 100.0 * (times.user + times.system) / alive


def _user(pid: int) -> str | None:
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):
        return None  # gone, or another container's: not available


def _name(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None  # gone, or another container's: not available
