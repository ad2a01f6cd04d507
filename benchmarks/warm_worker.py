"""Seed 002's cold-start lesson, measured through gpuq: the exercise-1 job (100 products of 500x500)
run by a warm gpuq worker, beside the same work as a fresh `python` process, in one run.

    python benchmarks/warm_worker.py [--repeats 5] [--size 500] [--products 100]

It starts its own local stack (simulated GPUs where there is no NVIDIA GPU) in a temporary home,
prints each figure and the ratios, and stops the stack. A figure, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.stack import free_port, has_gpu, stop_on_sigterm

COLD = """
import time, torch
t0 = time.perf_counter()
d = torch.device('cuda') if torch.cuda.is_available() else torch.device('cpu')
a = torch.randn({n}, {n}, device=d)
for _ in range({k}):
    torch.mm(a, a)
if d.type == 'cuda':
    torch.cuda.synchronize()
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=500)
    ap.add_argument("--products", type=int, default=100)
    ap.add_argument("--redis-port", type=int, default=0, help="0: a free port, with a Redis gpuq starts")
    args = ap.parse_args()
    stop_on_sigterm()  # a `timeout` or a killed run still takes the stack down

    home = Path(tempfile.mkdtemp(prefix="gpuq-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    # The server's socket in the temporary home: as root the default is the machine's /run/gpuq.
    env.update(GPUQ_HOME=str(home), GPUQ_CONFIG=str(home / "none.toml"), GPUQ_WARM_START="true",
               GPUQ_SOCKET=str(home / "gpuq.sock"),
               GPUQ_REDIS_PORT=str(args.redis_port or free_port()), GPUQ_SCHEDULER_INTERVAL="0.5")
    if not has_gpu():
        env["GPUQ_FAKE_GPUS"] = "1"
    os.environ.update(env)
    from gpuq.service import jobs, spec, submitting
    from gpuq.service.db import write_scope
    from gpuq.service.settings import get_settings

    gpuq = [sys.executable, "-m", "gpuq.cli"]
    subprocess.run([*gpuq, "up"], env=env, check=True)
    try:
        settings = get_settings()
        warm, inside = [], []
        for _ in range(args.repeats + 1):  # the first job pays the first-product cost: reported apart
            t0 = time.perf_counter()
            job = submitting.submit(settings, spec.workload_spec(
                "matmul", ["--size", str(args.size), "--repeat", str(args.products), "--warmup", "0"]))
            while True:
                with write_scope(settings) as session:
                    j = jobs.get_job(session, job.id)
                    if j.state in ("succeeded", "failed", "cancelled"):
                        break
                time.sleep(0.002)
            warm.append(time.perf_counter() - t0)
            inside.append(j.result["seconds"])
        cold = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", COLD.format(n=args.size, k=args.products)], check=True, env=env)
            cold.append(time.perf_counter() - t0)
    finally:
        subprocess.run([*gpuq, "down", "--grace", "5"], env=env)
        shutil.rmtree(home, ignore_errors=True)
    device = j.result["device"]
    print(f"device: {device}; {args.products} products of {args.size}x{args.size}, {args.repeats} runs each")
    print(f"first job on a fresh worker:        {warm[0] * 1000:8.1f} ms submit->ended")
    w, wi, c = statistics.median(warm[1:]), statistics.median(inside[1:]), statistics.median(cold)
    print(f"warm gpuq worker, median:           {w * 1000:8.1f} ms submit->ended ({wi * 1000:.1f} ms of products)")
    print(f"fresh `python` process, median:     {c * 1000:8.1f} ms wall")
    print(f"ratio fresh/warm:                   {c / w:8.2f}x")
    print(f"gpuq's overhead over the products:  {(w - wi) * 1000:8.1f} ms (queue, SQL, dispatch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
