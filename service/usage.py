"""How GPUs were used, from the device samples (raw ones, and the minute aggregates they were
rolled into): totals per job, user, node or time bucket; a job's summary when it ends, and an
array's tasks' summaries; and which running jobs hold their GPUs idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import JobNotFound
from gpuq.service.jobs import elapsed, get_job
from gpuq.service.models import DeviceMinute, DeviceSample, Gpu, Job, JobUsage, table, utcnow
from gpuq.service.prepared import Prepared
from gpuq.service.samples import floor_minute, minute_sums, raw_sums
from gpuq.service.settings import Settings

_SUMMED = ("samples", "seconds", "utilization_seconds", "utilization_sum", "idle_seconds", "memory_seconds",
           "memory_used_sum", "energy_j")
_MAXED = ("utilization_max", "memory_used_max", "temperature_max", "power_max")
# Each maximum and the sample column it is taken over.
_MAXED_COLUMNS = tuple(zip(_MAXED, ("utilization", "memory_used_mib", "temperature_c", "power_w"),
                           strict=True))


@dataclass
class Totals:
    """Sums (weighted by the seconds each sample stands for) and maxima over some samples."""

    samples: int = 0
    seconds: float = 0.0
    utilization_seconds: float = 0.0
    utilization_sum: float = 0.0
    idle_seconds: float = 0.0
    memory_seconds: float = 0.0
    memory_used_sum: float = 0.0
    energy_j: float = 0.0
    utilization_max: float | None = None
    memory_used_max: float | None = None
    temperature_max: float | None = None
    power_max: float | None = None

    @classmethod
    def of_samples(cls, rows: list[dict[str, Any]]) -> Totals:
        """The totals of raw sample rows in hand (``samples.sample_row`` dicts), as the database
        sums them (``samples.raw_sums``): a worker that holds every reading of a job that ended
        needs no read for its summary."""
        out = cls()
        for r in rows:
            seconds, util, mem = r["interval_s"], r["utilization"], r["memory_used_mib"]
            out.samples += 1
            out.seconds += seconds
            if util is not None:
                out.utilization_seconds += seconds
                out.utilization_sum += util * seconds
                out.idle_seconds += seconds if util < c.IDLE_UTILIZATION else 0.0
            if mem is not None:
                out.memory_seconds += seconds
                out.memory_used_sum += mem * seconds
            out.energy_j += r["energy_j"] or 0.0
            for name, column in _MAXED_COLUMNS:
                mine, theirs = getattr(out, name), r[column]
                if theirs is not None and (mine is None or theirs > mine):
                    setattr(out, name, theirs)
        return out

    def add(self, row: Any) -> Totals:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + (row[name] or 0))
        for name in _MAXED:
            mine, theirs = getattr(self, name), row[name]
            if theirs is not None and (mine is None or theirs > mine):
                setattr(self, name, theirs)
        return self

    @property
    def utilization_mean(self) -> float | None:
        return self.utilization_sum / self.utilization_seconds if self.utilization_seconds else None

    @property
    def memory_mean(self) -> float | None:
        return self.memory_used_sum / self.memory_seconds if self.memory_seconds else None

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "utilization_mean": self.utilization_mean, "memory_mean": self.memory_mean}


# A grouping: given the table (DeviceSample or DeviceMinute), the key columns and the joins it needs.
Grouping = Callable[[Any], tuple[list, Callable[[Any], Any]]]


def by_user(t: Any) -> tuple[list[Any], Callable[[Any], Any]]:
    return [Job.user], lambda q: q.join(Job, Job.id == t.job_id)


def by_node(t: Any) -> tuple[list[Any], Callable[[Any], Any]]:
    return [Gpu.node], lambda q: q.join(Gpu, Gpu.id == t.gpu_id)


def by_job(t: Any) -> tuple[list[Any], Callable[[Any], Any]]:
    return [t.job_id], lambda q: q


def totals(session: Session, group: Grouping | None = None, *, since: datetime | None = None,
           until: datetime | None = None, where: Callable[[Any], list] | None = None) -> dict[Any, Totals]:
    """Totals of raw samples and minute aggregates together, per key of ``group`` (one key, None,
    without one), over samples taken in [since, until) and matching ``where(table)``."""
    out: dict[Any, Totals] = {}
    for t, sums, time in ((DeviceSample, raw_sums(), DeviceSample.sampled_at),
                          (DeviceMinute, minute_sums(), DeviceMinute.minute)):
        keys, join = group(t) if group else ([], lambda q: q)
        q = join(select(*keys, *sums))
        conds = list(where(t)) if where else []
        if since is not None:
            conds.append(time >= since)
        if until is not None:
            conds.append(time < until)
        q = q.where(*conds)
        if keys:
            q = q.group_by(*keys)
        for row in session.execute(q).mappings():
            if not row["samples"]:
                continue
            key = tuple(row[k.key] for k in keys) if len(keys) > 1 else (row[keys[0].key] if keys else None)
            out.setdefault(key, Totals()).add(row)
    return out


def job_totals(session: Session, job_id: int, rolled: bool = True, since: datetime | None = None) -> Totals:
    """The samples of one job (on all its GPUs) from ``since`` (its attempt's start: a retried or
    requeued job's summary is its last attempt's, as its wall time and progress rows are); without
    ``rolled``, only its raw samples (a job younger than the sample retention has no minute
    aggregates yet). Minute aggregates count from the minute ``since`` falls in. Built once: a
    worker asks this at every job's end."""
    global _JOB_TOTALS
    if _JOB_TOTALS is None:
        _JOB_TOTALS = [select(*sums).where(t.job_id == bindparam("job_id"), at >= bindparam("since"))
                       for t, at, sums in ((DeviceSample, DeviceSample.sampled_at, raw_sums()),
                                           (DeviceMinute, DeviceMinute.minute, minute_sums()))]
    out = Totals()
    conn = session.connection()  # Core: the ORM's result handling was most of this call's cost
    since = since or _EPOCH
    for query, start in zip(_JOB_TOTALS if rolled else _JOB_TOTALS[:1], (since, floor_minute(since)), strict=False):
        row = conn.execute(query, {"job_id": job_id, "since": start}).mappings().one()
        if row["samples"]:
            out.add(row)
    return out


