"""What `/metrics` counts over all of history (the queue-wait and run-time histograms, and the
jobs by state and user), summed once for the jobs long ended.

A Prometheus histogram counts from the start, so a scrape counts every job that ever started: read
whole each time, that grew with the history (737 ms a scrape at 200,000 jobs on SQLite here, every
15 s a scrape). A job that ended no longer changes (an end state is final: service/lifecycle.py),
so the server keeps each histogram's sums over the jobs that ended before a moving line
(``Settled``) and each scrape reads only the jobs past it: those still waiting or running, and
those that ended since. The line trails the clock by ``SETTLE``: a job's end is written with its
worker's clock, in a transaction that may commit a little later, and one whose end lands behind
the line after the line has moved would never be counted (until the server restarts). The jobs by state and
user are kept the same way (``Settled.jobs``): a GROUP BY over every job was 70 ms a scrape at
200,000 jobs on SQLite; and so is each user's CPU time of ended commands (``Settled.cpu``), which a
job's end writes in the same transaction as its end state, and the attempts of jobs that ran again
by cause (``Settled.reruns``, an earlier attempt's row written with its end): all ``Settled._ended``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.dialect import not_for_an_index, seconds_between
from gpuq.service.models import EarlierAttempt, Job, JobUsage

# How far behind the clock the line of settled jobs stays.
SETTLE = timedelta(minutes=10)
# Sets of bounds remembered (the dashboard asks with one each; a caller trying many evicts).
MAX_REMEMBERED = 8


@dataclass
class Sums:
    """A histogram's cumulative counts at its bounds, its count and its sum."""

    counts: list[int]
    count: int = 0
    total: float = 0.0

    def plus(self, other: Sums) -> Sums:
        return Sums([a + b for a, b in zip(self.counts, other.counts, strict=True)], self.count + other.count,
                    self.total + other.total)

    def as_dict(self, bounds: list[float]) -> dict[str, Any]:
        return {"le": bounds, "counts": self.counts, "count": self.count, "sum": self.total}


@dataclass
class _Line:
    upto: datetime  # the jobs that ended before this are in ``sums``
    sums: Sums


@dataclass
class _Kept:
    upto: datetime  # the jobs that ended before this are in ``sums``
    sums: Counter[Any]


@dataclass
class Settled:
    """Each histogram's sums over the jobs that ended before its line, by kind and bounds, and the
    count of those jobs by end state and user and their CPU seconds by user (``kept``, by name; one
    server's memory: a restart sums them again, once)."""

    lines: dict[tuple[str, tuple[float, ...]], _Line] = field(default_factory=dict)
    kept: dict[str, _Kept] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def jobs(self, session: Session, now: datetime) -> dict[tuple[str, str], int]:
        """Every job, counted by (state, user): the settled count brought up to ``now - SETTLE``,
        plus the jobs that ended since and those still active, read afresh."""
        counts = self._ended("jobs", lambda since, before: _by_state_user(session, since, before), now)
        counts.update(_by_state_user(session, active=True))
        return dict(counts)

    def cpu(self, session: Session, now: datetime) -> dict[str, float]:
        """Each user's CPU seconds of every command that ended (a running one's is not known until
        it ends), earlier attempts of jobs that ran again included: the settled sums brought up to
        ``now - SETTLE``, plus those that ended since."""
        return dict(self._ended("cpu", lambda since, before: _cpu_by_user(session, since, before), now))

    def reruns(self, session: Session, now: datetime) -> dict[tuple[str, str], int]:
        """The attempts that ended with their job running again, counted by (user, cause): preempted,
        requeued, or the failure that retried or requeued it (``EarlierAttempt.cause``)."""
        return dict(self._ended("reruns", lambda since, before: _reruns(session, since, before), now))

    def _ended(self, name: str, read: Callable[[datetime | None, datetime | None], Counter[Any]],
               now: datetime) -> Counter[Any]:
        """What ``read(since, before)`` sums over what ended in [since, before) (None: unbounded),
        over all that ever ended: the sums kept as ``name`` brought up to ``now - SETTLE``, plus
        what ended since, read afresh. (``update``, not ``+=``: a Counter's + drops a sum of 0, a
        user whose commands used no CPU.)"""
        upto = now - SETTLE
        with self.lock:
            kept = self.kept.get(name)
            if kept is None:
                kept = self.kept[name] = _Kept(upto, read(None, upto))
            elif upto > kept.upto:  # what ended between the old line and the new
                kept.sums.update(read(kept.upto, upto))
                kept.upto = upto
            sums, since = Counter(kept.sums), kept.upto
        sums.update(read(since, None))
        return sums

    def histogram(self, session: Session, kind: str, bounds: list[float], now: datetime) -> dict[str, Any]:
        """``kind`` ("wait": submit to start of every job that started; "duration": start to end
        of every job that ended) at ``bounds``: the settled sums brought up to ``now - SETTLE``,
        plus the jobs past the line, read afresh."""
        key, upto = (kind, tuple(bounds)), now - SETTLE
        with self.lock:
            line = self.lines.get(key)
            if line is None:
                line = _Line(upto, _sums(session, kind, bounds, Job.ended_at < upto))
                if len(self.lines) >= MAX_REMEMBERED:
                    self.lines.pop(next(iter(self.lines)))
                self.lines[key] = line
            elif upto > line.upto:  # the jobs that ended between the old line and the new
                line.sums = line.sums.plus(_sums(session, kind, bounds,
                                                 Job.ended_at >= line.upto, Job.ended_at < upto))
                line.upto = upto
            settled, since = line.sums, line.upto
        # Past the line: the jobs that ended since, and (for the wait) those still active. Every
        # move to an end state writes ended_at (service/lifecycle.py), so no ended job is in neither.
        fresh = _sums(session, kind, bounds, Job.ended_at >= since)
        if kind == "wait":
            fresh = fresh.plus(_sums(session, kind, bounds, active=True))
        return settled.plus(fresh).as_dict(bounds)


