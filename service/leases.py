"""Leases: how gpuq knows a running job's worker is still there.

A worker that starts a job (a claim of its dispatched message, or a take from its GPU's next-up
list) gets a lease of ``lease_timeout`` seconds and a token; its heartbeat renews the lease every
interval (``renew``). A worker that cannot renew for most of the lease's length stops the job
itself (``Lease.overdue``: fencing), so the job is gone before the reaper gives it to another
worker. The reaper (``reap``, in the scheduler's whole passes) fails or requeues running jobs whose
lease ran out, and puts back dispatched jobs whose worker went silent before claiming them.
Only the holder of a lease's token may end its job (``lifecycle.end_attempt``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import bindparam, exists, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import lifecycle
from gpuq.service.constants import State
from gpuq.service.db import rows_changed
from gpuq.service.inventory import live_cutoff
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Allocation, Gpu, Job, table, utcnow
from gpuq.service.prepared import Prepared
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.scheduler")
_JOBS = table(Job)
_ID = _JOBS.c.id == bindparam("job_id")
# What the worker that starts a job reads of its row: a claim's RETURNING, or a take's.
STARTED_COLUMNS = (_JOBS.c.id, _JOBS.c.name, _JOBS.c.kind, _JOBS.c.workload, _JOBS.c.params, _JOBS.c.argv,
                   _JOBS.c.cwd, _JOBS.c.env, _JOBS.c.gpus, _JOBS.c.started_at, _JOBS.c.time_limit_s,
                   _JOBS.c.host_mem_mib, _JOBS.c.user, _JOBS.c.attempts, _JOBS.c.shared, _JOBS.c.mem_mib,
                   _JOBS.c.gpu_share, _JOBS.c.array_id, _JOBS.c.array_index, _JOBS.c.output_file,
                   _JOBS.c.error_file, _JOBS.c.signal, _JOBS.c.cpus, _JOBS.c.stdin)
_FIRST_GPU_HERE = exists().where(Allocation.job_id == bindparam("job_id"), Allocation.gpu_id == bindparam("gpu_id"),
                                 Allocation.rank == 0)
# The claim returns the row it started: no second read on the way to a job's start.
_CLAIM = Prepared(move("claim a dispatched job", Actor.WORKER, State.DISPATCHED, State.RUNNING, _ID, _FIRST_GPU_HERE,
                       started_at=bindparam("now"), worker=bindparam("worker"), lease_token=bindparam("token"),
                       lease_expires_at=bindparam("expires")).returning(*STARTED_COLUMNS))
_RENEW = move("renew a lease", Actor.WORKER, State.RUNNING, None, _ID, _JOBS.c.lease_token == bindparam("token"),
              lease_expires_at=bindparam("expires"))
_EXPIRED = select(Job.id, Job.worker, Job.lease_expires_at).where(Job.state == State.RUNNING,
                                                                  Job.lease_expires_at < bindparam("now"))
# Dispatched jobs whose first GPU's worker stopped heart-beating before it claimed them.
_STRANDED = (select(Job.id, Gpu.worker).join(Allocation, Allocation.job_id == Job.id)
             .join(Gpu, Gpu.id == Allocation.gpu_id)
             .where(Allocation.rank == 0, Job.state == State.DISPATCHED,
                    (Gpu.heartbeat_at < bindparam("cutoff")) | Gpu.heartbeat_at.is_(None)))
_DISPATCHED = (select(Job.id, Gpu.queue).join(Allocation, Allocation.job_id == Job.id)
               .join(Gpu, Gpu.id == Allocation.gpu_id).where(Allocation.rank == 0, Job.state == State.DISPATCHED))


@dataclass
class Lease:
    """A running job's lease as its worker holds it.

    ``job_id`` and ``token`` never change; ``renewed`` is written by the worker's heartbeat thread
    (after its creation by the task thread), and ``lost`` is set by it and read by the watch thread."""

    job_id: int
    token: str
    # When it was last renewed (time.monotonic()).
    renewed: float = field(default_factory=time.monotonic)
    # Set when it is no longer ours (the job was taken back) or could not be renewed in time.
    lost: threading.Event = field(default_factory=threading.Event)

    def overdue(self, lease_timeout: float) -> bool:
        """Whether it went unrenewed for most of its length: its worker must stop the job now,
        before the reaper gives it to another (c.LEASE_SELF_FENCE of the lease)."""
        return time.monotonic() - self.renewed > c.LEASE_SELF_FENCE * lease_timeout


def claim(session: Session, job_id: int, gpu_id: int, worker: str,
          lease_s: float) -> tuple[Any, str] | None:
    """Mark the job running on this worker, if it is dispatched to this GPU as rank 0, and give it
    a lease of ``lease_s`` seconds. Atomic. Returns (the job's row as ``STARTED_COLUMNS``, its lease
    token), or None if it was not ours."""
    token = uuid.uuid4().hex
    now = utcnow()
    rows = _CLAIM.run(session.connection(), {"job_id": job_id, "gpu_id": gpu_id, "now": now, "worker": worker,
                                             "token": token, "expires": now + timedelta(seconds=lease_s)})
    return (rows[0], token) if rows else None


def renew(session: Session, job_id: int, token: str, lease_s: float) -> bool:
    """Extend the running job's lease; False if this token no longer holds it (the job ended, or
    was reaped and given to someone else): its worker must stop it."""
    expires = utcnow() + timedelta(seconds=lease_s)
    return rows_changed(session.execute(_RENEW, {"job_id": job_id, "token": token, "expires": expires})) == 1


def reap(session: Session, settings: Settings) -> list[int]:
    """Take back what lost workers held.

    A running job whose lease ran out (its worker was SIGKILLed, lost its node or the database)
    is requeued if it asked for retries, else failed "worker lost". A dispatched job whose GPU's
    worker stopped heart-beating waits again: it never started, so this costs it nothing.
    """
    now = utcnow()
    expired = session.execute(_EXPIRED, {"now": now}).all()
    for job_id, worker, expires in expired:
        late = (now - (expires or now)).total_seconds() + settings.lease_timeout
        why = f"worker lost: {worker} did not renew the job's lease for {late:.0f} s"
        if lifecycle.end_attempt(session, job_id, State.FAILED, failure=c.FAILURE_WORKER_LOST, reason=why,
                                 max_requeues=settings.max_requeues, expired_before=now):
            log.warning("job %s: %s", job_id, why)
    stranded = session.execute(_STRANDED, {"cutoff": live_cutoff(settings)}).all()
    for job_id, worker in stranded:
        lifecycle.undispatch(session, job_id)
        log.warning("job %s: worker %s lost before it started the job; waiting again", job_id, worker)
    return [j for j, _, _ in expired] + [j for j, _ in stranded]


def reap_predecessor(session: Session, settings: Settings, worker: str) -> list[int]:
    """End what the earlier run of worker ``worker`` held when it died: a worker that starts under a
    name knows the jobs running under it are no one's (it killed what was left of them,
    ``job_processes.kill_leftovers``). Ended as the reaper ends a lost worker's (requeued if they asked
    for retries), at once rather than when their leases run out: the GPU stood idle, its jobs shown
    running, for up to the lease's 30 s. Ended under the dead run's own lease tokens."""
    ended = []
    for job_id, token in session.execute(_HELD_BY, {"worker": worker}).all():
        why = f"worker lost: {worker} died and was started again"
        if token is not None and lifecycle.end_attempt(session, job_id, State.FAILED, token=token,
                                                       failure=c.FAILURE_WORKER_LOST, reason=why,
                                                       max_requeues=settings.max_requeues):
            log.warning("job %s: %s", job_id, why)
            ended.append(job_id)
    return ended


_HELD_BY = select(Job.id, Job.lease_token).where(Job.worker == bindparam("worker"), Job.state == State.RUNNING)


# The ranks (1 and up) of running jobs whose ranks' meeting point is set: what rank 0 asked other
# workers to run.
_RANKS = (select(Job.id, Allocation.rank, Gpu.queue).join(Allocation, Allocation.job_id == Job.id)
          .join(Gpu, Gpu.id == Allocation.gpu_id)
          .where(Job.state == State.RUNNING, Job.rendezvous.is_not(None), Allocation.rank >= 1))


def ranks_to_send_again(session: Session) -> list[tuple[int, int, str]]:
    """After Redis restarted empty: the rank messages of running multi-GPU jobs, (job id, rank,
    queue) each, which may have been lost with it (rank 0 would wait at the meeting point until
    its timeout). A rank that runs already, or ran, drops the second message (``workers/ranks.py``)."""
    return [(r.id, r.rank, r.queue) for r in session.execute(_RANKS)]


def take_unclaimed(session: Session, settings: Settings, everything: bool = False) -> list[tuple[int, str]]:
    """Dispatched jobs whose message may be lost (Redis restarted empty, a send that vanished):
    those dispatched over ``resend_after`` seconds ago, or all of them; (job id, queue) each.
    They are marked sent again now; a duplicate message is harmless: only one claim can succeed."""
    query = _DISPATCHED
    if not everything:
        query = query.where(Job.dispatched_at < utcnow() - timedelta(seconds=settings.resend_after))
    lost = [(r.id, r.queue) for r in session.execute(query)]
    if lost:
        session.execute(lifecycle.SEND_AGAIN, {"ids": [j for j, _ in lost], "now": utcnow()})
    return lost
