"""SQLite's writers queue on a kernel lock beside the database file (service/writer_lock.py), held
for the whole write transaction, so a waiting writer wakes the moment the last one commits instead
of polling in SQLite's busy handler; readers never take it."""

import fcntl
import os
import subprocess
import sys

from gpuq.service.db import read_scope, write_scope
from gpuq.service.models import Node
from tests.conftest import make_settings, settings_env

HOLD = """
import sys, time
from gpuq.service.db import write_scope
from gpuq.service.models import Node
from gpuq.service.settings import get_settings
with write_scope(get_settings()) as session:
    session.add(Node(name="from-child", drained=False))
    session.flush()
    print("holding", flush=True)
    sys.stdin.readline()
"""


def _taken(path: str) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_sqlite_write_transaction_holds_the_writers_lock_until_it_commits_and_readers_take_none(tmp_path, redis_url):
    from gpuq.service import db

    s = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url)
    db.upgrade(s)
    lock = str(tmp_path / "gpuq.db") + "-writer"
    with read_scope(s) as session:
        session.execute(Node.__table__.select()).all()
    child = subprocess.Popen([sys.executable, "-c", HOLD], env=settings_env(s), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        assert _taken(lock)
        with read_scope(s) as session:  # WAL: reading goes on beside the writer, and sees none of it yet
            assert session.get(Node, "from-child") is None
        child.stdin.write("\n")
        child.stdin.flush()
        # This writer waits its turn on the lock, then sees what the one before it committed.
        with write_scope(s) as session:
            assert session.get(Node, "from-child") is not None
            assert _taken(lock)
        assert not _taken(lock)
    finally:
        child.kill()
        child.wait(10)


def test_the_servers_reads_answer_while_another_process_holds_the_writers_lock(tmp_path, redis_url):
    """Every read the server serves (status, show, logs, wait, devices, stats, the dashboard's
    metrics) is a read_scope: none queues behind a worker's write."""
    from gpuq.cli.client import Client
    from gpuq.service import db, spec, submitting
    from tests.conftest import serving

    s = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url)
    db.upgrade(s)
    job = submitting.submit(s, spec.command_spec(["true"], cwd=str(tmp_path)))
    with serving(s) as served:
        child = subprocess.Popen([sys.executable, "-c", HOLD], env=settings_env(s), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "holding"
            assert _taken(str(tmp_path / "gpuq.db") + "-writer")
            client = Client(str(served.socket), timeout=10)
            assert [j["id"] for j in client.get("/jobs")["jobs"]] == [job.id]
            assert client.get(f"/jobs/{job.id}")["state"] == "pending"
            assert client.get(f"/jobs/{job.id}/output")["chunks"] == []
            assert client.get("/jobs/states", ids=str(job.id))
            assert client.get(f"/jobs/{job.id}/why")["state"] == "pending"
            for path in ("/jobs/active", "/devices", "/stats", "/metrics", "/whoami"):
                client.get(path)
        finally:
            child.kill()
            child.wait(10)
