"""sbatch's kinds of dependency beside afterok and afterany: afternotok (after a failure) and after
(after a start), on both databases; and the migration that gave a job its kind."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import JSON, MetaData, Table, text

from gpuq.service import db
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import StateConflict
from gpuq.service.explain import why
from gpuq.service.scheduler import Scheduler
from tests.conftest import make_settings
from tests.test_scheduling import end, register, state_of, submit

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def settings(settings):
    """The passes place, not the submit: each test says when a pass runs."""
    return settings.with_overrides(place_at_submit=False)


def test_afternotok_starts_after_a_failure_and_is_cancelled_by_a_success(settings):
    register(settings, "a", 2)
    first, second = submit(settings, hold=True), submit(settings, hold=True)
    on_failure = submit(settings, dependency=f"afternotok:{first}")
    not_needed = submit(settings, dependency=f"afternotok:{second}")
    Scheduler(settings).schedule_once()
    assert state_of(settings, on_failure)[:2] == (State.PENDING, "dependency")
    with write_scope(settings) as session:
        assert why(session, settings, on_failure) == (
            f"job {on_failure} waits (dependency): it waits for job {first} (pending) to end other than succeeded "
            "(-d afternotok)")
    end(settings, first, State.FAILED)
    end(settings, second, State.SUCCEEDED)
    Scheduler(settings).schedule_once()
    assert state_of(settings, on_failure)[0] == State.DISPATCHED
    assert state_of(settings, not_needed)[:2] == (State.CANCELLED,
                                                  f"dependency never satisfied: job {second} succeeded")
    # One that succeeded already is refused at submit, as afterok's failed one is; a cancelled one
    # (it ended other than succeeded) lets it start.
    with pytest.raises(StateConflict, match=f"-d afternotok {second}: job {second} succeeded, so this job would "
                                            "never start$"):
        submit(settings, dependency=f"afternotok:{second}")
    assert _starts_after_a_cancelled_job(settings, "afternotok")


def test_after_starts_once_its_jobs_started_or_ended_without_starting(settings):
    register(settings, "a", 3)
    first = submit(settings, hold=True)
    beside = submit(settings, dependency=f"after:{first}")
    Scheduler(settings).schedule_once()
    assert state_of(settings, beside)[:2] == (State.PENDING, "dependency")
    with write_scope(settings) as session:
        assert f"it waits for job {first} (pending) to start (-d after)" in why(session, settings, beside)
    from gpuq.service import jobs

    jobs.set_held(settings, first, False, "ann")
    Scheduler(settings).schedule_once()  # the first starts; the pass read it pending
    assert state_of(settings, first)[0] == State.DISPATCHED
    Scheduler(settings).schedule_once()
    # It runs beside the job it waited for, which has not ended.
    assert state_of(settings, beside)[0] == State.DISPATCHED and state_of(settings, first)[0] == State.DISPATCHED
    assert _starts_after_a_cancelled_job(settings, "after")  # it ended without starting


def _starts_after_a_cancelled_job(settings, kind: str) -> bool:
    cancelled = submit(settings, hold=True)
    end(settings, cancelled, State.CANCELLED)
    then = submit(settings, dependency=f"{kind}:{cancelled}")
    Scheduler(settings).schedule_once()
    return state_of(settings, then)[0] == State.DISPATCHED


def test_afternotok_on_an_array_waits_for_every_task_and_one_success_cancels_it(settings):
    from tests.test_scheduling import submit_array

    register(settings, "a", 1)
    tasks = submit_array(settings, 2)
    on_failure = submit(settings, dependency=f"afternotok:{tasks[0]}")
    end(settings, tasks[0], State.FAILED)
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        assert f"array {tasks[0]} (1 of 2 tasks ended) to end other than succeeded" in why(
            session, settings, on_failure)
    end(settings, tasks[1], State.SUCCEEDED)
    Scheduler(settings).schedule_once()
    assert state_of(settings, on_failure)[:2] == (
        State.CANCELLED, f"dependency never satisfied: job {tasks[1]} succeeded (a task of array {tasks[0]})")


def test_the_migration_keeps_after_any_as_afterany_and_downgrades_back(database_url, tmp_path):
    settings = make_settings(tmp_path, database_url, "redis://127.0.0.1:6379/13")
    db.upgrade(settings, "0025")
    engine = db.get_engine(settings)
    with engine.begin() as conn:
        # The table as 0025 made it, every column a value: what a row of that day held.
        jobs = Table("jobs", MetaData(), autoload_with=conn)
        for job_id, after_any in ((1, True), (2, False)):
            row = {col.name: _value(col) for col in jobs.columns if not col.nullable}
            row.update(id=job_id, state="pending", kind="command", gpus=1, after=[7], after_any=after_any)
            conn.execute(jobs.insert().values(row))
    db.upgrade(settings)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT id, after_kind FROM jobs ORDER BY id")).all() == [(1, "afterany"),
                                                                                         (2, "afterok")]
    _downgrade(settings, "0025")
    with engine.begin() as conn:
        assert [bool(v) for v, in conn.execute(text("SELECT after_any FROM jobs ORDER BY id"))] == [True, False]


def _value(col):
    kind = col.type.python_type if not isinstance(col.type, JSON) else list
    return {bool: False, int: 0, str: "x", list: [], dict: {}}.get(kind, datetime.now(UTC))


def _downgrade(settings, revision: str) -> None:
    from alembic import command

    cfg = db.alembic_config(settings)
    with db.get_engine(settings).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
        conn.commit()
