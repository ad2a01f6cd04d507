"""What the fault suite needs: a Redis and a PostgreSQL of its own to restart, and a job that
records every run of itself in a marker file, so a test can count how often it really ran."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

from tests.conftest import free_port, system_redis_server

# The marker job: appends "start PID" when it begins and "end PID" when it ends, and "overlap PID"
# if another run of the same job holds the lock at the same time (two copies at once).
MARKER_JOB = r'''
import fcntl, os, sys, time
marker, seconds = sys.argv[1], float(sys.argv[2])
lock = open(marker + ".lock", "a")
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    clash = False
except OSError:
    clash = True
with open(marker, "a") as f:
    f.write(("overlap" if clash else "start") + f" {os.getpid()}\n")
time.sleep(seconds)
with open(marker, "a") as f:
    f.write(f"end {os.getpid()}\n")
'''


@dataclass
class Runs:
    starts: int
    ends: int
    overlaps: int


def stop_outside_a_transaction(proc: psutil.Process, database: str, tries: int = 100) -> None:
    """SIGSTOP ``proc`` (a gpuq process) at a moment it is inside no transaction. Stopped inside
    one, it holds its locks: on SQLite the whole file, for as long as it stays stopped; on
    PostgreSQL its rows, until the server ends the session (service/db.IDLE_IN_TRANSACTION_S). A
    test of what a stopped worker's peers do would then wait on those locks instead."""
    for _ in range(tries):
        proc.suspend()
        # SIGSTOP takes effect when the kernel next schedules it: probed before that, a loaded
        # machine let it begin a transaction after the probe (a submit then waited on its lock).
        deadline = time.monotonic() + 5
        while proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) and time.monotonic() < deadline:
            time.sleep(0.001)
        if not _in_transaction(proc, database):
            return
        proc.resume()
        time.sleep(0.02)
    raise AssertionError(f"pid {proc.pid} was inside a transaction each of {tries} times it was stopped")


def _in_transaction(proc: psutil.Process, database: str) -> bool:
    import sqlite3

    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from gpuq.service.dialect import is_sqlite_url, sqlite_file

    if is_sqlite_url(database):
        # A writer queues on its writers' lock file (service/writer_lock.py) before it begins: one
        # stopped holding that lock, between it and its BEGIN, held up every writer as well (a
        # submit waited 60 s in CI), and SQLite's own lock below was free.
        import fcntl

        with open(sqlite_file(database) + "-writer", "a+b") as queue:
            try:
                fcntl.flock(queue, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(queue, fcntl.LOCK_UN)
        try:  # a write transaction anywhere holds the write lock: another BEGIN IMMEDIATE waits
            probe = sqlite3.connect(sqlite_file(database), timeout=0.3, isolation_level=None)
            try:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
            finally:
                probe.close()
            return False
        except sqlite3.OperationalError:
            return True
    ports = [c.laddr.port for c in proc.net_connections(kind="tcp")]
    engine = create_engine(database, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY(:ports) "
                                          "AND state <> 'idle'"), {"ports": ports}).scalar())
    finally:
        engine.dispose()


def marker_job(tmp: Path, name: str, seconds: float) -> tuple[list[str], Path]:
    """The argv of a marker job that runs ``seconds``, and its marker file."""
    script = tmp / "marker_job.py"
    if not script.exists():
        # Written once, whole: rewritten in place for each job, it was empty for a moment, and a
        # job whose Python read it then ran nothing and succeeded with no marker (seen in CI).
        partial = tmp / f".marker_job.{os.getpid()}.py"
        partial.write_text(MARKER_JOB)
        partial.replace(script)
    marker = tmp / f"{name}.runs"
    return [sys.executable, str(script), str(marker), str(seconds)], marker


def runs(marker: Path) -> Runs:
    lines = marker.read_text().splitlines() if marker.exists() else []
    return Runs(sum(ln.startswith("start") for ln in lines), sum(ln.startswith("end") for ln in lines),
                sum(ln.startswith("overlap") for ln in lines))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class PrivateRedis:
    """A Redis server of the test's own on a free port, keeping nothing on disk (like the lab's
    default), so it can be restarted empty."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.dir = free_port(), tmp
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([system_redis_server() or "redis-server", "--port", str(self.port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 10, "redis to start")

    def _answers(self) -> bool:
        try:
            return redis.Redis(port=self.port, socket_connect_timeout=0.5).ping()
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart_empty(self) -> None:
        self.stop()
        self.start()


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (initdb as the postgres user) on a free port."""

    BIN = Path("/usr/lib/postgresql")

    def __init__(self, tmp: Path) -> None:
        versions = sorted(self.BIN.iterdir()) if self.BIN.exists() else []
        if not versions or shutil.which("runuser") is None:
            raise RuntimeError("no PostgreSQL server binaries here")
        self.bin = versions[-1] / "bin"
        self.port = free_port()
        # Outside pytest's private tmp tree: the postgres user must be able to reach it.
        self.root = Path(tempfile.mkdtemp(prefix="gpuq-pg-"))
        os.chmod(self.root, 0o755)
        self.data = self.root / "pgdata"
        self.data.mkdir()
        user = pwd.getpwnam("postgres")
        os.chown(self.data, user.pw_uid, user.pw_gid)
        self._as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"])
        self.start()

    def _as_postgres(self, argv: list[str]) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True, capture_output=True, timeout=120)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-l", str(self.data / "log"),
                           "-o", f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1", "start"])

    def stop(self) -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-m", "fast", "stop"])

    def remove(self) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin / "pg_ctl"), "-D", str(self.data),
                        "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)
