"""A job's life: which state may go to which, who makes each move, and the statements that make them.

Every change to a job's row is a conditional UPDATE (``WHERE id = ? AND state = ?``): a job starts
at most once even when its message is delivered twice, and a cancel never overwrites an ending.
Each such statement is built by ``move``, which refuses, when the module defining it is imported,
any move the table below does not allow; tests/test_lifecycle.py checks every statement built
here against the table and that no other module updates the jobs table on its own.

The moves of leases (claim, renew) are in service/leases.py, those of the next-up lists (a worker
taking the next job) in service/next_up.py, the scheduler's dispatch in service/scheduler.py; the
table and the moves that end a job or put it back to pending are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import Update, bindparam, func, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.dialect import is_sqlite
from gpuq.service.display import preemption_asked, requeue_asked
from gpuq.service.errors import BugError
from gpuq.service.models import Allocation, EarlierAttempt, Job, JobMetric, table, utcnow
from gpuq.service.prepared import Prepared

if TYPE_CHECKING:
    from gpuq.service.usage import HostUse

_JOBS = table(Job)


class Actor(StrEnum):
    """Who moves a job."""

    SUBMIT = "submit"  # `gpuq submit`, through the server: a new row
    SCHEDULER = "scheduler"  # its passes, and the placement a submit runs in its own transaction
    WORKER = "worker"  # the worker that holds the job's lease (or takes it from a next-up list)
    REAPER = "reaper"  # the scheduler's whole pass, taking back what lost workers held
    USER = "user"  # the job's owner, root or an admin: cancel, hold, release


S, A = State, Actor
# state -> {next state: the actors who may make that move}. A state to itself is a change to a job
# that leaves its state as it is (a hold, a lease renewed, a reason written); an end state goes
# nowhere. None is a job not yet written.
TRANSITIONS: dict[State | None, dict[State, frozenset[Actor]]] = {
    None: {S.PENDING: frozenset({A.SUBMIT})},
    S.PENDING: {
        S.PENDING: frozenset({A.SUBMIT, A.USER, A.SCHEDULER}),  # its submission's ids; hold, release; why it waits
        S.DISPATCHED: frozenset({A.SCHEDULER}),  # placed: GPUs allocated, its message sent
        S.RUNNING: frozenset({A.WORKER}),  # taken from a GPU's next-up list as the GPU fell free
        S.CANCELLED: frozenset({A.USER, A.SCHEDULER}),  # cancelled; a job it needed ended badly
    },
    S.DISPATCHED: {
        S.DISPATCHED: frozenset({A.SCHEDULER, A.USER}),  # its message sent again; an allocation's client alive
        S.RUNNING: frozenset({A.WORKER}),  # claimed by its first GPU's worker
        S.PENDING: frozenset({A.SCHEDULER, A.REAPER}),  # its message could not be sent; its worker died
        S.CANCELLED: frozenset({A.USER}),
    },
    S.RUNNING: {
        # a cancel asked for, an allocation's client alive or done; the lease renewed, ranks' meeting
        # point; a preemptible job asked to stop for a waiting job
        S.RUNNING: frozenset({A.USER, A.WORKER, A.SCHEDULER}),
        S.SUCCEEDED: frozenset({A.WORKER}),
        S.FAILED: frozenset({A.WORKER, A.REAPER}),  # its own failure; its worker lost
        S.TIMED_OUT: frozenset({A.WORKER}),
        S.CANCELLED: frozenset({A.WORKER, A.REAPER}),  # stopped by its worker once asked; asked, then lost
        S.PENDING: frozenset({A.WORKER, A.REAPER}),  # retried or requeued: it runs again
    },
    S.SUCCEEDED: {},
    S.FAILED: {},
    S.CANCELLED: {},
    S.TIMED_OUT: {},
}


def allowed(actor: Actor, source: State | None, target: State) -> bool:
    return actor in TRANSITIONS[source].get(target, frozenset())


def check(actor: Actor, source: State | None, target: State) -> None:
    """Refuse a move the table does not allow: a bug in gpuq, never the user's doing."""
    if not allowed(actor, source, target):
        raise BugError(f"the {actor} may not move a job from {source or 'nothing'} to {target} "
                       "(service/lifecycle.py's TRANSITIONS)")


@dataclass(frozen=True)
class Move:
    """A statement that changes jobs in ``sources`` to ``target`` (None: their state stays)."""

    name: str
    actors: tuple[Actor, ...]
    sources: tuple[State, ...]
    target: State | None
    statement: Update


