"""Where a job's dependencies (``--after``, ``--after-any``, ``--dependency singleton``) stand.

An id that is an array's (its first task's id, which `gpuq submit` prints as "submitted array N")
stands for every task of the array, as SLURM's ``afterok:<array job id>`` waits for all of them: a
sweep's summary job runs once the whole sweep is done. A later task's own id is that task alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, bindparam, or_, select

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.models import Job, table

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

    @property
    def done(self) -> bool:
        return self.ended == self.tasks

    @property
    def succeeded(self) -> bool:
        return self.done and self.failed is None

    def describe(self, state: str | None = None) -> str:
        """"job 7 (running)", or "array 7 (2 of 3 tasks ended)"."""
        if self.tasks == 1:
            return f"job {self.id} ({state or ('ended' if self.done else 'not ended')})"
        return f"array {self.id} ({self.ended} of {self.tasks} tasks ended)"

    def never_met(self) -> str:
        """Why ``--after`` this can no longer be satisfied (``failed`` is set)."""
        assert self.failed is not None
        task, state = self.failed
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
    out = {}
    for d, of_d in tasks.items():
        ended = sorted((job_id, state) for job_id, state in of_d if state in c.END_STATES)
        failed = next(((j, s) for j, s in ended if s != State.SUCCEEDED), None)
        out[d] = Dependency(id=d, tasks=len(of_d), ended=len(ended), failed=failed)
    return out, states


_WAITING_ON = select(_t.c.id, _t.c.array_id, _t.c.state, _t.c.after).where(or_(
    _t.c.id.in_(bindparam("ids", expanding=True)), _t.c.array_id.in_(bindparam("ids", expanding=True))))


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
