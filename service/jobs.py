"""Jobs as users and the server see them: look them up, list them, cancel, hold and release them,
and their ranks' meeting point.

A job's states and who moves it between them: service/lifecycle.py. Submitting: service/submitting.py.
Its output and metrics: service/job_output.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gpuq.service import broker, display, lifecycle, rights
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import require_schema, rows_changed, write_scope
from gpuq.service.dialect import matches_glob, not_for_an_index
from gpuq.service.errors import InvalidSpec, JobNotFound, NotAllowed, StateConflict
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Allocation, Gpu, Job, JobUsage, table, utcnow
from gpuq.service.rights import Caller, check_change
from gpuq.service.settings import Settings

_RENDEZVOUS = move("set a job's ranks' meeting point", Actor.WORKER, State.RUNNING, None,
                   table(Job).c.id == bindparam("job_id"), rendezvous=bindparam("init_method"))


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise JobNotFound(f"no job {job_id}")
    return job


# `gpuq status --state` (squeue's -t): a state's name, or squeue's code for it. "running" takes
# the dispatched jobs too, as squeue's R (and scancel's -t) would: a dispatched job is starting.
STATE_WORDS: dict[str, tuple[str, ...]] = {
    **{s.value: (s.value,) for s in State}, "running": (State.DISPATCHED, State.RUNNING),
    "pd": (State.PENDING,), "r": (State.DISPATCHED, State.RUNNING), "cd": (State.SUCCEEDED,),
    "f": (State.FAILED,), "ca": (State.CANCELLED,), "to": (State.TIMED_OUT,)}


def states_named(text: str) -> tuple[str, ...]:
    """``pending,running`` (or squeue's ``PD,R``) as the job states they name; InvalidSpec otherwise."""
    words = [w.strip().lower() for w in text.split(",")]
    unknown = next((w for w in words if w not in STATE_WORDS), None)
    if unknown is not None:
        raise InvalidSpec(f"--state takes {', '.join(s.value for s in State)} (or squeue's PD, R, CD, F, CA, TO), "
                          f"comma-separated; got {unknown[:40]!r}")
    return tuple(dict.fromkeys(s for w in words for s in STATE_WORDS[w]))


def list_jobs(session: Session, *, ended_limit: int = 10, user: str | None = None,
              but_pending_tasks: bool = False, states: Sequence[str] | None = None,
              name: str | None = None, ids: Sequence[int] | None = None) -> list[Job]:
    """Active jobs (oldest first), then the ``ended_limit`` most recently ended ones; with
    ``but_pending_tasks``, not the pending tasks of arrays (``pending_tasks`` has them). With
    ``states``, those in them only (the newest ``ended_limit`` of the ended ones asked for); with
    ``name``, those of that name (``name_matches``). With ``ids`` (`gpuq status -j`, squeue's -j),
    those jobs and every task of the arrays among them, in id order, ended ones all included."""
    base = select(Job)
    if user:
        base = base.where(Job.user == user)
    named = [name_matches(session, name)] if name is not None else []
    if ids is not None:
        picked = base.where(Job.id.in_(ids) | Job.array_id.in_(ids), *named,
                            *([Job.state.in_(states)] if states is not None else []))
        if but_pending_tasks:
            picked = picked.where(~((Job.state == State.PENDING) & Job.array_id.is_not(None)))
        return list(session.scalars(picked.order_by(Job.id)))
    active_states = [s for s in c.ACTIVE_STATES if states is None or s in states]
    ended_states = [s for s in c.END_STATES if states is None or s in states]
    active = base.where(Job.state.in_(active_states), *named)
    if but_pending_tasks:
        active = active.where(~((Job.state == State.PENDING) & Job.array_id.is_not(None)))
    rows = list(session.scalars(active.order_by(Job.id))) if active_states else []
    if states is not None and ended_states != list(c.END_STATES):
        # Some end states only: the newest of those (read by state, not down the index on ended_at,
        # which would pass over every job of the others).
        if ended_states and ended_limit:
            newest_of = (base.where(Job.state.in_(ended_states), *named)
                         .order_by(Job.ended_at.desc(), Job.id.desc()).limit(ended_limit))
            rows.extend(sorted(session.scalars(newest_of), key=lambda j: j.id))
        return rows
    if ended_limit:
        # The newest ended jobs, read down the index on ended_at (set when a job ends, and only
        # then): asked by state, both databases took the queue-order index (state first) and
        # sorted every job ever ended, 130 ms at 200,000 jobs.
        # A user's (`--me`): SQLite took the user's index and sorted all they ever ran; the index on
        # ended_at carries the user.
        mine = [not_for_an_index(Job.user, session) == user] if user else []
        newest = (select(Job.id).where(Job.ended_at.is_not(None), *mine, *named)
                  .order_by(Job.ended_at.desc(), Job.id.desc()).limit(ended_limit))
        ended = session.scalars(select(Job).where(Job.id.in_(newest.scalar_subquery()),
                                                  Job.state.in_(c.END_STATES)))
        rows.extend(sorted(ended, key=lambda j: j.id))
    return rows


@dataclass(frozen=True)
class PendingTasks:
    """Pending tasks of one array that wait for the same reason: one line of `gpuq status`, as
    squeue shows an array's pending tasks (``1234_[5-9999]``) rather than thousands of lines."""

    array_id: int
    user: str
    name: str  # the array's name with the tasks' indices: train[5-9999]
    ids: list[int]  # the tasks' job ids, in order
    gpus: int
    held: bool
    reason: str | None
    submitted_at: datetime  # the first task's: an array's tasks are submitted together
    admin_hold: bool = False  # held by an admin: only an admin releases them


def pending_tasks(session: Session, *, user: str | None = None, name: str | None = None,
                  ids: Sequence[int] | None = None) -> list[PendingTasks]:
    """The pending tasks of every array (or ``user``'s, those named ``name``, those of the arrays
    in ``ids`` or the tasks among them), grouped by array
    and by why they wait; the few columns a line needs, not whole rows: 10,000 tasks are 10,000
    small tuples."""
    query = (select(Job.id, Job.array_id, Job.array_index, Job.user, Job.name, Job.gpus, Job.held, Job.reason,
                    Job.submitted_at, Job.admin_hold)
             .where(Job.state == State.PENDING, Job.array_id.is_not(None)).order_by(Job.id))
    if user:
        query = query.where(Job.user == user)
    if name is not None:
        query = query.where(name_matches(session, name))
    if ids is not None:
        query = query.where(Job.id.in_(ids) | Job.array_id.in_(ids))
    groups: dict[tuple[int, bool, bool, str | None], list[Any]] = {}
    for row in session.execute(query):
        groups.setdefault((row.array_id, row.held, row.held and row.admin_hold, row.reason), []).append(row)
    out = []
    for (array_id, held, admin_hold, reason), rows in groups.items():
        first = rows[0]
        name = f"{display.array_name(first.name)}[{display.ranges([r.array_index for r in rows])}]"
        out.append(PendingTasks(array_id, first.user, name,
                                [r.id for r in rows], first.gpus, held, reason, first.submitted_at, admin_hold))
    return sorted(out, key=lambda g: g.ids[0])


def job_gpus(session: Session, job_id: int) -> list[Gpu]:
    """The GPUs allocated to the job, in rank order."""
    return list(session.scalars(select(Gpu).join(Allocation).where(Allocation.job_id == job_id)
                                .order_by(Allocation.rank)))


def gpu_indices(session: Session, job_id: int) -> list[int]:
    """The indices of the GPUs the job holds, or, once it ended, those it ran on (its usage
    summary's), in rank order; none for a job that never ran."""
    held = [g.index for g in job_gpus(session, job_id)]
    if held:
        return held
    return session.scalar(select(JobUsage.gpu_indices).where(JobUsage.job_id == job_id)) or []


def gpu_indices_of(session: Session, job_ids: Sequence[int]) -> dict[int, list[int]]:
    """``gpu_indices`` of many jobs at once (`gpuq status`, `gpuq history`), ``_CHUNK`` ids a
    statement: those of a job that holds GPUs, else its usage summary's; a job that never ran is
    left out."""
    unique = list(dict.fromkeys(job_ids))
    found: dict[int, list[int]] = {}
    for start in range(0, len(unique), _CHUNK):
        chunk = unique[start:start + _CHUNK]
        for job_id, index in session.execute(select(Allocation.job_id, Gpu.index).join(Gpu)
                                             .where(Allocation.job_id.in_(chunk))
                                             .order_by(Allocation.job_id, Allocation.rank)):
            found.setdefault(job_id, []).append(index)
        for job_id, indices in session.execute(select(JobUsage.job_id, JobUsage.gpu_indices).where(
                JobUsage.job_id.in_([j for j in chunk if j not in found]))):
            if indices:  # a summary from before gpuq kept them has none
                found[job_id] = list(indices)
    return found


@dataclass(frozen=True)
class CancelOutcome:
    job_id: int
    # "cancelled" at once, "cancelling" (a running job being stopped by its worker), or the end
    # state of a job that had already ended (``ended``).
    state: str
    ended: bool = False


# Jobs read or cancelled per statement: a bound parameter each, well under SQLite's limit.
_CHUNK = 1000


def cancel(settings: Settings, job_id: int, user: Caller | str | None = None) -> CancelOutcome:
    """Cancel a job: a pending or dispatched one at once, a running one by asking its worker.
    StateConflict if it already ended."""
    outcome = cancel_all(settings, [job_id], user)[0]
    if outcome.ended:
        raise StateConflict(f"job {job_id} already ended ({outcome.state})")
    return outcome


def cancel_all(settings: Settings, job_ids: Sequence[int], user: Caller | str | None = None) -> list[CancelOutcome]:
    """Cancel jobs, as ``cancel`` does each, in one transaction (`gpuq cancel --array` of 10,000
    tasks is one request): JobNotFound or NotAllowed for any of them and none is cancelled; a job
    that already ended is reported so (``ended``), not an error."""
    require_schema(settings)
    now = utcnow()
    ids = list(dict.fromkeys(job_ids))
    caller = Caller.of(user)
    asked = {"now": now, "reason": lifecycle.cancelled_by(caller.user)}
    with write_scope(settings) as session:
        found = changeable(session, settings, ids, caller)
        outcomes = []
        for job_id in ids:
            state = found[job_id].state
            if state in c.END_STATES:
                outcomes.append(CancelOutcome(job_id, state, ended=True))
            elif rows_changed(session.execute(lifecycle.CANCEL_WAITING, {"job_id": job_id, **asked})):
                # A dispatched job's worker will find the state changed and drop the message.
                lifecycle.free_gpus(session, job_id)
                outcomes.append(CancelOutcome(job_id, State.CANCELLED))
            else:
                session.execute(lifecycle.ASK_TO_CANCEL, {"job_id": job_id, **asked})
                outcomes.append(CancelOutcome(job_id, c.CANCELLING))
    if any(o.state == State.CANCELLED for o in outcomes):
        broker.wake_scheduler(settings)
    return outcomes


def rows_of(session: Session, ids: Sequence[int], *columns: Any) -> dict[int, Any]:
    """The jobs of ``ids`` (each once) that exist, by id: rows of their id and ``columns``, read
    ``_CHUNK`` ids a statement."""
    unique = list(dict.fromkeys(ids))
    found: dict[int, Any] = {}
    for start in range(0, len(unique), _CHUNK):
        found.update((r.id, r) for r in session.execute(
            select(Job.id, *columns).where(Job.id.in_(unique[start:start + _CHUNK]))))
    return found


def changeable(session: Session, settings: Settings, ids: list[int], caller: Caller, *columns: Any
               ) -> dict[int, Any]:
    """Each job's user, state and held flag (and ``columns``), by id; JobNotFound or NotAllowed for
    the first of ``ids`` that is missing or not the caller's to change: all are checked before any
    is changed."""
    found = rows_of(session, ids, Job.user, Job.state, Job.held, *columns)
    for job_id in ids:
        if job_id not in found:
            raise JobNotFound(f"no job {job_id}")
        check_change(settings, job_id, found[job_id].user, caller)
    return found


def requeue_all(settings: Settings, job_ids: Sequence[int], hold: bool = False, user: Caller | str | None = None
                ) -> dict[int, str | None]:
    """Put running jobs back in the queue (scontrol requeue; ``hold``: requeuehold): each one's
    worker stops it as for a cancel, and its end makes it pending again under its own id, the
    attempt kept (and charged to fair share). In one transaction: JobNotFound or NotAllowed for any
    of them and none changes. For each job, None where it is being requeued, else why not."""
    require_schema(settings)
    ids = list(dict.fromkeys(job_ids))
    caller = Caller.of(user)
    outcome: dict[int, str | None] = {}
    now = utcnow()
    # An admin's requeuehold of another user's job waits as an admin's hold (SLURM's admin hold).
    admin = hold and rights.is_admin(settings, caller)
    with write_scope(settings) as session:
        found = changeable(session, settings, ids, caller, Job.kind, Job.cancel_requested_at, Job.reason)
        for job_id in ids:
            job = found[job_id]
            if job.state != State.RUNNING:
                outcome[job_id] = f"job {job_id} is {job.state}; only a running job can be requeued" + (
                    " (gpuq resubmit runs an ended one again)" if job.state in c.END_STATES else "")
            elif job.kind == c.KIND_INTERACTIVE:
                outcome[job_id] = f"job {job_id} is an allocation; it cannot run again without its shell"
            elif job.cancel_requested_at is not None:
                outcome[job_id] = f"job {job_id} is stopping already; {job.reason or 'cancelled'}"
            else:
                reason = lifecycle.requeued_by(caller.user, hold, by_admin=admin and job.user != caller.user)
                session.execute(lifecycle.ASK_TO_REQUEUE, {"job_id": job_id, "now": now, "reason": reason})
                outcome[job_id] = None
    return outcome


def set_held(settings: Settings, job_id: int, held: bool, user: Caller | str | None = None) -> None:
    """Hold a pending job (it will not start) or release it; StateConflict if it cannot be."""
    why = set_held_all(settings, [job_id], held, user)[job_id]
    if why is not None:
        raise StateConflict(why)


def set_held_all(settings: Settings, job_ids: Sequence[int], held: bool, user: Caller | str | None = None
                 ) -> dict[int, str | None]:
    """Hold pending jobs or release them, in one transaction (an array's tasks in one request):
    JobNotFound or NotAllowed for any of them and none changes. For each job, None where it was
    held (released), else why not: it is not pending, or already held (not held)."""
    require_schema(settings)
    ids = list(dict.fromkeys(job_ids))
    outcome: dict[int, str | None] = {}
    caller = Caller.of(user)
    admin = rights.is_admin(settings, caller)
    with write_scope(settings) as session:
        found = changeable(session, settings, ids, caller, Job.admin_hold)
        if not held and not admin:
            for job_id in ids:
                if found[job_id].admin_hold and found[job_id].held:
                    raise NotAllowed(f"job {job_id} was held by an admin; only an admin may release it")
        for job_id in ids:
            job = found[job_id]
            if job.state != State.PENDING:
                outcome[job_id] = (f"job {job_id} is {job.state}; only a pending job can be "
                                   f"{'held' if held else 'released'}")
            elif job.held == held and not (held and admin and job.user != caller.user and not job.admin_hold):
                outcome[job_id] = f"job {job_id} is {'already held' if held else 'not held'}"
            else:
                # An admin's hold of another user's job is the admin's to lift (SLURM's admin hold).
                by_admin = held and admin and job.user != caller.user
                reason = (display.ADMIN_HELD if by_admin else "held") if held else None
                session.execute(lifecycle.HOLD, {"job_id": job_id, "held": held, "admin_hold": by_admin,
                                                 "reason": reason})
                outcome[job_id] = None
    if not held and None in outcome.values():
        broker.wake_scheduler(settings)
    return outcome


def array_jobs(session: Session, array_id: int) -> list[int]:
    """The jobs of array ``array_id``; JobNotFound if there is no such array."""
    ids = list(session.scalars(select(Job.id).where(Job.array_id == array_id).order_by(Job.id)))
    if not ids:
        raise JobNotFound(f"no array {array_id}")
    return ids


def active_jobs_of(session: Session, user: str, name: str | None = None,
                   states: Sequence[str] = c.ACTIVE_STATES) -> list[int]:
    """The ids of ``user``'s jobs in ``states`` (waiting and running by default), with ``name`` only
    those of that name (as `gpuq history --name` takes it: a pattern, or a name and its array's tasks)."""
    where = [Job.user == user, Job.state.in_(states)]
    if name is not None:
        where.append(name_matches(session, name))
    return list(session.scalars(select(Job.id).where(*where).order_by(Job.id)))


def name_matches(session: Session, name: str) -> Any:
    """The condition a job's name meets for ``--name``: a shell-style pattern (``*``, ``?``), or
    that name and the tasks of an array of that name (train[0], train[1] ...)."""
    if "*" in name or "?" in name:
        return matches_glob(Job.name, name, session)
    return (Job.name == name) | matches_glob(Job.name, name + "[*]", session)


def possible_mps_clients(session: Session, node: str, besides: int) -> set[str]:
    """The owners of the jobs other than ``besides`` placed on ``node`` whose processes may join
    its MPS daemon: shared command jobs, the only ones gpuq lets join (workers/mps.py)."""
    shared = select(Allocation.job_id).where(Allocation.share_mib.is_not(None))
    return set(session.scalars(select(Job.user).distinct().where(
        Job.node == node, Job.state.in_((State.DISPATCHED, State.RUNNING)), Job.id != besides,
        Job.kind == c.KIND_COMMAND, Job.id.in_(shared))))


def set_rendezvous(session: Session, job_id: int, init_method: str) -> None:
    session.execute(_RENDEZVOUS, {"job_id": job_id, "init_method": init_method})


def rank_to_run(session: Session, job_id: int, gpu_id: int, rank: int) -> Job | None:
    """The job, if it is running with rank ``rank`` (1 or more) on this GPU and its ranks' meeting
    point is set; None otherwise (rank 0 is the job itself, started by run_job)."""
    if rank < 1:
        return None
    return session.scalar(
        select(Job).join(Allocation, Allocation.job_id == Job.id)
        .where(Job.id == job_id, Job.state == State.RUNNING, Job.rendezvous.is_not(None),
               Allocation.gpu_id == gpu_id, Allocation.rank == rank)
    )


@dataclass(frozen=True)
class StopAsked:
    """What a running job's watch reads at each look (``stop_asked``)."""

    stop: bool  # its worker must stop it: a cancel was asked, or it is no longer running
    time_limit_s: int | None  # its time limit now (`gpuq update --time`)
    signal: str | None = None  # the last signal asked of it (`gpuq cancel --signal`), and when
    signal_at: datetime | None = None
    preempted: bool = False  # the stop asked is a preemption (its grace is GPUQ_PREEMPT_GRACE)
    # A `gpuq run`'s job: when its client last said it is alive (service/kept_jobs.py); None: not
    # kept, or an allocation (whose own watch reads its client, workers/allocation.py).
    kept_at: datetime | None = None


def stop_asked(session: Session, job_id: int) -> StopAsked:
    """A running job's row as its watch reads it at each look: one statement, every 0.2 s."""
    row = session.execute(select(Job.state, Job.cancel_requested_at, Job.time_limit_s, Job.signal_asked,
                                 Job.signal_asked_at, Job.reason, Job.kind, Job.keepalive_at)
                          .where(Job.id == job_id)).one_or_none()
    if row is None:
        return StopAsked(True, None)
    preempted = row.cancel_requested_at is not None and display.preemption_asked(row.reason)
    return StopAsked(row.state != State.RUNNING or row.cancel_requested_at is not None, row.time_limit_s,
                     row.signal_asked, row.signal_asked_at, preempted,
                     row.keepalive_at if row.kind != c.KIND_INTERACTIVE else None)


def elapsed(job: Job, now: datetime | None = None) -> timedelta | None:
    """How long the job has run (or ran); None if it never started."""
    if job.started_at is None:
        return None
    return (job.ended_at or now or utcnow()) - job.started_at


def wait_states(session: Session, job_ids: Sequence[int]) -> dict[int, str]:
    return {r.id: r.state for r in session.execute(select(Job.id, Job.state).where(Job.id.in_(job_ids)))}
