"""The ``copy`` workload: how many GB/s move host to device, device to host and device to device.

Host buffers are pinned (page-locked) where CUDA is, since that is what a DataLoader with
``pin_memory=True`` gives a training job; the pageable host-to-device figure is reported beside it
to show what pinning buys. On a CPU-only node every "device" is host memory, and the figures are
plain memcpy bandwidth.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads.common import describe, synchronize

MIB = 2**20


def bandwidth(dst: torch.Tensor, src: torch.Tensor, repeat: int, warmup: int,
              ctx: WorkloadContext) -> float:
    """GB/s of ``dst.copy_(src)`` over ``repeat`` copies, after ``warmup`` untimed ones."""
    devices = {dst.device, src.device}

    def copies(n: int) -> None:
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
            ctx.check_cancelled()
        for d in devices:
            synchronize(d)

    copies(warmup)
    start = time.perf_counter()
    copies(repeat)
    seconds = max(time.perf_counter() - start, 1e-12)
    return src.numel() * src.element_size() * repeat / seconds / 1e9


def run(ctx: WorkloadContext) -> dict[str, Any]:
    p = ctx.params
    d0 = ctx.devices[0]
    d1 = ctx.devices[1] if len(ctx.devices) > 1 else d0
    cuda = d0.type == "cuda"
    n = p["mib"] * MIB
    ctx.log(f"copy: {p['mib']} MiB x {p['repeat']} each way, {describe(d0)}"
            + (f" and {describe(d1)}" if d1 != d0 else ""))
    host = torch.ones(n, dtype=torch.uint8, pin_memory=cuda)
    on_d0 = torch.empty(n, dtype=torch.uint8, device=d0)
    on_d1 = torch.empty(n, dtype=torch.uint8, device=d1)
    args = (p["repeat"], p["warmup"], ctx)
    result: dict[str, Any] = {
        "devices": [describe(d) for d in ctx.devices],
        "mib": p["mib"],
        "repeat": p["repeat"],
        "pinned": cuda,
        "host_to_device_gbps": bandwidth(on_d0, host, *args),
        "device_to_host_gbps": bandwidth(host, on_d0, *args),
        "device_to_device_gbps": bandwidth(on_d1, on_d0, *args),
        "device_to_device": f"{d0} -> {d1}",
        "host_to_device_pageable_gbps": None,
        "simulated": not cuda,
    }
    if cuda:
        del host
        pageable = torch.ones(n, dtype=torch.uint8)
        result["host_to_device_pageable_gbps"] = bandwidth(on_d0, pageable, *args)
    else:
        result["note"] = "no CUDA: every copy is a host memcpy"
    ctx.log(f"copy: host->device {result['host_to_device_gbps']:.1f} GB/s, device->host "
            f"{result['device_to_host_gbps']:.1f} GB/s, {result['device_to_device']} "
            f"{result['device_to_device_gbps']:.1f} GB/s")
    return result
