"""gpuq's queue speed beside bare Celery, measured in one run on the same machine:

- the scheduler's decision pass over 10,000 pending jobs and 64 GPUs on 8 nodes (policy alone,
  and a whole pass over SQL);
- submit -> running latency on an idle stack (p50, p95) beside a bare Celery task's round trip;
- throughput of N no-op jobs over 4 simulated GPUs beside N bare Celery no-op tasks over 4 workers;
- the idle gap on one GPU between one job's end and the next queued job's start;
- how much of the machine's CPU stayed idle during each flood (more than none: the flood waits on
  a lock, not the CPU).

    python benchmarks/queue_speed.py [--jobs 2000] [--latency-samples 50] [--database URL]

``--database`` runs the scheduler pass and the stack on that database (an empty one: the pass
writes 10,000 jobs into it) instead of a new SQLite file.

Figures and ratios are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(math.ceil(p / 100 * len(values))) - 1)]


def cpu_ticks() -> tuple[int, int] | None:
    """(all, idle) CPU ticks of the machine so far, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(ticks[:8]), ticks[3] + ticks[4]  # idle and iowait


def idle_share(before: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time left idle since ``before``: above zero during a flood, the
    work waits on something else than the CPU (for gpuq on SQLite, the one write lock)."""
    after = cpu_ticks()
    if before is None or after is None or after[0] == before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def decision_pass(n_jobs: int = 10_000) -> None:
    from gpuq.service import policy

    rng = random.Random(0)
    now = time.time()
    gpus = [policy.GpuState(id=n * 8 + i, node=f"node{n}", index=i, queue="q", memory_total_mib=81920,
                            busy_until=None if i % 2 else now + rng.randint(60, 7200))
            for n in range(8) for i in range(8)]
    jobs = [policy.JobRequest(id=j, user=f"user{rng.randint(0, 19)}", gpus=rng.choice([1, 1, 1, 2, 4, 8]),
                              priority=rng.choice([0, 0, 0, 5]), submitted=now - j, time_limit_s=rng.choice([None, 3600]),
                              mem_mib=rng.choice([None, 20480]))
            for j in range(n_jobs)]
    snap = policy.Snapshot(now, jobs, gpus, usage={f"user{u}": rng.random() * 100 for u in range(20)})
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        d = policy.decide(snap)
        times.append(time.perf_counter() - t0)
    print(f"decision pass, {n_jobs} pending, 64 GPUs on 8 nodes (policy): {statistics.median(times) * 1000:.1f} ms "
          f"(goal 100 ms: {statistics.median(times) * 1000 / 100:.2f}x of it), {len(d.placements)} placed")


def sql_pass(env: dict[str, str], n_jobs: int = 10_000) -> None:
    from gpuq.service import inventory
    from gpuq.service.celery_app import queue_name
    from gpuq.service.db import session_scope, upgrade
    from gpuq.service.devices import GpuInfo
    from gpuq.service.models import Allocation, Gpu, Job, NextUp, utcnow
    from gpuq.service.scheduler import Scheduler
    from gpuq.service.settings import load_settings
    from sqlalchemy import delete

    home = Path(tempfile.mkdtemp(prefix="gpuq-sched-"))
    s = load_settings({**env, "GPUQ_HOME": str(home), "GPUQ_KEY_PREFIX": "bench-sched"})
    upgrade(s)
    with session_scope(s) as session:
        for n in range(8):
            for i in range(8):
                info = GpuInfo(index=i, uuid=f"u{n}{i}", name="sim", memory_total_mib=81920)
                inventory.register(session, f"node{n}", info, queue_name(s, f"node{n}", i), "w", 1)
        now = utcnow()
        session.add_all(Job(name="j", user=f"user{j % 20}", kind="command", argv=["true"], cwd="/", params={},
                            gpus=[1, 1, 2, 4, 8][j % 5], priority=0, state="pending", submitted_at=now, attempts=[])
                        for j in range(n_jobs))
    sched = Scheduler(s)
    t0 = time.perf_counter()
    first = sched.schedule_once()
    t1 = time.perf_counter()
    sched.schedule_once()
    t2 = time.perf_counter()
    quick = []
    for _ in range(5):
        t = time.perf_counter()
        sched.schedule_once(quick=True)
        quick.append(time.perf_counter() - t)
    with session_scope(s) as session:  # a database given with --database is the stack's next
        for model in (NextUp, Allocation, Job, Gpu):
            session.execute(delete(model))
    where = "SQLite" if s.database.startswith("sqlite") else "PostgreSQL"
    print(f"scheduler pass over {where} with {n_jobs} pending: whole pass first {1000 * (t1 - t0):.0f} ms "
          f"({len(first)} placed, every reason written), next {1000 * (t2 - t1):.0f} ms; quick pass (each user's "
          f"queue head, what a submit or a job's end runs) {1000 * statistics.median(quick):.0f} ms "
          f"(goal 100 ms: {10 * statistics.median(quick):.2f}x of it)")
    import redis

    r = redis.Redis.from_url(s.broker)
    for key in r.scan_iter("bench-sched*"):
        r.delete(key)


def gpuq_stack(env: dict[str, str], n_jobs: int,
               samples: int) -> tuple[list[float], float, list[float], float | None]:
    from gpuq.service import jobs, spec
    from gpuq.service.db import read_scope, session_scope
    from gpuq.service.models import Job
    from gpuq.service.settings import load_settings
    from sqlalchemy import select

    s = load_settings(env)
    subprocess.run([sys.executable, "-m", "gpuq.cli", "up"], env=env, check=True)
    try:
        noop = lambda: spec.workload_spec("sleep", [])  # noqa: E731
        jobs.submit(s, noop())  # warm the path once
        time.sleep(2)
        latency = []
        for _ in range(samples):
            job = jobs.submit(s, noop())
            while True:
                # A read, not a write transaction: polling must not queue for the lock the claim needs.
                with read_scope(s) as session:
                    j = session.get(Job, job.id)
                    state, took = j.state, j.started_at and (j.started_at - j.submitted_at).total_seconds()
                if state in ("succeeded", "failed"):
                    break
                time.sleep(0.005)
            latency.append(took)
        t0, ticks = time.perf_counter(), cpu_ticks()
        made = jobs.submit_all(s, [noop() for _ in range(n_jobs)])
        ids = [j.id for j in made]
        while True:
            # A range, not 2,000 bound ids: the poll must not take the CPU it is measuring.
            with read_scope(s) as session:
                left = session.scalar(select(Job.id).where(Job.id.between(ids[0], ids[-1]), Job.state.not_in(
                    ("succeeded", "failed", "cancelled"))).limit(1))
            if left is None:
                break
            time.sleep(0.05)
        elapsed, idle = time.perf_counter() - t0, idle_share(ticks)
        with session_scope(s) as session:
            rows = session.execute(select(Job.worker, Job.started_at, Job.ended_at)
                                   .where(Job.id.between(ids[0], ids[-1]))
                                   .order_by(Job.worker, Job.started_at)).all()
        gaps = [(b.started_at - a.ended_at).total_seconds() for a, b in zip(rows, rows[1:]) if a.worker == b.worker]
        return latency, n_jobs / elapsed, gaps, idle
    finally:
        subprocess.run([sys.executable, "-m", "gpuq.cli", "down", "--grace", "5"], env=env)


def bare_celery(broker: str, n_tasks: int, samples: int) -> tuple[list[float], float, float | None]:
    import redis

    env = dict(os.environ, BENCH_BROKER_URL=broker, PYTHONPATH=str(ROOT))
    r = redis.Redis.from_url(broker)
    r.delete("bench:done")
    workers = [subprocess.Popen([sys.executable, "-m", "celery", "-A", "bare_celery", "worker", "-P", "solo", "-c", "1",
                                 "-n", f"bare{i}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
                                 "-l", "WARNING"], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(4)]
    try:
        sys.path.insert(0, str(ROOT))
        os.environ["BENCH_BROKER_URL"] = broker
        from bare_celery import noop

        noop.delay(time.time())
        while r.llen("bench:done") < 1:
            time.sleep(0.05)
        r.delete("bench:done")
        latency = []
        for k in range(samples):
            noop.delay(time.time())
            while r.llen("bench:done") < k + 1:
                time.sleep(0.001)
        for item in r.lrange("bench:done", 0, -1):
            sent, ran = map(float, item.split())
            latency.append(ran - sent)
        r.delete("bench:done")
        t0, ticks = time.perf_counter(), cpu_ticks()
        for _ in range(n_tasks):
            noop.delay(time.time())
        while r.llen("bench:done") < n_tasks:
            time.sleep(0.02)
        return latency, n_tasks / (time.perf_counter() - t0), idle_share(ticks)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)
        r.delete("bench:done")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--latency-samples", type=int, default=50)
    ap.add_argument("--database", help="a database URL (default: a new SQLite file)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpuq-speed-"))
    broker = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/12")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    env.update(GPUQ_HOME=str(home), GPUQ_CONFIG=str(home / "none.toml"), GPUQ_FAKE_GPUS="4", GPUQ_BROKER_URL=broker,
               GPUQ_KEY_PREFIX="bench", GPUQ_WARM_START="true")
    if args.database:
        env["GPUQ_DATABASE_URL"] = args.database
    decision_pass()
    sql_pass(env)
    bare_lat, bare_tput, bare_idle = bare_celery(broker, args.jobs, args.latency_samples)
    lat, tput, gaps, idle = gpuq_stack(env, args.jobs, args.latency_samples)
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    print(f"submit->running latency, idle stack: p50 {ms(pct(lat, 50))}, p95 {ms(pct(lat, 95))}")
    print(f"bare Celery round trip:               p50 {ms(pct(bare_lat, 50))}, p95 {ms(pct(bare_lat, 95))}")
    print(f"  p50 difference: {ms(pct(lat, 50) - pct(bare_lat, 50))} (goal: within 5 ms)")
    print(f"throughput, {args.jobs} no-op jobs over 4 simulated GPUs: {tput:.0f} jobs/s")
    print(f"bare Celery, {args.jobs} no-op tasks over 4 workers:       {bare_tput:.0f} tasks/s")
    print(f"  ratio gpuq/bare: {tput / bare_tput:.2f} (goal: at least 0.5)")
    share = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    print(f"  CPU left idle during the flood: gpuq {share(idle)}, bare Celery {share(bare_idle)}")
    print(f"idle gap on one GPU between a job's end and the next one's start: p50 {ms(pct(gaps, 50))}, "
          f"p95 {ms(pct(gaps, 95))} (goal p95 under 50 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
