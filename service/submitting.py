"""Submitting: a submission checked (service/submit_checks.py), its rows written in one transaction
with its idempotency key, its code recorded or staged, and its jobs placed at once when nothing
else waits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import broker, dependencies, mail, policy
from gpuq.service import constants as c
from gpuq.service import snapshot as code_state
from gpuq.service.allocating import place_at_submit
from gpuq.service.constants import MAX_CPUS, State
from gpuq.service.db import read_scope, require_schema, write_scope
from gpuq.service.dialect import draw_ids, draws_ids, one_at_a_time
from gpuq.service.errors import DuplicateSubmission
from gpuq.service.lifecycle import Actor, check, move
from gpuq.service.models import Job, Submission, table, utcnow
from gpuq.service.prepared import Prepared
from gpuq.service.settings import Settings
from gpuq.service.snapshot import GitState, Staged, Stager
from gpuq.service.spec import JobSpec
from gpuq.service.submit_checks import check_pending_limit, check_submission, submitted_with
from gpuq.service.units import AFTER_CORR

# A new job's state, as the lifecycle's table has it.
_NEW = State.PENDING
check(Actor.SUBMIT, None, _NEW)
# ``submit_all``'s default for ``git``: ask git here, in the submitting process.
CAPTURE = object()
# Sends placed jobs' messages, (job id, queue) each; returns those it could not send.
Sender = Callable[[list[tuple[int, str]]], list[tuple[int, str]]]

_JOBS = table(Job)
# The first row of a submission, once its id is known: the array it heads, where its snapshot is.
_FIRST_ROW = move("complete a submission's first row", Actor.SUBMIT, State.PENDING, None,
                  _JOBS.c.id == bindparam("job_id"), array_id=bindparam("first_array_id"),
                  snapshot=bindparam("first_snapshot"), cwd=bindparam("first_cwd"))
_INSERT_JOB = _JOBS.insert().returning(_JOBS.c.id)
# A submission's first row (most submissions' only one) on the driver's cursor: the insert, its
# thirty-odd binds through SQLAlchemy, was a tenth to a sixth of the server's CPU a submit.
_INSERT_FIRST_JOB = Prepared(_INSERT_JOB)
# The rest of an array's rows with their ids drawn beforehand (``dialect.draws_ids``).
_INSERT_NUMBERED_JOBS = Prepared(_JOBS.insert())
# A submit's checks and its key, run on every submit the server takes.
_INSERT_SUBMISSION = Prepared(table(Submission).insert())


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
    ids (None if that one's transaction is not visible yet), or ``NotAllowed`` for another
    user's key.

    Everything that can be done before the write is: the checks read in their own read-only
    transaction, git runs, the rows are built; the write transaction (on SQLite, the one write
    lock every worker's job end waits for) holds just the inserts and the placement."""
    require_schema(settings)
    broker.check(settings)
    specs, near_cap = checked(settings, specs, key)
    staged = None
    try:
        specs, staged = _code_at_submit(settings, specs, snapshot, record_code, git, stage)
        now = utcnow()
        values = [job_row(s, now, position) for position, s in enumerate(specs)]
        with write_scope(settings) as session:
            if near_cap:
                # Two submissions of one user, each under the cap when it was read, could go past it
                # together: near it, the count is taken again where the jobs are written, one
                # submission of that user's at a time (SQLite's write lock already makes it so).
                one_at_a_time(session, f"gpuq pending cap: {specs[0].user}")
                check_pending_limit(session, settings, specs[0].user, len(specs))
            ids = _insert(session, values, staged, specs[0].array_index is not None, key, now)
            mail.ask(session, [(job_id, s.mail_events, s.mail_address) for job_id, s in zip(ids, specs, strict=True)])
            placed = place_at_submit(session, settings, values)
    except BaseException as failed:
        if staged is not None:
            staged.discard()
        if isinstance(failed, _KeyUsed):
            raise _used(settings, failed.key, specs[0].user) from None
        raise
    where = {job_id: (node, at) for job_id, _, node, at in placed}
    for row in values:
        if row["id"] in where:
            row.update(state=State.DISPATCHED, node=where[row["id"]][0], dispatched_at=where[row["id"]][1])
    messages = [(job_id, queue) for job_id, queue, _, _ in placed]
    if messages and send is not None:
        messages = send(messages)  # those it could not send go to the scheduler, as below
    if messages:
        # Jobs of the submission left waiting need a pass; those placed need only their messages.
        broker.hand_over(settings, messages, wake=len(placed) < len(ids))
    elif len(placed) < len(ids):
        broker.wake_scheduler(settings)
    return [Job(**row) for row in values]


