"""Jobs their client keeps: an allocation (`gpuq alloc`) and the job a `gpuq run` follows live only
while their client says it is alive, as SLURM ends a job whose srun or salloc stopped answering
(its InactiveLimit). The client says so every third of the ``alloc_keepalive`` setting; its word
is the job's ``keepalive_at``, which only a kept job has.

One not heard from within the setting (killed, its ssh dropped, its node down) is ended for good
as ``client_lost``: cancelled by the scheduler while it waits, stopped by its worker once it runs
(an allocation's worker, workers/allocation.py; a run's job's watch, workers/watch.py). A job
asked to survive its client is not kept: `gpuq submit`, `gpuq run --detach`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import bindparam, case
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import rows_changed
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Job, table, utcnow
from gpuq.service.settings import Settings

_JOBS = table(Job)
_ID = _JOBS.c.id == bindparam("job_id")
_KEPT = _JOBS.c.keepalive_at.is_not(None)

KEEPALIVE = move("a kept job's client says it is alive", Actor.USER, c.ACTIVE_STATES, None, _ID, _KEPT,
                 keepalive_at=bindparam("now"))
ABANDON = move("cancel a waiting kept job whose client is gone", Actor.SCHEDULER, State.PENDING, State.CANCELLED,
               _KEPT, _JOBS.c.keepalive_at < bindparam("cutoff"), ended_at=bindparam("now"),
               failure=c.FAILURE_CLIENT_LOST,
               reason=case((_JOBS.c.kind == c.KIND_INTERACTIVE, "its client (gpuq alloc) stopped answering while it "
                                                                "waited"),
                           else_="its client (gpuq run) stopped answering while it waited"))


def client_of(kind: str) -> str:
    """The command that keeps a job of ``kind``."""
    return "gpuq alloc" if kind == c.KIND_INTERACTIVE else "gpuq run"


def lapsed(settings: Settings, keepalive_at: datetime | None, now: datetime | None = None) -> bool:
    """Whether a kept job's client, last heard from at ``keepalive_at``, is gone: not heard from
    within ``alloc_keepalive`` (never heard from counts as gone)."""
    if keepalive_at is None:
        return True
    return ((now or utcnow()) - keepalive_at).total_seconds() > settings.alloc_keepalive


def lost_reason(settings: Settings, kind: str) -> str:
    """A running kept job's reason once its client is gone and it was stopped."""
    return (f"its client ({client_of(kind)}) was not heard from for {settings.alloc_keepalive:g} s "
            "(GPUQ_ALLOC_KEEPALIVE); everything it started was stopped")


def abandon_waiting(session: Session, settings: Settings, now: datetime) -> int:
    """Cancel the waiting kept jobs whose client has not been heard from within alloc_keepalive
    (the scheduler's pass); how many."""
    cutoff = now - timedelta(seconds=settings.alloc_keepalive)
    return rows_changed(session.execute(ABANDON, {"cutoff": cutoff, "now": now}))
