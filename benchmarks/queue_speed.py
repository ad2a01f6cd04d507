"""gpuq's queue speed beside bare Celery, measured in one run on the same machine:

- the scheduler's decision pass over 10,000 pending jobs and 64 GPUs on 8 nodes (policy alone,
  and a whole pass over SQL);
- submit -> running latency on an idle stack (p50, p95) beside a bare Celery task's round trip;
- throughput of N no-op jobs over 4 simulated GPUs beside N bare Celery no-op tasks over 4 workers;
- the idle gap on one GPU between one job's end and the next queued job's start, from the rows (on
  PostgreSQL a GPU handed from one job to the next is stamped by one statement: 0; a gap shows a
  GPU that waited for the scheduler);
- how much of the machine's CPU stayed idle during each flood (more than none: the flood waits on
  a lock, not the CPU);
- the CPU time each flood took a job, by process (client, server, workers, scheduler, Redis), beside
  bare Celery's: on a machine of C cores no flood passes C x 1000 / (ms a job) jobs/s.

    python benchmarks/queue_speed.py [--jobs 2000] [--latency-samples 50] [--keep-alive] [--clients N]
                                     [--database URL] [--cpus N]

gpuq's jobs are submitted as users submit them: `gpuq up` starts the server (on a Unix socket in
/tmp), the scheduler and the workers, and this process POSTs each job to /v1/jobs over the socket,
with the body `gpuq submit sleep` sends, one request per job for the latency. The flood is run
twice: as one submission of N jobs (`--array`, one request: what earlier rounds measured with an
in-process ``submit_all`` of N jobs), and as N requests one after the other (as Celery's side
makes N ``delay`` calls), which also bounds it by each request's round trip. By default each request opens its own
connection, as the CLI's client does (it is the CLI's client); with ``--keep-alive`` all of them
go over one persistent connection. With ``--clients N`` the N requests come from N submitters at
once (threads of this process, each one request after the other), as many users or a script's
worker pool submit: the server then answers several at a time. The latency is given twice: from
the server's ``submitted_at`` (what the earlier in-process submit measured) and from the moment this
process sent the request (what Celery's figure measures: from ``delay`` to the task's start).

``--database`` runs the scheduler pass and the stack on that database server instead of a new
SQLite file: given a PostgreSQL URL, the script creates a database of its own on that server
(``gpuq_bench_<random>``, through the URL's database, e.g. ``…/postgres``) and drops it at the end;
a SQLite URL is used as it is (an empty one: the pass writes 10,000 jobs into it).

Figures and ratios are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
from benchmarks.stack import stop_on_sigterm  # noqa: E402


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


class CpuMeter:
    """CPU time (user + system) spent by each role's processes between ``start`` and ``stop``, in
    ms per job: where a flood's CPU goes. On two cores, N jobs/s can take at most 2000/N ms of CPU
    each, all processes together."""

    def __init__(self, roles: dict[str, list[Any]]) -> None:
        self.roles = roles  # {role: [psutil.Process]}
        self.before: dict[str, dict[int, float]] = {}

    @staticmethod
    def _cpu(procs: list[Any]) -> dict[int, float]:
        import psutil

        times = {}
        for p in procs:
            try:
                t = p.cpu_times()
                times[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return times

    def _current(self, role: str) -> list[Any]:
        # A database server starts a backend for each new connection, and the stack's pools open
        # some during a flood: its processes are listed again at each reading (one that started
        # meanwhile counts whole; one that ended meanwhile is missed).
        return processes_named("postgres") if role == "postgresql" else self.roles[role]

    def start(self) -> None:
        self.before = {role: self._cpu(self._current(role)) for role in self.roles}

    def stop(self, n_jobs: int) -> dict[str, float]:
        spent = {}
        for role in self.roles:
            now, before = self._cpu(self._current(role)), self.before[role]
            spent[role] = 1000 * sum(t - before.get(pid, 0.0) for pid, t in now.items()) / n_jobs
        return spent


def gpuq_roles(supervisor_pid: int, database: str) -> dict[str, list[Any]]:
    """The stack's processes by role (children of `gpuq up`'s supervisor), this process (the client),
    Redis and, on PostgreSQL, its server's processes."""
    import psutil

    roles: dict[str, list[Any]] = {"client (this process)": [psutil.Process()], "server": [], "workers": [],
                                   "scheduler": [], "redis": processes_named("redis-server")}
    if database.startswith("postgresql"):
        # The database server's own share: all of its processes (the machine is assumed quiet otherwise).
        roles["postgresql"] = processes_named("postgres")
    for child in psutil.Process(supervisor_pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:  # a job's process that ended meanwhile (a command's, not yet reaped)
            continue
        role = ("server" if "gpuq.cli server" in cmd else "workers" if "gpuq.workers" in cmd else
                "scheduler" if "gpuq.cli scheduler" in cmd else None)
        if role is not None:
            roles[role].append(child)
    return roles


def processes_named(name: str) -> list[Any]:
    import psutil

    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]


