"""Where a job's dependencies (``--after``, ``--after-any``, ``--dependency``'s kinds and
``singleton``) stand.

An id that is an array's (its first task's id, which `gpuq submit` prints as "submitted array N")
stands for every task of the array, as SLURM's ``afterok:<array job id>`` waits for all of them: a
sweep's summary job runs once the whole sweep is done. A later task's own id is that task alone.

sbatch's ``aftercorr`` (each task after the task of its own index) holds, from the submit on, the
ids of those tasks (``corresponding``), each waited for alone, as afterok (``standing``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, bindparam, or_, select

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job, table
from gpuq.service.units import AFTER_CORR, AFTER_NOT_OK, AFTER_OK, AFTER_START

if TYPE_CHECKING:
    from gpuq.service.spec import JobSpec

_t = table(Job)
_ROWS = select(_t.c.id, _t.c.array_id, _t.c.state).where(or_(
    _t.c.id.in_(bindparam("ids", expanding=True)), _t.c.array_id.in_(bindparam("ids", expanding=True))))


@dataclass(frozen=True)
class Dependency:
    """One id a job waits for: a job, or an array's every task."""

    id: int
    tasks: int  # 1 for a job, the array's tasks for an array
    ended: int  # how many of them ended
    failed: tuple[int, str] | None  # the first of them that ended other than succeeded: its id and state
    started: int = 0  # how many of them are no longer pending (started, or ended without starting)
    first_success: int | None = None  # the first of them that succeeded

    @property
    def done(self) -> bool:
        return self.ended == self.tasks

    def describe(self, state: str | None = None, kind: str = AFTER_OK) -> str:
        """"job 7 (running)", or "array 7 (2 of 3 tasks ended)" ("started", waiting for their start)."""
        if self.tasks == 1:
            return f"job {self.id} ({state or ('ended' if self.done else 'not ended')})"
        if kind == AFTER_START:
            return f"array {self.id} ({self.started} of {self.tasks} tasks started)"
        return f"array {self.id} ({self.ended} of {self.tasks} tasks ended)"

    def never_met(self, kind: str = AFTER_OK) -> str | None:
        """Why waiting for this as ``kind`` can no longer be satisfied, or None where it still may be:
        afterok once one of its jobs ended other than succeeded, afternotok once one succeeded."""
        if kind in (AFTER_OK, AFTER_CORR) and self.failed is not None:
            return self._named(*self.failed)
        if kind == AFTER_NOT_OK and self.first_success is not None:
            return self._named(self.first_success, State.SUCCEEDED)
        return None

    def met(self, kind: str) -> bool:
        """Whether waiting for this as ``kind`` is over (``never_met`` aside)."""
        return self.started == self.tasks if kind == AFTER_START else self.done

    def _named(self, task: int, state: str) -> str:
        return f"job {task} {state}" if task == self.id and self.tasks == 1 else \
            f"job {task} {state} (a task of array {self.id})"


def look_up(conn: Any, ids: Iterable[int]) -> tuple[dict[int, Dependency], dict[int, str]]:
    """Each of ``ids`` that exists, and the state of each job among them (``conn``: a session's
    connection or a session)."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}, {}
    rows = conn.execute(_ROWS, {"ids": wanted}).all()
    states = {job_id: state for job_id, _, state in rows}
    # Each row to the ids it answers for, in one pass: the scheduler asks this every pass, for
    # every waiting job's dependencies at once.
    tasks: dict[int, list[tuple[int, str]]] = {d: [] for d in wanted if d in states}
    for job_id, array_id, state in rows:
        for d in {job_id, array_id} & tasks.keys():
            tasks[d].append((job_id, state))
    return {d: _standing_of(d, of_d) for d, of_d in tasks.items()}, states


def _standing_of(d: int, of_d: list[tuple[int, str]]) -> Dependency:
    """Where id ``d`` stands, its jobs ``of_d`` being (id, state) each: one, or an array's tasks."""
    ended = sorted((job_id, state) for job_id, state in of_d if state in c.END_STATES)
    failed = next(((j, s) for j, s in ended if s != State.SUCCEEDED), None)
    succeeded = next((j for j, s in ended if s == State.SUCCEEDED), None)
    return Dependency(id=d, tasks=len(of_d), ended=len(ended), failed=failed,
                      started=sum(state != State.PENDING for _, state in of_d), first_success=succeeded)


def standing(kind: str, deps: dict[int, Dependency], states: dict[int, str]) -> dict[int, Dependency]:
    """What a job waiting as ``kind`` waits for, from ``look_up``'s answer: ``deps``, or for
    aftercorr each job alone (by ``states``), a first task's id being its own and not its array's."""
    if kind != AFTER_CORR:
        return deps
    return {d: _standing_of(d, [(d, state)]) for d, state in states.items()}


def never_met(kind: str, after: Iterable[int], deps: dict[int, Dependency]) -> str | None:
    """Why a job waiting for ``after`` as ``kind`` can never start (``deps``: ``look_up``'s), or None.
    A job (or array) gone from the table counts as cancelled: it will never succeed, and it has
    ended other than succeeded and will not start."""
    for d in after:
        if d not in deps:
            if kind in (AFTER_OK, AFTER_CORR):
                return f"job {d} cancelled"
            continue
        why = deps[d].never_met(kind)
        if why is not None:
            return why
    return None


def all_met(kind: str, after: Iterable[int], deps: dict[int, Dependency]) -> bool:
    """Whether every one of ``after`` is done waiting for as ``kind`` (one gone from the table is)."""
    return all(deps[d].met(kind) for d in after if d in deps)


