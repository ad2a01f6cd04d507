"""Changing a job after its submit (`gpuq update`, as `scontrol update job`): its priority, time
limit, name, retries, its word on a requeue (`--requeue`, scontrol's Requeue=), how many tasks of
its array may run at once (SLURM's ArrayTaskThrottle), its
begin time and deadline, and a pending job's GPUs, GPU type, GPU memory, node, excluded nodes, sharing,
preemptibility (as scontrol's QOS=) and dependencies.

What may change depends on where the job is, as in SLURM: a pending job (held or not) takes any
of these; a job that started (dispatched or running) keeps its priority, begin time, GPUs, memory,
node, sharing and CPU cores, which only ordered or shaped its wait, and its owner may lower its time limit but only
root or an admin may raise it (a user who could would hold the GPUs past what the backfill
promised the jobs behind). A running job's worker reads the new limit within a look of its watch
(workers/watch.py); one below the time it has run stops it there, timed out. Its name changes in
the queue, not in the ``GPUQ_JOB_NAME`` it started with.

A started job's owner may make it preemptible (it gives up its protection: the next pass may stop
it for a waiting job, and it counts against their GPU limit no more, so another of their jobs may
start); only root or an admin may make a started one not preemptible, which could hold GPUs past
its user's limit, or preemptible where fair share charges preemptible jobs less (the whole run
would be charged so). A job being stopped keeps what it is.

New GPUs, GPU type, memory, node or sharing are checked as a submit checks them (no node has that
many, no GPU is of that type or has that much memory, no such node, a workload that cannot run on
that many, a shared job without a share: the request is refused whole, nothing changed), and the
job leaves every GPU's next-up list, which listed it for what it asked before: the scheduler's next
pass lists it again for what it asks now. Sharing changes only while the job waits (as SLURM's
OverSubscribe): a shared job's placement and the watch over its share are decided when it starts,
from its row, so a pending job's new sharing is all there is to change.

New dependencies (scontrol's ``Dependency=``) are checked as a submit's (each job exists; one that
already failed cannot be waited for to succeed) and for a loop, which a submit cannot make (it names
earlier jobs only) but an update can: a pending job after one that waits for it, directly or
through others, would never start, so it is refused. A job given dependencies leaves the next-up
lists too: a worker takes a listed job without looking at them.

What is asked (``Changes``, read from the request) is service/changes.py's; a new deadline, begin
time or time limit of a pending job with a deadline is refused for that job where it could no
longer end by it (service/deadline.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Float, Integer, String, and_, bindparam, case, cast, delete, func
from sqlalchemy.orm import Session

from gpuq.service import broker, deadline, dependencies, jobs, spec
from gpuq.service import constants as c
from gpuq.service.changes import FIELDS, NO_DEADLINE, Changes
from gpuq.service.constants import State
from gpuq.service.db import require_schema, rows_changed, write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Job, NextUp, UTCDateTime, table
from gpuq.service.policy import DEPENDENCY
from gpuq.service.rights import Caller, is_admin
from gpuq.service.settings import Settings
from gpuq.service.submit_checks import check_dependencies, check_resources, check_time_limit
from gpuq.service.units import AFTER_CORR, AFTER_OK, Waits
from gpuq.service.workloads import get_workload

_JOBS = table(Job)
_ID = _JOBS.c.id == bindparam("job_id")


def _kept(name: str, kind: Any) -> Any:
    """The value bound as ``new_<name>``, or the column's own where none is given (null: unchanged).
    (A bound name may not be a column's: SQLAlchemy keeps those for the SET clause's own.)"""
    return func.coalesce(bindparam(f"new_{name}", type_=kind), _JOBS.c[name])


# An array's limit: a number, 0 for none (stored as null), or null to leave it as it is.
_NEW_LIMIT = bindparam("new_array_limit", type_=Integer)
_LATER = dict(time_limit_s=_kept("time_limit_s", Integer), name=_kept("name", String),
              max_retries=_kept("max_retries", Integer), requeue=_kept("requeue", Boolean),
              array_limit=case((_NEW_LIMIT.is_(None), _JOBS.c.array_limit), (_NEW_LIMIT == 0, None),
                               else_=_NEW_LIMIT))
# A GPU type: a model, "" for any model (stored as null), or null to leave it as it is.
_NEW_TYPE = bindparam("new_gpu_type", type_=String)
# GPU memory: MiB, 0 for none asked (stored as null), or null to leave it as it is.
_NEW_MEM = bindparam("new_mem_mib", type_=Integer)
# A node: its name, "" for any node (stored as null), or null to leave it as it is.
_NEW_NODE = bindparam("new_on_node", type_=String)
# CPU cores: a number, 0 for no limit (stored as null), or null to leave it as it is.
# (Cast: PostgreSQL cannot tell a null float parameter's type, where an integer's is written with it.)
_NEW_CPUS = cast(bindparam("new_cpus", type_=Float), Float)
# Host memory: MiB, 0 for no limit (stored as null), or null to leave it as it is.
_NEW_HOST_MEM = bindparam("new_host_mem_mib", type_=Integer)
# A deadline: a moment, NO_DEADLINE for none (stored as null), or null to leave it as it is.
_NEW_DEADLINE = bindparam("new_deadline_at", type_=UTCDateTime())
_CHANGE_WAITING = move("change a job that waits", Actor.USER, State.PENDING, None, _ID,
                       priority=_kept("priority", Integer), begin_at=_kept("begin_at", UTCDateTime()),
                       deadline_at=case((_NEW_DEADLINE.is_(None), _JOBS.c.deadline_at),
                                        (_NEW_DEADLINE == NO_DEADLINE, None), else_=_NEW_DEADLINE),
                       gpus=_kept("gpus", Integer),
                       gpu_type=case((_NEW_TYPE.is_(None), _JOBS.c.gpu_type), (_NEW_TYPE == "", None),
                                     else_=_NEW_TYPE),
                       mem_mib=case((_NEW_MEM.is_(None), _JOBS.c.mem_mib), (_NEW_MEM == 0, None), else_=_NEW_MEM),
                       on_node=case((_NEW_NODE.is_(None), _JOBS.c.on_node), (_NEW_NODE == "", None),
                                    else_=_NEW_NODE), shared=_kept("shared", Boolean),
                       preemptible=_kept("preemptible", Boolean),
                       cpus=case((_NEW_CPUS.is_(None), _JOBS.c.cpus), (_NEW_CPUS == 0, None), else_=_NEW_CPUS),
                       host_mem_mib=case((_NEW_HOST_MEM.is_(None), _JOBS.c.host_mem_mib), (_NEW_HOST_MEM == 0, None),
                                         else_=_NEW_HOST_MEM),
                       **_LATER)
# A pending job's dependencies: the ids (null: none), how it waits for them (units.AFTER_KINDS), and
# whether it is a singleton.
_WAITS = bindparam("waits", type_=Boolean)
_CHANGE_DEPENDENCY = move("change the dependencies of a job that waits", Actor.USER, State.PENDING, None, _ID,
                          after=bindparam("new_after", type_=JSON(none_as_null=True)),
                          after_kind=bindparam("new_after_kind", type_=String),
                          singleton=bindparam("new_singleton", type_=Boolean),
                          # Its reason at once, as a submit's (a quick pass writes none): a job that waits for
                          # nothing any more waits for GPUs until the next whole pass says otherwise.
                          reason=case((and_(_WAITS, _JOBS.c.held == False), DEPENDENCY),  # noqa: E712
                                      (and_(~_WAITS, _JOBS.c.reason == DEPENDENCY), None), else_=_JOBS.c.reason))
# A pending job's excluded nodes (`--exclude`; null: none).
_CHANGE_EXCLUDE = move("change the nodes a job that waits may not run on", Actor.USER, State.PENDING, None, _ID,
                       exclude_nodes=bindparam("new_exclude_nodes", type_=JSON(none_as_null=True)))
_CHANGE_STARTED = move("change a job that started", Actor.USER, (State.DISPATCHED, State.RUNNING), None, _ID,
                       preemptible=_kept("preemptible", Boolean), **_LATER)
# What a change reads of each job beside its owner and state: the values it may change.
_VALUES = (_JOBS.c.priority, _JOBS.c.time_limit_s, _JOBS.c.name, _JOBS.c.max_retries, _JOBS.c.array_limit,
           _JOBS.c.begin_at, _JOBS.c.gpus, _JOBS.c.gpu_type, _JOBS.c.mem_mib, _JOBS.c.on_node, _JOBS.c.shared,
           _JOBS.c.array_id, _JOBS.c.kind, _JOBS.c.after, _JOBS.c.after_kind, _JOBS.c.singleton,
           _JOBS.c.exclude_nodes, _JOBS.c.preemptible, _JOBS.c.cpus, _JOBS.c.host_mem_mib, _JOBS.c.cancel_requested_at,
           _JOBS.c.deadline_at,
           _JOBS.c.requeue)
# What only a pending job may change: it ordered, timed or shaped its wait, which a started job has left.
_WAITING_ONLY = {"priority": "priority", "begin_at": "begin time", "deadline_at": "deadline", "gpus": "GPUs",
                 "gpu_type": "GPU type",
                 "mem_mib": "GPU memory", "on_node": "node", "shared": "sharing", "dependency": "dependencies",
                 "exclude_nodes": "excluded nodes",
                 # Its cgroup's quota is made as it starts.
                 "cpus": "CPU cores", "host_mem_mib": "host memory"}
# What shapes where a job may run: a change of one is checked as a submit, and unlists the job.
# (A job made preemptible or not leaves the lists too: it goes after every other job, or no longer.)
_SHAPE = ("gpus", "gpu_type", "mem_mib", "on_node", "shared", "exclude_nodes", "preemptible", "cpus", "host_mem_mib")

@dataclass
class Outcome:
    """One job's part of an update: what changed (field → [old, new]) or why nothing did."""

    job_id: int
    changed: dict[str, list[Any]] = field(default_factory=dict)
    refused: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"id": self.job_id, "not": self.refused,
                "changed": {f: [v.isoformat() if isinstance(v, datetime) else v for v in pair]
                            for f, pair in self.changed.items()}}