def cpu_line(cpu: dict[str, float]) -> str:
    parts = ", ".join(f"{role} {ms:.2f}" for role, ms in cpu.items())
    return f"{sum(cpu.values()):.1f} ms of CPU a job ({parts})"


def decision_pass(n_jobs: int = 10_000) -> None:
    from gpuq.service import policy

    rng = random.Random(0)
    now = time.time()
    gpus = [policy.GpuState(id=n * 8 + i, node=f"node{n}", index=i, queue="q", memory_total_mib=81920,
                            busy_until=None if i % 2 else now + rng.randint(60, 7200))
            for n in range(8) for i in range(8)]
    jobs = [policy.JobRequest(id=j, user=f"user{rng.randint(0, 19)}", gpus=rng.choice([1, 1, 1, 2, 4, 8]),
                              priority=rng.choice([0, 0, 0, 5]), submitted=now - j,
                              time_limit_s=rng.choice([None, 3600]), mem_mib=rng.choice([None, 20480]))
            for j in range(n_jobs)]
    snap = policy.QueueState(now, jobs, gpus, gpu_hours={f"user{u}": rng.random() * 100 for u in range(20)})

    def decided(state: Any) -> tuple[Any, float]:
        """``policy.decide(state)`` and the median of five runs' time, ms."""
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            decision = policy.decide(state)
            times.append(time.perf_counter() - t0)
        return decision, statistics.median(times) * 1000

    d, took = decided(snap)
    print(f"decision pass, {n_jobs} pending, 64 GPUs on 8 nodes (policy): {took:.1f} ms "
          f"(goal 100 ms: {took / 100:.2f}x of it), {len(d.placements)} placed")
    # The same queue with preemption in play: the busy GPUs' jobs preemptible (a night of scavenger
    # jobs), a tenth of the pending jobs preemptible too: each waiting job that is not looks for
    # GPUs to take by preemption before it reserves.
    from dataclasses import replace

    from gpuq.service.queue_state import Preemptible

    scavenged = policy.QueueState(now, [replace(j, preemptible=j.id % 10 == 0) for j in jobs],
                                  [replace(g, preemptible=Preemptible(10_000 + g.id, 0, now - g.id))
                                   if g.busy_until is not None else g for g in gpus], gpu_hours=snap.gpu_hours)
    pd, took = decided(scavenged)
    print(f"decision pass, the same with the busy GPUs' jobs preemptible (policy): "
          f"{took:.1f} ms, {len(pd.placements)} placed, {len(pd.preemptions)} preempted")
    # The same queue with each node's cores and host memory counted (service/node_use.py): every
    # pending job reserving cores and memory for its GPUs, each busy GPU's job holding 8 cores and
    # 100 GiB of a node's 64 and 1 TiB.
    from gpuq.service.node_use import CPUS, HOST_MEM, NodeUse

    def offer(amount: float, held: float) -> NodeUse:
        return NodeUse({f"node{n}": amount for n in range(8)},
                       {f"node{n}": {20_000 + g.id: (g.busy_until, held) for g in gpus
                                     if g.node == f"node{n}" and g.busy_until is not None} for n in range(8)})

    reserving = policy.QueueState(now, [replace(j, cpus=8.0 * j.gpus, host_mem_mib=102400 * j.gpus) for j in jobs],
                                  gpus, gpu_hours=snap.gpu_hours,
                                  node_use={CPUS: offer(64, 8), HOST_MEM: offer(1048576, 102400)})
    rd, took = decided(reserving)
    print(f"decision pass, the same with every job reserving cores and host memory (policy): "
          f"{took:.1f} ms, {len(rd.placements)} placed")
    from gpuq.service.forecast import DEPTH, start_times

    t0 = time.perf_counter()
    starts = start_times(snap, d)
    took = time.perf_counter() - t0
    print(f"expected starts over the same queue (forecast, the first {DEPTH} planned): {took * 1000:.0f} ms, "
          f"{sum(t is not None for t in starts.values())} known (no goal; `gpuq status --start` and `gpuq why`)")


