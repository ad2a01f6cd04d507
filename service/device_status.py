"""Every GPU as `gpuq devices` shows it: who serves it, which job and user hold it, and its newest
device sample (utilisation, memory, temperature, power, clock, the processes on it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from gpuq.service import samples
from gpuq.service.inventory import NodeReserved, holders, live_cutoff, node_reserved
from gpuq.service.models import utcnow
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
    # Why this one GPU is given out no more (lost, or its worker did not start); a drained node's
    # reason is the answer's ``drained``.
    drain_reason: str | None = None
    # Its node's CPU cores and host memory for jobs (None: not reported) and what its started jobs
    # reserve of them (`--cpus`, `--host-mem`).
    node_cpus: int | None = None
    node_cpus_reserved: float = 0.0
    node_host_mem_mib: int | None = None
    node_host_mem_reserved_mib: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"sampled_at": self.sampled_at.isoformat() if self.sampled_at else None}


def device_status(session: Session, settings: Settings, now: datetime | None = None) -> list[DeviceStatus]:
    """All GPUs gpuq knows, by node and index."""
    now = now or utcnow()
    gpus = holders(session)
    fresh = now - timedelta(seconds=max(STALE_INTERVALS * settings.sample_interval, STALE_SECONDS))
    newest = samples.latest(session, [g.id for g, _ in gpus], fresh)
    cutoff = live_cutoff(settings)
    reserved = node_reserved(session, [g for g, _ in gpus])
    out = []
    for gpu, held in gpus:
        job_id, job_name, user = held.whole
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
            shares=list(held.shares), drain_reason=gpu.drain_reason,
            **reserved.get(gpu.node, NodeReserved()).as_dict(),
        ))
    return out
