"""A job's output as its worker stores it (numbered chunks of stdout and stderr, a retried job's
attempts in one log) and the metrics a built-in workload records (an epoch's loss and accuracy),
as `gpuq logs`, `gpuq show` and the dashboard read them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.models import JobMetric, JobOutput, utcnow


def next_output_seq(session: Session, job_id: int) -> int:
    """The number the job's next output chunk gets: a retried job's attempts share one log."""
    last = session.scalar(select(func.max(JobOutput.seq)).where(JobOutput.job_id == job_id))
    return 0 if last is None else last + 1


def append_output(session: Session, job_id: int, seq: int, data: str, stream: int = c.STDOUT) -> None:
    session.add(JobOutput(job_id=job_id, seq=seq, data=data, stream=stream, written_at=utcnow()))


def read_output(session: Session, job_id: int, after_seq: int = -1) -> list[tuple[int, str, int]]:
    """The job's output chunks after ``after_seq``: (seq, text, stream: c.STDOUT or c.STDERR)."""
    rows = session.execute(select(JobOutput.seq, JobOutput.data, JobOutput.stream)
                           .where(JobOutput.job_id == job_id, JobOutput.seq > after_seq)
                           .order_by(JobOutput.seq)).all()
    return [(r.seq, r.data, r.stream) for r in rows]


def output_tail(session: Session, job_id: int, lines: int) -> list[str]:
    """The job's last ``lines`` lines of output (what usually explains a failure)."""
    chunks = session.scalars(select(JobOutput.data).where(JobOutput.job_id == job_id)
                             .order_by(JobOutput.seq.desc()).limit(4))
    text = "".join(reversed(list(chunks)))
    return text.rstrip("\n").splitlines()[-lines:] if text.strip() else []


def record_metric(session: Session, job_id: int, values: dict[str, Any]) -> None:
    seq = session.scalar(select(func.count()).select_from(JobMetric).where(JobMetric.job_id == job_id))
    session.add(JobMetric(job_id=job_id, seq=seq or 0, values=values, recorded_at=utcnow()))


def read_metrics(session: Session, job_id: int) -> list[dict[str, Any]]:
    return list(session.scalars(select(JobMetric.values).where(JobMetric.job_id == job_id)
                                .order_by(JobMetric.seq)))