def sql_pass(env: dict[str, str], n_jobs: int = 10_000) -> None:
    from sqlalchemy import delete

    from gpuq.service import inventory
    from gpuq.service.celery_app import queue_name
    from gpuq.service.db import dispose_engines, upgrade, write_scope
    from gpuq.service.devices import GpuInfo
    from gpuq.service.models import Allocation, Gpu, Job, NextUp, utcnow
    from gpuq.service.scheduler import Scheduler
    from gpuq.service.settings import load_settings

    home = Path(tempfile.mkdtemp(prefix="gpuq-sched-"))
    s = load_settings({**env, "GPUQ_HOME": str(home), "GPUQ_KEY_PREFIX": "bench-sched"})
    upgrade(s)
    with write_scope(s) as session:
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
    from gpuq.service.explain import expected_starts

    with write_scope(s) as session:  # what the server does for `gpuq status --start`: read, decide, plan
        t = time.perf_counter()
        expected_starts(session, s)
        starts_s = time.perf_counter() - t
    with write_scope(s) as session:  # a database given with --database is the stack's next
        for model in (NextUp, Allocation, Job, Gpu):
            session.execute(delete(model))
    where = "SQLite" if s.database.startswith("sqlite") else "PostgreSQL"
    print(f"scheduler pass over {where} with {n_jobs} pending: whole pass first {1000 * (t1 - t0):.0f} ms "
          f"({len(first)} placed, every reason written), next {1000 * (t2 - t1):.0f} ms; quick pass (each user's "
          f"queue head, what a submit or a job's end runs) {1000 * statistics.median(quick):.0f} ms "
          f"(goal 100 ms: {10 * statistics.median(quick):.2f}x of it); expected starts (`gpuq status --start`'s "
          f"read and plan) {1000 * starts_s:.0f} ms")
    import redis

    r = redis.Redis.from_url(s.broker)
    for key in [*r.scan_iter("bench-sched*"), *r.scan_iter("_kombu.binding*.bench-sched.*")]:
        r.delete(key)
    dispose_engines()
    shutil.rmtree(home, ignore_errors=True)