def _insert(session: Session, values: list[dict[str, Any]], staged: Staged | None, indexed: bool,
            key: str | None, now: datetime) -> list[int]:
    """Write a submission's rows (``values`` get their ids, array id and snapshot) and its key;
    the jobs' ids."""
    conn = session.connection()
    array = len(values) > 1 or indexed
    ids = [_INSERT_FIRST_JOB.run(conn, values[0])[0].id]
    if staged is not None:
        staged.place(ids[0])
    for row in values:
        row.update(array_id=ids[0] if array else None, **_staged_at(staged))
    if array or staged is not None:
        conn.execute(_FIRST_ROW, {"job_id": ids[0], "first_array_id": values[0]["array_id"],
                                  "first_snapshot": values[0]["snapshot"], "first_cwd": values[0]["cwd"]})
    numbered = len(values) > 1 and draws_ids(conn)
    if numbered:
        ids += draw_ids(conn, _JOBS, len(values) - 1)
    elif len(values) > 1:
        # Ids are drawn in the order the rows are inserted: sorted, they are the rows'.
        ids += sorted(conn.execute(_INSERT_JOB, values[1:]).scalars())
    for row, job_id in zip(values, ids, strict=True):
        row["id"] = job_id
    if numbered:
        _INSERT_NUMBERED_JOBS.run(conn, values[1:])
    if key is not None:
        try:  # no savepoint: a refused key rolls the whole submission back, as it should
            _INSERT_SUBMISSION.run(conn, {"key": key, "user": values[0]["user"], "job_ids": ids, "submitted_at": now})
        except IntegrityError:
            raise _KeyUsed(key) from None
    return ids


class _KeyUsed(Exception):
    """``_insert``'s key was used already: the write is rolled back, then ``submit_all`` looks it up."""

    def __init__(self, key: str) -> None:
        self.key = key


def _used(settings: Settings, key: str, user: str) -> DuplicateSubmission:
    """The DuplicateSubmission of a key another submission wrote (NotAllowed if it was another
    user's); its jobs' ids are None only if that submission's transaction is not visible yet."""
    with read_scope(settings) as session:
        return DuplicateSubmission(key, submitted_with(session, key, user))


def job_row(s: JobSpec, now: datetime, position: int = 0) -> dict[str, Any]:
    """The ``jobs`` row of a spec just submitted, every column given (it is also the Job returned);
    ``position``: its place in its submission (an array's task past its limit waits for it)."""
    return dict(name=s.name, user=s.user, kind=s.kind, workload=s.workload, params=s.params, argv=s.argv,
                cwd=s.cwd, gpus=s.gpus, priority=s.priority, state=_NEW, submitted_at=now,
                mem_mib=s.mem_mib, on_node=s.on_node, exclude_nodes=s.exclude_nodes,
                time_limit_s=s.time_limit_s, max_retries=s.max_retries,
                attempts=[], held=s.held, admin_hold=False, after=s.after, after_kind=s.after_kind,
                singleton=s.singleton, env=s.env, array_index=s.array_index, array_id=None, array_limit=s.array_limit,
                git_commit=s.git_commit,
                git_dirty=s.git_dirty, git_diff=s.git_diff, git_diff_cut=s.git_diff_cut, snapshot=s.snapshot,
                host_mem_mib=s.host_mem_mib, cpus=s.cpus, requeues=0, output_file=s.output_file,
                error_file=s.error_file,
                begin_at=s.begin_at, deadline_at=s.deadline_at, signal=s.signal, gpu_type=s.gpu_type,
                # A kept job's client is alive as it submits; it says so again while it waits.
                keepalive_at=now if s.kept else None, client_exit_code=None,
                shared=s.shared, gpu_share=None, preemptible=s.preemptible, stdin=s.stdin,
                requeue=s.requeue,
                # Its reason from the first look (`gpuq status` right after submit), not after a pass.
                reason=_first_reason(s, now, position))


