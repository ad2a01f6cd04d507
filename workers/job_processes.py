"""A job's processes: finding every one of them (its tree, its process group and session, its
cgroup, its GPUQ_RUN_ID), stopping them all at its end or its cancel, and a restarted worker's
kill of what its predecessor's jobs left.

A command's main process is the worker's child and its process group's leader: its pid is the
group's id. Signals go to the group only while that process is not reaped (its caller reaps it,
after ``stop_tree``), since a free number may become another group's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import psutil

from gpuq.service.process_end import alive, wait_ended
from gpuq.service.settings import Settings, mask_url
from gpuq.workers.cgroup import JobCgroup


def worker_mark(settings: Settings, worker: str) -> str:
    """What every process of a worker's jobs carries in GPUQ_WORKER, so a restarted worker finds its
    predecessor's leftovers and nobody else's: the worker's name, its installation's key prefix, and
    its queue's database (a digest of its URL, password masked). Two stacks on one machine (root's
    and a user's own, both prefix "gpuq" on the node's name) share the first two: a worker of one
    that restarted killed the other's jobs."""
    queue = hashlib.sha256(mask_url(settings.database).encode()).hexdigest()[:12]
    return f"{settings.key_prefix}/{queue}/{worker}"


def cgroup_prefix(settings: Settings, worker: str) -> str:
    """How the names of a worker's job cgroups begin: its name, readable, and a digest of its mark
    (``worker_mark``), so that a restarted worker removes the cgroups its killed predecessor left
    (``cgroup.remove_leftovers``) and never another stack's worker's of the same name."""
    digest = hashlib.sha256(worker_mark(settings, worker).encode()).hexdigest()[:8]
    return f"gpuq-{worker.replace('@', '-')}-{digest}-"


def kill_leftovers(worker: str) -> list[int]:
    """Kill what the jobs of an earlier run of worker ``worker`` left (it was SIGKILLed; its jobs'
    main processes died with it, their children may not have). Called when a worker starts."""
    killed = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("GPUQ_WORKER") == worker:
                p.kill()
                killed.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return killed


# The commands running now, by their main process's pid, each with the finder of its processes: a
# shared job's share watch (workers/shared.py) counts the GPU memory of every process of the job,
# not only its tree, or a process that left the tree (a double fork, setsid) held memory unseen.
_running: dict[int, Finder] = {}
_running_lock = threading.Lock()


@contextlib.contextmanager
def registered(found: Finder) -> Iterator[None]:
    with _running_lock:
        _running[found.pid] = found
    try:
        yield
    finally:
        with _running_lock:
            _running.pop(found.pid, None)


def is_process_of(main: int, pid: int) -> bool | None:
    """Whether process ``pid`` is one of the command's whose main process is ``main`` (one
    ``run_command`` runs), by the marks its stop finds them by (tree, process group, session,
    cgroup, GPUQ_RUN_ID); None when no command of this worker runs with that main process."""
    with _running_lock:
        finder = _running.get(main)
    return finder.owns(pid) if finder is not None else None


def descendants(root: int) -> list[int] | None:
    """The pids below ``root``, from Linux's per-thread children lists: a few small reads instead
    of psutil's scan of every process on the machine. None where the kernel does not offer them."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and its descendants now (none if it is gone), for a look at what they hold.
    Not for stopping them (``Finder``): the kernel's children lists may miss a process forked while
    they are read, which psutil's scan of the table does not."""
    try:
        root = psutil.Process(pid)
        pids = descendants(pid)
        if pids is None:  # no per-thread children lists here: psutil's scan of every process
            return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    procs = [root]
    for child in pids:
        try:
            procs.append(psutil.Process(child))
        except psutil.Error:  # gone since it was listed
            continue
    return procs