class Submitter:
    """POST /v1/jobs over the server's Unix socket: through the CLI's own client (a connection per
    request, as `gpuq submit` makes), or over one persistent connection (``keep_alive``)."""

    def __init__(self, socket_path: str, keep_alive: bool, cpus: str | None = None) -> None:
        from gpuq.cli.client import Client, unix_connection
        from gpuq.service import constants as c

        self.keep_alive = keep_alive
        self.client = Client(socket_path)
        self.conn = unix_connection(socket_path, c.CLIENT_TIMEOUT_SECONDS) if keep_alive else None
        self.target = c.API_PREFIX + "/jobs"
        self.retries = c.SUBMIT_RETRIES
        self.cwd = os.getcwd()
        self.cpus = cpus

    def body(self) -> dict[str, Any]:
        """What `gpuq submit sleep` sends (cli/submit.py), a new idempotency key each time; with
        ``cpus``, what `gpuq submit --cpus CPUS -- true` sends (``"0"``: `gpuq submit -- true`)."""
        job: dict[str, Any] = {"workload": "sleep", "command": None} if self.cpus is None else \
            {"workload": None, "command": ["true"], "cpus": None if self.cpus == "0" else self.cpus}
        return {**job, "args": [], "gpus": 1, "name": None, "priority": 0,
                "mem": None, "node": None, "host_mem": None, "time": None, "retries": 0, "hold": False,
                "after": None, "after_any": None, "array": None, "sweep": [], "snapshot": False, "env": [],
                "cwd": self.cwd, "user": None, "key": uuid.uuid4().hex}

    def submit(self, array: str | None = None) -> list[int]:
        """Queue one no-op job (or, with ``array``, an array of them in one request); their ids."""
        body = self.body() | {"array": array}
        if self.conn is None:
            return [j["id"] for j in self.client.post("/jobs", body, retries=self.retries)["jobs"]]
        import json

        data = json.dumps(body).encode("ascii")
        self.conn.request("POST", self.target, body=data,
                          headers={"Content-Type": "application/json", "Content-Length": str(len(data))})
        response = self.conn.getresponse()
        answer = json.loads(response.read())
        if response.status >= 400:
            raise RuntimeError(f"the server refused a submit ({response.status}): {answer}")
        return [j["id"] for j in answer["jobs"]]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    @property
    def how(self) -> str:
        return ("one persistent HTTP connection over the server's Unix socket" if self.keep_alive else
                "a new connection per submit over the server's Unix socket, through the CLI's client")


def gpuq_stack(env: dict[str, str], n_jobs: int, samples: int, keep_alive: bool, clients: int = 1,
               cpus: str | None = None
               ) -> tuple[list[float], list[float], list[float], dict[str, tuple], list[float], str]:
    """Latency on the server's clock and from the client's request, the submit requests' round
    trips, the two floods (the N jobs as one array submission, and as N submissions: each its
    throughput, submit rate, CPU left idle, job ids and CPU a job by role), the idle gaps, and how
    it submitted."""
    from sqlalchemy import select

    from gpuq.service.db import read_scope, write_scope
    from gpuq.service.models import Job
    from gpuq.service.settings import load_settings
    from gpuq.service.stack import pid_file

    s = load_settings(env)
    subprocess.run([sys.executable, "-m", "gpuq.cli", "up"], env=env, check=True)
    meter = CpuMeter(gpuq_roles(int(pid_file(s).read_text().strip()), s.database))
    api = None
    try:
        api = Submitter(str(s.server_socket), keep_alive, cpus)
        api.submit()  # warm the path once
        time.sleep(2)
        latency, from_client, round_trip = [], [], []
        for _ in range(samples):
            sent, t0 = time.time(), time.perf_counter()
            job_id = api.submit()[0]
            round_trip.append(time.perf_counter() - t0)
            while True:
                # A read, not a write transaction: polling must not queue for the lock the claim needs.
                with read_scope(s) as session:
                    j = session.get(Job, job_id)
                    state, submitted, started = j.state, j.submitted_at, j.started_at
                if state in ("succeeded", "failed"):
                    break
                time.sleep(0.005)
            latency.append((started - submitted).total_seconds())
            started = started if started.tzinfo else started.replace(tzinfo=UTC)
            from_client.append(started.timestamp() - sent)
        floods = {}
        for kind in ("array", "requests"):
            t0, ticks = time.perf_counter(), cpu_ticks()
            meter.start()
            if kind == "array":  # the N jobs in one submission, as the earlier rounds' submit_all
                ids = api.submit(array=f"0-{n_jobs - 1}")
            elif clients == 1:  # N submissions one after the other, as Celery's N delay calls
                ids = [api.submit()[0] for _ in range(n_jobs)]
            else:  # N submissions from ``clients`` submitters at once, each one after the other
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(clients) as pool:
                    ids = sorted(pool.map(lambda _: api.submit()[0], range(n_jobs)))
            submit_rate = n_jobs / (time.perf_counter() - t0)
            while True:
                # A range, not 2,000 bound ids: the poll must not take the CPU it is measuring.
                with read_scope(s) as session:
                    left = session.scalar(select(Job.id).where(Job.id.between(ids[0], ids[-1]), Job.state.not_in(
                        ("succeeded", "failed", "cancelled"))).limit(1))
                if left is None:
                    break
                time.sleep(0.05)
            elapsed, idle = time.perf_counter() - t0, idle_share(ticks)
            floods[kind] = (n_jobs / elapsed, submit_rate, idle, ids, meter.stop(n_jobs))
        ids = floods["array"][3]
        with write_scope(s) as session:
            rows = session.execute(select(Job.worker, Job.started_at, Job.ended_at)
                                   .where(Job.id.between(ids[0], ids[-1]))
                                   .order_by(Job.worker, Job.started_at)).all()
        gaps = [(b.started_at - a.ended_at).total_seconds() for a, b in pairwise(rows) if a.worker == b.worker]
        return latency, from_client, round_trip, floods, gaps, api.how
    finally:
        if api is not None:
            api.close()
        subprocess.run([sys.executable, "-m", "gpuq.cli", "down", "--grace", "5"], env=env)
        import redis

        r = redis.Redis.from_url(s.broker)  # the stack's queues and keys: nothing for the next run to find
        for key in [*r.scan_iter(f"{s.key_prefix}[.:/]*"), *r.scan_iter(f"_kombu.binding*.{s.key_prefix}.*")]:
            r.delete(key)


