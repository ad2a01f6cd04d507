"""When a process has ended, for whoever stops processes it did not start or cannot reap: a
job's (workers/job_processes.py) and a dead supervisor's children (service/stack.py)."""

from __future__ import annotations

import time

import psutil


def alive(p: psutil.Process) -> bool:
    """Whether ``p`` still runs: a zombie has ended (it holds nothing but its pid)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_ended(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``procs`` to end; those still alive then.

    Processes that are not the caller's children are reaped by init once orphaned, which may be
    late (here, a VM's init reaped them 0.7 s later; a container's PID 1 that is not an init, never),
    and psutil.wait_procs waits for the pid to be gone: every cancel, requeue and preemption waited
    that long, or the whole grace."""
    deadline = time.monotonic() + timeout
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [p for p in left if alive(p)]
    return left