def update_all(settings: Settings, job_ids: Sequence[int], changes: Changes, caller: Caller) -> list[Outcome]:
    """Change jobs in one transaction: JobNotFound or NotAllowed for any of them, or a priority
    above the caller's limit, and none changes. A job that cannot take the change (it ended; it
    started, and the change is to its priority or raises its time limit without the right) is
    refused alone, with why, and the others change."""
    require_schema(settings)
    admin = is_admin(settings, caller)
    if changes.priority is not None and changes.priority > settings.max_priority and not admin:
        raise InvalidSpec(f"--priority {changes.priority} is above the users' limit of {settings.max_priority}")
    if not admin:
        # As at submit; root and the admins may let one job run past it, as SLURM's operators may.
        check_time_limit(settings, changes.time_limit_s)
    if changes.name is not None and len(job_ids) > 1:
        # Each of an array's tasks carries its index in its name: one name for all would lose them.
        raise InvalidSpec("--name changes one job at a time")
    ids = list(dict.fromkeys(job_ids))
    with write_scope(settings) as session:
        found = jobs.changeable(session, settings, ids, caller, *_VALUES)
        waiting = [i for i in ids if found[i].state == State.PENDING]
        if any(getattr(changes, f) is not None for f in _SHAPE):
            _check_resources(session, settings, waiting, changes)
        if changes.dependency is not None and changes.dependency.after and waiting:
            _check_dependency(session, changes.dependency, set(waiting))
        outcomes = [_change(session, found[job_id], changes, admin, settings.preemptible_charge) for job_id in ids]
    if any(o.changed for o in outcomes):
        # A pending job's new priority or time limit reorders the queue and its backfill now,
        # not at the next timed pass.
        broker.wake_scheduler(settings)
    return outcomes


