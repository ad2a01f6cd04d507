"""Hold the job's GPUs for a while doing nothing: for testing and measuring the queue itself."""

from __future__ import annotations

import time
from typing import Any

from gpuq.workers.context import WorkloadContext


def run(ctx: WorkloadContext) -> dict[str, Any]:
    seconds = ctx.params["seconds"]
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if ctx.cancelled.wait(min(left, 0.1)):
            ctx.check_cancelled()
    return {"slept_s": seconds}
