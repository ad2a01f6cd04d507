"""Accounting over a period, as SLURM's sreport does it: GPU-hours, jobs, mean utilisation,
energy and CPU-hours per user and per node; and the time series that the plots draw.

GPU-hours are allocated time (a job's wall time in the period times its GPUs); utilisation and
energy come from the device samples. Per user they cover the samples of the user's jobs; per node,
every sample of the node's GPUs, idle ones included. CPU-hours are what commands used (sacct's
TotalCPU, not an allocation's cores times its time), known once a command has ended: a job's count
in the period whose end falls in it, and so does each attempt's of a job that ran again.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, literal, or_, select
from sqlalchemy.orm import Session

from gpuq.service.dialect import epoch_seconds, greatest, least, seconds_between
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import DeviceMinute, DeviceSample, EarlierAttempt, Job, JobUsage, UTCDateTime, utcnow
from gpuq.service.samples import floor_minute
from gpuq.service.usage import Totals, by_node, by_user, totals

_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$", re.ASCII)
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# The bounds of a period (a date before the first job, an age of 99999999d, is from the start): both
# databases take them, which year 1 and 9999 are not, each side of a time zone.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def parse_when(text: str, flag: str, now: datetime | None = None) -> datetime:
    """An ISO date or time (local time unless it names a zone), ``now``, or an age such as
    ``90m``, ``12h``, ``7d``; raises InvalidSpec naming ``flag`` otherwise."""
    now = now or utcnow()
    text = text.strip()
    if text == "now":
        return now
    age = _AGE.match(text)
    if age:
        try:
            return max(now - timedelta(seconds=float(age.group(1)) * _UNIT[age.group(2)]), EARLIEST)
        except OverflowError:  # an age longer than a time can go back: from the start
            return EARLIEST
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidSpec(f"bad {flag} {text[:40]!r}: use a date or time (2026-01-31, 2026-01-31T14:00) "
                          "or an age (90m, 12h, 7d)") from None
    if when.year < EARLIEST.year + 1 or when.year > LATEST.year - 1:  # no time zone moves it past a bound
        return EARLIEST if when.year < EARLIEST.year + 1 else LATEST
    if when.tzinfo is None:
        when = when.astimezone()  # the user's local time
    return when.astimezone(UTC)


@dataclass
class UsageRow:
    """One line of the report: a user's or a node's use of the GPUs in the period."""

    name: str
    jobs: int
    gpu_hours: float
    utilization_mean: float | None
    energy_j: float
    idle_hours: float
    # Its commands' CPU time, of those that ended in the period (a workload's or an allocation's is not known).
    cpu_hours: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def report(session: Session, since: datetime, until: datetime, now: datetime | None = None
           ) -> dict[str, list[UsageRow]]:
    """Per user and per node over [since, until): ``{"users": [...], "nodes": [...]}``, busiest first."""
    now = now or utcnow()
    # A job's GPU-seconds in the period: its time run inside it, times its GPUs (a shared job's
    # share of them), summed per user and per node by the database (as rows, 200,000 jobs in a
    # week took `gpuq stats` 6.5 s on SQLite).
    at_now, at_since, at_until = (literal(t, UTCDateTime()) for t in (now, since, until))  # stored as the columns
    start = greatest(func.coalesce(Job.started_at, at_now), at_since, session)
    end = least(func.coalesce(Job.ended_at, at_now), at_until, session)
    gpu_s = greatest(seconds_between(end, start, session), 0.0, session) * Job.gpus * func.coalesce(Job.gpu_share, 1.0)
    ran = (Job.started_at.is_not(None), Job.started_at < until, or_(Job.ended_at.is_(None), Job.ended_at > since))
    # A command's CPU seconds, counted whole where its end falls (known only then, from its reaped
    # process); a job that ended in the period ran in it, so the same pass sums them.
    cpu_s = case((and_(Job.ended_at >= since, Job.ended_at < until), JobUsage.cpu_s), else_=None)
    # One pass grouped by user and node together (a few rows), added up each way here: a pass per
    # grouping worked out every job's seconds twice (and a pass of its own for the CPU seconds
    # was a fifth more). The earlier attempts of jobs that ran again add their GPU time (not a job
    # each), and their CPU seconds where they ended in the period, as a job's.
    alloc: dict[str, dict[str, tuple[int, float, float]]] = {"users": {}, "nodes": {}}
    node = func.coalesce(Job.node, "-")
    a = EarlierAttempt
    a_start, a_end = greatest(a.started_at, at_since, session), least(a.ended_at, at_until, session)
    a_seconds = greatest(seconds_between(a_end, a_start, session), 0.0, session) * a.charged
    by_job = (select(Job.user, node, func.count(), func.sum(gpu_s), func.sum(cpu_s))
              .outerjoin(JobUsage, JobUsage.job_id == Job.id).where(*ran).group_by(Job.user, node))
    a_cpu_s = case((and_(a.ended_at >= since, a.ended_at < until), a.cpu_s), else_=None)
    by_attempt = (select(a.user, func.coalesce(a.node, "-"), literal(0), func.sum(a_seconds), func.sum(a_cpu_s))
                  .where(a.started_at < until, a.ended_at > since).group_by(a.user, a.node))
    for user, node_name, jobs, seconds, cpu in [*session.execute(by_job), *session.execute(by_attempt)]:
        for part, name in (("users", user), ("nodes", node_name)):
            had_jobs, had_seconds, had_cpu = alloc[part].get(name, (0, 0.0, 0.0))
            alloc[part][name] = (had_jobs + jobs, had_seconds + float(seconds or 0.0), had_cpu + float(cpu or 0.0))
    out = {}
    for part, group in (("users", by_user), ("nodes", by_node)):
        sampled = totals(session, group, since=since, until=until)
        rows = []
        for name in sorted(set(alloc[part]) | set(sampled)):
            t = sampled.get(name, Totals())
            jobs, seconds, cpu = alloc[part].get(name, (0, 0.0, 0.0))
            idle = t.idle_seconds
            if part == "users":
                # A job's first sample covers the interval before it, which can start before the
                # job did: a user held no more GPU time idle than they held (a node's idle GPUs count).
                idle = min(idle, seconds)
            rows.append(UsageRow(name=name, jobs=jobs, gpu_hours=seconds / 3600.0,
                                 utilization_mean=t.utilization_mean, energy_j=t.energy_j,
                                 idle_hours=idle / 3600.0, cpu_hours=cpu / 3600.0))
        out[part] = sorted(rows, key=lambda r: (-r.gpu_hours, r.name))
    return out


def job_series(session: Session, job_id: int, since: datetime | None = None) -> list[dict[str, Any]]:
    """A job's samples in time order from ``since`` (its last attempt's start, as its summary),
    one dict per sample (minute means where rolled up): ``at``, ``gpu_id``, ``utilization``,
    ``memory_used_mib``, ``power_w``."""
    raw = select(DeviceSample).where(DeviceSample.job_id == job_id)
    rolled = select(DeviceMinute).where(DeviceMinute.job_id == job_id)
    if since is not None:
        raw = raw.where(DeviceSample.sampled_at >= since)
        rolled = rolled.where(DeviceMinute.minute >= floor_minute(since))
    points = [dict(at=s.sampled_at, gpu_id=s.gpu_id, utilization=s.utilization, memory_used_mib=s.memory_used_mib,
                   power_w=s.power_w)
              for s in session.scalars(raw)]
    for m in session.scalars(rolled):
        points.append(dict(
            at=m.minute, gpu_id=m.gpu_id,
            utilization=m.utilization_sum / m.utilization_seconds if m.utilization_seconds else None,
            memory_used_mib=m.memory_used_sum / m.memory_seconds if m.memory_seconds else None,
            power_w=m.energy_j / m.seconds if m.seconds else None))
    return sorted(points, key=lambda p: (p["at"], p["gpu_id"]))


def utilization_by_user(session: Session, since: datetime, until: datetime, buckets: int = 120
                        ) -> tuple[list[datetime], dict[str, list[float]]]:
    """The cluster's use over [since, until) in ``buckets`` equal slices: the slices' starts, and
    per user the GPUs their jobs kept busy on average in each slice (utilisation x GPUs / 100)."""
    width = max((until - since).total_seconds() / buckets, 1.0)
    start = int(since.timestamp())
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * buckets)
    for t, time, used in ((DeviceSample, DeviceSample.sampled_at, DeviceSample.utilization * DeviceSample.interval_s),
                          (DeviceMinute, DeviceMinute.minute, DeviceMinute.utilization_sum)):
        bucket = func.floor((epoch_seconds(time, session) - start) / width).label("bucket")
        rows = session.execute(select(Job.user, bucket, func.sum(used).label("used"))
                               .join(Job, Job.id == t.job_id).where(time >= since, time < until)
                               .group_by(Job.user, bucket))
        for user, b, total in rows:
            if total is not None and 0 <= int(b) < buckets:
                series[user][int(b)] += float(total) / 100.0 / width
    edges = [since + timedelta(seconds=i * width) for i in range(buckets)]
    return edges, dict(series)
