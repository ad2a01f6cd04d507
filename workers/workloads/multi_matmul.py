"""Seed 002 exercise 4: two GPUs doing products at once vs one GPU doing them one after the other.

Kernel launches are asynchronous, so issuing the products to both devices from one thread and then
waiting for both runs them side by side; the ratio of the two times is the scaling (about 2 when
the GPUs are independent). With simulated GPUs both "devices" are the one CPU: the code path runs,
the ratio is about 1 and means nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads.common import describe, synchronize, timed


def products(pairs: list[tuple[torch.Tensor, int]], ctx: WorkloadContext) -> None:
    """For each ``(a, n)``, ``n`` products of ``a`` with itself, issued round-robin over the pairs."""
    for i in range(max(n for _, n in pairs)):
        for a, n in pairs:
            if i < n:
                torch.mm(a, a)
        ctx.check_cancelled()


def run(ctx: WorkloadContext) -> dict[str, Any]:
    p = ctx.params
    d0, d1 = ctx.devices[0], ctx.devices[1]
    size, repeat = p["size"], p["repeat"]
    ctx.log(f"multi-matmul: {repeat} products of {size}x{size} on each of {describe(d0)} and "
            f"{describe(d1)}")
    a0 = torch.randn(size, size, device=d0)
    a1 = torch.randn(size, size, device=d1)
    products([(a0, p["warmup"]), (a1, p["warmup"])], ctx)
    for d in (d0, d1):
        synchronize(d)

    one = timed(d0, lambda: products([(a0, 2 * repeat)], ctx))

    def both() -> None:
        products([(a0, repeat), (a1, repeat)], ctx)
        synchronize(d1)  # timed() waits for d0 only

    two = timed(d0, both)
    simulated = d0 == d1 or d0.type == "cpu"
    flops = 2.0 * size**3 * 2 * repeat
    result = {
        "devices": [describe(d0), describe(d1)],
        "size": size,
        "repeat": repeat,
        "seconds_one_device": one,
        "seconds_two_devices": two,
        "scaling": one / max(two, 1e-12),
        "gflops_one_device": flops / one / 1e9,
        "gflops_two_devices": flops / two / 1e9,
        "simulated": simulated,
    }
    if simulated:
        result["note"] = "both devices are the same CPU: the scaling figure is meaningless"
    ctx.log(f"multi-matmul: one device {one:.4f} s, two devices {two:.4f} s, "
            f"scaling {result['scaling']:.2f}x" + (" (simulated)" if simulated else ""))
    return result
