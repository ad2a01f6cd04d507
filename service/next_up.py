"""Next-up lists: for each busy GPU, the jobs it runs next, so that its worker starts the next job
in the very transaction that ends one, with no scheduler pass in between (SLURM's backfill does
the same planning; gpuq lets the GPU's own worker act on it).

The policy chooses the lists (``next_up_choice.choose``); the scheduler writes them (``Lists``); a worker
whose GPU fell free takes the first listed job that may still start there (``take_next``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Integer, bindparam, delete, exists, func, insert, literal, or_, select, true
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import policy
from gpuq.service.constants import State
from gpuq.service.dialect import is_sqlite, savepoint
from gpuq.service.leases import STARTED_COLUMNS
from gpuq.service.lifecycle import NOT_HELD, Actor, move, waiting
from gpuq.service.models import Allocation, Gpu, Job, NextUp, Node, table, utcnow
from gpuq.service.prepared import Prepared

_JOBS = table(Job)
_NEXT = table(NextUp)
_GPUS = table(Gpu)
# A listed job's user if it still waits, else null. It reads from the list, each job by its key, as
# a scalar subquery: joined, SQLite chose to walk every pending job and look each up in the list,
# and PostgreSQL turned an EXISTS into the same join whenever its statistics showed few pending
# jobs (a step per job in the queue, in the write lock of every job's end; 1,900 index scans a
# job under a flood of 2,000).
_LISTED_USER = select(_JOBS.c.user).where(_JOBS.c.id == _NEXT.c.job_id, *waiting()).scalar_subquery()
# This GPU's list, unless the GPU or its node was drained or is to drain (`gpuq drain --at`: whether
# a job ends by then is the scheduler's to see), or the GPU is held already.
_GPU_OPEN = (_NEXT.c.gpu_id == bindparam("gpu_id"),
             ~exists().where(_GPUS.c.id == bindparam("gpu_id"), _GPUS.c.drain_reason.is_not(None)),
             ~exists().where(_GPUS.c.id == bindparam("gpu_id"), table(Node).c.name == _GPUS.c.node,
                             or_(table(Node).c.drained.is_(True), table(Node).c.drain_at.is_not(None))))
_GPU_TAKES = (*_GPU_OPEN, ~exists().where(table(Allocation).c.gpu_id == bindparam("gpu_id")))
# This GPU's listed jobs that are still pending and not held: one read.
_LISTED_PREEMPTIBLE = select(_JOBS.c.preemptible).where(_JOBS.c.id == _NEXT.c.job_id).scalar_subquery()
_LISTED = (select(_NEXT.c.job_id, _LISTED_USER.label("user"), _LISTED_PREEMPTIBLE.label("preemptible"))
           .where(*_GPU_TAKES, _LISTED_USER.is_not(None)).order_by(_NEXT.c.rank))


def _started_here(token: str = "token") -> dict[str, Any]:
    """A taken job's values: started now on this worker, with the lease bound as ``token``."""
    return dict(dispatched_at=bindparam("now"), started_at=bindparam("now"), node=bindparam("node"),
                worker=bindparam("worker"), reason=None, lease_token=bindparam(token),
                lease_expires_at=bindparam("expires"))


_STARTED_HERE = _started_here()
_TAKE = Prepared(move("take a listed job", Actor.WORKER, State.PENDING, State.RUNNING,
                      _JOBS.c.id == bindparam("job_id"), NOT_HELD, **_STARTED_HERE).returning(*STARTED_COLUMNS))
# The first listed job that waits, started.
_FIRST_LISTED = _LISTED.with_only_columns(_NEXT.c.job_id).limit(1).scalar_subquery()
_TAKE_FIRST = Prepared(move("take the first listed job", Actor.WORKER, State.PENDING, State.RUNNING,
                            _JOBS.c.id == _FIRST_LISTED, NOT_HELD, **_STARTED_HERE).returning(*STARTED_COLUMNS))


