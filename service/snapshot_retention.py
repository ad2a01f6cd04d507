"""Snapshots past their retention: a job's copy of its work tree (`gpuq submit --snapshot`) is
removed ``GPUQ_SNAPSHOT_RETENTION_DAYS`` after the last job that runs from it ended (a resubmit
reuses its job's copy), and the copies a submit left half-made when it died go after a day.

The scheduler runs ``prune`` once an hour in a thread of its own (removing a large tree takes
seconds that no scheduling pass should wait for). A copy is first marked removed in its jobs'
rows, in a statement that finds no job of it still to run, and only then deleted: a resubmit
that commits meanwhile sees the mark and is refused rather than queue a job whose directory is
about to go.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import exists, func, select, update
from sqlalchemy.orm import aliased

from gpuq.service import constants as c
from gpuq.service.db import rows_changed, write_scope
from gpuq.service.models import Job, table
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.snapshots")

# A `.incoming-*` copy older than this belongs to a submit that died mid-copy (a copy is given at
# most the server's 600 s); none of them is any job's.
INCOMING_MAX_AGE_S = 86400.0
INCOMING_PREFIX = ".incoming-"


@dataclass
class Pruned:
    """What one ``prune`` removed: the snapshots (paths), the half-made copies, and the bytes freed."""

    removed: list[str] = field(default_factory=list)
    incoming: int = 0
    freed_bytes: int = 0


def prune(settings: Settings, now: datetime) -> Pruned:
    """Remove the snapshots whose jobs all ended more than the retention ago (none with a
    retention of 0) and the half-made copies older than a day, under ``settings.snapshots``."""
    done = Pruned()
    root = settings.snapshots
    # Where this process does not see the snapshot directory (a scheduler on another node or in
    # a container without that storage), the copies are not its to judge gone: nothing is marked.
    if settings.snapshot_retention_days > 0 and root.is_dir():
        for path in _expire(settings, now, now - timedelta(days=settings.snapshot_retention_days)):
            target = _inside(root, path)
            if target is None:
                log.warning("snapshot %s is not a job's directory in %s; left where it is", path, root)
                continue
            freed = _remove(target)
            if freed is not None:
                done.removed.append(path)
                done.freed_bytes += freed
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return done
    cutoff = time.time() - INCOMING_MAX_AGE_S
    for entry in entries:
        if entry.name.startswith(INCOMING_PREFIX) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
            freed = _remove(Path(entry.path))
            if freed is not None:
                done.incoming += 1
                done.freed_bytes += freed
    return done


def _expire(settings: Settings, now: datetime, cutoff: datetime) -> list[str]:
    """Mark removed (at ``now``), in their jobs' rows, the snapshots whose jobs all ended before
    ``cutoff``; their paths. The mark's own statement checks that no job of a snapshot is still to run."""
    jobs = table(Job)
    other = aliased(Job)
    candidates = (select(Job.snapshot).where(Job.snapshot.is_not(None), Job.snapshot_removed_at.is_(None))
                  .group_by(Job.snapshot)
                  .having(func.count().filter(Job.state.not_in(c.END_STATES)) == 0,
                          func.max(Job.ended_at) < cutoff))
    marked: list[str] = []
    with write_scope(settings) as session:
        for path in session.scalars(candidates).all():
            if path is None:
                continue
            still_to_run = exists().where(other.snapshot == path, other.state.not_in(c.END_STATES))
            done = session.execute(update(jobs).where(jobs.c.snapshot == path, jobs.c.snapshot_removed_at.is_(None),
                                                      ~still_to_run).values(snapshot_removed_at=now))
            if rows_changed(done):
                marked.append(path)
    return marked


def _inside(root: Path, path: str) -> Path | None:
    """``path`` if it is a job's snapshot directory right under ``root`` (named by its job id, a real
    directory, not a link); None for anything else, which is never removed."""
    target = Path(path)
    if not target.name.isdigit() or os.path.realpath(target.parent) != os.path.realpath(root):
        return None
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        return None
    return target  # a directory, or gone already (nothing left to remove)


def _remove(target: Path) -> int | None:
    """Remove the tree at ``target`` (links inside are removed, never followed); the bytes it held,
    or None if it could not be removed (logged)."""
    size = 0
    for top, dirs, files in os.walk(target):
        for name in dirs + files:
            try:
                size += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    try:
        shutil.rmtree(target)
    except FileNotFoundError:
        return size
    except OSError as exc:
        log.warning("could not remove snapshot %s: %s", target, exc)
        return None
    return size
