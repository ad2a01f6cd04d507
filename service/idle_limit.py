"""The idle limit (``GPUQ_IDLE_LIMIT``): a running job whose GPUs sat mostly idle for that long is
cancelled, so GPUs held by an allocation or a notebook left open overnight go back to the queue.

Idle is what `gpuq status` flags after ``GPUQ_IDLE_WINDOW`` (``usage.idle_jobs``: IDLE_SHARE of
the sampled time under IDLE_UTILIZATION), judged over the whole limit: a job younger than the limit,
or one whose GPUs were sampled for less than half of it, is never cancelled for it. The cancel is
the one `gpuq cancel` makes (its worker stops the job, TERM then KILL after GPUQ_KILL_GRACE), its
reason beginning "cancelled by", so every reader of a cancel reads it as one; it is never retried.
The jobs of the users in ``GPUQ_IDLE_LIMIT_EXEMPT`` are left running (the flag still shows them
idle). The scheduler asks this every ``check_every`` seconds, beside its passes (``Scheduler._end_idle``)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select

from gpuq.service import constants as c
from gpuq.service import lifecycle, usage
from gpuq.service.db import read_scope, rows_changed, write_scope
from gpuq.service.display import time_limit
from gpuq.service.models import Job, utcnow
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.idle_limit")


def reason(limit_s: int) -> str:
    """A job cancelled for the idle limit: why, in the words of `gpuq status`'s idle flag."""
    return (f"{lifecycle.CANCELLED_BY}the idle limit: its GPUs were mostly under {c.IDLE_UTILIZATION}% "
            f"for {time_limit(limit_s)} (GPUQ_IDLE_LIMIT)")


def check_every(limit_s: int) -> float:
    """Seconds between two looks: a tenth of the limit, at most IDLE_LIMIT_CHECK_EVERY and at least
    one, so a job is cancelled within a tenth of its limit past it and a look costs little."""
    return max(1.0, min(c.IDLE_LIMIT_CHECK_EVERY, limit_s / 10))


def end_idle_jobs(settings: Settings, now: datetime | None = None) -> list[int]:
    """Ask the worker of each running job idle through the last ``idle_limit`` to cancel it; the ids
    asked, in order. Nothing where no limit is set; a job being stopped already keeps its reason."""
    limit = settings.idle_limit_s
    if not limit:
        return []
    now = now or utcnow()
    asked = {"now": now, "reason": reason(limit), "since": now - timedelta(seconds=limit)}
    ended = []
    # Read first, outside the write: summing hours of samples must not hold SQLite's write lock.
    with read_scope(settings) as session:
        idle = sorted(usage.idle_jobs(session, settings, now, window=limit))
        exempt = settings.idle_exempt_users
        if idle and exempt:
            idle = sorted(session.scalars(select(Job.id).where(Job.id.in_(idle), Job.user.not_in(exempt))))
    if not idle:
        return []
    with write_scope(settings) as session:
        for job_id in idle:
            if rows_changed(session.execute(lifecycle.ASK_TO_END_IDLE, {"job_id": job_id, **asked})):
                ended.append(job_id)
    for job_id in ended:
        log.info("job %s: its GPUs were idle for the idle limit (%s s); cancelling it", job_id, limit)
    return ended