def _first_unlocked(*gpu_takes: Any) -> Any:
    """PostgreSQL's: the id of the first job of this GPU's list that waits and that no other
    transaction has locked (one another worker is taking), where ``gpu_takes`` say the GPU may take
    one. The list is read in rank order first (OFFSET 0 keeps it a step of its own), then each
    listed job is looked up by its key and locked (LATERAL ... FOR UPDATE SKIP LOCKED) until one is
    found: sorted after the lookups, every waiting job of the list was locked."""
    ranked = (select(_NEXT.c.job_id, _NEXT.c.rank).where(*gpu_takes).order_by(_NEXT.c.rank).offset(0)
              .subquery("ranked"))
    unlocked = (select(_JOBS.c.id).where(_JOBS.c.id == ranked.c.job_id, *waiting())
                .with_for_update(skip_locked=True).lateral("unlocked"))
    return (select(unlocked.c.id).select_from(ranked).join(unlocked, true())
            .order_by(ranked.c.rank).limit(1).scalar_subquery())


def taking_first_unlocked(handed_over_by: Any = None) -> Any:
    """PostgreSQL's take, an ``UPDATE ... RETURNING STARTED_COLUMNS`` of the first listed job no
    other worker is taking. With ``handed_over_by``, a CTE of the job whose end hands this GPU over
    (bound as ``job_id``, see service/handover.py), the GPU may be held by that job alone, whole; the
    take happens only if that job's end did, and its lease token is bound as ``next_token``."""
    if handed_over_by is None:
        return move("take the first listed job no other worker is taking", Actor.WORKER, State.PENDING,
                    State.RUNNING, _JOBS.c.id == _first_unlocked(*_GPU_TAKES), NOT_HELD,
                    **_STARTED_HERE).returning(*STARTED_COLUMNS)
    held = table(Allocation).c
    handed = (exists().where(held.gpu_id == bindparam("gpu_id"), held.job_id == bindparam("job_id"),
                             held.share_mib.is_(None)),
              ~exists().where(held.gpu_id == bindparam("gpu_id"), held.job_id != bindparam("job_id")))
    return move("take the first listed job as the last one's end hands its GPU over", Actor.WORKER,
                State.PENDING, State.RUNNING, _JOBS.c.id == _first_unlocked(*_GPU_OPEN, *handed), NOT_HELD,
                exists(select(handed_over_by.c.id)), **_started_here("next_token")).returning(*STARTED_COLUMNS)


# The take and the GPU's allocation to the job it took in one statement (data-modifying CTEs): a
# statement fewer at every job's end (see lifecycle's ``_SUCCEED_AND_FREE``). The allocation's
# unique key refuses it as it refused the separate INSERT, failing the whole statement.
_TAKEN = taking_first_unlocked().cte("taken")
_ALLOCATED = insert(Allocation).from_select(
    ["job_id", "gpu_id", "rank"], select(_TAKEN.c.id, bindparam("gpu_id", type_=Integer), literal(0))).cte("allocated")
_TAKE_FIRST_UNLOCKED = Prepared(select(*_TAKEN.c).add_cte(_ALLOCATED))
# How many of a GPU's listed jobs still wait, and how many rows its list has: a taken job's rows
# stay until the scheduler's next pass, so the second is what that pass wrote.
_LEFT_OF = Prepared(select(func.count().filter(_LISTED_USER.is_not(None)), func.count()).select_from(_NEXT)
                    .where(_NEXT.c.gpu_id == bindparam("gpu_id")))
_ALLOCATE_HERE = Prepared(table(Allocation).insert().values(job_id=bindparam("job_id"), gpu_id=bindparam("gpu_id"),
                                                               rank=0))
_n = table(NextUp).c
_UNLIST = Prepared(table(NextUp).delete().where(_n.gpu_id == bindparam("gpu_id"), _n.job_id == bindparam("job_id")))


def _ranked(insert: Any) -> Any:
    """``insert`` (SQLite's or PostgreSQL's) as an upsert of a row's rank: a row is written whether
    or not it is there already (at another rank, or written by a scheduler that ran before this
    one), so nothing is deleted first."""
    return insert.on_conflict_do_update(index_elements=[_n.gpu_id, _n.job_id], set_={"rank": insert.excluded.rank})


_LIST = Prepared(_ranked(sqlite.insert(NextUp)))
# PostgreSQL's: a pass's rows as arrays, one statement for all of them. Row by row, each row is a
# statement the server parses and runs: under a flood every waiting job is listed on each busy
# GPU, so that was a dozen statements a job, half of all the statements a deep queue cost there.
_IDS = postgresql.ARRAY(Integer)
_KEYS = func.unnest(bindparam("gpu_ids", type_=_IDS), bindparam("job_ids", type_=_IDS)).table_valued(
    "gpu_id", "job_id").render_derived()
