"""What sharing GPUs by memory buys, measured in one run on simulated GPUs:

    python benchmarks/sharing.py [--jobs 32] [--mem-mib 2048] [--seconds 3]

It starts its own stack (a server on a Unix socket in /tmp, a scheduler, 2 workers on simulated
16 GiB GPUs, SQLite in a temporary home, the local Redis at BENCH_REDIS, default
redis://127.0.0.1:6379/12, under a key prefix of its own) and submits the same --jobs small jobs
twice, as one array each through the server's API, as `gpuq submit --array` does: once on whole
GPUs, once `--shared --mem`. Each job holds --mem-mib of simulated GPU memory for --seconds
(`python -m gpuq.workers.simulated_memory`), so the worker's watchdog reads real per-process
figures. Printed for each: the makespan (first submit to last end), jobs per hour, the most jobs
that ran at once, and GPU memory utilisation: the memory the jobs held over time (each job's MiB x
its run time, summed) over the GPUs' capacity x the makespan. Then the ratio of the makespans
(goal: shared at least 4x shorter).

On a lent GPU the same comparison with real training jobs is worth running too (eight small
`train` jobs sharing one GPU against one after another); this script runs the simulated one only.
Figures are printed; nothing is asserted. Everything it started is stopped, its Redis keys deleted
and its temporary directory removed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.stack import BenchStack, stop_on_sigterm  # noqa: E402

GPU_MIB = 16384
GPUS = 2


def run_batch(client, settings, jobs: int, mem_mib: int, seconds: float, shared: bool) -> dict[str, float]:
    """Submit ``jobs`` as one array and wait for all of them; the batch's figures."""
    from sqlalchemy import select

    from gpuq.service.constants import END_STATES
    from gpuq.service.db import read_scope
    from gpuq.service.models import Job

    argv = [sys.executable, "-m", "gpuq.workers.simulated_memory", "--mib", str(mem_mib), "--seconds", str(seconds)]
    body = {"command": argv, "array": f"1-{jobs}", "gpus": 1, "cwd": "/tmp", "environ": {"PATH": os.defpath},
            "mem": f"{mem_mib}M" if shared else None, "shared": shared, "key": uuid.uuid4().hex}
    began = time.time()
    ids = [j["id"] for j in client.post("/jobs", body)["jobs"]]
    while True:
        with read_scope(settings) as session:
            rows = session.execute(select(Job.state, Job.started_at, Job.ended_at).where(Job.id.in_(ids))).all()
        if all(r.state in END_STATES for r in rows):
            break
        time.sleep(0.2)
    failed = sum(r.state != "succeeded" for r in rows)
    spans = [(r.started_at.timestamp(), r.ended_at.timestamp()) for r in rows if r.started_at and r.ended_at]
    makespan = max(e for _, e in spans) - began
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    held = sum((e - s) * mem_mib for s, e in spans)
    return {"makespan_s": makespan, "jobs_per_hour": jobs / makespan * 3600.0, "most_at_once": most,
            "memory_utilisation": held / (GPUS * GPU_MIB * makespan), "failed": failed}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--mem-mib", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    stop_on_sigterm()  # a `timeout` or a killed run still takes the stack down

    from gpuq.cli.client import Client

    with BenchStack("sharing", fake_gpus=GPUS, fake_gpu_memory_mib=GPU_MIB, sample_interval=0) as bench:
        settings = bench.settings
        bench.start()
        client = Client(bench.socket)
        print(f"stack: {GPUS} simulated GPUs of {GPU_MIB // 1024} GiB, shared jobs' context reserve "
              f"{settings.shared_context_mib} MiB; {args.jobs} jobs each holding {args.mem_mib} MiB for "
              f"{args.seconds:g} s")
        results = {}
        for shared in (False, True):
            results[shared] = run_batch(client, settings, args.jobs, args.mem_mib, args.seconds, shared)
        print(f"\n{'':14} {'makespan':>10} {'jobs/hour':>10} {'at once':>8} {'memory util':>12} {'failed':>7}")
        for shared, r in results.items():
            print(f"{'shared' if shared else 'whole GPUs':14} {r['makespan_s']:9.1f}s {r['jobs_per_hour']:10.0f} "
                  f"{r['most_at_once']:8.0f} {r['memory_utilisation']:11.1%} {r['failed']:7.0f}")
        ratio = results[False]["makespan_s"] / results[True]["makespan_s"]
        print(f"\nshared makespan {ratio:.1f}x shorter (goal: at least 4x: {'met' if ratio >= 4 else 'not met'})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