_JOB_TOTALS: list | None = None
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def summarize(session: Session, job: Any, now: datetime | None = None, *, rolled: bool = True,
              totals: Totals | None = None) -> JobUsage:
    """The job's usage summary (not saved): wall time, GPU-hours, memory, utilisation, energy, idle.
    ``job``: a Job, or any row with its id, gpus, started_at and ended_at; ``rolled``: as for
    ``job_totals``; ``totals``: the job's samples summed already (none read)."""
    return JobUsage(**_summary(job, totals if totals is not None
                               else job_totals(session, job.id, rolled, job.started_at), now))


def summary(ended: Ended, totals: Totals) -> dict[str, Any]:
    """The summary row of a job its worker just ended (``service/handover.py`` writes it)."""
    return _summary(ended, totals)


def _summary(job: Any, t: Totals, now: datetime | None = None) -> dict[str, Any]:
    wall = (elapsed(job, now) or timedelta()).total_seconds()
    # A shared job is charged its share of each GPU (``jobs.gpu_share``), as fair share charges it.
    charged = job.gpus * (getattr(job, "gpu_share", None) or 1.0)
    return dict(job_id=job.id, wall_s=wall, gpu_hours=wall * charged / 3600.0,
                memory_peak_mib=None if t.memory_used_max is None else int(t.memory_used_max),
                memory_mean_mib=t.memory_mean, utilization_mean=t.utilization_mean,
                # No more idle than held: a first sample's interval can reach back before the start.
                energy_j=t.energy_j if t.samples else None, idle_s=min(t.idle_seconds, wall * charged),
                samples=t.samples,
                gpu_indices=list(getattr(job, "gpu_indices", ())) or None, recorded_at=utcnow(),
                cpu_s=getattr(job, "cpu_s", None), host_mem_peak_mib=getattr(job, "host_mem_peak_mib", None))


@dataclass(frozen=True)
class Ended:
    """What the worker that ended a job knows of it, so storing its summary reads no job row."""

    id: int
    gpus: int
    started_at: datetime | None
    ended_at: datetime
    # Whether it ran before (a retry, a requeue): an earlier attempt's summary is replaced.
    ran_before: bool = True
    # A shared job's share of each GPU (what it is charged); None: whole GPUs.
    gpu_share: float | None = None
    # The GPUs it ran on, by index on its node, in rank order (kept in its summary: its allocation
    # goes with its end).
    gpu_indices: tuple[int, ...] = ()
    # A command's CPU seconds, as its worker reaped it (workers/command.py); None: not known (a
    # workload, an allocation, a lost worker).
    cpu_s: float | None = None
    # The most host memory a command's processes were seen to hold, MiB (workers/host_memory.py).
    host_mem_peak_mib: int | None = None


@dataclass(frozen=True)
class HostUse:
    """What a command used of its node besides the GPUs, as its worker measured it: its CPU
    seconds and its host memory's peak (None: not known)."""

    cpu_s: float | None = None
    host_mem_peak_mib: int | None = None


def record_usage(session: Session, job_id: int, ended: Ended | None = None,
                 retention_days: float | None = None, totals: Totals | None = None) -> None:
    """Store (or replace) the summary of a job that ended. With ``ended`` (the worker that ended
    it) no job row is read; with ``retention_days`` too, the minute aggregates of a job younger
    than that are not read (none of its samples has been rolled up yet); with ``totals`` (its
    samples summed from the readings in hand, ``Totals.of_samples``), no sample is read."""
    job: Any = ended
    if job is None:
        # The row as the database has it now (its end was just written by an UPDATE), in Core.
        job = session.connection().execute(_JOB_TIMES, {"job_id": job_id}).one_or_none()
        if job is None:
            raise JobNotFound(f"no job {job_id}")
    if totals is None:
        young = (retention_days is not None and job.started_at is not None
                 and job.ended_at - job.started_at < timedelta(days=retention_days) - timedelta(minutes=2))
        totals = job_totals(session, job.id, rolled=not young, since=job.started_at)
    conn = session.connection()
    if ended is None or ended.ran_before:
        conn.execute(_FORGET_USAGE, {"job_id": job_id})
    _INSERT_USAGE.send(conn, _summary(job, totals))


