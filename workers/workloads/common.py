"""Helpers every torch workload shares: picking devices, synchronising, peak memory."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on ``device``, synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def reset_peak_memory(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def peak_memory(devices: list[torch.device]) -> dict[str, Any]:
    """Peak memory the job held: per CUDA device (allocated and reserved), or the process's peak RSS."""
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        return {
            "peak_allocated_mib": round(max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**20, 1),
            "peak_reserved_mib": round(max(torch.cuda.max_memory_reserved(d) for d in cuda) / 2**20, 1),
        }
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform != "darwin" else 1 / 1024  # macOS reports bytes
    return {"peak_rss_mib": round(rss_kib * scale / 1024, 1)}


def release_memory(devices: list[torch.device]) -> None:
    """Give cached device memory back, so the next job on this warm worker starts clean."""
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"
