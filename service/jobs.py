"""The queue's operations on SQL: submit, look up, cancel, claim, finish, output.

Every state change is a conditional UPDATE (``WHERE id = ? AND state = ?``): a job starts at most
once even when its message is delivered twice, and a cancel never overwrites an ending.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, exists, func, select, true, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import broker
from gpuq.service import constants as c
from gpuq.service import snapshot as code_state
from gpuq.service.db import read_scope, require_schema, savepoint, session_scope
from gpuq.service.devices import GpuInfo, open_devices
from gpuq.service.errors import DuplicateSubmission, InvalidSpec, JobNotFound, NotAllowed, OverLimit, StateConflict
from gpuq.service.models import Allocation, Gpu, Job, JobMetric, JobOutput, NextUp, Node, Submission, utcnow
from gpuq.service.prepared import Prepared
from gpuq.service.settings import Settings
from gpuq.service.rights import Caller, check_change
from gpuq.service.snapshot import GitState, Staged, Stager
from gpuq.service.spec import JobSpec

# ``submit_all``'s default for ``git``: ask git here, in the submitting process.
CAPTURE = object()
# Sends placed jobs' messages, (job id, queue) each; returns those it could not send.
Sender = Callable[[list[tuple[int, str]]], list[tuple[int, str]]]

# The worker's per-job statements are built once, in Core: a worker ends a job and starts the
# next every few milliseconds on a queue of short jobs, and building them is most of that cost.
_JOBS = Job.__table__


def largest_node(session: Session, settings: Settings, local: list[GpuInfo]) -> tuple[str | None, int]:
    """The node with the most GPUs known to gpuq (registered by workers, or ``local``: this node's)."""
    rows = _GPUS_PER_NODE.run(session.connection(), {})
    best = max(rows, key=lambda r: r[1], default=(None, 0))
    if len(local) > best[1]:
        return settings.node, len(local)
    return best[0], best[1]


def submit(settings: Settings, spec: JobSpec) -> Job:
    """Queue one job; see ``submit_all``."""
    return submit_all(settings, [spec])[0]


def submit_all(settings: Settings, specs: list[JobSpec], *, snapshot: bool = False,
               record_code: bool = True, git: GitState | None | object = CAPTURE,
               stage: Stager | None = None, key: str | None = None, send: Sender | None = None) -> list[Job]:
    """Queue ``specs`` as pending jobs in one transaction (an array shares its first job's id as
    ``array_id``) and wake the scheduler. Nothing is written on any error.

    A command's git state is recorded (``record_code``; a resubmit copies it instead), and with
    ``snapshot`` its work tree is copied and the jobs run from the copy (service/snapshot.py).
    ``git`` is the work tree's state as the submitter's own process found it (the server is given
    it by the client, which runs git as the user); by default it is asked of git here. ``stage``
    copies the work tree (by default in this process; the server copies as the submitting user).
    Jobs placed at submit get their messages from the scheduler, handed over through Redis;
    ``send``, given by a process that keeps a Celery app (the server), sends them itself, one hop
    sooner, and returns those it could not send, which go to the scheduler.
    ``key``, an idempotency key, is stored with the jobs in their transaction: a second submit
    with the same key writes nothing and raises ``DuplicateSubmission`` with the first one's job
    ids (None when both ran at once and the other one's ids are not known yet).

    Everything that can be done before the write is: the checks read in their own read-only
    transaction, git runs, the rows are built; the write transaction (on SQLite, the one write
    lock every worker's job end waits for) holds just the inserts and the placement."""
    require_schema(settings)
    broker.check(settings)
    first = specs[0]
    with read_scope(settings) as session:
        if key is not None and (made := submitted_with(session, key, first.user)) is not None:
            raise DuplicateSubmission(key, made)  # asked again: the jobs exist, whatever the checks say now
        _check_resources(session, settings, first)
        _check_dependencies(session, first.after)
        _check_pending_limit(session, settings, first.user, len(specs))
    _check_priority(settings, first)
    if first.host_mem_mib is not None and first.kind != c.KIND_COMMAND:
        raise InvalidSpec("--host-mem limits a command's processes; a built-in workload runs in its worker")
    staged = None
    try:
        specs, staged = _code_at_submit(settings, specs, snapshot, record_code, git, stage)
        now = utcnow()
        values = [_row(s, now) for s in specs]
        array = len(values) > 1 or first.array_index is not None
        with session_scope(settings) as session:
            conn = session.connection()
            ids = [conn.execute(_INSERT_JOB.returning(_JOBS.c.id), values[:1]).scalar_one()]
            if staged is not None:
                staged.place(ids[0])
            for row in values:
                row.update(array_id=ids[0] if array else None, **_staged_at(staged))
            if array or staged is not None:
                conn.execute(_JOBS.update().where(_JOBS.c.id == ids[0]).values(
                    array_id=values[0]["array_id"], snapshot=values[0]["snapshot"], cwd=values[0]["cwd"]))
            if len(values) > 1:
                # Ids are drawn in the order the rows are inserted: sorted, they are the rows'.
                ids += sorted(conn.execute(_INSERT_JOB.returning(_JOBS.c.id), values[1:]).scalars())
            if key is not None:
                try:  # no savepoint: a refused key rolls the whole submission back, as it should
                    _INSERT_SUBMISSION.run(conn, {"key": key, "user": first.user, "job_ids": ids, "submitted_at": now})
                except IntegrityError:
                    raise DuplicateSubmission(key, None) from None  # the same key, sent twice at once
            from gpuq.service.scheduler import place_at_submit  # it imports this module

            placed = place_at_submit(session, settings, ids)
    except BaseException:
        if staged is not None:
            staged.discard()
        raise
    where = {job_id: (node, at) for job_id, _, node, at in placed}
    for job_id, row in zip(ids, values):
        row["id"] = job_id
        if job_id in where:
            row.update(state=c.DISPATCHED, node=where[job_id][0], dispatched_at=where[job_id][1])
    messages = [(job_id, queue) for job_id, queue, _, _ in placed]
    if messages and send is not None:
        messages = send(messages)  # those it could not send go to the scheduler, as below
    if messages:
        # Jobs of the submission left waiting need a pass; those placed need only their messages.
        broker.hand_over(settings, messages, wake=len(placed) < len(ids))
    elif len(placed) < len(ids):
        broker.wake_scheduler(settings)
    return [Job(**row) for row in values]


_INSERT_JOB = _JOBS.insert()
# A submit's checks and its key, run on every submit the server takes.
_INSERT_SUBMISSION = Prepared(Submission.__table__.insert())
_SUBMITTED = Submission.__table__
_SUBMITTED_WITH = Prepared(select(_SUBMITTED.c.user, _SUBMITTED.c.job_ids).where(_SUBMITTED.c.key == bindparam("key")))
_GPUS_PER_NODE = Prepared(select(Gpu.__table__.c.node, func.count()).group_by(Gpu.__table__.c.node))
# Held and not held apart: each count then seeks this user's jobs in the queue-order index (state,
# held, user, ...) instead of counting through every pending job of everyone.
_PENDING_OF = Prepared(select(func.count()).select_from(_JOBS).where(
    _JOBS.c.state == c.PENDING, _JOBS.c.held == bindparam("held"), _JOBS.c.user == bindparam("user")))


def _row(s: JobSpec, now: datetime) -> dict[str, Any]:
    """The ``jobs`` row of a spec just submitted, every column given (it is also the Job returned)."""
    return dict(name=s.name, user=s.user, kind=s.kind, workload=s.workload, params=s.params, argv=s.argv,
                cwd=s.cwd, gpus=s.gpus, priority=s.priority, state=c.PENDING, submitted_at=now,
                mem_mib=s.mem_mib, on_node=s.on_node, time_limit_s=s.time_limit_s, max_retries=s.max_retries,
                attempts=[], held=s.held, after=s.after, after_any=s.after_any, env=s.env,
                array_index=s.array_index, array_id=None, git_commit=s.git_commit, git_dirty=s.git_dirty,
                git_diff=s.git_diff, git_diff_cut=s.git_diff_cut, snapshot=s.snapshot,
                host_mem_mib=s.host_mem_mib, requeues=0)


def _staged_at(staged: Staged | None) -> dict[str, Any]:
    """Where the jobs of a submission with a snapshot run (nothing to change without one)."""
    return {} if staged is None else {"snapshot": str(staged.path), "cwd": staged.workdir()}


def _code_at_submit(settings: Settings, specs: list[JobSpec], snapshot: bool, record_code: bool,
                    git: GitState | None | object, stage: Stager | None) -> tuple[list[JobSpec], Staged | None]:
    """The specs with their git state recorded, and the staged snapshot if one was asked for.
    The tasks of one submission share one directory, so git is asked once."""
    first = specs[0]
    if first.kind != c.KIND_COMMAND or not (record_code or snapshot):
        return specs, None
    if git is CAPTURE:
        git = code_state.capture(first.cwd, settings.git_diff_max_bytes)
    assert git is None or isinstance(git, GitState)
    staged = (stage or code_state.stage)(settings, first.cwd, git) if snapshot else None
    if git is not None and record_code:
        specs = [replace(s, git_commit=git.commit, git_dirty=git.dirty, git_diff=git.diff or None,
                         git_diff_cut=git.diff_cut) for s in specs]
    return specs, staged


def _check_resources(session: Session, settings: Settings, spec: JobSpec) -> None:
    local = open_devices(settings).list()  # once: on a GPU node this initialises NVML
    node, most = largest_node(session, settings, local)
    if most == 0:
        raise InvalidSpec("no GPU is known to gpuq yet: start the workers first (`gpuq up`, or "
                          "`gpuq worker --gpu I` on each GPU node)")
    if spec.on_node is not None:
        n = session.scalar(select(func.count()).select_from(Gpu).where(Gpu.node == spec.on_node))
        if spec.on_node == settings.node:
            n = max(n, len(local))
        if n == 0:
            raise InvalidSpec(f"--node {spec.on_node}: no such node is known to gpuq")
        if spec.gpus > n:
            raise InvalidSpec(f"--gpus {spec.gpus} is more than node {spec.on_node} has ({n})")
    elif spec.gpus > most:
        raise InvalidSpec(f"--gpus {spec.gpus} is more than any node has (the largest, {node}, has {most})")
    if spec.mem_mib is not None:
        biggest = session.scalar(select(func.max(Gpu.memory_total_mib))) or 0
        here = max((g.memory_total_mib for g in local), default=0)
        if spec.mem_mib > max(biggest, here):
            raise InvalidSpec(f"--mem {spec.mem_mib} MiB is more than any GPU has ({max(biggest, here)} MiB)")


def _check_pending_limit(session: Session, settings: Settings, user: str, adding: int) -> None:
    limit = settings.max_pending_per_user
    if not limit:
        return
    conn = session.connection()
    pending = sum(_PENDING_OF.run(conn, {"user": user, "held": held})[0][0] for held in (False, True))
    if pending + adding > limit:
        raise OverLimit(f"{user} has {pending} jobs pending and the limit is {limit} at once "
                        f"(GPUQ_MAX_PENDING_PER_USER); this submission adds {adding}")


def submitted_with(session: Session, key: str, user: str) -> list[int] | None:
    """The ids of the jobs ``user`` submitted with idempotency key ``key``, or None. Another
    user's key is theirs: it is refused, not answered."""
    rows = _SUBMITTED_WITH.run(session.connection(), {"key": key})
    if not rows:
        return None
    row = rows[0]
    if row.user != user:
        raise NotAllowed("that submission key belongs to another user")
    return list(row.job_ids)


def _check_priority(settings: Settings, spec: JobSpec) -> None:
    if spec.priority > settings.max_priority and spec.user not in settings.admin_users:
        raise InvalidSpec(f"--priority {spec.priority} is above the users' limit of {settings.max_priority}")


def _check_dependencies(session: Session, after: list[int] | None) -> None:
    if not after:
        return
    found = set(session.scalars(select(Job.id).where(Job.id.in_(after))))
    missing = [i for i in after if i not in found]
    if missing:
        raise InvalidSpec(f"--after: no job {missing[0]}")


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise JobNotFound(f"no job {job_id}")
    return job


def list_jobs(session: Session, *, ended_limit: int = 10, user: str | None = None) -> list[Job]:
    """Active jobs (oldest first), then the ``ended_limit`` most recently ended ones."""
    base = select(Job)
    if user:
        base = base.where(Job.user == user)
    rows = list(session.scalars(base.where(Job.state.in_(c.ACTIVE_STATES)).order_by(Job.id)))
    if ended_limit:
        ended = session.scalars(base.where(Job.state.in_(c.END_STATES))
                                .order_by(Job.ended_at.desc(), Job.id.desc()).limit(ended_limit))
        rows.extend(sorted(ended, key=lambda j: j.id))
    return rows


def job_gpus(session: Session, job_id: int) -> list[Gpu]:
    """The GPUs allocated to the job, in rank order."""
    return list(session.scalars(select(Gpu).join(Allocation).where(Allocation.job_id == job_id)
                                .order_by(Allocation.rank)))


@dataclass(frozen=True)
class CancelOutcome:
    job_id: int
    state: str  # "cancelled" at once, or "cancelling" (a running job being stopped by its worker)


def cancel(settings: Settings, job_id: int, user: Caller | str | None = None) -> CancelOutcome:
    """Cancel a job: a pending or dispatched one at once, a running one by asking its worker."""
    require_schema(settings)
    now = utcnow()
    with session_scope(settings) as session:
        job = get_job(session, job_id)
        check_change(settings, job_id, job.user, Caller.of(user))
        if job.state in c.END_STATES:
            raise StateConflict(f"job {job_id} already ended ({job.state})")
        ended = session.execute(
            update(Job).where(Job.id == job_id, Job.state.in_((c.PENDING, c.DISPATCHED)))
            .values(state=c.CANCELLED, ended_at=now, cancel_requested_at=now, reason="cancelled by user")
        ).rowcount
        if ended:
            # A dispatched job's worker will find the state changed and drop the message.
            session.execute(delete(Allocation).where(Allocation.job_id == job_id))
            outcome = CancelOutcome(job_id, c.CANCELLED)
        else:
            session.execute(update(Job).where(Job.id == job_id, Job.state == c.RUNNING)
                            .values(cancel_requested_at=now))
            outcome = CancelOutcome(job_id, "cancelling")
    if outcome.state == c.CANCELLED:
        broker.wake_scheduler(settings)
    return outcome


def set_held(settings: Settings, job_id: int, held: bool, user: Caller | str | None = None) -> None:
    """Hold a pending job (it will not start) or release it."""
    require_schema(settings)
    with session_scope(settings) as session:
        job = get_job(session, job_id)
        check_change(settings, job_id, job.user, Caller.of(user))
        if job.state != c.PENDING:
            raise StateConflict(f"job {job_id} is {job.state}; only a pending job can be "
                                f"{'held' if held else 'released'}")
        if job.held == held:
            raise StateConflict(f"job {job_id} is {'already held' if held else 'not held'}")
        session.execute(update(Job).where(Job.id == job_id, Job.state == c.PENDING)
                        .values(held=held, reason="held" if held else None))
    if not held:
        broker.wake_scheduler(settings)


def array_jobs(session: Session, array_id: int) -> list[int]:
    """The jobs of array ``array_id``; JobNotFound if there is no such array."""
    ids = list(session.scalars(select(Job.id).where(Job.array_id == array_id).order_by(Job.id)))
    if not ids:
        raise JobNotFound(f"no array {array_id}")
    return ids


def active_jobs_of(session: Session, user: str) -> list[int]:
    return list(session.scalars(select(Job.id).where(Job.user == user, Job.state.in_(c.ACTIVE_STATES))
                                .order_by(Job.id)))


# ---- the worker's side ---------------------------------------------------------------------------

def claim(session: Session, job_id: int, gpu_id: int, worker: str, lease_s: float) -> str | None:
    """Mark the job running on this worker, if it is dispatched to this GPU as rank 0, and give it
    a lease of ``lease_s`` seconds. Atomic. Returns the lease token, or None if it was not ours."""
    token = uuid.uuid4().hex
    now = utcnow()
    held = exists().where(Allocation.job_id == job_id, Allocation.gpu_id == gpu_id, Allocation.rank == 0)
    claimed = session.execute(
        update(Job).where(Job.id == job_id, Job.state == c.DISPATCHED, held)
        .values(state=c.RUNNING, started_at=now, worker=worker, lease_token=token,
                lease_expires_at=now + timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    ).rowcount == 1
    return token if claimed else None


def take_next(session: Session, gpu_id: int, worker: str, node: str, lease_s: float,
              user_gpu_limit: int = 0) -> tuple[Any, str] | None:
    """Start the first job of this GPU's next-up list that may still start here, as a claim would:
    running on this GPU with a lease. Returns (the job's row as ``TAKEN_COLUMNS``, its lease
    token), or None: nothing listed still pending, or the GPU or its node was drained. Call it in
    the transaction that freed the GPU.

    The list is only a hint: the job must still be pending and not held, and its user under their
    GPU limit; a job another GPU's worker took first is passed over. If the scheduler allocated
    this GPU meanwhile (it saw it free), the unique allocation key refuses the take. The taken
    job's row stays listed on other GPUs until the scheduler's next pass drops it: every take reads
    only pending jobs, so that costs nothing but a row."""
    conn = session.connection()
    now = utcnow()
    token = uuid.uuid4().hex
    take = {"gpu_id": gpu_id, "now": now, "node": node, "worker": worker, "token": token,
            "expires": now + timedelta(seconds=lease_s)}
    if not user_gpu_limit:
        # The usual take: the list's first waiting job, in one statement. On SQLite this
        # transaction holds the write lock, so nothing moves meanwhile. On PostgreSQL the workers
        # of a node's GPUs, whose lists hold the same jobs, take at once: each passes over the jobs
        # another one is taking (SKIP LOCKED) instead of queueing behind its transaction.
        return _take(session, _TAKE_FIRST if conn.dialect.name == "sqlite" else _TAKE_FIRST_UNLOCKED, take)
    listed = conn.execute(_LISTED, {"gpu_id": gpu_id}).all()
    for job_id, user in listed:
        if _gpus_held(session, user) + 1 > user_gpu_limit:
            continue
        taken = _take(session, _TAKE, {**take, "job_id": job_id})
        if taken is not None:
            return taken
    return None


def listed_left(session: Session, gpu_id: int) -> int:
    """How many jobs of this GPU's next-up list still wait (a worker wakes the scheduler to refill
    a list that runs short)."""
    return _LEFT.run(session.connection(), {"gpu_id": gpu_id})[0][0]


def _take(session: Session, statement, values: dict[str, Any]) -> tuple[Any, str] | None:
    """Run a take (``_TAKE``, ``_TAKE_FIRST`` or ``_TAKE_FIRST_UNLOCKED``) and allocate the GPU to
    the job it started."""
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
            _ALLOCATE_HERE.run(conn, {"job_id": row.id, "gpu_id": values["gpu_id"]})
    except IntegrityError:
        return None  # the scheduler gave this GPU out meanwhile
    return row, values["token"]


def waiting(table=_JOBS) -> tuple:
    """What makes a job one that waits to run: pending and not held (``table``: jobs, or an alias).
    "= false", not "IS false": PostgreSQL seeks a boolean index column only on equality."""
    return table.c.state == c.PENDING, table.c.held == False  # noqa: E712


_NEXT = NextUp.__table__
_GPUS = Gpu.__table__
# What a take returns of the job: what its run needs (workers/runner.py's JobRun).
TAKEN_COLUMNS = (_JOBS.c.id, _JOBS.c.name, _JOBS.c.kind, _JOBS.c.workload, _JOBS.c.params, _JOBS.c.argv,
                 _JOBS.c.cwd, _JOBS.c.env, _JOBS.c.gpus, _JOBS.c.started_at, _JOBS.c.time_limit_s,
                 _JOBS.c.host_mem_mib, _JOBS.c.user, _JOBS.c.attempts)
# A listed job's user if it still waits, else null. It reads from the list, each job by its key, as
# a scalar subquery: joined, SQLite chose to walk every pending job and look each up in the list,
# and PostgreSQL turned an EXISTS into the same join whenever its statistics showed few pending
# jobs (a step per job in the queue, in the write lock of every job's end; 1,900 index scans a
# job under a flood of 2,000).
_LISTED_USER = select(_JOBS.c.user).where(_JOBS.c.id == _NEXT.c.job_id, *waiting()).scalar_subquery()
# This GPU's list, unless the GPU or its node was drained or the GPU is held already.
_GPU_TAKES = (_NEXT.c.gpu_id == bindparam("gpu_id"),
              ~exists().where(_GPUS.c.id == bindparam("gpu_id"), _GPUS.c.drain_reason.is_not(None)),
              ~exists().where(_GPUS.c.id == bindparam("gpu_id"), Node.__table__.c.name == _GPUS.c.node,
                              Node.__table__.c.drained.is_(True)),
              ~exists().where(Allocation.__table__.c.gpu_id == bindparam("gpu_id")))
# This GPU's listed jobs that are still pending and not held: one read.
_LISTED = (select(_NEXT.c.job_id, _LISTED_USER.label("user")).where(*_GPU_TAKES, _LISTED_USER.is_not(None))
           .order_by(_NEXT.c.rank))
_STARTED_HERE = dict(state=c.RUNNING, dispatched_at=bindparam("now"), started_at=bindparam("now"),
                     node=bindparam("node"), worker=bindparam("worker"), reason=None, lease_token=bindparam("token"),
                     lease_expires_at=bindparam("expires"))
_TAKE = Prepared(_JOBS.update().where(_JOBS.c.id == bindparam("job_id"), *waiting()).values(**_STARTED_HERE)
                 .returning(*TAKEN_COLUMNS))
# The first listed job that waits, started.
_FIRST_LISTED = _LISTED.with_only_columns(_NEXT.c.job_id).limit(1).scalar_subquery()
_TAKE_FIRST = Prepared(_JOBS.update().where(_JOBS.c.id == _FIRST_LISTED, *waiting()).values(**_STARTED_HERE)
                       .returning(*TAKEN_COLUMNS))
# PostgreSQL's: the first listed job that waits and that no other transaction has locked (one
# another worker is taking). The list is read in rank order first (OFFSET 0 keeps it a step of
# its own), then each listed job is looked up by its key and locked (LATERAL ... FOR UPDATE SKIP
# LOCKED) until one is found: sorted after the lookups, every waiting job of the list was locked.
_RANKED = (select(_NEXT.c.job_id, _NEXT.c.rank).where(*_GPU_TAKES).order_by(_NEXT.c.rank).offset(0)
           .subquery("ranked"))
_UNLOCKED = (select(_JOBS.c.id).where(_JOBS.c.id == _RANKED.c.job_id, *waiting())
             .with_for_update(skip_locked=True).lateral("unlocked"))
_FIRST_UNLOCKED = (select(_UNLOCKED.c.id).select_from(_RANKED).join(_UNLOCKED, true())
                   .order_by(_RANKED.c.rank).limit(1).scalar_subquery())
_TAKE_FIRST_UNLOCKED = Prepared(_JOBS.update().where(_JOBS.c.id == _FIRST_UNLOCKED, *waiting())
                                .values(**_STARTED_HERE).returning(*TAKEN_COLUMNS))
_LEFT = Prepared(select(func.count()).select_from(_NEXT)
                 .where(_NEXT.c.gpu_id == bindparam("gpu_id"), _LISTED_USER.is_not(None)))
_ALLOCATE_HERE = Prepared(Allocation.__table__.insert().values(job_id=bindparam("job_id"), gpu_id=bindparam("gpu_id"),
                                                               rank=0))


def anything_waits(session: Session, besides: Sequence[int] = ()) -> bool:
    """Whether any job but ``besides`` is pending and not held: what a GPU that fell free wakes the
    scheduler for, and what keeps a submit from placing its own jobs."""
    return session.connection().execute(_WAITING, {"besides": list(besides)}).first() is not None


_WAITING = select(_JOBS.c.id).where(*waiting(), _JOBS.c.id.not_in(bindparam("besides", expanding=True))).limit(1)


def _gpus_held(session: Session, user: str) -> int:
    return session.scalar(select(func.count()).select_from(Allocation).join(Job, Job.id == Allocation.job_id)
                          .where(Job.user == user)) or 0


def renew_lease(session: Session, job_id: int, token: str, lease_s: float) -> bool:
    """Extend the running job's lease; False if this token no longer holds it (the job ended, or
    was reaped and given to someone else): its worker must stop it."""
    return session.execute(
        update(Job).where(Job.id == job_id, Job.state == c.RUNNING, Job.lease_token == token)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    ).rowcount == 1


def set_rendezvous(session: Session, job_id: int, init_method: str) -> None:
    session.execute(update(Job).where(Job.id == job_id, Job.state == c.RUNNING).values(rendezvous=init_method))


def rank_to_run(session: Session, job_id: int, gpu_id: int, rank: int) -> Job | None:
    """The job, if it is running with rank ``rank`` (1 or more) on this GPU and its ranks' meeting
    point is set; None otherwise (rank 0 is the job itself, started by run_job)."""
    if rank < 1:
        return None
    return session.scalar(
        select(Job).join(Allocation, Allocation.job_id == Job.id)
        .where(Job.id == job_id, Job.state == c.RUNNING, Job.rendezvous.is_not(None),
               Allocation.gpu_id == gpu_id, Allocation.rank == rank)
    )


def cancel_requested(session: Session, job_id: int) -> bool:
    row = session.execute(select(Job.state, Job.cancel_requested_at).where(Job.id == job_id)).one_or_none()
    return row is None or row.state != c.RUNNING or row.cancel_requested_at is not None


def finish(session: Session, job_id: int, state: str, *, token: str | None = None, failure: str | None = None,
           exit_code: int | None = None, result: dict[str, Any] | None = None, reason: str | None = None,
           from_state: str = c.RUNNING, max_requeues: int = 0, expired_before: datetime | None = None,
           now: datetime | None = None) -> bool:
    """End a job and free its GPUs, or put it back to pending when it may run again:

    - an infrastructure failure (``c.INFRA_FAILURES``) of a job that asked for retries is requeued
      without using one up, at most ``max_requeues`` times;
    - any other failure is retried while the job has retries left.

    Every attempt is kept. Only the holder of the lease ``token`` may end a running job; the
    reaper passes ``expired_before`` instead (the lease must have run out before then). False if
    the job was not in ``from_state`` under that lease: it had ended, or was taken back.
    """
    assert state in c.END_STATES
    conn = session.connection()
    now = now or utcnow()
    if state == c.SUCCEEDED and token is not None and from_state == c.RUNNING:
        # The common end needs nothing of the row: a success is never retried. One statement.
        if _SUCCEED.run(conn, {"job_id": job_id, "token": token, "now": now, "result": result,
                               "exit_code": exit_code, "reason": reason}) != 1:
            return False
        _FREE_GPUS.run(conn, {"job_id": job_id})
        return True
    job = conn.execute(_FINISH_READ, {"job_id": job_id}).one_or_none()
    if job is None or job.state != from_state:
        return False
    guard = [_JOBS.c.id == job_id, _JOBS.c.state == from_state]
    if token is not None:
        guard.append(_JOBS.c.lease_token == token)
    if expired_before is not None:
        guard.append(_JOBS.c.lease_expires_at < expired_before)
    ended: dict[str, Any] = dict(state=state, ended_at=now, exit_code=exit_code, result=result, reason=reason,
                                 failure=failure if state != c.SUCCEEDED else None, lease_token=None,
                                 lease_expires_at=None)
    again = _runs_again(job, state, failure, max_requeues)
    if again is not None:
        attempt = {"started_at": job.started_at.isoformat() if job.started_at else None, "ended_at": now.isoformat(),
                   "state": state, "failure": failure, "reason": reason, "exit_code": exit_code, "worker": job.worker,
                   "requeue": again == "requeue"}
        requeues = job.requeues + (again == "requeue")
        what = (f"requeue {requeues} of at most {max_requeues}" if again == "requeue"
                else f"retry {_retries_used(job) + 1} of {job.max_retries}")
        ended = dict(state=c.PENDING, attempts=[*(job.attempts or []), attempt], started_at=None, dispatched_at=None,
                     node=None, worker=None, exit_code=None, result=None, cancel_requested_at=None, rendezvous=None,
                     lease_token=None, lease_expires_at=None, requeues=requeues, failure=None,
                     reason=f"{what} after: {reason}")
    elif failure in c.INFRA_FAILURES and job.max_retries and job.requeues >= max_requeues:
        ended["reason"] = f"{reason} (requeued {job.requeues} times already: the cap)"
    done = conn.execute(_JOBS.update().where(*guard).values(**ended)).rowcount == 1
    if done:
        _FREE_GPUS.run(conn, {"job_id": job_id})
    return done


_FINISH_READ = select(_JOBS.c.state, _JOBS.c.started_at, _JOBS.c.worker, _JOBS.c.attempts, _JOBS.c.requeues,
                      _JOBS.c.max_retries).where(_JOBS.c.id == bindparam("job_id"))
_SUCCEED = Prepared(_JOBS.update().where(_JOBS.c.id == bindparam("job_id"), _JOBS.c.state == c.RUNNING,
                                          _JOBS.c.lease_token == bindparam("token"))
                    .values(state=c.SUCCEEDED, ended_at=bindparam("now"), exit_code=bindparam("exit_code"),
                            result=bindparam("result"), reason=bindparam("reason"), failure=None, lease_token=None,
                            lease_expires_at=None))
_FREE_GPUS = Prepared(Allocation.__table__.delete().where(Allocation.__table__.c.job_id == bindparam("job_id")))


def _retries_used(job: Job) -> int:
    return sum(1 for a in job.attempts or [] if not a.get("requeue"))


def _runs_again(job: Job, state: str, failure: str | None, max_requeues: int) -> str | None:
    """"requeue" (an infrastructure failure), "retry" (the job's own), or None: it ends."""
    if state == c.SUCCEEDED or state == c.CANCELLED or failure == c.FAILURE_CANCELLED:
        return None
    if failure in c.INFRA_FAILURES:
        return "requeue" if job.max_retries > 0 and job.requeues < max_requeues else None
    if state == c.FAILED and _retries_used(job) < job.max_retries:
        return "retry"
    return None


def next_output_seq(session: Session, job_id: int) -> int:
    """The number the job's next output chunk gets: a retried job's attempts share one log."""
    last = session.scalar(select(func.max(JobOutput.seq)).where(JobOutput.job_id == job_id))
    return 0 if last is None else last + 1


def append_output(session: Session, job_id: int, seq: int, data: str) -> None:
    session.add(JobOutput(job_id=job_id, seq=seq, data=data, written_at=utcnow()))


def read_output(session: Session, job_id: int, after_seq: int = -1) -> list[tuple[int, str]]:
    rows = session.execute(select(JobOutput.seq, JobOutput.data)
                           .where(JobOutput.job_id == job_id, JobOutput.seq > after_seq)
                           .order_by(JobOutput.seq)).all()
    return [(r.seq, r.data) for r in rows]


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


def elapsed(job: Job, now: datetime | None = None) -> timedelta | None:
    """How long the job has run (or ran); None if it never started."""
    if job.started_at is None:
        return None
    return (job.ended_at or now or utcnow()) - job.started_at


def wait_states(session: Session, job_ids: Sequence[int]) -> dict[int, str]:
    return {r.id: r.state for r in session.execute(select(Job.id, Job.state).where(Job.id.in_(job_ids)))}
