"""How long a user's `gpuq` command takes, as a whole process, now that it is a thin client of
`gpuq server`; beside a bare `python -c pass` of the same venv, measured in one run.

    python benchmarks/client_speed.py [--runs 20] [--loop 12] [--deep 9000] [--cwd DIR]

It starts its own stack (a server on a Unix socket in /tmp, a scheduler, 2 workers on simulated
GPUs, warm start off) in a temporary home with its own SQLite file, on the local Redis
(BENCH_REDIS, default redis://127.0.0.1:6379/12) under its own key prefix. Each command runs as a
user runs it: the venv's `gpuq` script in a new process whose environment holds PATH, HOME and
GPUQ_SOCKET and GPUQ_NODE only. For each: p50 and p90 wall time over --runs runs, and its ratio to
`python -c pass`; then --loop `gpuq submit -- true` one after the other (a script's loop), in all;
then `gpuq status` and `gpuq status -r` with a held array of --deep tasks pending (one line for
the array, and a line for each task); then which heavy modules a `gpuq status` process imported
(`python -X importtime`).

Goals: `gpuq status` and `gpuq submit` p50 at most 150 ms; twelve submits at most 12 x 150 ms; a
no-op `gpuq run -- true` (queued, run and followed to its end) at most 300 ms; no sqlalchemy,
celery, kombu, redis, torch or aiohttp in a user's command. `gpuq alloc -- true` is timed too (an
allocation held for `true` and given back), and with `--cpus 1` (its gate asks the server for its
cores before the shell starts), with no goal.

Between groups the script waits (up to 2 minutes) for the stack's queue to empty, so the jobs a
group submitted do not run on the CPU the next group is timed on. The matmul submits go last.
Everything it started is stopped, its Redis keys deleted and its temporary directory removed.
Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.stack import BenchStack, stop_on_sigterm  # noqa: E402

GOAL_MS = 150.0
RUN_GOAL_MS = 300.0  # `gpuq run -- true`, a whole job's round trip
HEAVY = ("sqlalchemy", "celery", "kombu", "redis", "torch", "aiohttp")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(math.ceil(p / 100 * len(values))) - 1)]


def venv_bin() -> Path:
    """The bin directory holding the `gpuq` script: this python's, else the repository's .venv."""
    here = Path(sys.executable).parent
    return here if (here / "gpuq").exists() else ROOT / ".venv" / "bin"


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         timeout=120)
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return took, out.stdout


def wait_idle(settings, timeout: float = 120.0) -> float:
    """Wait until no job of the stack is pending or running; the seconds it took."""
    from sqlalchemy import select

    from gpuq.service.db import read_scope
    from gpuq.service.models import Job

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with read_scope(settings) as session:
            left = session.scalar(select(Job.id).where(Job.state.not_in(("succeeded", "failed", "cancelled")))
                                  .limit(1))
        if left is None:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def imported_by_status(py: str, env: dict[str, str], cwd: str) -> tuple[list[str], float, list[tuple[float, str]]]:
    """The heavy packages a `gpuq status` process imported, its total import time (s), and its five
    costliest top-level imports (s, name), from ``python -X importtime``."""
    out = subprocess.run([py, "-X", "importtime", "-m", "gpuq.cli", "status"], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"gpuq status under -X importtime exited {out.returncode}: {out.stderr[-2000:]}")
    names, top = set(), []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if not m:
            continue
        name = m.group(4)
        names.add(name.split(".")[0])
        if len(m.group(3)) == 1:  # a top-level import (its children are indented further)
            top.append((int(m.group(2)) / 1e6, name))
    heavy = sorted(h for h in HEAVY if h in names)
    return heavy, sum(s for s, _ in top), sorted(top, reverse=True)[:5]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20, help="runs of each command")
    ap.add_argument("--loop", type=int, default=12, help="`gpuq submit -- true` one after the other")
    ap.add_argument("--deep", type=int, default=9000,
                    help="then `gpuq status` with an array of this many tasks pending (0: not timed)")
    ap.add_argument("--cwd", help="where the commands run (default: the temporary directory, outside any git "
                                  "work tree; a command submit inside one also runs git there)")
    args = ap.parse_args()
    stop_on_sigterm()  # a `timeout` or a killed run still takes the stack down

    with BenchStack("client", fake_gpus=2, kill_grace=1.0) as bench:
        settings, sock, tmp = bench.settings, bench.socket, bench.tmp
        t0 = time.perf_counter()
        bench.start()
        print(f"stack up in {time.perf_counter() - t0:.1f} s: server on {sock}, scheduler, 2 workers on "
              f"simulated GPUs (warm start off), SQLite, {settings.broker_url} prefix {settings.key_prefix}")

        bindir = venv_bin()
        py, gpuq = str(bindir / "python"), str(bindir / "gpuq")
        # GPUQ_NODE: `gpuq alloc` asks for GPUs on the node it runs on, the workers' "benchnode" here.
        user_env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", str(tmp)),
                    "GPUQ_SOCKET": sock, "GPUQ_NODE": settings.node}
        cwd = args.cwd or str(tmp)
        print(f"commands: {gpuq}, environment PATH, HOME, GPUQ_SOCKET, GPUQ_NODE only, in {cwd}; {args.runs} runs each")

        def runs(argv: list[str]) -> tuple[list[float], list[str]]:
            timed(argv, user_env, cwd)  # once untimed: the page cache, not the first run's disk reads
            took, outs = [], []
            for _ in range(args.runs):
                t, out = timed(argv, user_env, cwd)
                took.append(t)
                outs.append(out)
            return took, outs

        results: dict[str, list[float]] = {}
        results["python -c pass"], _ = runs([py, "-c", "pass"])
        results["gpuq --help"], _ = runs([gpuq, "--help"])
        results["gpuq status"], _ = runs([gpuq, "status"])
        results["gpuq submit -- true"], outs = runs([gpuq, "submit", "--", "true"])
        job_id = re.search(r"submitted job (\d+)", outs[-1]).group(1)
        # A job script named as sbatch takes one: its #GPUQ lines read and its #! line split here.
        with open(os.path.join(cwd, "job.sh"), "w") as script:
            script.write("#!/bin/sh\n#GPUQ --name timed --time 5m\ntrue\n")
        results["gpuq submit job.sh"], _ = runs([gpuq, "submit", "job.sh"])
        waited = wait_idle(settings)
        results[f"gpuq show {job_id}"], _ = runs([gpuq, "show", job_id])
        # Each queues a job and follows it to its end, on the idle stack: submit, placement, the
        # worker's start and end of `true`, and the answer that it ended, all inside the process.
        results["gpuq run -- true"], _ = runs([gpuq, "run", "--", "true"])
        results["gpuq alloc -- true"], _ = runs([gpuq, "alloc", "--", "true"])
        # With --cpus the shell's gate asks the server for its cores before the shell starts.
        results["gpuq alloc --cpus 1 -- true"], _ = runs([gpuq, "alloc", "--cpus", "1", "--", "true"])

        waited += wait_idle(settings)
        t0 = time.perf_counter()
        for _ in range(args.loop):
            timed([gpuq, "submit", "--", "true"], user_env, cwd)
        loop = time.perf_counter() - t0
        waited += wait_idle(settings)

        # Last: each of these jobs starts a fresh process that imports torch (warm start is off).
        results["gpuq submit matmul --size 64"], _ = runs([gpuq, "submit", "matmul", "--size", "64"])

        if args.deep:
            # A deep queue: one user's held array. `gpuq status` shows its pending tasks as one line
            # (as squeue does), `status -r` a line each, which the server, the JSON and the table pay for.
            waited += wait_idle(settings)
            timed([gpuq, "submit", "--hold", "--array", f"0-{args.deep - 1}", "--", "true"], user_env, cwd)
            deep = max(3, args.runs // 4)
            for label, argv in ((f"gpuq status, {args.deep} pending", [gpuq, "status"]),
                                (f"gpuq status -r, {args.deep} pending", [gpuq, "status", "-r"])):
                timed(argv, user_env, cwd)
                results[label] = [timed(argv, user_env, cwd)[0] for _ in range(deep)]

        heavy, import_s, costliest = imported_by_status(py, user_env, cwd)

        base = statistics.median(results["python -c pass"])
        ms = lambda v: f"{v * 1000:6.0f} ms"  # noqa: E731
        print(f"\n{'command':34} {'p50':>9} {'p90':>9}  {'p50 / python -c pass':>20}  goal")
        for name, took in results.items():
            p50 = statistics.median(took)
            goal = ""
            if name == "gpuq status" or name.startswith("gpuq submit"):
                goal = f"p50 <= {GOAL_MS:.0f} ms: {'met' if p50 * 1000 <= GOAL_MS else 'not met'}"
            elif name == "gpuq run -- true":
                goal = f"p50 <= {RUN_GOAL_MS:.0f} ms: {'met' if p50 * 1000 <= RUN_GOAL_MS else 'not met'}"
            print(f"{name:34} {ms(p50)} {ms(pct(took, 90))}  {p50 / base:19.1f}x  {goal}")
        print(f"\n{args.loop} x `gpuq submit -- true` in a loop: {loop * 1000:.0f} ms in all, "
              f"{loop * 1000 / args.loop:.0f} ms each, {loop / base:.1f}x one `python -c pass` "
              f"(goal <= {args.loop} x {GOAL_MS:.0f} ms = {args.loop * GOAL_MS:.0f} ms: "
              f"{'met' if loop * 1000 <= args.loop * GOAL_MS else 'not met'})")
        print(f"\n`gpuq status` under -X importtime: {import_s * 1000:.0f} ms importing; heavy modules imported: "
              f"{', '.join(heavy) or 'none'} (of {', '.join(HEAVY)}; goal: none)")
        print("  costliest top-level imports: " + ", ".join(f"{n} {s * 1000:.0f} ms" for s, n in costliest))
        print(f"(waited {waited:.1f} s in all for the queue to empty between groups)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
