"""A GPU handed over from one job to the next: on PostgreSQL, a job's success on its worker, its
usage summary, the start of the GPU's next listed job and the GPU's allocation passed to it, as
one statement.

Under a flood of short jobs a job's end and the next one's start are most of the CPU a job costs
the workers and the database. Apart they are seven statements (``BEGIN``, the success with its
GPUs freed, the usage summary, ``SAVEPOINT``, the take with its allocation, ``RELEASE``,
``COMMIT``), and the worker pays psycopg's and SQLAlchemy's Python for each; here the middle five
are one, built of the same moves (``lifecycle.SUCCEEDED_ID``, ``next_up.taking_first_unlocked``) as
data-modifying ``WITH`` clauses, which SQLite lacks (it keeps the statements apart, in its one
write lock). Measured in isolation: the worker's CPU for an end and a take 0.53 ms before, 0.28
after; PostgreSQL's 0.72 and 0.61, most of it the rows' own work.

One statement sees one snapshot: the take cannot see the ended job's allocation go, so it asks
instead that the GPU be held by that job alone, and the allocation row is passed to the taken
job (an ``UPDATE`` of its ``job_id``) rather than deleted and inserted again, which the unique index
on a GPU's whole allocation could refuse within the statement. The GPU is held throughout: no
scheduler can allocate it between the end and the start. Nothing is taken unless the end was
written (the worker still held the job's lease).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, bindparam, column, exists, func, not_, select, true, values
from sqlalchemy.orm import Session

from gpuq.service.dialect import on_psycopg
from gpuq.service.lifecycle import SUCCEEDED_ID
from gpuq.service.models import Allocation, JobUsage, table
from gpuq.service.next_up import taking_first_unlocked
from gpuq.service.prepared import Prepared

_ALLOCATIONS = table(Allocation).c
_USAGE = table(JobUsage)
_USAGE_COLUMNS = [c.name for c in _USAGE.columns if c.name != "job_id"]


_ENDED = SUCCEEDED_ID.cte("ended")
_TAKEN = taking_first_unlocked(handed_over_by=_ENDED).cte("taken")
# The GPU's allocation passes to the taken job; the ended job's others (on other GPUs) go.
_PASSED = (table(Allocation).update().where(_ALLOCATIONS.job_id == bindparam("job_id"),
                                            _ALLOCATIONS.gpu_id == bindparam("gpu_id"))
           .values(job_id=_TAKEN.c.id).cte("passed"))
_FREED = (table(Allocation).delete()
          .where(_ALLOCATIONS.job_id.in_(select(_ENDED.c.id)),
                 not_((_ALLOCATIONS.gpu_id == bindparam("gpu_id")) & exists(select(_TAKEN.c.id))))
          .cte("freed"))
_SUMMARY = _USAGE.insert().from_select(
    ["job_id", *_USAGE_COLUMNS],
    select(_ENDED.c.id, *(bindparam(f"usage_{name}", type_=_USAGE.c[name].type) for name in _USAGE_COLUMNS)),
).cte("summary")
# One row whatever was taken: whether the end was written, and the taken job's columns (or nulls).
_ONE = values(column("one", Integer), name="one").data([(1,)])
_OUTCOME = select(select(func.count()).select_from(_ENDED).scalar_subquery().label("ended"),
                  *_TAKEN.c).select_from(_ONE.outerjoin(_TAKEN, true()))
_WITH_SUMMARY = Prepared(_OUTCOME.add_cte(_PASSED, _FREED, _SUMMARY))
_WITHOUT_SUMMARY = Prepared(_OUTCOME.add_cte(_PASSED, _FREED))


def hands_over(session: Session) -> bool:
    """Whether ``end_and_take`` runs here: on PostgreSQL through psycopg (``Prepared``'s cursor)."""
    return on_psycopg(session)


def end_and_take(session: Session, *, job_id: int, token: str, now: datetime, exit_code: int | None, result: Any,
                 reason: str | None, summary: dict[str, Any] | None, gpu_id: int, worker: str, node: str,
                 lease_s: float) -> tuple[bool, tuple[Any, str] | None]:
    """End job ``job_id`` succeeded under lease ``token``, with its usage ``summary`` (a
    ``usage.summary`` row; None: none stored), and start the first job of GPU ``gpu_id``'s next-up
    list that may start there, on this ``worker`` with a lease of ``lease_s`` seconds, the GPU
    passed to it. In the caller's transaction; a row the database refuses (the summary) fails the
    whole statement.

    Returns whether the end was written (False: the worker no longer held the lease, and nothing
    was written) and, as ``next_up.take_next`` does, the job started (its row as
    ``leases.STARTED_COLUMNS`` and its lease token; None: none)."""
    next_token = uuid.uuid4().hex
    params: dict[str, Any] = {"job_id": job_id, "token": token, "now": now, "exit_code": exit_code,
                              "result": result, "reason": reason, "gpu_id": gpu_id, "node": node, "worker": worker,
                              "next_token": next_token, "expires": now + timedelta(seconds=lease_s)}
    if summary is not None:
        params.update({f"usage_{name}": summary[name] for name in _USAGE_COLUMNS})
    row = (_WITH_SUMMARY if summary is not None else _WITHOUT_SUMMARY).run(session.connection(), params)[0]
    return row.ended == 1, ((row, next_token) if row.id is not None else None)