_JOB_TIMES = select(table(Job).c.id, table(Job).c.gpus, table(Job).c.started_at, table(Job).c.ended_at,
                    table(Job).c.gpu_share).where(table(Job).c.id == bindparam("job_id"))
_INSERT_USAGE = Prepared(table(JobUsage).insert())
_FORGET_USAGE = table(JobUsage).delete().where(table(JobUsage).c.job_id == bindparam("job_id"))


def job_usage(session: Session, job_id: int) -> JobUsage:
    """The stored summary of an ended job, else one computed now (a running job, or one whose
    worker was lost before it could write it)."""
    job = get_job(session, job_id)
    stored = session.get(JobUsage, job_id)
    if stored is not None and job.state in c.END_STATES:
        return stored
    return summarize(session, job)


def idle_jobs(session: Session, settings: Settings, now: datetime | None = None, window: float | None = None
              ) -> set[int]:
    """Running jobs that held their GPUs mostly idle (IDLE_SHARE of the sampled time below
    IDLE_UTILIZATION) through the whole last ``window`` seconds (the flag's: ``idle_window``)."""
    now = now or utcnow()
    window = settings.idle_window if window is None else window
    since = now - timedelta(seconds=window)
    running = dict(session.execute(select(Job.id, Job.gpus).where(Job.state == State.RUNNING,
                                                                  Job.started_at <= since)).all())
    if not running:
        return set()
    per_job = totals(session, by_job, since=since, where=lambda t: [t.job_id.in_(running)])
    # Half the window sampled at least, so a job is never judged on a handful of readings.
    return {job_id for job_id, t in per_job.items()
            if t.seconds >= 0.5 * window * running[job_id]
            and t.idle_seconds >= c.IDLE_SHARE * t.seconds}


# An array's tasks with what ``summarize`` and the summary's reader need of each.
_TASKS = select(Job.id, Job.array_index, Job.state, Job.time_limit_s, Job.name, Job.user, Job.gpus, Job.gpu_share,
                Job.started_at, Job.ended_at).where(Job.array_id == bindparam("array_id")).order_by(Job.id)
_TASKS_USAGE = select(JobUsage).join(Job, Job.id == JobUsage.job_id).where(Job.array_id == bindparam("array_id"))
# A summary's fields that a task's line and the array's sums use.
_TASK_FIELDS = ("wall_s", "gpu_hours", "memory_peak_mib", "memory_mean_mib", "utilization_mean", "energy_j",
                "idle_s", "samples", "cpu_s", "host_mem_peak_mib")


def array_usage(session: Session, array_id: int, now: datetime | None = None) -> list[dict[str, Any]]:
    """Each task of array ``array_id`` in id order: its id, index, state, time limit, name and user,
    and for one that started its usage summary's fields (the stored one of a task that ended, else
    one computed now, as ``job_usage`` gives it). JobNotFound if there is no such array."""
    tasks = session.execute(_TASKS, {"array_id": array_id}).all()
    if not tasks:
        raise JobNotFound(f"no array {array_id}")
    stored = {u.job_id: u for u in session.scalars(_TASKS_USAGE, {"array_id": array_id})}
    now = now or utcnow()
    out = []
    for t in tasks:
        row: dict[str, Any] = dict(job_id=t.id, index=t.array_index, state=t.state, time_limit_s=t.time_limit_s,
                                   name=t.name, user=t.user)
        if t.started_at is not None:
            u = stored.get(t.id) if t.state in c.END_STATES else None
            u = u or summarize(session, t, now)
            row |= {f: getattr(u, f) for f in _TASK_FIELDS}
        out.append(row)
    return out


# What `gpuq history` gives of each ended job's summary (sacct's TotalCPU, MaxRSS and TRES usage).
SUMMARY_FIELDS = ("gpu_hours", "memory_peak_mib", "utilization_mean", "energy_j", "cpu_s", "host_mem_peak_mib")
_SUMMARY = select(JobUsage.job_id, JobUsage.gpu_indices, *(JobUsage.__table__.c[f] for f in SUMMARY_FIELDS))
_SUMMARY_CHUNK = 1000  # ids a statement (SQLite's bound parameters)


def summaries(session: Session, job_ids: list[int]) -> dict[int, Any]:
    """The stored usage summaries of ended jobs by id, each row with ``SUMMARY_FIELDS`` and the
    GPUs it ran on (``gpu_indices``: an ended job's allocation is gone, so its summary is where
    they are); a job without one (it never ran, or its end wrote none) is left out."""
    found: dict[int, Any] = {}
    for start in range(0, len(job_ids), _SUMMARY_CHUNK):
        for row in session.execute(_SUMMARY.where(JobUsage.job_id.in_(job_ids[start:start + _SUMMARY_CHUNK]))):
            found[row.job_id] = row
    return found