def _check_resources(session: Session, settings: Settings, job_ids: list[int], changes: Changes) -> None:
    """InvalidSpec, before anything changes, where a pending job could not run with its new GPUs,
    GPU type, memory or node, as its submit would have been refused: no node has that many (of
    that type), no GPU is of that type or has that much memory, no such node, a shared job left
    without its share (or made shared without one), its workload cannot run on that many. Each
    shape is checked once: an array's tasks are one."""
    checked: set[tuple[Any, ...]] = set()
    for job in jobs.rows_of(session, job_ids, Job.kind, Job.user, Job.workload, Job.params, Job.on_node,
                            Job.mem_mib, Job.shared, Job.gpus, Job.gpu_type, Job.exclude_nodes,
                            Job.preemptible, Job.cpus, Job.host_mem_mib).values():
        gpus = changes.gpus if changes.gpus is not None else job.gpus
        gpu_type = job.gpu_type if changes.gpu_type is None else changes.gpu_type or None
        mem_mib = job.mem_mib if changes.mem_mib is None else changes.mem_mib or None
        on_node = job.on_node if changes.on_node is None else changes.on_node or None
        shared = bool(job.shared) if changes.shared is None else changes.shared
        exclude = job.exclude_nodes if changes.exclude_nodes is None else changes.exclude_nodes
        preemptible = bool(job.preemptible) if changes.preemptible is None else changes.preemptible
        cpus = job.cpus if changes.cpus is None else changes.cpus or None
        host_mem_mib = job.host_mem_mib if changes.host_mem_mib is None else changes.host_mem_mib or None
        if shared and mem_mib is None:
            if job.shared:
                raise InvalidSpec(f"job {job.id} is shared: its --mem is its share, which it cannot go without")
            raise InvalidSpec(f"job {job.id} asks no GPU memory: --shared needs --mem, its share of the GPU")
        if job.kind == c.KIND_INTERACTIVE and (changes.on_node is not None or changes.exclude_nodes is not None):
            raise InvalidSpec(f"job {job.id} is an allocation: its node is the one its client runs on")
        refused = _cannot_be_preempted(job.id, job.kind) if preemptible else None
        if refused is not None:
            raise InvalidSpec(refused)
        params = dict(job.params or {})
        shape = (job.kind, job.workload, json.dumps(params, sort_keys=True, default=str), on_node, mem_mib,
                 shared, gpus, gpu_type, tuple(exclude or ()), preemptible, cpus, host_mem_mib)
        if shape in checked:
            continue
        checked.add(shape)
        check_resources(session, settings, spec.JobSpec(kind=job.kind, name="", user=job.user, gpus=gpus, cwd="/",
                                                        mem_mib=mem_mib, on_node=on_node,
                                                        shared=shared, gpu_type=gpu_type, preemptible=preemptible,
                                                        exclude_nodes=list(exclude) if exclude else None, cpus=cpus,
                                                        host_mem_mib=host_mem_mib))
        if job.kind == c.KIND_WORKLOAD and job.workload is not None and changes.gpus is not None:
            get_workload(job.workload).check_gpus(params, gpus)


