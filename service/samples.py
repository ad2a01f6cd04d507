"""Device samples in SQL: written in batches by each worker, read newest-first by `gpuq devices`,
and past retention rolled into 1-minute aggregates that keep every sum and maximum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, delete, func, insert, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import GpuReading
from gpuq.service.dialect import epoch_seconds
from gpuq.service.models import Allocation, DeviceMinute, DeviceSample, Job, table
from gpuq.service.prepared import Prepared
from gpuq.service.settings import Settings


def sample_row(gpu_id: int, job_id: int | None, at: datetime, interval_s: float, reading: GpuReading,
               energy_j: float | None) -> dict[str, Any]:
    """A ``device_samples`` row (as a dict, for a batched insert) from one reading."""
    procs = None if reading.processes is None else [asdict(p) for p in reading.processes]
    return dict(gpu_id=gpu_id, job_id=job_id, sampled_at=at, interval_s=interval_s,
                utilization=reading.utilization, memory_utilization=reading.memory_utilization,
                memory_used_mib=reading.memory_used_mib, memory_total_mib=reading.memory_total_mib,
                temperature_c=reading.temperature_c, power_w=reading.power_w, sm_clock_mhz=reading.sm_clock_mhz,
                energy_j=energy_j, processes=procs)


def record(session: Session, gpu_id: int, rows: Sequence[dict[str, Any]]) -> None:
    """Insert one batch of a GPU's samples in one statement.

    A sample the worker took with no job of its own is tagged with the running job that holds the
    GPU, if any: a multi-GPU job run by another GPU's worker uses this GPU too.
    """
    if not rows:
        return
    if any(r["job_id"] is None for r in rows):
        holder = session.execute(
            select(Job.id, Job.started_at).join(Allocation, Allocation.job_id == Job.id)
            .where(Allocation.gpu_id == gpu_id, Job.state == State.RUNNING)
        ).first()
        if holder is not None and holder.started_at is not None:
            rows = [r if r["job_id"] is not None or r["sampled_at"] < holder.started_at
                    else {**r, "job_id": holder.id} for r in rows]
    # Prepared, not the ORM's bulk insert: a worker writes its job's last readings at every end.
    _INSERT.run(session.connection(), list(rows))


_INSERT = Prepared(table(DeviceSample).insert())


def latest(session: Session, gpu_ids: Sequence[int], newer_than: datetime) -> dict[int, DeviceSample]:
    """Each GPU's newest sample taken after ``newer_than`` (one indexed lookup per GPU)."""
    out = {}
    for gpu_id in gpu_ids:
        row = session.scalar(select(DeviceSample).where(DeviceSample.gpu_id == gpu_id,
                                                        DeviceSample.sampled_at >= newer_than)
                             .order_by(DeviceSample.sampled_at.desc()).limit(1))
        if row is not None:
            out[gpu_id] = row
    return out


def raw_sums(t: Any = DeviceSample) -> list[Any]:
    """The aggregates of raw samples, labelled as the columns of ``device_minutes``."""
    known = lambda col: case((col.is_not(None), t.interval_s), else_=0.0)  # noqa: E731
    return [
        func.count().label("samples"),
        func.sum(t.interval_s).label("seconds"),
        func.sum(known(t.utilization)).label("utilization_seconds"),
        func.sum(func.coalesce(t.utilization, 0) * t.interval_s).label("utilization_sum"),
        func.max(t.utilization).label("utilization_max"),
        func.sum(case((t.utilization < c.IDLE_UTILIZATION, t.interval_s), else_=0.0)).label("idle_seconds"),
        func.sum(known(t.memory_used_mib)).label("memory_seconds"),
        func.sum(func.coalesce(t.memory_used_mib, 0) * t.interval_s).label("memory_used_sum"),
        func.max(t.memory_used_mib).label("memory_used_max"),
        func.max(t.temperature_c).label("temperature_max"),
        func.max(t.power_w).label("power_max"),
        func.sum(func.coalesce(t.energy_j, 0.0)).label("energy_j"),
    ]


def minute_sums(t: Any = DeviceMinute) -> list[Any]:
    """The same aggregates over ``device_minutes`` rows, labelled alike."""
    return [
        func.sum(t.samples).label("samples"),
        *(func.sum(getattr(t, n)).label(n) for n in ("seconds", "utilization_seconds", "utilization_sum",
                                                     "idle_seconds", "memory_seconds", "memory_used_sum")),
        *(func.max(getattr(t, n)).label(n) for n in ("utilization_max", "memory_used_max", "temperature_max",
                                                     "power_max")),
        func.sum(t.energy_j).label("energy_j"),
    ]


def floor_minute(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0)


def rollup(settings: Settings, now: datetime, gpu_id: int | None = None) -> int:
    """Roll raw samples older than the retention window into 1-minute aggregates; returns how many
    raw rows were rolled up (and deleted). A day at a time, each day in one transaction, so a
    concurrent reader sees either the raw rows or their aggregates, never both or neither.
    """
    cutoff = floor_minute(now - timedelta(days=settings.sample_retention_days))
    done = 0
    while True:
        with write_scope(settings) as session:
            scope = [DeviceSample.sampled_at < cutoff]
            if gpu_id is not None:
                scope.append(DeviceSample.gpu_id == gpu_id)
            oldest = session.scalar(select(func.min(DeviceSample.sampled_at)).where(*scope))
            if oldest is None:
                return done
            start = floor_minute(oldest)
            end = min(start + timedelta(seconds=c.ROLLUP_CHUNK_SECONDS), cutoff)
            window = [*scope, DeviceSample.sampled_at >= start, DeviceSample.sampled_at < end]
            minute = (epoch_seconds(DeviceSample.sampled_at, session)
                      // c.AGGREGATE_SECONDS).label("minute_no")
            groups = session.execute(
                select(DeviceSample.gpu_id, DeviceSample.job_id, minute, *raw_sums())
                .where(*window).group_by(DeviceSample.gpu_id, DeviceSample.job_id, minute)
            ).mappings().all()
            rows = []
            for g in groups:
                row = {k: v for k, v in g.items() if k != "minute_no"}
                row["minute"] = datetime.fromtimestamp(int(g["minute_no"]) * c.AGGREGATE_SECONDS, UTC)
                rows.append(row)
            if rows:
                session.execute(insert(DeviceMinute), rows)
            session.execute(delete(DeviceSample).where(*window))
            done += sum(int(g["samples"]) for g in groups)
