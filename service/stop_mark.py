"""A stop of a stack under way, marked in its run folder (``run/stopping.json``), so that a second
`gpuq down` (a second admin's, a service manager's beside an admin's) waits for the first rather
than send the supervisor the second request, which interrupts running jobs at once.

The first `gpuq down` claims the mark before its SIGTERM (only one process can: a hard link); the
supervisor marks a stop it was asked for from elsewhere (``kill``, a service manager) at its first
SIGTERM. A mark of a dead supervisor, or of a `gpuq down` that died before its request was had,
counts for nothing."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpuq.service.settings import Settings


def stopping_file(settings: Settings) -> Path:
    """The mark of a stop under way: written by the `gpuq down` that asks the supervisor to stop
    (before its first SIGTERM), or by the supervisor at a stop request from elsewhere (a service
    manager, `kill`), and removed once the stack is down."""
    return settings.run_dir / "stopping.json"


@dataclass(frozen=True)
class Stopping:
    """A stop under way: of supervisor ``supervisor``, since ``since`` (epoch seconds), asked by
    pid ``by`` (a `gpuq down`, or the supervisor itself for a signal from elsewhere); ``taken``
    once the supervisor has had the request."""

    supervisor: int
    since: float
    by: int
    taken: bool = False

    def owned(self) -> bool:
        """Whether a live `gpuq down` times this stop (and interrupts its jobs after its grace)."""
        return self.by != self.supervisor and psutil.pid_exists(self.by) and _not_zombie(self.by)


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_under_way(settings: Settings, supervisor_pid: int) -> Stopping | None:
    """The stop of supervisor ``supervisor_pid`` under way, if one is. A mark of another (dead)
    supervisor's, or one left by a `gpuq down` that died before its request was had, is none."""
    try:
        mark = Stopping(**json.loads(stopping_file(settings).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if mark.supervisor != supervisor_pid or not (mark.taken or mark.owned()):
        return None
    return mark


def write_stop_mark(settings: Settings, mark: Stopping, exclusive: bool) -> bool:
    """Write ``mark`` whole (never half-written to a reader); ``exclusive``: only if no mark is
    there. Whether it was written."""
    path = stopping_file(settings)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(json.dumps(mark.__dict__))
    try:
        if exclusive:
            os.link(part, path)
        else:
            part.replace(path)
        return True
    except FileExistsError:
        return False
    finally:
        part.unlink(missing_ok=True)


def claim_stop(settings: Settings, supervisor_pid: int) -> Stopping | None:
    """Mark a stop of supervisor ``supervisor_pid`` under way, asked by this process: None when
    this process now owns the stop, else the stop already under way (which it must not hasten)."""
    mine = Stopping(supervisor_pid, time.time(), os.getpid())
    for _ in range(5):
        if write_stop_mark(settings, mine, exclusive=True):
            return None
        if (under_way := stop_under_way(settings, supervisor_pid)) is not None:
            return under_way
        stopping_file(settings).unlink(missing_ok=True)  # stale: a dead supervisor's, or a dead request's
    write_stop_mark(settings, mine, exclusive=False)
    return None