def _check_dependency(session: Session, waits: Waits, waiting: set[int]) -> None:
    """InvalidSpec (StateConflict for a job that failed already), before anything changes, where
    the pending jobs ``waiting`` could not wait for ``waits``' jobs: as a submit's, and no loop."""
    if waits.kind == AFTER_CORR:
        # A submit makes it each task's afterok on the task of its index: that, not aftercorr, is kept.
        raise InvalidSpec("--dependency aftercorr is given at submit (each task then waits for its own task's id): "
                          "give a task afterok:ID of the task it waits for")
    check_dependencies(session, list(waits.after), waits.kind)
    loop = dependencies.loop_back(session, waits.after, waiting)
    if loop is not None:
        raise InvalidSpec(f"--dependency {waits.text}: {loop}")


def _cannot_be_preempted(job_id: int, kind: str) -> str | None:
    """Why a job of ``kind`` cannot be made preemptible, pending or started; None where it can."""
    if kind == c.KIND_INTERACTIVE:
        return f"job {job_id} is an allocation: its shell cannot be requeued, so it cannot be preempted"
    return None


def _started_preemptibility(job: Any, preemptible: bool, admin: bool, charge: float) -> str | None:
    """Why a started job may not be made ``preemptible`` (or no longer), or None where it may. Its
    owner may give up a running job's protection (the next pass may stop it for a waiting job, and
    it counts against their GPU limit no more); only root or an admin may take a running
    scavenger off preemption, which could hold GPUs past its user's limit, as raising a started
    job's time limit is theirs. Where fair share charges preemptible jobs less (``charge``,
    GPUQ_PREEMPTIBLE_CHARGE), a job made so would be charged that for its whole run: admins only."""
    if job.cancel_requested_at is not None:
        return f"job {job.id} is being stopped already; its preemptibility stays as it is"
    if not preemptible:
        return None if admin else (f"job {job.id} is {job.state}; only root or an admin may make a started job not "
                                   "preemptible (it would count against its user's GPU limit past it)")
    refused = _cannot_be_preempted(job.id, job.kind)
    if refused is not None:
        return refused
    if charge != 1.0 and not admin:
        return (f"job {job.id} is {job.state}; only root or an admin may make a started job preemptible here: fair "
                f"share would charge its whole run at GPUQ_PREEMPTIBLE_CHARGE ({charge:g})")
    return None