# ``look_up``'s rows not ended, with when each started and its time limit (a forecast's read).
_UNENDED = _ROWS.add_columns(_t.c.started_at, _t.c.time_limit_s).where(_t.c.state.not_in(c.END_STATES))


def unended(conn: Any, ids: Iterable[int], now: float) -> tuple[dict[int, list[int]], dict[int, float]]:
    """For a forecast of the jobs waiting for ``ids``: the jobs not ended that each id stands for
    (its own, or an array's tasks; an aftercorr task's id is its own alone, which the caller
    picks), and each started one's expected end (epoch s; inf without a time limit; a dispatched
    one counted from ``now``)."""
    wanted = sorted(set(ids))
    jobs: dict[int, list[int]] = {d: [] for d in wanted}
    ends: dict[int, float] = {}
    if not wanted:
        return jobs, ends
    for job_id, array_id, state, started_at, limit_s in conn.execute(_UNENDED, {"ids": wanted}).all():
        for d in {job_id, array_id} & jobs.keys():
            jobs[d].append(job_id)
        if state != State.PENDING:  # dispatched (its start is a moment away) or running
            start = started_at.timestamp() if started_at is not None else now
            ends[job_id] = math.inf if limit_s is None else start + limit_s
    return jobs, ends


# ``look_up``'s rows with what each waits for in turn (read apart: a pass reads ``_ROWS`` for every
# waiting job's dependencies, and needs none of that).
_WAITING_ON = _ROWS.add_columns(_t.c.after)


def loop_back(conn: Any, after: Iterable[int], jobs: set[int]) -> str | None:
    """Why waiting for ``after`` would make one of ``jobs`` (pending jobs given new dependencies by
    `gpuq update`) wait for itself, or None where it would not. A dependency is followed through
    the pending jobs it names (an array's id through its every task) and theirs in turn, as far as
    they go: a job that started will end whatever it was after, so a loop needs pending jobs all
    round. A submit needs no such look: it may only name jobs that exist, all of them earlier."""
    # Each id still to look up, with the id of ``after`` it was reached from.
    frontier = {d: d for d in after}
    seen: set[int] = set()
    while frontier:
        seen |= frontier.keys()
        reached: dict[int, int] = {}
        for job_id, array_id, state, waits in conn.execute(_WAITING_ON, {"ids": sorted(frontier)}).all():
            root = frontier[job_id] if job_id in frontier else frontier[array_id]
            if job_id in jobs:
                if job_id == root:
                    return f"job {job_id} cannot wait for itself"
                if array_id == root:
                    return f"job {job_id} is a task of array {root}: it would wait for itself"
                return (f"job {root} waits for job {job_id} already (directly or through others), so neither "
                        "would ever start")
            if state == State.PENDING:
                reached.update((d, root) for d in waits or () if d not in seen and d not in reached)
        frontier = reached
    return None


def singleton_ahead(conn: Any, job_id: int, user: str, name: str, priority: int) -> tuple[int, str] | None:
    """The job a `--dependency singleton` job waits for, as (id, state): another job of its user and
    name that holds GPUs, else one of them pending ahead of it (a singleton too, not held, first in
    queue order); None where none is (it waits for something else, or for its next pass)."""
    j = _t.c
    same = (j.user == user, j.name == name, j.id != job_id)
    started = conn.execute(select(j.id, j.state).where(*same, j.state.in_((State.DISPATCHED, State.RUNNING)))
                           .order_by(j.id).limit(1)).first()
    if started is not None:
        return started.id, started.state
    ahead = conn.execute(select(j.id, j.state).where(
        *same, j.state == State.PENDING, j.singleton.is_(True), j.held.is_(False),
        or_(j.priority > priority, and_(j.priority == priority, j.id < job_id)))
        .order_by(j.priority.desc(), j.id).limit(1)).first()
    return None if ahead is None else (ahead.id, ahead.state)


_TASKS_OF = select(_t.c.array_id, _t.c.array_index, _t.c.id).where(_t.c.array_id.in_(bindparam("ids", expanding=True)))


def corresponding(conn: Any, specs: list[JobSpec]) -> list[JobSpec]:
    """``specs`` with sbatch's ``aftercorr`` resolved: each task waits for the task of its own index
    of every array its ``after`` names, by that task's id; specs of another kind as they are.
    InvalidSpec where the submission is no array (nor sweep), an id is no array's, or an array has
    no task of some index of this one's."""
    if not specs or specs[0].after_kind != AFTER_CORR:
        return specs
    if specs[0].array_index is None:
        raise InvalidSpec("--dependency aftercorr is for an array's tasks (--array or --sweep): each waits for the "
                          "task of its own index")
    arrays = list(specs[0].after or [])
    task_of = {(array, index): job_id for array, index, job_id in conn.execute(_TASKS_OF, {"ids": arrays})}
    known = {array for array, _ in task_of}
    for array in arrays:
        if array not in known:
            raise InvalidSpec(f"--dependency aftercorr:{array}: job {array} is no array's id (the id `gpuq submit` "
                              "printed for an array)")
    out = []
    for spec in specs:
        missing = next((a for a in arrays if (a, spec.array_index) not in task_of), None)
        if missing is not None:
            raise InvalidSpec(f"--dependency aftercorr:{missing}: array {missing} has no task {spec.array_index} "
                              f"for task {spec.array_index} of this one to wait for")
        out.append(replace(spec, after=[task_of[a, spec.array_index] for a in arrays]))
    return out
