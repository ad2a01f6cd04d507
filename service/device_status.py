"""Every GPU as `gpuq devices` shows it: who serves it, which job and user hold it, and its newest
device sample (utilisation, memory, temperature, power, clock, the processes on it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuq.service import samples
from gpuq.service.inventory import live_cutoff
from gpuq.service.models import Allocation, Gpu, Job, utcnow
from gpuq.service.settings import Settings

# A sample older than this many sample intervals (and at least this many seconds) is stale:
# the table shows "not available" rather than an old reading as if it were now.
STALE_INTERVALS, STALE_SECONDS = 10, 30.0


@dataclass(frozen=True)
class DeviceStatus:
    """One GPU now; None where not available (no recent sample, or the device cannot tell)."""

    node: str
    index: int
    name: str
    online: bool
    memory_total_mib: int
    memory_used_mib: int | None
    utilization: int | None
    memory_utilization: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    job_id: int | None = None
    job_name: str | None = None
    user: str | None = None
    sampled_at: datetime | None = None
    processes: list[dict[str, Any]] = field(default_factory=list)  # gpuq's (the worker's, its job's)
    foreign: list[dict[str, Any]] = field(default_factory=list)  # processes gpuq did not start
    # Shared jobs on it (job_id is then None): [{"job_id", "job_name", "user", "share_mib", "used_mib"}].
    shares: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"sampled_at": self.sampled_at.isoformat() if self.sampled_at else None}


def device_status(session: Session, settings: Settings, now: datetime | None = None) -> list[DeviceStatus]:
    """All GPUs gpuq knows, by node and index."""
    now = now or utcnow()
    rows = session.execute(
        select(Gpu, Job.id, Job.name, Job.user, Allocation.share_mib, Allocation.used_mib)
        .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
        .outerjoin(Job, Job.id == Allocation.job_id).order_by(Gpu.node, Gpu.index, Job.id)
    ).all()
    fresh = now - timedelta(seconds=max(STALE_INTERVALS * settings.sample_interval, STALE_SECONDS))
    newest = samples.latest(session, [g.id for g, *_ in rows], fresh)
    cutoff = live_cutoff(settings)
    gpus: dict[int, Gpu] = {}
    whole: dict[int, tuple[int | None, str | None, str | None]] = {}
    shares: dict[int, list[dict[str, Any]]] = {}
    for gpu, held_by, held_name, held_user, share_mib, used_mib in rows:
        gpus[gpu.id] = gpu
        if share_mib is not None:
            shares.setdefault(gpu.id, []).append({"job_id": held_by, "job_name": held_name, "user": held_user,
                                                  "share_mib": share_mib, "used_mib": used_mib})
        elif held_by is not None:
            whole[gpu.id] = (held_by, held_name, held_user)
    out = []
    for gpu in gpus.values():
        job_id, job_name, user = whole.get(gpu.id, (None, None, None))
        s = newest.get(gpu.id)
        procs = (s.processes or []) if s else []
        out.append(DeviceStatus(
            node=gpu.node, index=gpu.index, name=gpu.name,
            online=gpu.heartbeat_at is not None and gpu.heartbeat_at >= cutoff,
            memory_total_mib=(s.memory_total_mib if s and s.memory_total_mib else gpu.memory_total_mib),
            # The heartbeat's reading when sampling is off or behind.
            memory_used_mib=s.memory_used_mib if s else gpu.memory_used_mib,
            utilization=s.utilization if s else gpu.utilization,
            memory_utilization=s.memory_utilization if s else None,
            temperature_c=s.temperature_c if s else None, power_w=s.power_w if s else None,
            sm_clock_mhz=s.sm_clock_mhz if s else None, job_id=job_id, job_name=job_name, user=user,
            sampled_at=s.sampled_at if s else None,
            processes=[p for p in procs if p.get("gpuq")], foreign=[p for p in procs if not p.get("gpuq")],
            shares=shares.get(gpu.id, []),
        ))
    return out