def _deadline_missed(job: Any, changes: Changes) -> str | None:
    """Why a pending job's deadline could not be met as changed (its deadline, begin time or time
    limit: as a submit's would be refused, ``deadline.check``), or None where it could."""
    if changes.deadline_at is None and changes.begin_at is None and changes.time_limit_s is None:
        return None
    at = job.deadline_at if changes.deadline_at is None else changes.deadline_at
    if at is None or at == NO_DEADLINE:
        return None
    try:
        deadline.check(at, changes.begin_at or job.begin_at,
                       changes.time_limit_s if changes.time_limit_s is not None else job.time_limit_s)
    except InvalidSpec as exc:
        return f"job {job.id}: {exc}"
    return None


def _change(session: Any, job: Any, changes: Changes, admin: bool, charge: float) -> Outcome:
    outcome = Outcome(job.id)
    if job.state in c.END_STATES:
        outcome.refused = f"job {job.id} {job.state}; an ended job cannot be changed"
        return outcome
    started = job.state != State.PENDING
    for name, words in _WAITING_ONLY.items():
        if started and getattr(changes, name) is not None:
            outcome.refused = f"job {job.id} is {job.state}; only a pending job's {words} can be changed"
            return outcome
    if (started and not admin and changes.time_limit_s is not None
            and job.time_limit_s is not None and changes.time_limit_s > job.time_limit_s):
        # No limit is the longest there is: a user may give one to a started job that had none.
        outcome.refused = (f"job {job.id} is {job.state}; only root or an admin may raise a started job's "
                           "time limit (you may lower it)")
        return outcome
    if started and changes.preemptible is not None and changes.preemptible != bool(job.preemptible):
        outcome.refused = _started_preemptibility(job, changes.preemptible, admin, charge)
        if outcome.refused is not None:
            return outcome
    if changes.dependency is not None and job.kind == c.KIND_INTERACTIVE:
        outcome.refused = f"job {job.id} is an allocation (gpuq alloc): it waits for nothing but GPUs"
        return outcome
    if changes.dependency is not None and changes.dependency.singleton and job.array_id is not None:
        outcome.refused = (f"job {job.id} is a task of array {job.array_id}: each task has a name of its own; "
                           "--array-limit 1 runs them one at a time")
        return outcome
    if changes.cpus and job.kind == c.KIND_WORKLOAD:
        outcome.refused = f"job {job.id} is a built-in workload: it runs in its worker, which --cpus cannot hold"
        return outcome
    if changes.host_mem_mib and job.kind != c.KIND_COMMAND:
        what = "an allocation" if job.kind == c.KIND_INTERACTIVE else "a built-in workload"
        outcome.refused = f"job {job.id} is {what}: --host-mem holds a command's processes"
        return outcome
    if changes.array_limit is not None and job.array_id is None:
        outcome.refused = f"job {job.id} is not a task of an array; --array-limit is an array's"
        return outcome
    if not started:
        outcome.refused = _deadline_missed(job, changes)
        if outcome.refused is not None:
            return outcome
    values = {f: getattr(changes, f) for f in FIELDS}
    # The answer's new values as stored: a limit of 0 asks for none, a type of "" for any model.
    shown = dict(values, array_limit=values["array_limit"] or None, gpu_type=values["gpu_type"] or None,
                 mem_mib=values["mem_mib"] or None, on_node=values["on_node"] or None, cpus=values["cpus"] or None,
                 host_mem_mib=values["host_mem_mib"] or None,
                 deadline_at=None if values["deadline_at"] == NO_DEADLINE else values["deadline_at"])
    outcome.changed = {f: [getattr(job, f), shown[f]] for f, v in values.items()
                       if v is not None and shown[f] != getattr(job, f)}
    if changes.dependency is not None:
        # As sbatch writes them, both sides: `afterok:5` → `afterany:5` is one change, not two.
        old = Waits(tuple(job.after or ()), job.after_kind, bool(job.singleton)).text
        new = changes.dependency.text
        if old != new:
            outcome.changed["dependency"] = [old, new]
    if changes.exclude_nodes is not None and (job.exclude_nodes or None) != (changes.exclude_nodes or None):
        outcome.changed["exclude_nodes"] = [job.exclude_nodes or None, changes.exclude_nodes or None]
    if not outcome.changed:
        return outcome
    if started:
        for name in _WAITING_ONLY.keys() & values.keys():
            del values[name]
    bound = {f"new_{f}": v for f, v in values.items()}
    if not rows_changed(session.execute(_CHANGE_STARTED if started else _CHANGE_WAITING, {"job_id": job.id, **bound})):
        # PostgreSQL: it started or ended between the read and this write (SQLite's write lock
        # keeps both in one moment).
        outcome.changed, outcome.refused = {}, f"job {job.id} changed state meanwhile; run the update again"
        return outcome
    if "dependency" in outcome.changed:
        waits = changes.dependency or Waits()
        # The job's row is this transaction's since the change above: it is still pending.
        session.execute(_CHANGE_DEPENDENCY, {"job_id": job.id, "new_after": list(waits.after) or None,
                                             "new_after_kind": waits.kind if waits.after else AFTER_OK,
                                             "new_singleton": waits.singleton, "waits": bool(waits.after)})
    if "exclude_nodes" in outcome.changed:
        session.execute(_CHANGE_EXCLUDE, {"job_id": job.id, "new_exclude_nodes": changes.exclude_nodes or None})
    if not started and (any(f in outcome.changed for f in _SHAPE) or "dependency" in outcome.changed):
        # Listed next on GPUs for what it asked before (or with nothing to wait for: a worker takes
        # a listed job without looking at its dependencies): the next pass lists it for what it
        # asks now.
        session.execute(delete(NextUp).where(NextUp.job_id == job.id))
    return outcome
