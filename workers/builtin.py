"""Running a built-in workload inside the warm worker, with torch already imported."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuq.service.workloads import get_workload
from gpuq.workers.context import WorkloadContext
from gpuq.workers.owner_files import OwnerFiles
from gpuq.workers.workloads.common import peak_memory, release_memory, reset_peak_memory


def job_devices(count: int) -> list[torch.device]:
    """The job's devices as torch sees them: its GPUs, or the CPU for each when there is no CUDA.

    The worker (or the child it starts) has CUDA_VISIBLE_DEVICES set to exactly the job's GPUs,
    so they are cuda:0..count-1 here.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= count:
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * count


def entry_point(entry: str) -> Callable[..., dict[str, Any]]:
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func)


@dataclass(frozen=True)
class Rank:
    """One rank of a job run one rank per GPU worker: which, of how many, meeting where."""

    rank: int
    world_size: int
    init_method: str


def run_workload(job_id: int, workload: str, params: dict[str, Any], gpus: int,
                 log: Callable[[str], None], cancelled: threading.Event,
                 on_metric: Callable[[dict[str, Any]], None] | None = None,
                 rank: Rank | None = None, *, files: OwnerFiles) -> dict[str, Any]:
    """Run the workload (or one rank of it, on this worker's GPU) and return its result, with the
    peak memory it held added. The paths it is given are opened through ``files``, with the job
    owner's rights (``owner_files``), and made with the job's umask (``files.umask``)."""
    w = get_workload(workload)
    devices = job_devices(gpus if rank is None else 1)
    ctx = WorkloadContext(job_id=job_id, params=params, devices=devices, log=log, cancelled=cancelled,
                          on_metric=on_metric, files=files)
    reset_peak_memory(devices)
    try:
        if rank is None:
            result = dict(entry_point(w.entry)(ctx))
        else:
            result = dict(entry_point(w.rank_entry)(ctx, rank.rank, rank.world_size, rank.init_method))
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
