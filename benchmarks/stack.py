"""What the benchmarks and scripts/gpu_check.py, which start a stack of their own, share: a free
port and whether a real GPU is here to start it with, a stack of simulated GPUs in a temporary
home (``BenchStack``), and taking it down without a trace."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the stack's Redis)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def has_gpu() -> bool:
    """Whether nvidia-smi lists a GPU here (else the stack runs on simulated GPUs)."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def stop_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, a killed CI step) unwind like Ctrl-C, so the benchmark's ``finally``
    takes its stack down: by default Python dies at once and a detached stack outlives it, holding
    a GPU, a port and, as root, the machine's socket (seen on a lent GPU machine)."""
    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def tear_down(stack: Any, settings: Any, socket: str, tmp: Path) -> None:
    """Stop ``stack`` (tests/conftest.Stack, or None if it never came up), close the database's
    connections, delete the stack's Redis keys and Celery bindings (nothing for the next run to
    find), and remove its socket and temporary directory."""
    import redis

    from gpuq.service import db

    if stack is not None:
        stack.stop()
    db.dispose_engines()
    prefix = settings.key_prefix
    try:
        r = redis.Redis.from_url(settings.broker_url)
        for pattern in (f"{prefix}*", f"_kombu.binding*.{prefix}.*"):
            for key in r.scan_iter(pattern):
                r.delete(key)
    except redis.RedisError as exc:
        print(f"could not delete the Redis keys under {prefix}: {exc}", file=sys.stderr)
    Path(socket).unlink(missing_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)


class BenchStack:
    """A benchmark's own stack, as ``with BenchStack("sharing", fake_gpus=2) as bench:``: settings
    with a temporary home, SQLite there unless ``database_url`` names another database (its schema
    made on entry), a server socket in /tmp, the local Redis at BENCH_REDIS (default
    redis://127.0.0.1:6379/12) under a key prefix of its own, and simulated GPUs (``overrides``:
    more settings). ``start()`` starts the server, the scheduler and the workers (tests/conftest's
    ``start_stack``); the exit takes down whatever was started (``tear_down``)."""

    def __init__(self, name: str, database_url: str | None = None, **overrides: Any) -> None:
        from gpuq.service.settings import Settings

        self.tmp = Path(tempfile.mkdtemp(prefix=f"gpuq-{name}-"))
        tag = uuid.uuid4().hex[:8]
        # A socket path must fit in 108 bytes: a short one in /tmp, whatever TMPDIR is.
        self.socket = f"/tmp/gpuqb-{tag}.sock"
        values: dict[str, Any] = dict(
            home=self.tmp / "home", database_url=database_url or f"sqlite:///{self.tmp / 'gpuq.db'}",
            broker_url=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/12"), socket=self.socket,
            key_prefix=f"bench-{name}-{tag}", node="benchnode", warm_start=False,
            fake_gpu_memory_dir=str(self.tmp / "simulated-gpu-memory"))
        self.settings = Settings(**{**values, **overrides})
        self.stack: Any = None

    def __enter__(self) -> BenchStack:
        from gpuq.service import db

        try:
            db.upgrade(self.settings)
        except BaseException:
            tear_down(None, self.settings, self.socket, self.tmp)
            raise
        return self

    def start(self) -> Any:
        """Start the stack's processes; tests/conftest.Stack."""
        from tests.conftest import start_stack

        self.stack = start_stack(self.settings, self.tmp / "logs")
        return self.stack

    def __exit__(self, *exc: object) -> None:
        tear_down(self.stack, self.settings, self.socket, self.tmp)
