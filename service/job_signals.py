"""Signals sent to running jobs on the word of their owner (`gpuq cancel --signal USR1`, as scancel's
--signal): to save a checkpoint now, to reload a setting, to stop one stage of a pipeline.

The server only writes the ask on the job's row (the signal and when it was asked); the job's
worker reads that row every CANCEL_POLL_SECONDS anyway (``jobs.stop_asked``, its watch), sends the
signal to the job's processes or its main process alone (``B:``) and says so in the job's output.
So no user's process signals another's, and the signal reaches the job on whatever node runs it.
Only a command takes one: a built-in workload runs inside gpuq's own worker, and an allocation's
shell (`gpuq alloc`) is the user's own process, theirs to signal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import bindparam, case

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import require_schema, write_scope
from gpuq.service.jobs import changeable
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Job, UTCDateTime, table, utcnow
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings
from gpuq.service.units import JobSignal

# Jobs asked per statement: a bound parameter each, well under SQLite's limit.
_CHUNK = 1000
_jobs = table(Job).c
# Still running: the row was read in the same transaction, but on PostgreSQL a worker may have
# ended the job since, and an ended job's row keeps no ask. Its moment is never before the job's
# start: the worker takes an ask made after the start it wrote with its own clock, which on
# another node may run ahead of the server's.
_ASK = move("ask a running job's worker to send it a signal", Actor.USER, State.RUNNING, None,
            _jobs.id.in_(bindparam("ids", expanding=True)), signal_asked=bindparam("asked"),
            signal_asked_at=case((_jobs.started_at > bindparam("now", type_=UTCDateTime), _jobs.started_at),
                                 else_=bindparam("now", type_=UTCDateTime)))


@dataclass(frozen=True)
class SignalOutcome:
    job_id: int
    state: str
    # Why it was not asked, in a phrase (it is not running, it is a built-in workload); None: its
    # worker sends the signal within a second.
    not_sent: str | None = None


def why_not(state: str, kind: str) -> str | None:
    """Why a job in ``state`` of ``kind`` takes no signal now; None where it does."""
    if state == State.DISPATCHED:
        return "not started yet (dispatched)"
    if state != State.RUNNING:
        return f"{state}, not running"
    if kind == c.KIND_WORKLOAD:
        return "a built-in workload, which runs inside gpuq's worker: cancel it instead"
    if kind == c.KIND_INTERACTIVE:
        return "an allocation: its shell is your own process, signal it there"
    return None


def signal_all(settings: Settings, job_ids: Sequence[int], sig: JobSignal,
               user: Caller | str | None = None) -> list[SignalOutcome]:
    """Ask the workers of the running commands among ``job_ids`` to send them ``sig``, in one
    transaction: JobNotFound or NotAllowed for any of them and none is asked (as a cancel); a job
    that takes no signal now is reported with why (``not_sent``), not an error. Asking again
    sends it again; an ask its worker has not yet acted on is replaced by the newer one."""
    require_schema(settings)
    ids = list(dict.fromkeys(job_ids))
    caller = Caller.of(user)
    with write_scope(settings) as session:
        found = changeable(session, settings, ids, caller, Job.kind)
        outcomes = [SignalOutcome(i, found[i].state, why_not(found[i].state, found[i].kind)) for i in ids]
        asked = [o.job_id for o in outcomes if o.not_sent is None]
        now = utcnow()
        for start in range(0, len(asked), _CHUNK):
            session.execute(_ASK, {"ids": asked[start:start + _CHUNK], "asked": sig.asked_text, "now": now})
    return outcomes
