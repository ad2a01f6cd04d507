"""A job as the worker runs it: ``JobRun``, the parts of its row a run needs, and ``Started``, a
job this worker started, with the reads that make them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gpuq.service.job_output import next_output_seq
from gpuq.service.leases import Lease
from gpuq.service.models import Allocation, Gpu, table
from gpuq.service.units import JobSignal

_JOB_GPUS = (select(table(Gpu).c.index, table(Gpu).c.queue, table(Gpu).c.memory_total_mib)
             .join_from(table(Allocation), table(Gpu), table(Gpu).c.id == table(Allocation).c.gpu_id)
             .where(table(Allocation).c.job_id == bindparam("job_id")).order_by(table(Allocation).c.rank))


@dataclass(frozen=True)
class JobRun:
    """The parts of a job row a run needs, read once after the claim."""

    id: int
    name: str
    kind: str
    workload: str | None
    params: dict[str, Any]
    argv: list[str] | None
    cwd: str | None
    gpu_indices: tuple[int, ...]
    gpu_queues: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    time_limit_s: int | None = None
    host_mem_mib: int | None = None
    cpus: float | None = None  # `--cpus`: the cores its processes may use together
    user: str = ""
    started_at: datetime | None = None
    # Whether it ran before (a retry, a requeue): its output and usage go on from the earlier attempts'.
    ran_before: bool = False
    # A shared job: it runs beside other shared jobs, held to ``mem_mib`` of its first GPU's
    # ``memory_total_mib`` there.
    shared: bool = False
    mem_mib: int | None = None
    memory_total_mib: int = 0
    # What it is charged of each GPU, as its dispatch wrote it (``jobs.gpu_share``); None: whole GPUs.
    gpu_share: float | None = None
    array_id: int | None = None
    array_index: int | None = None
    # A command's output copied to the user's files as well, patterns unfilled (service/output_files.py).
    output_file: str | None = None
    error_file: str | None = None
    # Sent ahead of its time limit (`--signal`), read once from the row; None: none.
    signal: JobSignal | None = None
    # Its stdin comes from the `gpuq run` that submitted it (service/job_input.py); else /dev/null.
    stdin: bool = False

    @property
    def signal_before_s(self) -> int | None:
        """How long before its time limit it is sent its `--signal`, seconds; None: it has none."""
        return self.signal.before_s if self.signal is not None else None

    @property
    def started_s(self) -> float | None:
        """When it started, in epoch seconds (what a time limit counts from)."""
        return self.started_at.timestamp() if self.started_at else None


@dataclass(frozen=True)
class Started:
    """A job this worker started (claimed, or took from its next-up list), as read in that transaction."""

    job: JobRun
    lease: Lease
    # The number its first output chunk gets (after earlier attempts' output).
    output_seq: int
    # The device sampler's count of batches taken to write (``Sampler.flushes``) before the job
    # started; None without a sampler.
    flush_mark: int | None = None

    @classmethod
    def read(cls, session: Session, job: JobRun, token: str, flush_mark: int | None) -> Started:
        """``job``, started with lease ``token``, in the transaction that started it."""
        # A retried job's output goes on after its earlier attempts'.
        return cls(job, Lease(job.id, token), next_output_seq(session, job.id) if job.ran_before else 0,
                   flush_mark)


def claimed(session: Session, row: Any, gpu_index: int, queue: str) -> JobRun:
    """The job a claim returned (``leases.claim``'s row) as its run needs it. A whole job of one GPU
    runs on the claiming worker's own: nothing to read. A job of several GPUs reads them all, in
    rank order, and a shared one its GPU's memory (what its share is a fraction of)."""
    if row.gpus == 1 and not row.shared:
        return job_run(row, (gpu_index,), (queue,))
    gpus = session.connection().execute(_JOB_GPUS, {"job_id": row.id}).all()
    # By position: a Row's ``index`` is also the Sequence method's name.
    return job_run(row, tuple(g[0] for g in gpus), tuple(g[1] for g in gpus), gpus[0][2] if gpus else 0)


def job_run(job: Any, gpu_indices: tuple[int, ...], gpu_queues: tuple[str, ...], memory_total_mib: int = 0) -> JobRun:
    """A JobRun from a job row with ``leases.STARTED_COLUMNS`` (a claim's or a take's RETURNING)."""
    return JobRun(id=job.id, name=job.name, kind=job.kind, workload=job.workload, params=dict(job.params),
                  argv=job.argv, cwd=job.cwd, gpu_indices=gpu_indices, gpu_queues=gpu_queues,
                  env=dict(job.env or {}), time_limit_s=job.time_limit_s,
                  host_mem_mib=job.host_mem_mib, cpus=job.cpus, user=job.user, started_at=job.started_at,
                  ran_before=bool(job.attempts), shared=bool(job.shared), mem_mib=job.mem_mib,
                  memory_total_mib=memory_total_mib, gpu_share=job.gpu_share, array_id=job.array_id,
                  array_index=job.array_index, output_file=job.output_file, error_file=job.error_file,
                  signal=JobSignal.parse(job.signal) if job.signal is not None else None, stdin=bool(job.stdin))
