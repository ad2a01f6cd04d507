"""A memory cgroup per command job: its memory limit, whether the OOM killer struck, and every
process it left, even ones that double-forked out of its session; and its CPU quota (`--cpus`).

Made under the worker's own memory cgroup (cgroup v1's memory controller, or v2 where the parent
delegates memory); where neither can be written (not root, a read-only /sys/fs/cgroup), jobs run
without one and the worker falls back to the process tree, group and session. The CPU quota is
cgroup v1's cpu controller (a directory of the same name in its own hierarchy, under the worker's
own) or v2's cpu.max where the parent delegates cpu; where neither is there, a job's --cpus is
not held (its output says so). The cores a job is bound to (workers/core_binding.py) are its
cpuset's as well where the worker may make one (v1's cpuset controller, v2's where the parent
delegates cpuset), as SLURM's ConstrainCores does: the kernel then keeps every process of the job
on them, even one that widens its own affinity again (``taskset``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from gpuq.service.core_sets import format_list

log = logging.getLogger("gpuq.worker")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A CPU quota's period, microseconds (the kernel's default): a job of --cpus 2 may run 200 ms of
# CPU time in each 100 ms, over however many cores.
CPU_PERIOD_US = 100_000


class JobCgroup:
    """One job's cgroup directory and the files gpuq uses in it; ``cpus``, the cores its CPU quota
    holds it to (None: none), and on cgroup v1 the quota's own directory (``cpu_path``); ``cores``,
    the CPU cores its cpuset holds it to (empty: none), and on v1 the cpuset's own directory."""

    def __init__(self, path: Path, v2: bool, cpu_path: Path | None = None) -> None:
        self.path, self.v2 = path, v2
        self._procs = str(path / "cgroup.procs")
        self.cpu_path = cpu_path
        self.cpus: float | None = None
        self.cpuset_path: Path | None = None
        self.cores: tuple[int, ...] = ()

    @classmethod
    def create(cls, name: str, limit_mib: int | None, cpus: float | None = None,
               cores: tuple[int, ...] = ()) -> JobCgroup | None:
        """A new cgroup ``name`` with ``limit_mib`` of memory (None: no limit), a CPU quota of
        ``cpus`` cores (None: none; where the machine has no CPU quota to give, the cgroup is made
        without one: ``cpus`` stays None) and a cpuset of ``cores`` (empty: none; where the machine
        has no cpuset to give, ``cores`` stays empty); None if this machine does not let the worker
        make one."""
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
        if cpus is not None:
            group._hold_to(name, cpus)
        if cores:
            group._confine_to(name, cores)
        return group

    def _confine_to(self, name: str, cores: tuple[int, ...]) -> None:
        """Keep its processes on ``cores`` (its cpuset); on v1 its parent's memory nodes go with
        them, without which the kernel lets no process in. ``cores`` stays empty where it cannot be."""
        listed = format_list(cores)
        where = self._control(name, "cpuset", {"cpuset.cpus": listed}, lambda parent: {
            "cpuset.mems": (parent / "cpuset.mems").read_text().strip(), "cpuset.cpus": listed})
        if where is not None:
            self.cores = cores
            self.cpuset_path = where if where != self.path else None

    def _hold_to(self, name: str, cpus: float) -> None:
        """Hold it to ``cpus`` cores (its CPU quota); ``cpus`` stays None where it cannot be."""
        quota = max(1000, round(cpus * CPU_PERIOD_US))  # the kernel's least quota: 1 ms
        where = self._control(name, "cpu", {"cpu.max": f"{quota} {CPU_PERIOD_US}"}, lambda parent: {
            "cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": str(quota)})
        if where is not None:
            self.cpus = cpus
            self.cpu_path = where if where != self.path else None

    def _control(self, name: str, controller: str, v2_files: dict[str, str],
                 v1_files: Callable[[Path], dict[str, str]]) -> Path | None:
        """Write ``controller``'s files: on v2 ``v2_files`` in its own directory, where the parent
        delegates the controller; on v1 ``v1_files`` (given the worker's own directory there) in
        a directory ``name`` of the controller's hierarchy. The directory written, None where
        neither could be (the job runs without that controller's hold)."""
        if self.v2:
            try:
                if controller not in (self.path.parent / "cgroup.subtree_control").read_text().split():
                    return None
                for file, value in v2_files.items():
                    (self.path / file).write_text(value)
                return self.path
            except OSError as exc:
                log.info("no %s cgroup for jobs here (%s)", controller, exc)
                return None
        parent = _own_v1(_own_lines(), controller)
        if parent is None:
            return None
        path = parent / name
        try:
            path.mkdir()
            for file, value in v1_files(parent).items():
                (path / file).write_text(value)
        except OSError as exc:
            log.info("no %s cgroup for jobs here (%s)", controller, exc)
            _remove_dir(path)
            return None
        return path

    def throttled(self) -> tuple[int, int] | None:
        """Of the quota's periods its processes ran in, how many they wanted more CPU than it gave
        (the kernel's nr_periods and nr_throttled); None without a quota."""
        if self.cpus is None:
            return None
        try:
            stat = (self.cpu_path or self.path) / "cpu.stat"
            values = dict(line.split() for line in stat.read_text().splitlines() if line.count(" ") == 1)
            return int(values["nr_periods"]), int(values["nr_throttled"])
        except (OSError, KeyError, ValueError):
            return None

    def join(self) -> bool:
        """Put the calling process in this cgroup: called in the job's child between fork and exec,
        so nothing it starts can be outside. Raw system calls only (no locks after a fork). False if
        the kernel refused (cgroup v2 wants write access to the worker's own cgroup as well): the job
        then runs outside it, found by its process tree and GPUQ_RUN_ID instead."""
        joined = _write_raw(self._procs, os.getpid())
        if joined:
            for procs in self._other_procs():  # refused: it runs without its quota or cpuset, nothing worse
                _write_raw(procs, os.getpid())
        return joined

    def _other_procs(self) -> list[str]:
        """The procs files of its directories in other hierarchies (v1's quota and cpuset)."""
        return [str(path / "cgroup.procs") for path in (self.cpu_path, self.cpuset_path) if path is not None]

    def place(self, pid: int) -> bool:
        """Move process ``pid`` into this cgroup (an allocation's processes, which the worker did
        not start); False if the kernel refused or the process is gone."""
        try:
            Path(self._procs).write_text(str(pid))
            for procs in self._other_procs():
                Path(procs).write_text(str(pid))
            return True
        except OSError:
            return False

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self._procs).read_text().split()]
        except OSError:
            return []

    def resident(self) -> int | None:
        """Bytes its processes hold that the kernel cannot drop: anonymous and shared memory (not
        the page cache); None if the kernel does not say."""
        names = ("anon", "shmem") if self.v2 else ("total_rss", "total_shmem")
        try:
            values = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines()
                          if line.count(" ") == 1)
            return sum(int(values[name]) for name in names)
        except (OSError, KeyError, ValueError):
            return None

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
        _remove_dir(self.path, within)
        for path in (self.cpu_path, self.cpuset_path):
            if path is not None:
                _remove_dir(path, within)