# Every move built, by name: what tests/test_lifecycle.py checks against the table.
MOVES: dict[str, Move] = {}


def move(name: str, actors: Actor | tuple[Actor, ...], sources: State | tuple[State, ...],
         target: State | None, /, *where: Any, **values: Any) -> Update:
    """``UPDATE jobs SET state = target, values WHERE state IN sources AND where``, once the table
    allows each of ``actors`` each of those moves (with ``target`` None the state stays: a change
    to a job in ``sources`` that the table must allow as a move to the same state)."""
    actors = (actors,) if isinstance(actors, Actor) else tuple(actors)
    sources = (sources,) if isinstance(sources, State) else tuple(sources)
    for actor in actors:
        for source in sources:
            check(actor, source, target or source)
    guard = _JOBS.c.state == sources[0] if len(sources) == 1 else _JOBS.c.state.in_(sources)
    if target is not None:
        values = {"state": target, **values}
    statement = _JOBS.update().where(guard, *where).values(**values)
    if name in MOVES:
        raise BugError(f"two moves named {name}")
    MOVES[name] = Move(name, actors, sources, target, statement)
    return statement


# "= false", not "IS false": PostgreSQL seeks a boolean index column only on equality.
NOT_HELD = _JOBS.c.held == False  # noqa: E712


def waiting(table: Any = _JOBS) -> tuple[Any, Any]:
    """What makes a job one that waits to run: pending and not held (``table``: jobs, or an alias;
    ``NOT_HELD``'s comparison)."""
    return table.c.state == State.PENDING, table.c.held == False  # noqa: E712 - as NOT_HELD


_ID = _JOBS.c.id == bindparam("job_id")
_EARLIER = table(EarlierAttempt)
_CLEAR_METRICS = table(JobMetric).delete().where(table(JobMetric).c.job_id == bindparam("job_id"))
_IDS = _JOBS.c.id.in_(bindparam("ids", expanding=True))

# ---- the user's moves ----------------------------------------------------------------------------
CANCEL_WAITING = move("cancel a job not started", A.USER, (S.PENDING, S.DISPATCHED), S.CANCELLED, _ID,
                      ended_at=bindparam("now"), cancel_requested_at=bindparam("now"), reason=bindparam("reason"))
# A running job is stopped by its worker, which ends it cancelled (``end_attempt``), with the
# reason written here: who asked ("cancelled by alice"), as SLURM keeps the uid that cancelled.
ASK_TO_CANCEL = move("ask a running job's worker to cancel it", A.USER, S.RUNNING, None, _ID,
                     cancel_requested_at=bindparam("now"), reason=bindparam("reason"))
CANCELLED_BY = "cancelled by "
# A running job is requeued the same way (scontrol requeue): its worker stops it as for a cancel, and
# its end puts it back to pending (``end_attempt``), held where asked (scontrol requeuehold). Who
# asked is its reason, as for a cancel; the reason tells the two apart.
ASK_TO_REQUEUE = move("ask a running job's worker to requeue it", A.USER, S.RUNNING, None, _ID,
                      cancel_requested_at=bindparam("now"), reason=bindparam("reason"))
REQUEUED = "requeued"  # the state an attempt stopped by `gpuq requeue` is kept in (no job's state)
PREEMPTED = "preempted"  # and one stopped by a preemption (sacct's PREEMPTED)


def requeued_by(user: str, hold: bool, by_admin: bool = False) -> str:
    """A requeued job's reason: who requeued it, and whether it waits held (``by_admin``: as an
    admin's hold of another user's job, which its owner may not release)."""
    if hold and by_admin:
        return f"{c.REQUEUED_ADMIN_HELD} ({user})"
    return (c.REQUEUED_HELD_BY if hold else c.REQUEUED_BY) + user


def cancelled_by(user: str) -> str:
    """A cancelled job's reason: who cancelled it."""
    return CANCELLED_BY + user


HOLD = move("hold or release", A.USER, S.PENDING, None, _ID, held=bindparam("held"), reason=bindparam("reason"),
            admin_hold=bindparam("admin_hold"))

# ---- the scheduler's -----------------------------------------------------------------------------
DISPATCH = Prepared(move("dispatch", A.SCHEDULER, S.PENDING, S.DISPATCHED, _ID, NOT_HELD,
                         dispatched_at=bindparam("now"), node=bindparam("node"), reason=None,
                         gpu_share=bindparam("gpu_share")))