_ROWS = func.unnest(bindparam("gpu_ids", type_=_IDS), bindparam("job_ids", type_=_IDS),
                    bindparam("ranks", type_=_IDS)).table_valued("gpu_id", "job_id", "rank").render_derived()
_UNLIST_ALL = delete(_NEXT).where(_n.gpu_id == _KEYS.c.gpu_id, _n.job_id == _KEYS.c.job_id)
_LIST_ALL = _ranked(postgresql.insert(NextUp).from_select(["gpu_id", "job_id", "rank"],
                                                           select(_ROWS.c.gpu_id, _ROWS.c.job_id, _ROWS.c.rank)))
# The first jobs that wait, as many as asked for (in no order: any will do).
_FIRST_WAITING = Prepared(select(_JOBS.c.id).where(*waiting()).limit(bindparam("n")))


def take_next(session: Session, gpu_id: int, worker: str, node: str, lease_s: float,
              limit_of: Callable[[str], int] | None = None) -> tuple[Any, str] | None:
    """Start the first job of this GPU's next-up list that may still start here, as a claim would:
    running on this GPU with a lease. Returns (the job's row as ``STARTED_COLUMNS``, its lease
    token), or None: nothing listed still pending, or the GPU or its node was drained. Call it in
    the transaction that freed the GPU.

    The list is only a hint: the job must still be pending and not held, and its user under their
    GPU limit; a job another GPU's worker took first is passed over. If the scheduler allocated
    this GPU meanwhile (it saw it free), the unique allocation key refuses the take. The taken
    job's row stays listed on other GPUs until the scheduler's next pass drops it: every take reads
    only pending jobs, so that costs nothing but a row. ``limit_of``: each user's GPU limit (0:
    none), where any user has one; None: nobody does."""
    conn = session.connection()
    now = utcnow()
    token = uuid.uuid4().hex
    take = {"gpu_id": gpu_id, "now": now, "node": node, "worker": worker, "token": token,
            "expires": now + timedelta(seconds=lease_s)}
    if limit_of is None:
        # The usual take: the list's first waiting job, in one statement. On SQLite this
        # transaction holds the write lock, so nothing moves meanwhile. On PostgreSQL the workers
        # of a node's GPUs, whose lists hold the same jobs, take at once: each passes over the jobs
        # another one is taking (SKIP LOCKED) instead of queueing behind its transaction.
        if is_sqlite(conn):
            return _take(session, _TAKE_FIRST, take)
        return _take(session, _TAKE_FIRST_UNLOCKED, take, allocates=True)
    listed = conn.execute(_LISTED, {"gpu_id": gpu_id}).all()
    for job_id, user, preemptible in listed:
        limit = limit_of(user)
        if limit and not preemptible and _gpus_in_use(session, user) + 1 > limit:
            continue  # a preemptible job is held to no limit
        taken = _take(session, _TAKE, {**take, "job_id": job_id})
        if taken is not None:
            return taken
    return None


def list_runs_short(session: Session, gpu_id: int) -> bool:
    """Whether half or more of this GPU's next-up list is gone since the scheduler wrote it (a
    worker wakes the scheduler then, to refill it). How long a list is depends on the node's busy
    GPUs and on how much of the queue the pass read (``next_up_choice.choose``), so it is measured against
    the rows the pass wrote, not against a constant."""
    left, written = _LEFT_OF.run(session.connection(), {"gpu_id": gpu_id})[0]
    return 2 * left <= written


def _take(session: Session, statement: Prepared, values: dict[str, Any], allocates: bool = False
          ) -> tuple[Any, str] | None:
    """Run a take (``_TAKE``, ``_TAKE_FIRST`` or ``_TAKE_FIRST_UNLOCKED``) and allocate the GPU to
    the job it started (``allocates``: the take's statement did)."""
    conn = session.connection()
    try:
        # SQLite: this transaction holds the database's write lock, so no allocation can appear
        # between the take and the insert below; PostgreSQL: one may, and the unique key refuses
        # ours, which the savepoint keeps from aborting the job's end.
        with savepoint(session):
            rows = statement.run(conn, values)
            if not rows:
                return None
            row = rows[0]
            if not allocates:
                _ALLOCATE_HERE.send(conn, {"job_id": row.id, "gpu_id": values["gpu_id"]})
    except IntegrityError:
        return None  # the scheduler gave this GPU out meanwhile
    return row, values["token"]