class Finder:
    """Finds every live process of one job run. Where its main process is in its cgroup, the
    cgroup's list is the job: every process it starts is born in the cgroup, and none of its user's
    can leave it (moving a process between cgroups takes write access to a cgroup that holds both,
    root's here), as SLURM's proctrack/cgroup counts on. Elsewhere (no cgroup, or the main process
    could not join it) in one pass over the process table: its tree, its process group and
    session (children that left the tree), and whatever carries its GPUQ_RUN_ID (children that
    left all of those). The pass reads every process of the machine (their environment too),
    which on a node of many processes was most of a short command's cost to its worker."""

    def __init__(self, pid: int, cgroup: JobCgroup | None, run_id: str, contained: bool = False) -> None:
        """``contained``: its main process joined ``cgroup`` before its exec (its child said so)."""
        self.pid, self.cgroup, self.run_id = pid, cgroup, run_id
        self.contained = contained and cgroup is not None

    def __call__(self) -> list[psutil.Process]:
        if self.contained:
            return self._in_cgroup()
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.pid)
            found[self.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        in_cgroup = set(self.cgroup.pids()) if self.cgroup is not None else set()
        me = os.getpid()
        for p in psutil.process_iter(["pid"]):
            if p.pid != me and p.pid not in found and (p.pid in in_cgroup or self._ours(p)):
                found[p.pid] = p
        return list(found.values())

    def _in_cgroup(self) -> list[psutil.Process]:
        """Its cgroup's processes: its main process too while it runs (once it ended it left the
        cgroup, and once it is reaped its pid may be another's)."""
        assert self.cgroup is not None
        found = []
        for pid in self.cgroup.pids():
            try:
                found.append(psutil.Process(pid))
            except psutil.Error:  # ended since it was listed
                continue
        return found

    def owns(self, pid: int) -> bool:
        """Whether the live process ``pid`` is one of this run's, by the marks ``__call__`` finds
        them by, looked at for that one process only."""
        if pid == self.pid:
            return True
        if self.contained:
            assert self.cgroup is not None
            return pid in self.cgroup.pids()
        try:
            p = psutil.Process(pid)
            if any(parent.pid == self.pid for parent in p.parents()):
                return True
        except psutil.Error:
            return False
        if self.cgroup is not None and pid in self.cgroup.pids():
            return True
        return pid != os.getpid() and self._ours(p)

    def _ours(self, p: psutil.Process) -> bool:
        try:
            if os.getpgid(p.pid) == self.pid or os.getsid(p.pid) == self.pid:
                return True
            return p.environ().get("GPUQ_RUN_ID") == self.run_id
        except (ProcessLookupError, PermissionError, psutil.Error, OSError):
            return False


def verify_gone(found: Callable[[], list[psutil.Process]], within: float, pgid: int | None,
                cgroup: JobCgroup | None) -> list[int]:
    """Kill whatever of the job is still alive (``found()``, its process group ``pgid``, its
    ``cgroup``) until nothing is, for at most ``within`` seconds; the pids still alive then."""
    if cgroup is not None:
        left = cgroup.kill_all(within)
        if left:
            return left
    deadline = time.monotonic() + within
    while procs := [p for p in found() if alive(p)]:
        if time.monotonic() >= deadline:
            return [p.pid for p in procs]
        signal_all(pgid, procs, signal.SIGKILL)
        wait_ended(procs, 0.2)
    return []


def stop_tree(pid: int | None, grace: float, found: Callable[[], list[psutil.Process]]) -> None:
    """SIGTERM every process of the job (``found()``, and its process group ``pid`` if it has one),
    wait up to ``grace`` seconds, then SIGKILL the rest. The main process ``pid`` (the worker's
    child, the group's leader) is waited for without reaping it: its caller reaps it, and reads its
    status then."""
    procs = [p for p in found() if p.pid != pid]
    if grace > 0:
        signal_all(pid, procs, signal.SIGTERM)
        deadline = time.monotonic() + grace
        procs = wait_ended(procs, grace)
        _wait_until_exited(pid, deadline)
    if procs or (pid is not None and not exited(pid)):
        signal_all(pid, procs, signal.SIGKILL)
        wait_ended(procs, 5)
        _wait_until_exited(pid, time.monotonic() + 5)


def exited(pid: int) -> bool:
    """Whether the worker's child ``pid`` has ended, looked at without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _wait_until_exited(pid: int | None, deadline: float) -> None:
    while pid is not None and not exited(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def signal_each_once(pgid: int, procs: list[psutil.Process], sig: signal.Signals) -> None:
    """``sig`` to the process group ``pgid`` and to those of ``procs`` that left it, so that each
    process gets it once: a signal a job acts on (`--signal`'s checkpoint) must not come twice, as
    ``signal_all``'s, harmless for a stop, would to every process still in the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for p in procs:
        try:
            if os.getpgid(p.pid) != pgid:
                p.send_signal(sig)
        except (OSError, psutil.Error):
            pass


def signal_all(pgid: int | None, procs: list[psutil.Process], sig: signal.Signals) -> None:
    """``sig`` to the process group ``pgid`` (while its leader holds the number: see the module's
    note) and to each of ``procs`` (psutil checks each is still the process it found)."""
    if pgid is not None:  # never 0: that would be the worker's own group
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