SEND_AGAIN = move("send a dispatched job's message again", A.SCHEDULER, S.DISPATCHED, None, _IDS,
                  dispatched_at=bindparam("now"))
WHY_WAITING = move("write why jobs wait", A.SCHEDULER, S.PENDING, None, _IDS, reason=bindparam("reason"))
# A preemptible job whose GPUs a waiting job takes is stopped as `gpuq requeue` stops one (the
# reason says by whom: ``display.preempted_by``); only if it is still preemptible and not stopping.
ASK_TO_PREEMPT = move("ask a preemptible job's worker to requeue it", A.SCHEDULER, S.RUNNING, None, _ID,
                      _JOBS.c.preemptible == True, _JOBS.c.cancel_requested_at.is_(None),  # noqa: E712
                      cancel_requested_at=bindparam("now"), reason=bindparam("reason"))
# A job whose GPUs sat idle past GPUQ_IDLE_LIMIT is cancelled the same way, its reason beginning
# CANCELLED_BY (``idle_limit.reason``); only if it is not being stopped already, and still in the
# attempt that was idle (started before the limit's window: not run again since it was read).
ASK_TO_END_IDLE = move("ask an idle job's worker to cancel it", A.SCHEDULER, S.RUNNING, None, _ID,
                       _JOBS.c.cancel_requested_at.is_(None), _JOBS.c.started_at <= bindparam("since"),
                       cancel_requested_at=bindparam("now"), reason=bindparam("reason"))
DOOM = move("cancel a job whose dependency ended badly", A.SCHEDULER, S.PENDING, S.CANCELLED, _ID,
            ended_at=bindparam("now"), reason=bindparam("reason"))
# A dispatched job that never started waits again: its message could not be sent (the
# scheduler), or its GPU's worker stopped heart-beating before claiming it (the reaper).
UNDISPATCH = move("put back a dispatched job that never started", (A.SCHEDULER, A.REAPER), S.DISPATCHED,
                  S.PENDING, _ID, dispatched_at=None, node=None)
_FREE_GPUS = Prepared(table(Allocation).delete().where(table(Allocation).c.job_id == bindparam("job_id")))


def free_gpus(session: Session, job_id: int) -> None:
    _FREE_GPUS.run(session.connection(), {"job_id": job_id})


def undispatch(session: Session, job_id: int) -> None:
    """A dispatched job that never started waits again, its GPUs freed."""
    session.execute(UNDISPATCH, {"job_id": job_id})
    free_gpus(session, job_id)


# ---- a run's end ---------------------------------------------------------------------------------
# The worker's common end, one statement: a success is never retried, so it needs nothing of the row.
_SUCCEED_MOVE = move("succeed", A.WORKER, S.RUNNING, S.SUCCEEDED, _ID, _JOBS.c.lease_token == bindparam("token"),
                     ended_at=bindparam("now"), exit_code=bindparam("exit_code"), result=bindparam("result"),
                     reason=bindparam("reason"), failure=None, lease_token=None, lease_expires_at=None)
# The success returning the job's id, what the statements built on it read (below, and
# service/handover.py). Made before ``Prepared`` reads the move: made after, a CTE of it came
# without its column.
SUCCEEDED_ID = _SUCCEED_MOVE.returning(_JOBS.c.id)
# PostgreSQL's: the success and its GPUs' freeing as one statement (data-modifying CTEs), the
# number of jobs it ended as its row. Under a flood of short jobs every job's end pays each
# statement's cost on both sides of the socket: with the end and the next job's take as two
# statements instead of four, the workers' CPU a job fell by a tenth to a seventh (arrays of
# 1,000 on PostgreSQL, interleaved runs).
_ENDED = SUCCEEDED_ID.cte("ended")
_FREED = table(Allocation).delete().where(table(Allocation).c.job_id.in_(select(_ENDED.c.id))).cte("freed")
_SUCCEED_AND_FREE = Prepared(select(func.count()).select_from(_ENDED).add_cte(_FREED))
_SUCCEED = Prepared(_SUCCEED_MOVE)
_RUN_READ = select(_JOBS.c.state, _JOBS.c.started_at, _JOBS.c.worker, _JOBS.c.attempts, _JOBS.c.requeues,
                   _JOBS.c.max_retries, _JOBS.c.requeue, _JOBS.c.user, _JOBS.c.node, _JOBS.c.gpus,
                   _JOBS.c.gpu_share, _JOBS.c.cancel_requested_at, _JOBS.c.reason).where(_ID)
