"""A command job's host memory as its worker watches it: its peak, for its usage summary (seff's
Memory Utilized, against its --host-mem), and, where no memory cgroup holds it to its --host-mem,
the limit itself (as SLURM's OverMemoryKill does without cgroups).

What counts is what the job's processes hold that the kernel cannot drop. In its memory cgroup:
anonymous and shared memory (v1's total_rss + total_shmem, v2's anon + shmem; a DataLoader's
workers hand their batches over in shared memory), not the page cache of the files it read, which
the kernel takes back before a limit's OOM kill would strike. Without a cgroup: the resident memory
of its processes summed, so pages two of them share count in each and the sum errs high.

It is looked at every LOOK_SECONDS from FIRST_LOOK_SECONDS after the start (without a cgroup, a
look walks the job's process tree from the kernel's children lists and reads each one's memory:
134 µs for a shell and its command here, 387 µs for nine processes, under 0.1% of a core at this
pace): a peak between two looks is missed, as SLURM's sampled MaxRSS misses it, and a job over
before the first look has none.
Not the kernel's own high-water marks: v1's max_usage_in_bytes counts the page cache, and a forked
process's ru_maxrss starts at its worker's size (workers/command.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import psutil

from gpuq.workers.cgroup import JobCgroup

FIRST_LOOK_SECONDS = 0.1
LOOK_SECONDS = 0.5


class HostMemory:
    """The watch over one running command: ``look()`` in its loop, ``peak_mib`` at its end.

    ``cgroup``: its memory cgroup, if it has one. ``found``: every process of the job (a pass over
    the process table, for a limit the worker enforces: a process that left the tree counts too);
    ``tree``: its main process and their descendants (for the peak alone)."""

    def __init__(self, cgroup: JobCgroup | None, found: Callable[[], list[psutil.Process]],
                 tree: Callable[[], list[psutil.Process]], limit_mib: int | None = None) -> None:
        self.cgroup = cgroup
        # The worker enforces a limit only where no cgroup does.
        self.limit = limit_mib * 2**20 if cgroup is None and limit_mib is not None else None
        self.processes = found if self.limit is not None else tree
        self.next_look = time.monotonic() + FIRST_LOOK_SECONDS
        self.peak: int | None = None  # bytes

    def look(self) -> int | None:
        """Look at it if it is time: the MiB it holds where that is past a limit the worker
        enforces (the caller stops it), else None."""
        now = time.monotonic()
        if now < self.next_look:
            return None
        self.next_look = now + LOOK_SECONDS
        held = self._held()
        if held is None:
            return None
        self.peak = held if self.peak is None else max(self.peak, held)
        return held // 2**20 if self.limit is not None and held > self.limit else None

    @property
    def peak_mib(self) -> int | None:
        """The most it was seen to hold, MiB (rounded up); None: never looked at."""
        return None if self.peak is None else math.ceil(self.peak / 2**20)

    def _held(self) -> int | None:
        if self.cgroup is not None:
            held = self.cgroup.resident()
            # Nothing in it: its processes could not join (cgroup v2 without write access to the
            # worker's own), and are counted as processes instead.
            if held is not None and (held or self.cgroup.pids()):
                return held
        held = 0
        for p in self.processes():
            try:
                held += p.memory_info().rss
            except psutil.Error:  # gone since it was found
                pass
        return held

