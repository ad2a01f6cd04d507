"""How long a job waits when it has to preempt, beside one that finds a GPU free, measured in one run
on simulated GPUs:

    python benchmarks/preemption.py [--rounds 10]

It starts its own stack (a server on a Unix socket in /tmp, a scheduler, 2 workers on simulated
GPUs, SQLite in a temporary home, the local Redis at BENCH_REDIS, default redis://127.0.0.1:6379/12,
under a key prefix of its own). Each round submits a job to an idle stack (submit -> running: the
baseline), then fills both GPUs with `--preemptible` jobs that exit as soon as SIGTERM comes (a
job that saves no checkpoint: what the scheduler and the workers cost, not the job's own grace),
and submits a job that is not preemptible: its submit -> running, and how long after its submit
its victim's attempt ended (the ask, the worker's look at its row every 0.2 s, SIGTERM, the end).
The round's jobs are then cancelled. Times are the server's own stamps. Figures are printed;
nothing is asserted. Everything it started is stopped, its Redis keys deleted and its temporary
directory removed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.stack import BenchStack, stop_on_sigterm  # noqa: E402

GPUS = 2
# Runs until SIGTERM, and ends at once when it comes.
SCAVENGER = ["sh", "-c", "trap 'exit 143' TERM; sleep 300 & wait"]


def submit(client: Any, argv: list[str], preemptible: bool = False) -> int:
    body = {"command": argv, "gpus": 1, "cwd": "/tmp", "environ": {"PATH": os.defpath}, "time": "10m",
            "preemptible": preemptible, "key": uuid.uuid4().hex}
    return int(client.post("/jobs", body)["jobs"][0]["id"])


def rows(settings: Any, ids: list[int]) -> dict[int, Any]:
    from sqlalchemy import select

    from gpuq.service.db import read_scope
    from gpuq.service.models import Job

    with read_scope(settings) as session:
        return {r.id: r for r in session.execute(select(Job.id, Job.state, Job.submitted_at, Job.started_at,
                                                        Job.attempts).where(Job.id.in_(ids)))}


def until(settings: Any, ids: list[int], ok: Any, timeout: float = 60.0) -> dict[int, Any]:
    """The jobs' rows once ``ok(row)`` holds for each."""
    deadline = time.monotonic() + timeout
    while True:
        got = rows(settings, ids)
        if all(ok(r) for r in got.values()):
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"jobs {ids} did not get there in {timeout:g} s: {[r.state for r in got.values()]}")
        time.sleep(0.02)


def cancel(client: Any, settings: Any, ids: list[int]) -> None:
    from gpuq.service.constants import END_STATES

    client.post("/jobs/cancel", {"ids": ids})
    until(settings, ids, lambda r: r.state in END_STATES)


def ms(values: list[float]) -> str:
    values = sorted(values)
    return f"p50 {statistics.median(values) * 1000:.0f} ms, p95 {values[int(0.95 * (len(values) - 1))] * 1000:.0f} ms"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    stop_on_sigterm()  # a `timeout` or a killed run still takes the stack down

    from gpuq.cli.client import Client

    with BenchStack("preemption", fake_gpus=GPUS, sample_interval=0) as bench:
        settings = bench.settings
        bench.start()
        client = Client(bench.socket)
        idle, preempting, freed = [], [], []
        for _ in range(args.rounds):
            alone = submit(client, SCAVENGER)
            r = until(settings, [alone], lambda r: r.started_at is not None)[alone]
            idle.append((r.started_at - r.submitted_at).total_seconds())
            cancel(client, settings, [alone])
            victims = [submit(client, SCAVENGER, preemptible=True) for _ in range(GPUS)]
            until(settings, victims, lambda r: r.state == "running")
            urgent = submit(client, SCAVENGER)
            got = until(settings, [urgent, *victims], lambda r, u=urgent: r.id != u or r.started_at is not None)
            u = got[urgent]
            preempting.append((u.started_at - u.submitted_at).total_seconds())
            ended = [datetime.fromisoformat(a["ended_at"]) for v in victims for a in (got[v].attempts or [])
                     if a.get("state") == "preempted"]
            if ended:
                freed.append((min(ended) - u.submitted_at).total_seconds())
            cancel(client, settings, [urgent, *victims])
        print(f"stack: {GPUS} simulated GPUs, SQLite, {args.rounds} rounds; the workers look at a running job's "
              f"row every 0.2 s; GPUQ_PREEMPT_GRACE {settings.preempt_grace:g} s (the victims exit at SIGTERM)")
        print(f"submit -> running on an idle GPU:              {ms(idle)}")
        print(f"submit -> running by preempting a job:         {ms(preempting)}")
        print(f"  of which submit -> the victim's attempt ended: {ms(freed)} ({len(freed)} of {args.rounds} "
              f"rounds preempted)")
        print("each round, ms:", [round(x * 1000) for x in preempting])
        print(f"preempting costs {statistics.median(preempting) - statistics.median(idle):.2f} s more at the "
              f"median (no goal)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