# The other ends, and the way back to pending: their values depend on the row, so the statement
# is built when it runs, by ``_end_statement``, checked against the table there.
_LEASE_HOLDER = _JOBS.c.lease_token == bindparam("token")
_LEASE_RAN_OUT = _JOBS.c.lease_expires_at < bindparam("expired_before")


def end_attempt(session: Session, job_id: int, state: State, *, token: str | None = None,
                expired_before: datetime | None = None, failure: str | None = None, exit_code: int | None = None,
                result: dict[str, Any] | None = None, reason: str | None = None, max_requeues: int = 0,
                now: datetime | None = None, host: HostUse | None = None) -> bool:
    """End a running job's attempt in ``state``: the job ends there and frees its GPUs, or it
    waits again (pending) for another attempt when it may run again:

    - an infrastructure failure (``c.INFRA_FAILURES``) of a job that is requeued on one
      (``requeues_on_infra``: `--requeue`, or retries asked for) is requeued without using a retry,
      at most ``max_requeues`` times;
    - any other failure is retried while the job has retries left.

    Every attempt is kept, with its command's CPU seconds and host memory peak (``host``, where its
    worker measured them: the job's usage summary will be its last attempt's). The worker holding the lease ``token``
    ends its job; the reaper passes ``expired_before`` instead (the lease must have run out before
    then). False if the job was not running under that lease: it had ended, or was taken back.
    """
    if state not in c.END_STATES or (token is None) == (expired_before is None):
        raise BugError(f"end_attempt: an end state and either a lease token or a reaping time, got {state!r}")
    actor = A.WORKER if token is not None else A.REAPER
    conn = session.connection()
    now = now or utcnow()
    if state == S.SUCCEEDED and token is not None:
        params = {"job_id": job_id, "token": token, "now": now, "result": result, "exit_code": exit_code,
                  "reason": reason}
        if not is_sqlite(conn):
            return bool(_SUCCEED_AND_FREE.run(conn, params)[0][0] == 1)
        if _SUCCEED.run(conn, params) != 1:
            return False
        free_gpus(session, job_id)
        return True
    job = conn.execute(_RUN_READ, {"job_id": job_id}).one_or_none()
    if job is None or job.state != S.RUNNING:
        return False
    stop_asked = job.cancel_requested_at is not None and state != S.SUCCEEDED
    # A preemption requeues only a job that may be requeued: one that said no (its own `--no-requeue`,
    # or the site's GPUQ_REQUEUE=no at its submit) ends as preempted instead.
    ends_preempted = stop_asked and preemption_asked(job.reason) and job.requeue is False
    requeued = stop_asked and requeue_asked(job.reason) and not ends_preempted
    if ends_preempted:
        state, failure, reason = S.CANCELLED, c.FAILURE_PREEMPTED, f"{job.reason}, not requeued (no requeue)"
    elif requeued:
        # Asked to requeue (`gpuq requeue`): whatever stopped it, it waits again, as the asker wanted
        # (held with --hold); neither a retry nor one of the requeues the lost-worker cap counts.
        state, failure, reason = S.CANCELLED, c.FAILURE_CANCELLED, job.reason
    elif stop_asked:
        # Asked to cancel: it ends cancelled, whatever stopped it, and never runs again (a job
        # whose worker died before it confirmed the stop was requeued, its cancel forgotten).
        asked = job.reason if job.reason and job.reason.startswith(CANCELLED_BY) else CANCELLED_BY + "user"
        reason = asked if state == S.CANCELLED or not reason else f"{asked} ({reason})"
        state, failure = S.CANCELLED, c.FAILURE_CANCELLED
    values: dict[str, Any] = dict(state=state, ended_at=now, exit_code=exit_code, result=result, reason=reason,
                                  failure=failure if state != S.SUCCEEDED else None, lease_token=None,
                                  lease_expires_at=None)
    again = "asked" if requeued else _runs_again(job, state, failure, max_requeues)
    if again is not None:
        # The attempt as its record keeps it: stopped to be requeued reads so (sacct's REQUEUED).
        attempt = dict(state=_asked_state(job.reason) if again == "asked" else state,
                       failure=None if again == "asked" else failure, reason=reason, exit_code=exit_code,
                       **_measured(host))
        values = _waits_again(job, again, now, max_requeues, attempt)
    elif failure in c.INFRA_FAILURES and requeues_on_infra(job) and job.requeues >= max_requeues:
        values["reason"] = f"{reason} (requeued {job.requeues} times already: the cap)"
    check(actor, S.RUNNING, values["state"])
    lease = _LEASE_HOLDER if token is not None else _LEASE_RAN_OUT
    statement = _JOBS.update().where(_ID, _JOBS.c.state == S.RUNNING, lease).values(**values)
    done = conn.execute(statement, {"job_id": job_id, "token": token, "expired_before": expired_before}).rowcount == 1
    if done:
        free_gpus(session, job_id)
        if again is not None:
            # Its progress rows start again with the next attempt (a retried train job listed epochs
            # 1-4 of the lost attempt, then 1-6): the attempt that ends it is the one they describe.
            conn.execute(_CLEAR_METRICS, {"job_id": job_id})
            if job.started_at is not None:  # the GPU and CPU time it held, which its row will no longer show
                conn.execute(_EARLIER.insert(), {
                    "job_id": job_id, "user": job.user, "node": job.node, "started_at": job.started_at,
                    "charged": job.gpus * (job.gpu_share if job.gpu_share is not None else 1.0), "ended_at": now,
                    "cause": attempt["failure"] or attempt["state"], "cpu_s": host.cpu_s if host else None})
    return done


