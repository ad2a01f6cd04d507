"""The job's life as one table (service/lifecycle.py): every statement that changes a job is
built from it, and nothing else in gpuq updates the jobs table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import BindParameter, select
from sqlalchemy.sql.elements import BinaryExpression

from gpuq.service import jobs, leases, lifecycle, next_up, scheduler, spec, submitting  # noqa: F401 - their moves
from gpuq.service.constants import ALL_STATES, END_STATES, State
from gpuq.service.db import write_scope
from gpuq.service.errors import BugError
from gpuq.service.lifecycle import MOVES, TRANSITIONS, Actor, allowed, move
from gpuq.service.models import Job

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent
STATE = Job.__table__.c.state


def _state_guards(clause) -> list[tuple[State, ...]]:
    """The states each ``jobs.state = X`` / ``jobs.state IN (...)`` term of a WHERE clause names."""
    found = []
    if isinstance(clause, BinaryExpression) and clause.left is STATE:
        right = clause.right
        values = right.value if isinstance(right, BindParameter) else [b.value for b in right.clauses]
        found.append(tuple(values) if isinstance(values, (list, tuple)) else (values,))
    for child in getattr(clause, "clauses", ()):  # AND, OR: a ClauseList's terms
        found += _state_guards(child)
    return found


def test_every_move_is_one_the_table_allows_and_its_where_names_exactly_its_states():
    assert len(MOVES) >= 15
    for name, m in MOVES.items():
        guards = _state_guards(m.statement.whereclause)
        assert guards == [m.sources], (name, guards)
        for actor in m.actors:
            for source in m.sources:
                assert allowed(actor, source, m.target or source), name
        sets = {col.name if hasattr(col, "name") else col: v for col, v in m.statement._values.items()}
        if m.target is None:
            assert "state" not in sets, name  # a move that keeps the state must not set it
        else:
            assert sets["state"].value == m.target, name


def test_the_table_names_every_state_and_lets_nothing_leave_an_end_state():
    assert set(TRANSITIONS) == {None, *ALL_STATES}
    for end in END_STATES:
        assert TRANSITIONS[end] == {}
    # Every state can be reached from a submit.
    reached, frontier = set(), [None]
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(ALL_STATES)


def test_running_back_to_pending_is_the_workers_or_the_reapers_move_only():
    assert {a for a in Actor if allowed(a, State.RUNNING, State.PENDING)} == {Actor.WORKER, Actor.REAPER}
    assert not allowed(Actor.USER, State.RUNNING, State.PENDING)


def test_a_move_the_table_does_not_allow_is_refused_when_it_is_built():
    with pytest.raises(BugError, match="may not move a job from running to pending"):
        move("a user requeues a running job", Actor.USER, State.RUNNING, State.PENDING, STATE.is_not(None))
    with pytest.raises(BugError, match="from succeeded"):
        move("a worker restarts an ended job", Actor.WORKER, State.SUCCEEDED, State.RUNNING)
    assert "a user requeues a running job" not in MOVES


# Statements that would change a job's row without the table: an ORM update of Job, or a Core
# update of the jobs table under any of the names gpuq gives it.
_UPDATES_OF_JOBS = re.compile(r"update\(\s*Job\s*\)|(?:Job\.__table__|table\(\s*Job\s*\)|_JOBS|_t|_JOB)\s*\.update\(|"
                              r"\bJob\.__table__\.c\b.*\.update\(|session\.query\(\s*Job\s*\)[^\n]*\.update\(")


def test_no_module_of_gpuq_updates_the_jobs_table_but_through_the_lifecycle():
    offenders = []
    for folder in ("service", "workers", "server", "cli", "web"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "lifecycle.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _UPDATES_OF_JOBS.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "update jobs through lifecycle.move:\n" + "\n".join(offenders)


def test_a_job_row_changed_outside_the_table_is_caught_by_the_scan(tmp_path):
    # The scan above must be able to fail: it finds the forms gpuq's code would use.
    for line in ("session.execute(update(Job).where(Job.id == 1).values(state='running'))",
                 "_JOBS.update().where(_JOBS.c.id == 1)", "Job.__table__.update().values(held=True)",
                 "table(Job).update().values(held=True)"):
        assert _UPDATES_OF_JOBS.search(line), line


def test_the_reaper_may_not_end_a_job_as_succeeded_and_nothing_is_written(settings):
    job = submitting.submit(settings, spec.command_spec(["true"], cwd="/"))
    with write_scope(settings) as session:
        session.execute(Job.__table__.update().where(Job.id == job.id).values(state=State.RUNNING, lease_token="t"))
    with write_scope(settings) as session, pytest.raises(BugError, match="reaper may not move"):
        lifecycle.end_attempt(session, job.id, State.SUCCEEDED, expired_before=job.submitted_at)
    with write_scope(settings) as session:
        assert session.scalar(select(Job.state).where(Job.id == job.id)) == State.RUNNING
        assert lifecycle.end_attempt(session, job.id, State.SUCCEEDED, token="t")
        assert jobs.get_job(session, job.id).state == State.SUCCEEDED
