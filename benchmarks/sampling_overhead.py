"""What device sampling costs a running job, in one run: the sampler thread's CPU time per hour at
1 Hz, and a CPU-bound job's wall time with sampling off and on (1 Hz and 10 Hz), alternating runs.

    python benchmarks/sampling_overhead.py [--seconds 30] [--runs 5]

Runs a real sampler (the worker's, on a simulated GPU) writing to a real SQLite database in a
temporary directory, in this process, beside the job, as in a worker. Prints figures; asserts
nothing. The goal: under 0.5% of one core at 1 Hz.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

from gpuq.service import db
from gpuq.service.db import write_scope
from gpuq.service.devices import SimulatedDevices
from gpuq.service.models import Gpu
from gpuq.service.settings import Settings
from gpuq.workers.probe import GpuProbe
from gpuq.workers.sampler import Sampler


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU seconds used so far by ``thread`` (a started thread of this process)."""
    for t in psutil.Process().threads():
        if t.id == thread.native_id:
            return t.user_time + t.system_time
    return 0.0


def job(size: int = 400, repeat: int = 300) -> float:
    """A CPU-bound job in this thread (as a built-in workload runs): seconds it took."""
    import torch

    a = torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(repeat):
        a = torch.tanh(a @ a / size)
    return time.perf_counter() - start


def start_sampler(settings: Settings, gpu_id: int, hz: float) -> Sampler:
    sampler = Sampler(settings.with_overrides(sample_interval=1.0 / hz), gpu_id,
                      GpuProbe(SimulatedDevices(1, 16384, "bench"), 0), lambda: None)
    sampler.start()
    return sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to sample at 1 Hz for the CPU cost")
    parser.add_argument("--runs", type=int, default=5, help="job runs per setting")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp), database_url=f"sqlite:///{tmp}/bench.db", fake_gpus=1)
        db.upgrade(settings)
        with write_scope(settings) as s:
            gpu = Gpu(node="bench", index=0, uuid="GPU-bench", name="Simulated GPU", memory_total_mib=16384,
                      queue="bench", simulated=True)
            s.add(gpu)
            s.flush()
            gpu_id = gpu.id

        sampler = start_sampler(settings, gpu_id, 1.0)
        time.sleep(1.0)  # past the start-up roll-up
        cpu0, t0 = thread_cpu_seconds(sampler), time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            job(200, 20)  # a busy job, so the readings are of one
        cpu1, t1 = thread_cpu_seconds(sampler), time.monotonic()
        sampler.stop()
        sampler.join()
        per_hour = (cpu1 - cpu0) / (t1 - t0) * 3600
        print(f"sampler at 1 Hz: {cpu1 - cpu0:.3f} CPU-s over {t1 - t0:.0f} s = {per_hour:.1f} CPU-s per hour "
              f"= {100 * per_hour / 3600:.3f}% of one core")

        job()  # warm up torch
        times: dict[str, list[float]] = {"off": [], "1 Hz": [], "10 Hz": []}
        for _ in range(args.runs):
            for mode in times:
                sampler = None if mode == "off" else start_sampler(settings, gpu_id, float(mode.split()[0]))
                time.sleep(0.2)
                times[mode].append(job())
                if sampler:
                    sampler.stop()
                    sampler.join()
        base = statistics.median(times["off"])
        for mode, values in times.items():
            med = statistics.median(values)
            print(f"job with sampling {mode:>5}: median {med:.3f} s of {len(values)} runs "
                  f"({100 * (med - base) / base:+.2f}% vs off)")


if __name__ == "__main__":
    main()
