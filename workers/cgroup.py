"""A memory cgroup per command job: its memory limit, whether the OOM killer struck, and every
process it left, even ones that double-forked out of its session.

Made under the worker's own memory cgroup (cgroup v1's memory controller, or v2 where the parent
delegates memory); where neither can be written (not root, a read-only /sys/fs/cgroup), jobs run
without one and the worker falls back to the process tree, group and session.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("gpuq.worker")

CGROUP_ROOT = Path("/sys/fs/cgroup")


class JobCgroup:
    """One job's cgroup directory and the files gpuq uses in it."""

    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2
        self._procs = str(path / "cgroup.procs")

    @classmethod
    def create(cls, name: str, limit_mib: int | None) -> JobCgroup | None:
        """A new cgroup ``name`` with ``limit_mib`` of memory (None: no limit); None if this
        machine does not let the worker make one."""
        parent = _own_memory_cgroup()
        if parent is None:
            return None
        path, v2 = parent
        group = cls(path / name, v2)
        try:
            group.path.mkdir()
            if limit_mib is not None:
                limit = str(limit_mib * 2**20)
                if v2:
                    (group.path / "memory.max").write_text(limit)
                    _write_if_there(group.path / "memory.swap.max", "0")
                else:
                    (group.path / "memory.limit_in_bytes").write_text(limit)
                    # Without this the job would swap past its limit instead of being stopped.
                    _write_if_there(group.path / "memory.memsw.limit_in_bytes", limit)
        except OSError as exc:
            log.info("no memory cgroup for jobs here (%s); using the process tree", exc)
            group.remove()
            return None
        return group

    def join(self) -> bool:
        """Put the calling process in this cgroup: called in the job's child between fork and exec,
        so nothing it starts can be outside. Raw system calls only (no locks after a fork). False if
        the kernel refused (cgroup v2 wants write access to the worker's own cgroup as well): the job
        then runs outside it, found by its process tree and GPUQ_RUN_ID instead."""
        try:
            fd = os.open(self._procs, os.O_WRONLY)
        except OSError:
            return False
        try:
            os.write(fd, str(os.getpid()).encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def place(self, pid: int) -> bool:
        """Move process ``pid`` into this cgroup (an allocation's processes, which the worker did
        not start); False if the kernel refused or the process is gone."""
        try:
            Path(self._procs).write_text(str(pid))
            return True
        except OSError:
            return False

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self._procs).read_text().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        """How many of its processes the OOM killer has killed."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill_all(self, within: float) -> list[int]:
        """SIGKILL every process in it until none is left or ``within`` seconds pass; the pids
        still there then (a process in uninterruptible sleep can outlive SIGKILL a while)."""
        deadline = time.monotonic() + within
        while True:
            pids = self.pids()
            if not pids or time.monotonic() >= deadline:
                return pids
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.05)

    def remove(self, within: float = 2.0) -> None:
        """Remove it; a process that was just killed may take a moment to leave (EBUSY till then)."""
        deadline = time.monotonic() + within
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    log.warning("could not remove %s: %s", self.path, exc)
                    return
                time.sleep(0.05)


def remove_leftovers(prefix: str) -> list[str]:
    """Remove the cgroups under the worker's own whose names start with ``prefix`` (``job_processes.
    cgroup_prefix``: this worker's, of this installation and queue): what an earlier run of it,
    killed mid-job, could not remove. Their processes were killed first (``kill_leftovers``); one
    still holding a process stays. The names removed."""
    own = _own_memory_cgroup()
    if own is None:
        return []
    parent, v2 = own
    removed = []
    for path in parent.iterdir():
        if path.is_dir() and path.name.startswith(prefix):
            JobCgroup(path, v2).remove()
            if not path.exists():
                removed.append(path.name)
    return removed


def _own_memory_cgroup() -> tuple[Path, bool] | None:
    """The worker's own memory cgroup directory, and whether it is cgroup v2."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = CGROUP_ROOT / "memory" / path.lstrip("/")
            if os.access(where, os.W_OK):
                return where, False
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            where = CGROUP_ROOT / path.lstrip("/")
            try:
                delegated = "memory" in (where / "cgroup.subtree_control").read_text().split()
            except OSError:
                return None
            if delegated and os.access(where, os.W_OK):
                return where, True
    return None


def _write_if_there(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)