def _first_reason(s: JobSpec, now: datetime, position: int) -> str | None:
    """Why a job just submitted waits, where the submit knows it already (a quick pass writes no
    reason, and "waiting for GPUs" beside an idle GPU misleads until the next whole pass)."""
    if s.after:
        return policy.DEPENDENCY
    if s.begin_at is not None and s.begin_at > now:
        return policy.BEGIN_TIME
    if s.array_limit is not None and position >= s.array_limit:
        return policy.ARRAY_LIMIT
    return None


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


def checked(settings: Settings, specs: list[JobSpec], key: str | None = None) -> tuple[list[JobSpec], bool]:
    """The specs as a submit writes them (the queue's default time limit given, an aftercorr
    resolved), after the submit's checks (``check_submission``, whose answer comes second): what
    a submit and its estimate (service/estimate.py) both start from."""
    specs = _with_default_host_mem(settings, _with_default_cpus(settings, _with_default_time(settings, specs)))
    specs = _with_corresponding(settings, specs)
    return specs, check_submission(settings, specs, key)


def _with_corresponding(settings: Settings, specs: list[JobSpec]) -> list[JobSpec]:
    """The specs, an aftercorr resolved to the ids of each task's own tasks (``dependencies.corresponding``)."""
    if not specs or specs[0].after_kind != AFTER_CORR:
        return specs
    with read_scope(settings) as session:
        return dependencies.corresponding(session.connection(), specs)


def _with_default_cpus(settings: Settings, specs: list[JobSpec]) -> list[JobSpec]:
    """The specs, a command's or an allocation's without --cpus held to GPUQ_CPUS_PER_GPU for each
    of its GPUs (SLURM's DefCpuPerGPU); a built-in workload runs in its worker, which no job's limit holds."""
    per_gpu = settings.cpus_per_gpu
    if not per_gpu:
        return specs
    return [replace(s, cpus=round(min(per_gpu * s.gpus, MAX_CPUS), 2))
            if s.cpus is None and s.kind != c.KIND_WORKLOAD else s for s in specs]


def _with_default_host_mem(settings: Settings, specs: list[JobSpec]) -> list[JobSpec]:
    """The specs, a command's without --host-mem held to (and reserving) GPUQ_HOST_MEM_PER_GPU_MIB for
    each of its GPUs (SLURM's DefMemPerGPU); a workload runs in its worker and an allocation's shell
    in its client's terminal, which no job's memory limit holds."""
    per_gpu = settings.host_mem_per_gpu_mib
    if not per_gpu:
        return specs
    return [replace(s, host_mem_mib=per_gpu * s.gpus) if s.host_mem_mib is None and s.kind == c.KIND_COMMAND else s
            for s in specs]


def _with_default_time(settings: Settings, specs: list[JobSpec]) -> list[JobSpec]:
    """The specs, those without --time given the queue's default time limit (GPUQ_DEFAULT_TIME,
    else GPUQ_MAX_TIME), as SLURM gives a partition's DefaultTime."""
    default = settings.time_limits[0]
    if default is None or all(s.time_limit_s is not None for s in specs):
        return specs
    return [s if s.time_limit_s is not None else replace(s, time_limit_s=default) for s in specs]