def bare_celery(broker: str, n_tasks: int, samples: int
                ) -> tuple[list[float], float, float | None, dict[str, float]]:
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
        import psutil

        meter = CpuMeter({"client (this process)": [psutil.Process()],
                          "workers": [psutil.Process(w.pid) for w in workers],
                          "redis": processes_named("redis-server")})
        t0, ticks = time.perf_counter(), cpu_ticks()
        meter.start()
        for _ in range(n_tasks):
            noop.delay(time.time())
        while r.llen("bench:done") < n_tasks:
            time.sleep(0.02)
        return latency, n_tasks / (time.perf_counter() - t0), idle_share(ticks), meter.stop(n_tasks)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)
        r.delete("bench:done")


def own_database(url: str) -> tuple[str, Any]:
    """For a PostgreSQL URL, a new database of this run's on that server, and a function that drops
    it; a SQLite URL as it is (and a function that does nothing)."""
    if url.startswith("sqlite"):
        return url, lambda: None
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"gpuq_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        from gpuq.service.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return make_url(url).set(database=name).render_as_string(hide_password=False), drop


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--latency-samples", type=int, default=50)
    ap.add_argument("--keep-alive", action="store_true",
                    help="submit over one persistent connection (default: a new one per submit, as the CLI)")
    ap.add_argument("--clients", type=int, default=1,
                    help="submitters sending the N requests at once (default 1: one request after the other)")
    ap.add_argument("--cpus", help="each gpuq job a command (`true`) reserving this many of its node's CPU cores "
                                   "(`gpuq submit --cpus N -- true`; the node offers the cores the workers may run "
                                   "on): such jobs start at a scheduler pass, never from a GPU's next-up list; "
                                   "0: a command reserving none, to compare with")
    ap.add_argument("--database", help="a PostgreSQL server's URL (the script makes and drops a database of its own "
                                       "there), or an empty SQLite database's (default: a new SQLite file)")
    args = ap.parse_args()
    if args.clients < 1 or (args.keep_alive and args.clients > 1):
        ap.error("--clients takes 1 or more, and --keep-alive (one connection) only 1")
    stop_on_sigterm()  # a `timeout` or a killed run still takes the stack down
    home = Path(tempfile.mkdtemp(prefix="gpuq-speed-"))
    broker = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/12")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    # The server's socket: a short path of its own (as root, the default is the machine's /run/gpuq).
    sock = f"/tmp/gpuqs-{uuid.uuid4().hex[:8]}.sock"
    env.update(GPUQ_HOME=str(home), GPUQ_CONFIG=str(home / "none.toml"), GPUQ_FAKE_GPUS="4", GPUQ_BROKER_URL=broker,
               GPUQ_KEY_PREFIX="bench", GPUQ_WARM_START="true", GPUQ_SOCKET=sock)
    drop = lambda: None  # noqa: E731
    try:
        if args.database:
            env["GPUQ_DATABASE_URL"], drop = own_database(args.database)
        decision_pass()
        sql_pass(env)
        bare_lat, bare_tput, bare_idle, bare_cpu = bare_celery(broker, args.jobs, args.latency_samples)
        lat, lat_client, trip, floods, gaps, how = gpuq_stack(env, args.jobs, args.latency_samples, args.keep_alive,
                                                                args.clients, args.cpus)
    finally:
        drop()
        shutil.rmtree(home, ignore_errors=True)
        Path(sock).unlink(missing_ok=True)
    where = "SQLite" if not args.database or args.database.startswith("sqlite") else "PostgreSQL"
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    what = "no-op workloads (`gpuq submit sleep`)" if args.cpus is None else (
        "commands (`gpuq submit -- true`)" if args.cpus == "0" else
        f"commands (`gpuq submit --cpus {args.cpus} -- true`)")
    print(f"gpuq on {where}, submitting through the server: {how}; jobs: {what}")
    print(f"submit->running latency, idle stack (server's submitted_at -> started_at): "
          f"p50 {ms(pct(lat, 50))}, p95 {ms(pct(lat, 95))}")
    print(f"submit->running latency, idle stack (client's request sent -> started_at): "
          f"p50 {ms(pct(lat_client, 50))}, p95 {ms(pct(lat_client, 95))}")
    print(f"  the submit request's round trip (POST /v1/jobs -> its answer): p50 {ms(pct(trip, 50))}, "
          f"p95 {ms(pct(trip, 95))}")
    print(f"bare Celery round trip (delay -> task start):                         "
          f"p50 {ms(pct(bare_lat, 50))}, p95 {ms(pct(bare_lat, 95))}")
    print(f"  p50 difference: {ms(pct(lat, 50) - pct(bare_lat, 50))} on the server's clock, "
          f"{ms(pct(lat_client, 50) - pct(bare_lat, 50))} from the client's request (goal: within 5 ms)")
    share = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    print(f"bare Celery, {args.jobs} no-op tasks over 4 workers: {bare_tput:.0f} tasks/s "
          f"(CPU left idle: {share(bare_idle)})")
    print(f"  {cpu_line(bare_cpu)}")
    for kind, label in (("array", f"one submission of {args.jobs} jobs (an array)"),
                        ("requests", f"{args.jobs} submissions one after the other" if args.clients == 1 else
                         f"{args.jobs} submissions from {args.clients} submitters at once")):
        tput, submit_rate, idle, _, cpu = floods[kind]
        print(f"throughput, {label}, over 4 simulated GPUs: {tput:.0f} jobs/s (submitting took "
              f"{args.jobs / submit_rate:.2f} s); ratio gpuq/bare {tput / bare_tput:.2f} (goal: at least 0.5); "
              f"CPU left idle {share(idle)}")
        print(f"  {cpu_line(cpu)}; {sum(cpu.values()) / sum(bare_cpu.values()):.1f}x bare Celery's")
    print(f"idle gap on one GPU between a job's end and the next one's start: p50 {ms(pct(gaps, 50))}, "
          f"p95 {ms(pct(gaps, 95))} (goal p95 under 50 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