def _remove_dir(path: Path, within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                log.warning("could not remove %s: %s", path, exc)
                return
            time.sleep(0.05)


def _write_raw(path: str, pid: int) -> bool:
    """Write ``pid`` to a cgroup's procs file with raw system calls (safe between fork and exec)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, str(pid).encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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
    lines = _own_lines()
    for controller in () if v2 else ("cpu", "cpuset"):
        other = _own_v1(lines, controller)
        for path in other.iterdir() if other is not None else ():
            # The quota's and the cpuset's, on v1: empty with its memory's.
            if path.is_dir() and path.name.startswith(prefix):
                _remove_dir(path)
    return removed


def _own_memory_cgroup() -> tuple[Path, bool] | None:
    """The worker's own memory cgroup directory, and whether it is cgroup v2."""
    lines = _own_lines()
    v1 = _own_v1(lines, "memory")
    if v1 is not None:
        return v1, False
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


def _own_lines() -> list[str]:
    try:
        return Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []


def _own_v1(lines: list[str], controller: str) -> Path | None:
    """cgroup v1: the worker's own directory in ``controller``'s hierarchy, if it may write there."""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            # Mounted under the controller's name, or as cpu,cpuacct with cpu a link to it (systemd's).
            for mount in dict.fromkeys((controller, controllers)):
                where = CGROUP_ROOT / mount / path.lstrip("/")
                if where.is_dir() and os.access(where, os.W_OK):
                    return where
    return None


def _write_if_there(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)
