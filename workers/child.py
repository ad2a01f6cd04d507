"""A built-in workload on several GPUs, run as the worker's child (``python -m gpuq.workers.child``).

The worker is pinned to one GPU; this process is started with CUDA_VISIBLE_DEVICES listing all of
the job's GPUs. It prints progress to stdout (the worker keeps it as the job's output), records
metrics in SQL, and writes its result as JSON to the path it is given.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any, cast

from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.job_output import record_metric
from gpuq.service.jobs import get_job
from gpuq.service.settings import get_settings
from gpuq.workers.builtin import run_workload
from gpuq.workers.identity import run_as
from gpuq.workers.owner_files import OwnerFiles, umask_of


def main(argv: list[str]) -> int:
    job_id, result_path = int(argv[0]), argv[1]
    settings = get_settings()
    with write_scope(settings) as session:
        job = get_job(session, job_id)
        workload, params, gpus = cast(str, job.workload), dict(job.params), job.gpus  # a workload job names one
        owner, env = job.user, dict(job.env or {})
    cancelled = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: cancelled.set())
    fraction = os.environ.get(c.MEMORY_FRACTION_VARIABLE)
    if fraction:
        hold_to_share(float(fraction))

    def on_metric(values: dict[str, Any]) -> None:
        with write_scope(settings) as session:
            record_metric(session, job_id, values)

    # Its worker (root on a machine's stack) started it as itself: the user's paths, as the user.
    files = OwnerFiles(run_as(owner, settings.node), umask=umask_of(env))
    result = run_workload(job_id, workload, params, gpus, lambda s: print(s, flush=True), cancelled, on_metric,
                          files=files)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


def hold_to_share(fraction: float) -> None:
    """Make CUDA's caching allocator refuse past ``fraction`` of each GPU's memory in this process
    (``torch.cuda.set_per_process_memory_fraction``): a shared built-in fails with CUDA out of
    memory at its share rather than taking its neighbours'. Without CUDA (simulated GPUs) there is
    nothing to hold; the worker's watchdog still watches what the process uses."""
    import torch

    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(min(max(fraction, 0.0), 1.0), device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