def _sums(session: Session, kind: str, bounds: list[float], *where: Any, active: bool = False) -> Sums:
    """The histogram over the ended jobs ``where`` says (or, with ``active``, the jobs still
    waiting or running that started), summed by the database in one statement."""
    if kind == "wait":
        seconds = seconds_between(Job.started_at, Job.submitted_at, session)
        base = [Job.started_at.is_not(None)]
    else:
        seconds = seconds_between(Job.ended_at, Job.started_at, session)
        base = [Job.started_at.is_not(None), Job.ended_at.is_not(None)]
    # Ended jobs are read down the index on ended_at: SQLite, without statistics, took the queue
    # order's (state first) for the end states, and read every job ever run.
    states = (Job.state.in_(c.ACTIVE_STATES) if active else
              not_for_an_index(Job.state, session).in_(c.END_STATES))
    # Each job's seconds worked out once (MATERIALIZED: inlined, SQLite parsed the timestamps again
    # for every bound), then counted at each bound.
    each = select(seconds.label("s")).where(states, *base, *where).cte("each").prefix_with("MATERIALIZED")
    counts = [func.coalesce(func.sum(case((each.c.s <= b, 1), else_=0)), 0) for b in bounds]
    row = session.execute(select(func.count(), func.coalesce(func.sum(each.c.s), 0.0), *counts)
                          .select_from(each)).one()
    return Sums([int(n) for n in row[2:]], int(row[0]), float(row[1]))


def _between(ended_at: Any, since: datetime | None, before: datetime | None) -> list[Any]:
    """The conditions that ``ended_at`` falls in [since, before), either end open where None."""
    return [*([] if since is None else [ended_at >= since]), *([] if before is None else [ended_at < before])]


def _by_state_user(session: Session, since: datetime | None = None, before: datetime | None = None,
                   active: bool = False) -> Counter[tuple[str, str]]:
    """The jobs that ended in [since, before) (or, with ``active``, the jobs still waiting or
    running), counted by state and user: for the ended, from the index on ended_at, state and user alone."""
    where = _between(Job.ended_at, since, before)
    if active:
        state, user = Job.state, Job.user
        states = state.in_(c.ACTIVE_STATES)
    else:
        # Grouped by the columns as they are, SQLite walked the queue-order index (state first)
        # over every job to skip the grouping's sort: 150 ms at 200,000 jobs, for a few hundred.
        state, user = not_for_an_index(Job.state, session), not_for_an_index(Job.user, session)
        states = state.in_(c.END_STATES)
    rows = session.execute(select(state, user, func.count()).where(states, *where).group_by(state, user))
    return Counter({(state, user): n for state, user, n in rows})


def _cpu_by_user(session: Session, since: datetime | None, before: datetime | None) -> Counter[str]:
    """The CPU seconds of the jobs, and of the earlier attempts, that ended in [since, before),
    summed by user (those that have them: commands), read down the indexes on ended_at (grouped by
    the column as it is, SQLite walked the index on user over every job ever run: 150 ms a scrape at
    200,000 jobs)."""
    a = EarlierAttempt
    user = not_for_an_index(Job.user, session)
    out: dict[str, float] = {}
    for name, seconds in [
            *session.execute(select(user, func.sum(JobUsage.cpu_s)).join(JobUsage, JobUsage.job_id == Job.id)
                             .where(JobUsage.cpu_s.is_not(None), *_between(Job.ended_at, since, before))
                             .group_by(user)),
            *session.execute(select(a.user, func.sum(a.cpu_s))
                             .where(a.cpu_s.is_not(None), *_between(a.ended_at, since, before)).group_by(a.user))]:
        out[name] = out.get(name, 0.0) + float(seconds)
    return Counter(out)


def _reruns(session: Session, since: datetime | None, before: datetime | None) -> Counter[tuple[str, str]]:
    """The earlier attempts that ended in [since, before), counted by user and cause (those kept
    since the cause is: migration 0032)."""
    a = EarlierAttempt
    rows = session.execute(select(a.user, a.cause, func.count())
                           .where(a.cause.is_not(None), *_between(a.ended_at, since, before)).group_by(a.user, a.cause))
    return Counter({(user, str(cause)): n for user, cause, n in rows})
