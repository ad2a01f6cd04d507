"""The local stack behind `gpuq up` / `gpuq down`: a supervisor process (service/supervisor.py)
that runs a Redis (when none is configured or reachable), the server, the scheduler, and one worker
per GPU, and restarts any that die.

``gpuq up`` starts the supervisor detached and waits until every worker has registered (or its GPU
was left out); ``gpuq down`` asks it to stop. The supervisor starts its children by module name
(``python -m ...``), so nothing here imports the workers or the CLI.

Run as root, the stack is the machine's and serves every user, from a home made safe to share
(service/system_home.py). Run as anyone else, the stack is that user's own, in their home, closed
to everyone else: its server serves only them (server/app.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
from sqlalchemy import select

from gpuq.migrations.versions import HEAD
from gpuq.service import broker, inventory, simulated_memory, system_home
from gpuq.service.db import current_revision, new_sqlite_file, upgrade, write_scope
from gpuq.service.devices import open_devices
from gpuq.service.dialect import sqlite_file
from gpuq.service.errors import StackError, StateConflict
from gpuq.service.models import Gpu
from gpuq.service.process_end import wait_ended
from gpuq.service.settings import Settings
from gpuq.service.stop_mark import Stopping, claim_stop, stop_under_way, stopping_file, write_stop_mark

# The supervisor's logger's name, which `gpuq up` cuts its last log line at.
SUPERVISOR_LOGGER = "gpuq.stack"


def pid_file(settings: Settings) -> Path:
    return settings.run_dir / "supervisor.pid"


def left_out_file(settings: Settings) -> Path:
    """The GPUs the running supervisor left out, {index: why}: what `gpuq up` reports."""
    return settings.run_dir / "left-out.json"


def left_out(settings: Settings) -> dict[int, str]:
    try:
        return {int(k): v for k, v in json.loads(left_out_file(settings).read_text()).items()}
    except (OSError, ValueError):
        return {}


def running_supervisor(settings: Settings) -> psutil.Process | None:
    """The live supervisor of this home, if any."""
    try:
        pid = int(pid_file(settings).read_text().strip())
        proc = psutil.Process(pid)
        if proc.status() != psutil.STATUS_ZOMBIE and "gpuq.service.supervisor" in " ".join(proc.cmdline()):
            return proc
    except (OSError, ValueError, psutil.Error):
        pass
    return None


@dataclass(frozen=True)
class StackStatus:
    supervisor_pid: int
    workers: int
    log_dir: Path
    managed_redis: bool
    # The broker the stack uses (with the password a root stack generated; mask it to print).
    broker: str = ""
    # The GPUs whose worker could not start, {index: why}: drained until `gpuq resume`.
    left_out: dict[int, str] = field(default_factory=dict)
    # The SQLite file this start made: a queue with no jobs yet (said, so a mistyped path shows).
    new_database: str | None = None
    # The schema revision an existing database was at, where this start upgraded it (said: on a
    # database other nodes share, their older gpuq would meet a schema it does not know).
    upgraded_from: str | None = None
    # This node's GPUs gpuq knew that are no longer here, retired by this start (inventory.retire_missing).
    retired: list[int] = field(default_factory=list)


def up(settings: Settings, timeout: float = 120.0) -> StackStatus:
    """Start the local stack in the background and wait until every worker has registered, or its
    GPU was left out (its worker could not start while another GPU's did).

    As root, the home and its files get the modes that let every user of the machine use the
    stack and none read its state (see the module's docstring), before anything starts."""
    if (sup := running_supervisor(settings)) is not None:
        # Exit 4, as for any request the state refuses: 69 read as "cannot reach the server".
        raise StateConflict(f"gpuq is already up (supervisor pid {sup.pid}); `gpuq down` stops it")
    if orphans := _orphans(settings):
        # Its supervisor was killed (SIGKILL, the OOM killer): its children run on, this stack's,
        # with nothing to restart them. Not taken over here: a worker's running jobs would be
        # killed by an `up`; `gpuq down` stops them as the supervisor would have.
        raise StateConflict(f"gpuq's supervisor (pid {_group(settings) or orphans[0].pid}) died and left this "
                            "stack's server, scheduler and workers running; `gpuq down` stops them, then `gpuq up`")
    if _answers(settings):
        # Another home's stack (or a `gpuq server` run by hand) holds the socket: this stack's
        # server could not listen there, and every `gpuq` command would talk to the other one.
        raise StackError(f"a gpuq server that is not this stack's already answers on {settings.server_socket}: "
                         f"stop it (`gpuq down` with its GPUQ_HOME), or set GPUQ_SOCKET to another path")
    if settings.broker_is_managed and broker.asks_no_password(settings):
        # Someone's Redis without a password on the port (a system one on 6379): taken for the
        # stack's own, it carried every user's job messages where any local user could read and
        # write them, and a user's own stack on the same port joined it and took root's messages.
        # Refused before anything is made (the home, the simulated GPUs' folder).
        raise StackError(f"a Redis that asks no password answers on port {settings.redis_port}: gpuq will not put "
                         "its queue where every local user can read and write it; set GPUQ_REDIS_PORT to a free "
                         "port (gpuq starts its own Redis there, with a password), or GPUQ_BROKER_URL to a Redis "
                         "to use")
    devices = open_devices(settings)
    gpus = devices.list()
    if not gpus:
        raise StackError(f"no GPU on this node ({devices.why_none}); set GPUQ_FAKE_GPUS=N to run on N simulated GPUs")
    if not settings.broker_is_managed:
        broker.check(settings)
    # Root's stack serves every user of the machine; a user's own serves them alone (its server
    # refuses anyone else, and its home and database are closed to them). Each runs a Redis of its
    # own with a generated password; a user's that finds its Redis answering already (with the
    # password in its home) keeps that password.
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
    new_database = sqlite_file(settings.database) if new_sqlite_file(settings) else None
    was = None if new_database else current_revision(settings)
    upgrade(settings)
    upgraded_from = None if new_database or was == HEAD else (was or "none")
    with write_scope(settings) as session:
        retired = inventory.retire_missing(session, settings.node, [g.index for g in gpus])
    system_home.private_database(settings)
    for d in (settings.run_dir, settings.log_dir):
        d.mkdir(parents=True, exist_ok=True)
    started = time.time()
    out = open(settings.log_dir / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gpuq.service.supervisor"], stdin=subprocess.DEVNULL,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    out.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"the stack did not start: {_last_words(settings.log_dir / 'supervisor.log')}")
        gone = left_out(settings)
        up_now = _registered(settings, [g.index for g in gpus], started) - set(gone)
        if up_now and len(up_now) + len(gone) == len(gpus) and _answers(settings):
            return StackStatus(proc.pid, len(up_now), settings.log_dir, starts_redis, settings.broker, gone,
                               new_database, upgraded_from, retired)
        time.sleep(0.2)
    # Nothing half-started is left behind: a stack that did not come up is not "up" either. Stopped
    # by its process, not its pid file, which a supervisor that is still starting may not have yet.
    _stop(settings, psutil.Process(proc.pid), grace=5.0)
    raise StackError(f"workers did not register within {timeout:g} s, so the stack was stopped; see {settings.log_dir} "
                     f"(a slow GPU start: `gpuq up --timeout SECONDS`)")


def _port_taken(settings: Settings) -> bool:
    """Whether something accepts connections on the managed Redis's port."""
    try:
        with socket.create_connection(("127.0.0.1", settings.redis_port), timeout=1.0):
            return True
    except OSError:
        return False


def _registered(settings: Settings, indices: list[int], since: float) -> set[int]:
    """Which of these GPUs' workers registered since ``since``."""
    after = datetime.fromtimestamp(since, UTC)
    try:
        with write_scope(settings) as session:
            return set(session.scalars(select(Gpu.index).where(Gpu.node == settings.node, Gpu.index.in_(indices),
                                                               Gpu.heartbeat_at >= after)))
    except Exception:  # noqa: BLE001 - the database may still be starting
        return set()


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


def tail(path: Path, lines: int = 1) -> str:
    try:
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no log at {path}"
    return " | ".join(text[-lines:]) if text else f"nothing in {path}"


def _last_words(path: Path) -> str:
    """The supervisor log's last line without its time, level and logger: what made it stop."""
    return tail(path).split(f" {SUPERVISOR_LOGGER}: ", 1)[-1]


def down(settings: Settings, grace: float = 30.0, say: Callable[[str], object] = lambda line: None) -> bool:
    """Stop the stack: running jobs get ``grace`` seconds to finish, then are interrupted. A stop
    already under way (another `gpuq down`, a service manager's SIGTERM) is waited for, not
    hastened: ``say`` gets one line that says so.

    Returns False if the stack was not up. Leaves no process of it behind.
    """
    sup = running_supervisor(settings)
    if sup is None:
        orphans = _orphans(settings)
        pid_file(settings).unlink(missing_ok=True)
        stopping_file(settings).unlink(missing_ok=True)
        if not orphans:
            return False
        _stop_orphans(settings, orphans, grace)
        simulated_memory.remove_default_dir(settings)
        return True
    _stop(settings, sup, grace, say)
    simulated_memory.remove_default_dir(settings)  # its jobs are gone: what they held is too
    return True


def _group(settings: Settings) -> int | None:
    """The process group the pid file names: the supervisor's, which its children share."""
    try:
        return int(pid_file(settings).read_text().strip())
    except (OSError, ValueError):
        return None


def _orphans(settings: Settings) -> list[psutil.Process]:
    """What a supervisor that died (SIGKILLed) left running: the processes of its group, which
    carry this home. Without this, `gpuq down` said "was not up" and `gpuq up` refused the server
    still answering on the socket: the stack could be stopped only by pid."""
    group = _group(settings)
    if group is None:
        return []
    found = []
    for p in psutil.process_iter():
        try:
            if (p.pid != os.getpid() and os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE
                    and (p.environ().get("GPUQ_HOME") == str(settings.home) or _its_redis(settings, p))):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _its_redis(settings: Settings, p: psutil.Process) -> bool:
    """The stack's own Redis: its process title (which redis-server writes over its environment,
    so that cannot tell) names the stack's port."""
    return p.name() == "redis-server" and f":{settings.redis_port}" in " ".join(p.cmdline())


def _stop_orphans(settings: Settings, procs: list[psutil.Process], grace: float) -> None:
    """Stop a dead supervisor's children as it would have: SIGTERM (the workers let their jobs
    finish for ``grace`` seconds), SIGTERM again (they interrupt them), then SIGKILL."""
    for wait in (max(grace, STOP_SIGNAL_GAP), settings.kill_grace + 10):
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        procs = wait_ended(procs, wait)  # orphans: init reaps them, perhaps late
        if not procs:
            return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_ended(procs, 5)


# Seconds between `gpuq down`'s two stop requests at least.
STOP_SIGNAL_GAP = 0.5


def _stop(settings: Settings, sup: psutil.Process, grace: float,
          say: Callable[[str], object] = lambda line: None) -> None:
    """Stop supervisor ``sup`` and everything it started (its process group)."""
    pgid = os.getpgid(sup.pid)
    started = time.monotonic()
    under_way = claim_stop(settings, sup.pid)
    if under_way is not None:
        since = datetime.fromtimestamp(under_way.since).strftime("%H:%M:%S")
        say(f"gpuq is already stopping (since {since}, pid {under_way.supervisor}): waiting for it")
        if not _wait_for_stop(settings, sup, started, grace):
            return _end(settings, sup.pid, pgid)
        # Nobody times that stop (its `gpuq down` died, or it came from a signal): this one did,
        # with its own grace from its own start. Its first request was had: the next interrupts.
        _interrupt(settings, sup, pgid)
        return _end(settings, sup.pid, pgid)
    sup.terminate()
    try:
        # Two SIGTERMs close together are one (the kernel and Python's handler keep one pending):
        # the second, which interrupts running jobs, waits until the supervisor has taken the first.
        # With --grace 0 they merged, and the stack took kill_grace + 30 s to be killed whole.
        sup.wait(max(grace, STOP_SIGNAL_GAP))
    except psutil.TimeoutExpired:
        _interrupt(settings, sup, pgid)
    _end(settings, sup.pid, pgid)


def _wait_for_stop(settings: Settings, sup: psutil.Process, started: float, grace: float) -> bool:
    """Wait for the stop under way of ``sup``, owned by another `gpuq down`, without hastening it:
    False once ``sup`` has exited; True when no live `gpuq down` owns it any more (this one then
    takes it over, having marked it its own) and this one's grace has passed. StackError after
    what this one's own stop would have taken at most."""
    end = started + max(grace, STOP_SIGNAL_GAP) + settings.kill_grace + 35
    while True:
        try:
            sup.wait(0.2)
            return False
        except psutil.TimeoutExpired:
            pass
        now = time.monotonic()
        mark = stop_under_way(settings, sup.pid)
        mine = mark is not None and mark.by == os.getpid()
        if mark is None or mine or not mark.owned():
            if not mine:
                since = mark.since if mark is not None else time.time()
                write_stop_mark(settings, Stopping(sup.pid, since, os.getpid(), taken=True), exclusive=False)
            if now - started >= grace:
                return True
        if now >= end:
            raise StackError(f"gpuq is still stopping after {now - started:.0f} s (supervisor pid {sup.pid}): "
                             f"the stop another `gpuq down` asked for has not ended; see {settings.log_dir}")


def _interrupt(settings: Settings, sup: psutil.Process, pgid: int) -> None:
    """The second stop request, which interrupts running jobs; the group is killed if the
    supervisor outlives what that takes."""
    try:
        sup.terminate()
        sup.wait(settings.kill_grace + 30)
    except psutil.NoSuchProcess:
        pass  # it has just exited
    except psutil.TimeoutExpired:
        _kill_group(pgid)


def _end(settings: Settings, supervisor_pid: int, pgid: int) -> None:
    """Once supervisor ``supervisor_pid`` is down: kill what outlived it, and remove its pid file and
    stop mark (not those of a stack started again meanwhile)."""
    _kill_group(pgid)  # anything that outlived the supervisor
    for path in (pid_file(settings), stopping_file(settings)):
        try:
            text = path.read_text()
            named = int(text) if path == pid_file(settings) else json.loads(text)["supervisor"]
        except (OSError, ValueError, TypeError, KeyError):
            named = supervisor_pid  # unreadable: nobody's
        if named == supervisor_pid:
            path.unlink(missing_ok=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
