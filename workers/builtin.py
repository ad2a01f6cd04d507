"""Running a built-in workload inside the warm worker, with torch already imported."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from gpuq.service.workloads import get_workload
from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads.common import peak_memory, release_memory, reset_peak_memory


def job_devices(count: int) -> list[torch.device]:
    """The job's devices as torch sees them: its GPUs, or the CPU for each when there is no CUDA.

    The worker (or the child it starts) has CUDA_VISIBLE_DEVICES set to exactly the job's GPUs,
    so they are cuda:0..count-1 here.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= count:
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * count


def entry_point(workload: str) -> Callable[[WorkloadContext], dict[str, Any]]:
    module, _, func = get_workload(workload).entry.partition(":")
    return getattr(importlib.import_module(module), func)


def run_workload(job_id: int, workload: str, params: dict[str, Any], gpus: int,
                 log: Callable[[str], None], cancelled: threading.Event,
                 on_metric: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the workload and return its result, with the peak memory it held added."""
    run = entry_point(workload)
    devices = job_devices(gpus)
    ctx = WorkloadContext(job_id=job_id, params=params, devices=devices, log=log, cancelled=cancelled,
                          on_metric=on_metric)
    reset_peak_memory(devices)
    try:
        result = dict(run(ctx))
        result["memory"] = peak_memory(devices)
        if devices[0].type == "cpu":
            result.setdefault("fell_back_to_cpu", True)
        return result
    finally:
        release_memory(devices)


def warm_up() -> str:
    """Import torch and touch the GPU once, so the first job pays no start-up cost. Returns the device."""
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda").sum().item()
        return torch.cuda.get_device_name(0)
    torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    return "cpu"
