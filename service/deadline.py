"""A job's deadline (`--deadline`, sbatch's): it must end by then, or it is not run at all.

A submit (or `gpuq update --deadline`) is refused where the job could never meet it: a deadline
past already, or sooner than its time limit would end from its soonest start (now, or its
--begin). A pending job is cancelled by the scheduler's next pass (its read of the queue:
``queue_read``'s doomed jobs) once it could no longer end by its deadline: now plus its time limit
past it, or without a limit, the deadline come and the job not started. A job that started is left
to run: with a limit it ends by its deadline (give or take the second between two passes); without
one, the deadline only bounded its start, as SLURM's does."""

from __future__ import annotations

from datetime import datetime, timedelta

from gpuq.service.display import time_limit
from gpuq.service.display import utc as when
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import utcnow

# A missed deadline's reason begins so: what `gpuq status`, `show` and a follower's end line say.
MISSED = "deadline: "


def check(deadline: datetime | None, begin: datetime | None, limit_s: int | None, now: datetime | None = None) -> None:
    """InvalidSpec for a deadline the job could never meet (see the module's words)."""
    if deadline is None:
        return
    now = now or utcnow()
    start = max(now, begin) if begin is not None else now
    if deadline <= start:
        raise InvalidSpec(f"--deadline {when(deadline)} is past already" if start == now else
                          f"--deadline {when(deadline)} is not after its --begin {when(start)}")
    if limit_s is not None and start + timedelta(seconds=limit_s) > deadline:
        raise InvalidSpec(f"--deadline {when(deadline)} comes before the job could end: its time limit of "
                          f"{time_limit(limit_s)} from {'now' if start == now else 'its --begin'} ends at "
                          f"{when(start + timedelta(seconds=limit_s))}")


def latest_start(deadline: datetime, limit_s: int | None) -> str:
    """What `gpuq why` adds for a pending job with a deadline: the latest start it allows."""
    latest = deadline - timedelta(seconds=limit_s or 0)
    return (f"it is cancelled unless it starts by {when(latest)} (--deadline {when(deadline)}"
            + (", less its time limit)" if limit_s else ")"))


def missed(deadline: datetime, limit_s: int | None, now: datetime) -> str | None:
    """Why a pending job can no longer meet its deadline (its cancel's reason), or None while it can."""
    if limit_s is None:
        return f"{MISSED}not started by {when(deadline)}" if now >= deadline else None
    if now + timedelta(seconds=limit_s) > deadline:
        return f"{MISSED}its time limit of {time_limit(limit_s)} would end past {when(deadline)}"
    return None