def _measured(host: HostUse | None) -> dict[str, Any]:
    """What an attempt's record keeps of its command's use of the node: the values its worker knew."""
    if host is None:
        return {}
    return {k: v for k, v in (("cpu_s", host.cpu_s), ("host_mem_peak_mib", host.host_mem_peak_mib)) if v is not None}


def _asked_state(reason: str) -> str:
    """The state an attempt stopped to go back to the queue is kept in: preempted or requeued."""
    return PREEMPTED if preemption_asked(reason) else REQUEUED


def _waits_again(job: Any, again: str, now: datetime, max_requeues: int, ended: dict[str, Any]) -> dict[str, Any]:
    """The values that put a job whose attempt ended back to pending, the attempt kept. ``again``:
    "requeue" (an infrastructure failure), "retry" (its own), or "asked" (`gpuq requeue`, whose
    reason says who asked: no retry and no requeue of the cap's is used)."""
    attempt = {"started_at": job.started_at.isoformat() if job.started_at else None, "ended_at": now.isoformat(),
               **ended, "worker": job.worker, "requeue": again != "retry"}
    requeues = job.requeues + (again == "requeue")
    what = (f"requeue {requeues} of at most {max_requeues}" if again == "requeue"
            else f"retry {_retries_used(job) + 1} of {job.max_retries}")
    held = again == "asked" and ended["reason"].startswith(c.REQUEUED_HELD_BY)
    by_admin = held and ended["reason"].startswith(c.REQUEUED_ADMIN_HELD)
    return dict(state=S.PENDING, attempts=[*(job.attempts or []), attempt], started_at=None, dispatched_at=None,
                node=None, worker=None, exit_code=None, result=None, cancel_requested_at=None, rendezvous=None,
                lease_token=None, lease_expires_at=None, requeues=requeues, failure=None,
                reason=ended["reason"] if again == "asked" else f"{what} after: {ended['reason']}",
                **({"held": True, "admin_hold": by_admin} if held else {}))


def _retries_used(job: Any) -> int:
    return sum(1 for a in job.attempts or [] if not a.get("requeue"))


def requeues_on_infra(job: Any) -> bool:
    """Whether a failure of the machinery puts the job back in the queue: its own word
    (`--requeue`, `--no-requeue`, sbatch's), else whether it asked for retries (the rule before the
    word existed, kept for the jobs submitted without one)."""
    return bool(job.max_retries > 0 if job.requeue is None else job.requeue)


def _runs_again(job: Any, state: State, failure: str | None, max_requeues: int) -> str | None:
    """"requeue" (an infrastructure failure), "retry" (the job's own), or None: it ends. A job whose
    client is gone (client_lost) ends for good, as a cancelled one: nobody follows it any more."""
    if state == S.SUCCEEDED or state == S.CANCELLED or failure in (c.FAILURE_CANCELLED, c.FAILURE_CLIENT_LOST,
                                                                  c.FAILURE_PREEMPTED):
        return None
    if failure in c.INFRA_FAILURES:
        return "requeue" if requeues_on_infra(job) and job.requeues < max_requeues else None
    if state == S.FAILED and _retries_used(job) < job.max_retries:
        return "retry"
    return None
