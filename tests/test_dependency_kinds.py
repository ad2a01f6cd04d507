"""sbatch's kinds of dependency beside afterok and afterany: afternotok (after a failure) and after
(after a start), on both databases; and the migration that gave a job its kind."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from sqlalchemy import JSON, MetaData, Table, text

from gpuq.service import db, spec, submitting
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


def tasks_of(settings, argv=("true",), array="0-2", **sched) -> list[int]:
    make = lambda extra: spec.command_spec(list(argv), user="ann")  # noqa: E731
    return [j.id for j in submitting.submit_all(settings, spec.expand(make, spec.Scheduling(**sched), array, []))]


def test_aftercorr_makes_each_task_wait_for_the_task_of_its_own_index(settings):
    from gpuq.service.models import Job

    register(settings, "a", 3)
    first = tasks_of(settings, hold=True)
    # Two arrays named: each task waits for both of its index; the second array's ids interleave.
    other = tasks_of(settings, hold=True)
    then = tasks_of(settings, dependency=f"aftercorr:{first[0]}:{other[0]}")
    with write_scope(settings) as session:
        kept = [(session.get(Job, j).after, session.get(Job, j).after_kind) for j in then]
    assert kept == [([first[i], other[i]], "aftercorr") for i in range(3)]
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:  # its own tasks, by their ids: task 0's is its array's id too
        assert why(session, settings, then[0]) == (
            f"job {then[0]} waits (dependency): it waits for job {first[0]} (pending), job {other[0]} (pending) to "
            "succeed (-d aftercorr)")
    for job in (*first, *other):
        if job not in (first[1], other[1]):
            end(settings, job, State.SUCCEEDED)
    end(settings, first[1], State.FAILED)
    Scheduler(settings).schedule_once()
    # Task 0 and 2 start as theirs succeeded; task 1 is cancelled by its own one's failure alone.
    assert [state_of(settings, j)[0] for j in then] == [State.DISPATCHED, State.CANCELLED, State.DISPATCHED]
    assert state_of(settings, then[1])[1] == f"dependency never satisfied: job {first[1]} failed"


def test_aftercorr_is_refused_for_a_single_job_a_job_that_is_no_array_and_a_task_without_its_pair(settings):
    from gpuq.service.errors import InvalidSpec

    register(settings, "a", 1)
    pair = tasks_of(settings, array="0-1", hold=True)
    single = submit(settings, hold=True)
    for args, says in (({"array": None}, "--dependency aftercorr is for an array's tasks"),
                       ({"dependency": f"aftercorr:{single}"}, f"job {single} is no array's id"),
                       ({"array": "0-2"}, f"array {pair[0]} has no task 2 for task 2 of this one to wait for"),
                       ({"array": "1-2"}, f"array {pair[0]} has no task 2")):
        options = {"dependency": f"aftercorr:{pair[0]}", "array": "0-1"} | args
        array = options.pop("array")
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            tasks_of(settings, array=array, **options)
    # A sweep's tasks are its indices 0..N-1 too: each waits for the task of its own.
    make = lambda extra: spec.command_spec(["true", *extra], user="ann")  # noqa: E731
    swept = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(dependency=f"aftercorr:{pair[0]}"),
                                                        None, ["lr=0.1,0.01"]))
    assert [j.after for j in swept] == [[pair[0]], [pair[1]]]


@pytest.mark.parametrize(("dependency", "says"), [
    ("afterok:{0}", "after the success of job {0}"), ("afterany:{0}", "after any end of job {0}"),
    ("afternotok:{0}", "after a failure of job {0}"), ("after:{0}", "after the start of job {0}"),
    # Task 1 waits for task 1 of the array alone, by its own id, named as that array's task.
    ("aftercorr:{0}", "after the success of job {1} (task 1 of array {0})")])
def test_show_says_what_a_job_waits_for_its_jobs_to_do_by_its_kind(use_settings, dependency, says):
    from typer.testing import CliRunner

    from gpuq.cli.app import app

    register(use_settings, "a", 1)
    first = tasks_of(use_settings, array="0-1", hold=True)
    made = tasks_of(use_settings, array="0-1", dependency=dependency.format(first[0]))
    shown = CliRunner().invoke(app, ["show", str(made[1])], prog_name="gpuq")
    assert shown.exit_code == 0, shown.output
    assert says.format(*first) in shown.output, shown.output


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