def anything_waits(session: Session, besides: Sequence[int] = ()) -> bool:
    """Whether any job but ``besides`` is pending and not held: what a GPU that fell free wakes the
    scheduler for, and what keeps a submit from placing its own jobs."""
    # One more than ``besides`` holds: if another job waits, at least one of them is not ours. A
    # statement of one form, whatever ``besides`` holds (a NOT IN list was compiled anew each time).
    ours = set(besides)
    return any(row.id not in ours for row in _FIRST_WAITING.run(session.connection(), {"n": len(ours) + 1}))




def _gpus_in_use(session: Session, user: str) -> int:
    """The GPUs ``user``'s jobs hold against their limit: a preemptible job's count for none."""
    return session.scalar(select(func.count()).select_from(Allocation).join(Job, Job.id == Allocation.job_id)
                          .where(Job.user == user, Job.preemptible == False)) or 0  # noqa: E712


class Lists:
    """The next-up rows one scheduler wrote last, and how it rewrites them: each pass writes what
    changed since, not the hundreds of rows of 64 GPUs' lists. ``next_up_choice.choose`` chooses the lists;
    this writes them."""

    def __init__(self) -> None:
        # {(gpu id, job id): rank} as written last; None: not known (rewrite them whole).
        self.written: dict[tuple[int, int], int] | None = None

    def changes(self, lists: dict[int, list[int]], order: list[policy.JobRequest]) -> Changes:
        """The rows wanted now, {(gpu id, job id): rank}, and as changes to ``written``: the rows
        to delete and those to write (new to the lists, or at another rank). A worker that takes a
        job leaves its rows on the other GPUs' lists; they go here, as the job is no longer pending."""
        rank = {j.id: r for r, j in enumerate(order)}
        listed = self.written or {}
        # Ranks only order the lists. Under a flood the jobs ahead leave and new ones join at the
        # tail, which moves every rank by the same amount: the rows written stay, shifted, and
        # only the jobs taken and the jobs new to the lists are written.
        written = {job: r for (_, job), r in listed.items()}
        shifts = {written[job] - rank[job] for jobs in lists.values() for job in jobs if job in written}
        shift = shifts.pop() if len(shifts) == 1 else 0
        wanted = {(gpu, job): rank[job] + shift for gpu, jobs in lists.items() for job in jobs}
        changed = [key for key, r in wanted.items() if listed.get(key) != r]  # written as upserts
        stale = [key for key in listed if key not in wanted]
        return Changes(wanted, stale, changed)

    def write(self, session: Session, changes: Changes) -> None:
        """Write ``changes`` in the pass's transaction; ``written`` follows once it commits
        (``committed``), or is forgotten if it does not (``forget``)."""
        conn = session.connection()
        if self.written is None:
            conn.execute(delete(NextUp))  # not known what is there: rewrite the lists whole
        stale, rows = changes.stale, [(g, j, changes.wanted[g, j]) for g, j in changes.changed]
        if is_sqlite(conn):
            # Prepared, row by row: a quick pass under a flood writes a few rows every 20 ms inside
            # the write lock, where the ORM's bulk statements cost a millisecond a pass, and a row
            # costs SQLite, in this process, a few microseconds.
            if stale:
                _UNLIST.run(conn, [{"gpu_id": g, "job_id": j} for g, j in stale])
            if rows:
                _LIST.run(conn, [{"gpu_id": g, "job_id": j, "rank": r} for g, j, r in rows])
            return
        if stale:
            gpu_ids, job_ids = (list(column) for column in zip(*stale, strict=True))
            conn.execute(_UNLIST_ALL, {"gpu_ids": gpu_ids, "job_ids": job_ids})
        if rows:
            gpu_ids, job_ids, ranks = (list(column) for column in zip(*rows, strict=True))
            conn.execute(_LIST_ALL, {"gpu_ids": gpu_ids, "job_ids": job_ids, "ranks": ranks})

    def committed(self, changes: Changes) -> None:
        self.written = changes.wanted

    def forget(self) -> None:
        self.written = None


@dataclass(frozen=True)
class Changes:
    wanted: dict[tuple[int, int], int]
    stale: list[tuple[int, int]]
    changed: list[tuple[int, int]]

    def __bool__(self) -> bool:
        return bool(self.stale or self.changed)
