"""The server's CPU for one request, by kind of request, measured in one run on a private stack:

- a read that touches one row (`GET /v1/jobs/states`): what any request costs the server (the
  connection's accept, aiohttp's parse and answer, the caller's identity, a thread's read);
- a question with a whole pass's read (`GET /v1/jobs/ID/why`);
- a submit of a held job (`POST /v1/jobs`, `hold`): the submit's checks and write, no placement;
- a submit that runs (`POST /v1/jobs`): the placement, its message, and the workers' CPU for it.

Each request opens its own connection, as the CLI's client does. The CPU of the server, the
workers and the scheduler is read from /proc (psutil) before and after N requests of a kind, sent
one after the other by this process (whose own CPU is given too), and printed per request beside
the wall time a request took. It says where the request-per-job flood of queue_speed.py spends the
server's share, against the floor of a request that does nearly nothing.

    python benchmarks/server_cost.py [--requests 600] [--database URL]

Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
from benchmarks.queue_speed import own_database  # noqa: E402
from benchmarks.stack import stop_on_sigterm  # noqa: E402

ROLES = {"gpuq.cli server": "server", "gpuq.workers": "workers", "gpuq.cli scheduler": "scheduler"}


def roles(supervisor_pid: int) -> dict[str, list[Any]]:
    import psutil

    found: dict[str, list[Any]] = {role: [] for role in ROLES.values()}
    for child in psutil.Process(supervisor_pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:  # a short-lived child (a probe) gone or a zombie meanwhile: none of these
            continue
        for mark, role in ROLES.items():
            if mark in cmd:
                found[role].append(child)
    return found


def cpu_of(procs: dict[str, list[Any]]) -> dict[str, float]:
    import psutil

    out = {role: sum(sum(p.cpu_times()[:2]) for p in ps) for role, ps in procs.items()}
    out["client (this process)"] = sum(psutil.Process().cpu_times()[:2])
    return out


def submit_body(**fields: Any) -> dict[str, Any]:
    """What `gpuq submit sleep` sends (cli/submit.py), a new idempotency key each time."""
    return {"workload": "sleep", "args": [], "command": None, "gpus": 1, "name": None, "priority": 0, "mem": None,
            "node": None, "host_mem": None, "time": None, "retries": 0, "hold": False, "after": None,
            "after_any": None, "array": None, "sweep": [], "snapshot": False, "env": [], "cwd": os.getcwd(),
            "user": None, "key": uuid.uuid4().hex} | fields


def measure(label: str, n: int, procs: dict[str, list[Any]], request: Callable[[], object]) -> None:
    before, start = cpu_of(procs), time.perf_counter()
    for _ in range(n):
        request()
    wall = time.perf_counter() - start
    time.sleep(1.5)  # the jobs a submit started end, and their workers' CPU is counted
    after = cpu_of(procs)
    per = "  ".join(f"{role} {(after[role] - before[role]) / n * 1000:.2f}" for role in before)
    print(f"{label:<44} {per}  (ms of CPU a request; {wall / n * 1000:.2f} ms of wall)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--database", help="a PostgreSQL server's URL (a database of its own is made and dropped)")
    args = ap.parse_args()
    stop_on_sigterm()
    home = Path(tempfile.mkdtemp(prefix="gpuq-cost-"))
    sock = f"/tmp/gpuqc-{uuid.uuid4().hex[:8]}.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    env.update(GPUQ_HOME=str(home), GPUQ_CONFIG=str(home / "none.toml"), GPUQ_FAKE_GPUS="4",
               GPUQ_BROKER_URL=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/13"), GPUQ_KEY_PREFIX="cost",
               GPUQ_WARM_START="true", GPUQ_SOCKET=sock)
    drop = lambda: None  # noqa: E731
    try:
        if args.database:
            env["GPUQ_DATABASE_URL"], drop = own_database(args.database)
        subprocess.run([sys.executable, "-m", "gpuq.cli", "up"], env=env, check=True, stdout=subprocess.DEVNULL)
        try:
            from gpuq.cli.client import Client
            from gpuq.service.settings import load_settings
            from gpuq.service.stack import pid_file

            procs = roles(int(pid_file(load_settings(env)).read_text().strip()))
            client = Client(sock)
            first = client.post("/jobs", submit_body(), retries=3)["jobs"][0]["id"]
            time.sleep(2)
            n = args.requests
            print(f"server CPU by request ({n} each, a new connection per request, 4 simulated GPUs, "
                  f"{'PostgreSQL' if args.database else 'SQLite'}):")
            measure("GET /v1/jobs/states (one row)", n, procs, lambda: client.get("/jobs/states", ids=str(first)))
            measure("GET /v1/jobs/ID/why (a whole pass's read)", n, procs, lambda: client.get(f"/jobs/{first}/why"))
            measure("POST /v1/jobs, held (checks and write)", n, procs,
                    lambda: client.post("/jobs", submit_body(hold=True), retries=3))
            measure("POST /v1/jobs (placed, sent, run)", n, procs,
                    lambda: client.post("/jobs", submit_body(), retries=3))
        finally:
            subprocess.run([sys.executable, "-m", "gpuq.cli", "down"], env=env, stdout=subprocess.DEVNULL)
    finally:
        drop()
        shutil.rmtree(home, ignore_errors=True)
        Path(sock).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
