"""Fair share: each user's recent GPU-hours, decayed, which the policy (service/policy.py,
``order_key``) puts users in order by: who used less lately goes first at equal priority; and
each user's standing in it, as `gpuq share` shows it (``standings``, SLURM's sshare)."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from gpuq.service.constants import ACTIVE_STATES, State
from gpuq.service.models import EarlierAttempt, Job, utcnow
from gpuq.service.settings import Settings

# What a job is charged per hour it runs: its GPUs, each times its share of the GPU's memory for a
# shared job (``jobs.gpu_share``, written at dispatch), whole for any other.
_CHARGED = Job.gpus * func.coalesce(Job.gpu_share, 1.0)


def _factor(settings: Settings, column: Any, preemptible: Any) -> Any:
    """``column`` (what a job or attempt is charged an hour) as fair share counts it: a preemptible
    job's times GPUQ_PREEMPTIBLE_CHARGE. The GPU-hours `gpuq stats` reports are the GPUs' own."""
    if settings.preemptible_charge == 1.0:
        return column
    return column * case((preemptible == True, settings.preemptible_charge), else_=1.0)  # noqa: E712


class FairShare:
    """Each user's recent GPU-hours, a GPU-hour ``h`` half-lives ago counting 2**-h, kept pass
    after pass without reading the whole job history each time.

    A job that ran from ``start`` to ``end`` adds ``gpus * (e**(r*end) - e**(r*start)) / r`` to its
    user's sum, measured from an anchor; scaled by ``e**(-r*now)`` that is the integral of the decay
    over its run, in closed form. Jobs that ended are folded into the sums once; each pass reads
    only the running jobs and those that ended in the last few seconds (their end may still be
    committing: SETTLE seconds).
    """

    SETTLE = timedelta(seconds=2)

    def __init__(self, settings: Settings) -> None:
        self.rate = math.log(2) / (settings.fairshare_half_life_h * 3600.0)
        self.horizon = timedelta(seconds=10 * settings.fairshare_half_life_h * 3600.0)
        self.charged = _factor(settings, _CHARGED, Job.preemptible)
        # An earlier attempt is charged as its job is now (a pending job's preemptibility may change).
        self.attempt_charged = _factor(settings, EarlierAttempt.charged, Job.preemptible)
        self.anchor: datetime | None = None
        self.folded: dict[str, float] = defaultdict(float)
        # Jobs that ended before this are in ``folded``; later ones are read each pass.
        self.until: datetime | None = None

    def _weight(self, start: datetime, end: datetime) -> float:
        assert self.anchor is not None
        return (math.exp(self.rate * (end - self.anchor).total_seconds())
                - math.exp(self.rate * (start - self.anchor).total_seconds()))

    def _ended(self, session: Session, since: datetime, before: datetime | None = None) -> list[Any]:
        """The jobs, and the earlier attempts of jobs that ran again, that ended in [since, before)."""
        out: list[Any] = []
        attempts = select(EarlierAttempt.user, self.attempt_charged, EarlierAttempt.started_at,
                          EarlierAttempt.ended_at).where(EarlierAttempt.ended_at >= since)
        if self.attempt_charged is not EarlierAttempt.charged:
            attempts = attempts.join(Job, Job.id == EarlierAttempt.job_id)
        for query, ended in ((select(Job.user, self.charged, Job.started_at, Job.ended_at).where(
                                 Job.ended_at >= since, Job.started_at.is_not(None)), Job.ended_at),
                             (attempts, EarlierAttempt.ended_at)):
            out += session.execute(query.where(ended < before) if before is not None else query)
        return out

    def gpu_hours(self, session: Session, now: datetime) -> dict[str, float]:
        """Each user's decayed GPU-hours at ``now``: the policy's order between users."""
        settled = now - self.SETTLE
        if self.anchor is None or self.until is None:
            self.anchor, self.until = now, now - self.horizon
        if settled - self.until >= self.SETTLE:
            for user, gpus, started, ended in self._ended(session, self.until, settled):
                self.folded[user] += gpus * self._weight(started, ended)
            self.until = settled
        decay = math.exp(-self.rate * (now - self.anchor).total_seconds()) / self.rate / 3600.0
        hours = {user: total * decay for user, total in self.folded.items()}
        fresh: list[Any] = list(session.execute(select(Job.user, self.charged, Job.started_at, Job.ended_at)
                                                .where(Job.state == State.RUNNING, Job.started_at.is_not(None))))
        fresh += self._ended(session, self.until)
        for user, gpus, started, ended in fresh:  # started: never null here (the queries ask so)
            hours[user] = hours.get(user, 0.0) + gpus * self._weight(started or now, ended or now) * decay
        return hours


@dataclass(frozen=True)
class Standing:
    """One user's place in the fair share now."""

    user: str
    gpu_hours: float  # recent GPU-hours, decayed: what puts users in order
    # 1: goes first among users at equal priority; users of equal GPU-hours share a place (their
    # jobs then go by submit time).
    order: int
    gpus: float  # GPUs held now, a shared job's counted as it is charged (its share of the GPU)
    running: int  # jobs that hold GPUs (dispatched or running)
    pending: int  # jobs that wait, held ones among them
    gpu_limit: int = 0  # the GPUs their jobs may hold at once (service/gpu_limits.py); 0: no limit


def standings(session: Session, settings: Settings, now: datetime | None = None) -> list[Standing]:
    """Every user with recent GPU-hours or a job in the queue, first in the order first."""
    now = now or utcnow()
    hours = FairShare(settings).gpu_hours(session, now)
    held: dict[str, float] = defaultdict(float)
    running: dict[str, int] = defaultdict(int)
    pending: dict[str, int] = defaultdict(int)
    for user, state, count, charged in session.execute(
            select(Job.user, Job.state, func.count(), func.sum(_CHARGED))
            .where(Job.state.in_(ACTIVE_STATES)).group_by(Job.user, Job.state)):
        if state == State.PENDING:
            pending[user] += count
        else:
            running[user] += count
            held[user] += charged or 0.0
    users = sorted(set(hours) | set(running) | set(pending), key=lambda u: (hours.get(u, 0.0), u))
    ranked = [hours.get(u, 0.0) for u in users]
    return [Standing(user=u, gpu_hours=ranked[i], order=bisect.bisect_left(ranked, ranked[i]) + 1, gpus=held[u],
                     running=running[u], pending=pending[u], gpu_limit=settings.gpu_limit_of(u))
            for i, u in enumerate(users)]
