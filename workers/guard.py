"""The lease guard: a small process beside each worker that kills a command job's process group
once its lease has gone unrenewed past ``GUARD_SHARE`` of its length.

The worker stops its own job when it cannot renew the lease (``c.LEASE_SELF_FENCE`` of it), so
the job is gone before the reaper hands it to another worker. A worker that is stopped whole
(SIGSTOP, a frozen cgroup) stops nothing: its command's processes run on, and the requeued job ran
a second copy beside them. The guard is another process, in a session of its own, so what stops
the worker does not stop it: every renewal moves a group's deadline on (the heartbeat sends it),
and a group whose deadline passes is sent SIGKILL, after the worker's own fence and before the
reaper. The job's end takes its group off the list. A worker that dies closes the guard's input:
the guard kills what it still watches (as the job's parent-death signal would) and exits.

    worker -> guard, one line each:  watch PGID DEADLINE   (time.monotonic(), the system's clock)
                                     forget PGID
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuq.service.leases import Lease

log = logging.getLogger("gpuq.worker")

# Where, in a lease's length since its last renewal, the guard kills: after the worker's own fence
# (0.8: a worker that can act has stopped the job by then), before the lease runs out and the
# reaper may give the job to another worker.
GUARD_SHARE = 0.9


class Guard:
    """The worker's side: the groups under guard, each with its job's lease, and the guard process
    that is told of them. One lock orders it all: a group the task thread took off is never given
    a deadline again by a heartbeat that read the groups before (its pid could be another's by
    then)."""

    def __init__(self, lease_timeout: float) -> None:
        self.lease_timeout = lease_timeout
        self._lock = threading.Lock()
        self._groups: dict[int, Lease] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._failed = False

    def _deadline(self, lease: Lease) -> float:
        return lease.renewed + GUARD_SHARE * self.lease_timeout

    def watch(self, pgid: int, lease: Lease) -> None:
        """Guard the process group of a command just started, of the job holding ``lease``."""
        with self._lock:
            self._groups[pgid] = lease
            self._send(f"watch {pgid} {self._deadline(lease):.3f}\n")

    def forget(self, pgid: int) -> None:
        """The command is over: its group is no longer the job's."""
        with self._lock:
            if self._groups.pop(pgid, None) is not None:
                self._send(f"forget {pgid}\n")

    def renewed(self, leases: list[Lease]) -> None:
        """Move on the deadline of each group whose job's lease was just renewed (one not renewed
        keeps its old deadline, which the guard acts on)."""
        with self._lock:
            for pgid, lease in self._groups.items():
                if any(lease is r for r in leases):
                    self._send(f"watch {pgid} {self._deadline(lease):.3f}\n")

    def _send(self, line: str) -> None:
        """Tell the guard process ``line`` (started at the first); held in the lock."""
        try:
            if self._proc is None or self._proc.poll() is not None:
                # In a session of its own: a stop sent to the worker's group does not reach it.
                self._proc = subprocess.Popen([sys.executable, "-m", "gpuq.workers.guard"], stdin=subprocess.PIPE,
                                              text=True, start_new_session=True, close_fds=True)
            assert self._proc.stdin is not None
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
            self._failed = False
        except (OSError, ValueError) as exc:
            if not self._failed:  # once per outage: the worker's own fence still holds
                log.warning("the lease guard could not be told %r: %s", line.strip(), exc)
            self._failed = True

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    self._proc.kill()


def _kill(pgid: int, why: str) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
        print(f"gpuq lease guard: killed process group {pgid}: {why}", file=sys.stderr, flush=True)
    except ProcessLookupError:
        pass  # it ended meanwhile
    except OSError as exc:
        print(f"gpuq lease guard: could not kill process group {pgid}: {exc}", file=sys.stderr, flush=True)


def main() -> int:
    """The guard process: read lines, kill groups past their deadline, until the worker is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at `gpuq up` is the worker's to act on
    deadlines: dict[int, float] = {}
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        now = time.monotonic()
        for pgid in [p for p, at in deadlines.items() if at <= now]:
            _kill(pgid, "its job's lease went unrenewed (its worker stopped or hung)")
            del deadlines[pgid]
        wait = max(0.0, min(deadlines.values()) - now) if deadlines else None
        ready, _, _ = select.select([stdin], [], [], wait)
        if not ready:
            continue
        data = os.read(stdin, 4096)
        if not data:  # the worker is gone
            for pgid in deadlines:
                _kill(pgid, "its worker is gone")
            return 0
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            words = line.decode("ascii", "replace").split()
            try:
                if words[0] == "watch":
                    deadlines[int(words[1])] = float(words[2])
                elif words[0] == "forget":
                    deadlines.pop(int(words[1]), None)
            except (IndexError, ValueError):
                print(f"gpuq lease guard: a line it cannot read: {line!r}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
