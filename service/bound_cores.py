"""The CPU cores a running job is bound to (`--cpus`; workers/core_binding.py chooses and sets them),
as SQL keeps them for `gpuq show` (SLURM's CPU_IDs): on its rank 0 allocation row, gone with it
when the job ends."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpuq.service.models import Allocation


def record(session: Session, job_id: int, cores: str) -> None:
    """Job ``job_id`` runs on ``cores`` (as 0-3,8)."""
    session.execute(update(Allocation).where(Allocation.job_id == job_id, Allocation.rank == 0)
                    .values(cores=cores))


def of(session: Session, job_id: int) -> str | None:
    """The cores job ``job_id`` runs on now; None: it is bound to none, or does not run."""
    return session.scalar(select(Allocation.cores).where(Allocation.job_id == job_id, Allocation.rank == 0))
