"""Seed 002 exercise 3: log a Frobenius norm per step to the host, or keep the log on the device?

The same chain of products runs twice: once copying each step's norm to the host with ``.item()``
(Python waits for the device every step), once writing it into a tensor on the device and copying
that tensor once at the end. On a GPU the second is much faster; on the CPU there is no copy and
the ratio is about 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads.common import describe, synchronize, timed

# Steps between cancellation checks: a check is cheap, but not free in a 10 us loop.
CHECK_EVERY = 50


def chain(a: torch.Tensor, x: torch.Tensor, steps: int, ctx: WorkloadContext,
          on_host: bool) -> list[float]:
    """Norms of ``x <- a @ x / |a @ x|`` over ``steps`` steps, logged on the host or on the device."""
    host: list[float] = []
    log = torch.empty(steps, device=a.device, dtype=a.dtype)
    for i in range(steps):
        y = torch.mm(a, x)
        norm = torch.linalg.matrix_norm(y)  # Frobenius
        if on_host:
            host.append(norm.item())
        else:
            log[i] = norm
        x = y / norm  # keeps the chain finite without a host round trip
        if i % CHECK_EVERY == CHECK_EVERY - 1:
            ctx.check_cancelled()
    return host if on_host else log.cpu().tolist()


def run(ctx: WorkloadContext) -> dict[str, Any]:
    p = ctx.params
    device, steps, size = ctx.device, p["steps"], p["size"]
    ctx.log(f"norm-log: {steps} products of {size}x{size} on {describe(device)}")
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(size, size, generator=g) / math.sqrt(size)).to(device)
    x0 = torch.randn(size, size, generator=g).to(device)
    chain(a, x0, p["warmup"], ctx, on_host=False)  # the cold-start cost belongs to neither variant
    synchronize(device)
    logs: dict[bool, list[float]] = {}

    def variant(on_host: bool) -> float:
        def work() -> None:
            logs[on_host] = chain(a, x0, steps, ctx, on_host)
        return timed(device, work)

    seconds_item = variant(on_host=True)
    seconds_on_device = variant(on_host=False)
    match = all(math.isclose(h, d, rel_tol=1e-4, abs_tol=1e-6)
                for h, d in zip(logs[True], logs[False], strict=False))
    result = {
        "device": describe(device),
        "steps": steps,
        "size": size,
        "seconds_item": seconds_item,
        "seconds_on_device": seconds_on_device,
        "ratio": seconds_item / max(seconds_on_device, 1e-12),
        "norms_match": match,
        "last_norm": logs[False][-1],
        "simulated": device.type == "cpu",
    }
    ctx.log(f"norm-log: .item() every step {seconds_item:.4f} s, log on the device "
            f"{seconds_on_device:.4f} s ({result['ratio']:.2f}x)")
    return result
