"""Seed 002 exercise 1: how long do N products of an SxS matrix take, on the GPU and on the CPU?

Done the way a benchmark should be: warm-up products are kept apart from the timed ones (the seed's
155 ms cold first call), and the device is synchronised before the clock is read.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads.common import DTYPES, describe, set_tf32, synchronize, timed


def time_products(device: torch.device, size: int, repeat: int, warmup: int, dtype: str,
                  ctx: WorkloadContext) -> float:
    """Seconds for ``repeat`` products of a size x size matrix with itself on ``device``."""
    torch_dtype = DTYPES[dtype]
    if device.type == "cpu" and torch_dtype is torch.float16:
        torch_dtype = torch.float32  # half-precision matmul on the CPU is emulated and meaningless
    set_tf32(dtype == "tf32")
    a = torch.randn(size, size, device=device, dtype=torch_dtype)
    for _ in range(warmup):
        torch.mm(a, a)
        ctx.check_cancelled()
    synchronize(device)

    def products() -> None:
        # Check for cancellation every 10 products: often enough to stop within a second,
        # rarely enough that the check never shows in the timing.
        for i in range(repeat):
            torch.mm(a, a)
            if i % 10 == 9:
                ctx.check_cancelled()

    return timed(device, products)


def run(ctx: WorkloadContext) -> dict[str, Any]:
    p = ctx.params
    device = ctx.device
    size, repeat = p["size"], p["repeat"]
    flops = 2.0 * size**3 * repeat
    ctx.log(f"matmul: {repeat} products of {size}x{size} ({p['dtype']}) on {describe(device)}")
    seconds = time_products(device, size, repeat, p["warmup"], p["dtype"], ctx)
    result: dict[str, Any] = {
        "device": describe(device),
        "size": size,
        "repeat": repeat,
        "dtype": p["dtype"],
        "seconds": seconds,
        "gflops": flops / seconds / 1e9,
        "tflops": flops / seconds / 1e12,
    }
    ctx.log(f"matmul: {seconds:.4f} s, {result['gflops']:.1f} GFLOP/s")
    if p["cpu_baseline"]:
        cpu_seconds = time_products(torch.device("cpu"), size, repeat, p["warmup"], p["dtype"], ctx)
        result["cpu_seconds"] = cpu_seconds
        result["cpu_gflops"] = flops / cpu_seconds / 1e9
        result["speedup_vs_cpu"] = cpu_seconds / seconds
        ctx.log(f"matmul: cpu {cpu_seconds:.4f} s, device is {result['speedup_vs_cpu']:.1f}x the cpu")
    return result
