"""A built-in workload on several GPUs, run as the worker's child (``python -m gpuq.workers.child``).

The worker is pinned to one GPU; this process is started with CUDA_VISIBLE_DEVICES listing all of
the job's GPUs. It prints progress to stdout (the worker keeps it as the job's output), records
metrics in SQL, and writes its result as JSON to the path it is given.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Any, cast

from gpuq.service.db import write_scope
from gpuq.service.jobs import get_job, record_metric
from gpuq.service.settings import get_settings
from gpuq.workers.builtin import run_workload


def main(argv: list[str]) -> int:
    job_id, result_path = int(argv[0]), argv[1]
    settings = get_settings()
    with write_scope(settings) as session:
        job = get_job(session, job_id)
        workload, params, gpus = cast(str, job.workload), dict(job.params), job.gpus  # a workload job names one
    cancelled = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: cancelled.set())

    def on_metric(values: dict[str, Any]) -> None:
        with write_scope(settings) as session:
            record_metric(session, job_id, values)

    result = run_workload(job_id, workload, params, gpus, lambda s: print(s, flush=True), cancelled, on_metric)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
