"""What a long history costs the commands that read it: `gpuq status`, `gpuq stats`, `gpuq history` and a
Prometheus scrape of `GET /v1/metrics`, with --jobs ended jobs (default 200,000) behind the queue,
as a lab's database holds after months of arrays.

    python benchmarks/long_history.py [--jobs 200000] [--runs 5] [--database URL [--no-analyze]]

It writes the jobs straight into a new database (SQLite in a temporary directory, or with
--database a PostgreSQL server's URL, on which it makes and drops a database of its own), as
succeeded jobs of seven users spread over the last six days, each with its usage summary (a
command's, with its CPU seconds, as a worker writes it at the end), then starts a stack (a server, a
scheduler, 2 workers on simulated GPUs) and times each command as a whole process, as a user runs
it (p50 of --runs), and the scrape as one request over the server's socket. `gpuq stats` covers
the last seven days, so every job. Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.client_speed import timed, venv_bin  # noqa: E402
from benchmarks.queue_speed import own_database  # noqa: E402
from benchmarks.stack import BenchStack, stop_on_sigterm  # noqa: E402

USERS = 7
DAYS = 6


def fill(settings, n: int) -> float:
    """``n`` succeeded jobs, the newest ending now, each with its usage summary; the seconds it took."""
    from sqlalchemy import insert, literal, select

    from gpuq.service.db import write_scope
    from gpuq.service.models import Job, JobUsage, utcnow

    t0 = time.perf_counter()
    now, step = utcnow(), timedelta(days=DAYS) / n
    for start in range(0, n, 5000):
        rows = []
        for i in range(start, min(n, start + 5000)):
            ended = now - step * (n - i)
            rows.append(dict(name=f"task[{i}]", user=f"user{i % USERS}", kind="command", argv=["true"], cwd="/",
                             params={}, gpus=1, priority=0, state="succeeded", node="benchnode",
                             submitted_at=ended - timedelta(seconds=5), started_at=ended - timedelta(seconds=3),
                             ended_at=ended, exit_code=0, attempts=[]))
        with write_scope(settings) as session:
            session.execute(insert(Job), rows)
    with write_scope(settings) as session:
        columns = ("job_id", "wall_s", "gpu_hours", "idle_s", "samples", "cpu_s", "recorded_at")
        session.execute(insert(JobUsage).from_select(columns, select(
            Job.id, literal(3.0), literal(3.0 / 3600), literal(0.0), literal(3), literal(2.5), Job.ended_at)))
    return time.perf_counter() - t0


def analyze(settings) -> None:
    """PostgreSQL's statistics for the jobs just written, as autovacuum gathers them once a tenth of
    a table has changed: a lab's months of jobs have them, a bulk insert a moment old has not yet
    (without them its planner walked the queue-order index over every ended job for a scrape)."""
    from sqlalchemy import text

    from gpuq.service.db import write_scope

    with write_scope(settings) as session:
        session.execute(text("ANALYZE jobs"))
        session.execute(text("ANALYZE job_usage"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--database", help="a PostgreSQL server's URL (a database of the script's own is made there "
                                       "and dropped); default: a new SQLite file")
    ap.add_argument("--no-analyze", action="store_true",
                    help="on PostgreSQL, time the commands before its statistics know the jobs")
    args = ap.parse_args()
    stop_on_sigterm()

    url, drop = own_database(args.database) if args.database else (None, lambda: None)
    try:
        with BenchStack("history", database_url=url, fake_gpus=2) as bench:
            return measure(args, bench)
    finally:
        drop()


def measure(args: argparse.Namespace, bench: BenchStack) -> int:
    """Fill the stack's database with ended jobs, start it, and time the commands that read them."""
    from gpuq.cli.client import Client

    settings, tmp = bench.settings, bench.tmp
    took = fill(settings, args.jobs)
    where = "SQLite" if settings.database_url.startswith("sqlite") else "PostgreSQL"
    print(f"{args.jobs} ended jobs of {USERS} users over {DAYS} days written to {where} in {took:.1f} s")
    if where == "PostgreSQL" and not args.no_analyze:
        analyze(settings)
    bench.start()
    gpuq = str(venv_bin() / "gpuq")
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", str(tmp)),
           "GPUQ_SOCKET": bench.socket}
    api = Client(bench.socket)
    bounds = ",".join(str(b) for b in (0.1, 1, 10, 60, 600, 3600, 86400))

    def scrape() -> float:
        t0 = time.perf_counter()
        api.get("/metrics", wait_le=bounds, duration_le=bounds)
        return time.perf_counter() - t0

    figures = {
        "gpuq status": lambda: timed([gpuq, "status"], env, str(tmp))[0],
        "gpuq stats (the last 7 days)": lambda: timed([gpuq, "stats"], env, str(tmp))[0],
        "gpuq history --all (a day)": lambda: timed([gpuq, "history", "--all"], env, str(tmp))[0],
        "gpuq history (a user, 7 days, failed)": lambda: timed(
            [gpuq, "history", "--user", "user3", "--since", "7d", "--state", "failed"], env, str(tmp))[0],
        "gpuq history (a name pattern, 7 days)": lambda: timed(
            [gpuq, "history", "--all", "--since", "7d", "--name", "task?1*"], env, str(tmp))[0],
        "GET /v1/metrics (a scrape)": scrape,
    }
    print(f"\n{'':40} {'p50':>9}  (of {args.runs} runs)")
    for name, run in figures.items():
        run()  # once untimed
        print(f"{name:40} {statistics.median(run() for _ in range(args.runs)) * 1000:6.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
