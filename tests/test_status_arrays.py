"""Large arrays from the command line: `gpuq status` shows an array's pending tasks as one line for
each reason they wait (as squeue writes ``1234_[5-9999]``), `-r` shows each task and --json every
job; `gpuq wait --array` asks about any number of tasks, and `gpuq cancel` of many jobs is one
request that cancels all of them or, if one may not be, none."""

import json
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.cli.client import Client, Refused
from gpuq.service import constants as c
from gpuq.service import display, jobs, spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.display import ranges
from gpuq.service.errors import JobNotFound, NotAllowed
from gpuq.service.explain import why
from gpuq.service.models import Job, utcnow

pytestmark = pytest.mark.timeout(120)


def invoke(args):
    return CliRunner().invoke(app, args, prog_name="gpuq")


def job_lines(output: str) -> list[list[str]]:
    """The queue table's rows, split on runs of spaces (a cell never holds two spaces)."""
    lines = output.split("\n\n")[0].splitlines()[2:]  # the title and the header first, a blank line after
    return [[cell for cell in line.split("  ") if cell.strip()] for line in lines]


@pytest.mark.parametrize("numbers,text", [([0, 1, 2, 3, 7, 9, 10, 11, 12], "0-3,7,9-12"), ([5], "5"), ([], ""),
                                          ([9, 3, 1, 2], "1-3,9"), ([1, 3, 5, 7, 9, 11], "1,3,5,7,…")])
def test_task_numbers_are_written_as_runs_and_cut_after_four_pieces(numbers, text):
    assert ranges(numbers) == text


def test_an_arrays_pending_tasks_are_one_line_per_reason_among_the_jobs_and_r_lists_each(use_settings):
    assert invoke(["submit", "--array", "0-5", "--hold", "--", "true"]).exit_code == 0  # jobs 1-6
    assert invoke(["submit", "--", "true"]).exit_code == 0  # job 7, no array
    assert invoke(["submit", "--array", "0-1", "--", "echo"]).exit_code == 0  # jobs 8-9
    assert invoke(["release", "2", "4"]).exit_code == 0
    with write_scope(use_settings) as session:  # a task that started shows as itself
        session.execute(update(Job).where(Job.id == 6).values(state=State.RUNNING, started_at=utcnow()))
        session.execute(update(Job).where(Job.id.in_([2, 4])).values(reason="priority"))

    result = invoke(["status"])
    assert result.exit_code == 0, result.output
    rows = job_lines(result.output)
    assert [r[0].strip() for r in rows] == ["1,3,5", "2,4", "6", "7", "8-9"], result.output
    held, released, running, single, other = rows
    assert held[2:4] == ["true[0,2,4]", "pending"] and held[-1] == "held (3 tasks)"
    assert released[2] == "true[1,3]" and released[-1] == "priority (2 tasks)"
    assert running[2:4] == ["true[5]", "running"]
    assert single[2] == "true" and other[2] == "echo[0-1]"

    every = invoke(["status", "-r"])
    assert [r[0].strip() for r in job_lines(every.output)] == [str(i) for i in range(1, 10)], every.output
    mine = job_lines(invoke(["status", "--me"]).output)
    assert [r[:4] for r in mine] == [r[:4] for r in rows]  # the running job's elapsed time moves on
    document = json.loads(invoke(["status", "--json"]).output)
    assert [j["id"] for j in document["jobs"]] == list(range(1, 10)) and "arrays" not in document


def test_a_long_array_name_is_cut_before_the_tasks_brackets(use_settings):
    name = "a fairly long name for a sweep of learning rates"
    assert invoke(["submit", "--array", "0-3", "--hold", "--name", name, "--", "true"]).exit_code == 0
    cell = job_lines(invoke(["status"]).output)[0][2]
    assert cell == name[:24] + "…[0-3]" and len(cell) == 30  # the column's width


def states(settings, ids) -> list[str]:
    with write_scope(settings) as session:
        return list(session.scalars(select(Job.state).where(Job.id.in_(ids)).order_by(Job.id)))


def test_wait_and_cancel_of_an_array_of_2000_tasks_each_work_in_one_line_and_cancel_in_one_request(use_settings):
    # 2,000 ids in one query string (12 KB) passed the server's 8 KiB request line: `wait --array` failed.
    assert invoke(["submit", "--hold", "--array", "0-1999", "--", "true"]).exit_code == 0
    waited = invoke(["wait", "--array", "1", "--timeout", "0"])
    assert waited.exit_code == c.EXIT_TIMEOUT, waited.output
    assert waited.output.strip() == ("gpuq: still waiting after 0 s: job 1 (pending), 2 (pending), 3 (pending), "
                                     "4 (pending), 5 (pending) and 1995 more")
    with write_scope(use_settings) as session:
        session.execute(update(Job).where(Job.id == 7).values(state=State.SUCCEEDED, ended_at=utcnow()))
    cancelled = invoke(["cancel", "--array", "1"])
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.output == "cancelled 1,999 jobs of array 1; 1 had already ended\n"  # not 2,000 lines
    assert set(states(use_settings, range(1, 2001))) == {State.CANCELLED, State.SUCCEEDED}
    assert invoke(["wait", "--array", "1"]).exit_code == c.EXIT_JOB_FAILED


def test_cancelling_many_jobs_cancels_none_when_one_is_anothers_or_missing(settings, tmp_path):
    mine = submitting.submit_all(settings, [spec.command_spec(["true"], cwd="/", user="ann")] * 3)
    theirs = submitting.submit(settings, spec.command_spec(["true"], cwd="/", user="bob"))
    ids = [j.id for j in mine]
    with pytest.raises(NotAllowed, match=f"job {theirs.id} belongs to bob"):
        jobs.cancel_all(settings, [*ids, theirs.id], user="ann")
    with pytest.raises(JobNotFound, match="no job 999"):
        jobs.cancel_all(settings, [*ids, 999], user="ann")
    assert states(settings, [*ids, theirs.id]) == [State.PENDING] * 4
    outcomes = jobs.cancel_all(settings, ids + ids[:1], user="ann")  # each once
    assert [(o.job_id, o.state, o.ended) for o in outcomes] == [(i, State.CANCELLED, False) for i in ids]
    assert states(settings, [*ids, theirs.id]) == [State.CANCELLED] * 3 + [State.PENDING]


@pytest.mark.parametrize("body", [{"ids": "1,2"}, {"ids": [1, "2"]}, {"ids": []}, {"ids": [1], "user": "bob"},
                                  {"ids": [True]}])
def test_a_malformed_cancel_request_is_bad_input_and_changes_nothing(use_settings, body):
    assert invoke(["submit", "--", "true"]).exit_code == 0
    with pytest.raises(Refused) as refused:
        Client(str(use_settings.server_socket)).post("/jobs/cancel", body)
    assert refused.value.exit_code == c.EXIT_USAGE and "\n" not in str(refused.value)
    assert states(use_settings, [1]) == [State.PENDING]


def test_hold_and_release_take_an_array_in_one_request_and_a_named_job_they_cannot_change_exits_4(use_settings):
    assert invoke(["submit", "--hold", "--array", "0-3", "--", "true"]).exit_code == 0  # jobs 1-4
    with write_scope(use_settings) as session:
        session.execute(update(Job).where(Job.id == 2).values(state=State.RUNNING, started_at=utcnow()))
    released = invoke(["release", "--array", "1"])
    assert released.exit_code == 0, released.output
    # An array's tasks are one line, as `cancel --array` writes them (2,000 tasks were 2,000 lines).
    assert released.output == "released 3 jobs of array 1; not 1 running\n"
    nothing = invoke(["release", "--array", "1"])
    assert nothing.exit_code == c.EXIT_CONFLICT, nothing.output  # nothing of it changed
    assert nothing.output == "released 0 jobs of array 1; not 3 not held, 1 running\n"
    again = invoke(["release", "3"])  # named alone, a job that cannot be released is an error
    assert again.exit_code == c.EXIT_CONFLICT and again.output.strip() == "gpuq: job 3 is not held"
    held = invoke(["hold", "1", "3"])
    assert held.exit_code == 0 and held.output.splitlines() == ["job 1 held", "job 3 held"]
    # Named by id in a list, a job that cannot be held is an error once the others are held.
    some = invoke(["hold", "4", "2", "3"])
    assert some.exit_code == c.EXIT_CONFLICT
    assert some.output.splitlines() == ["job 4 held", "gpuq: job 2 is running; only a pending job can be held",
                                        "gpuq: job 3 is already held"]
    with write_scope(use_settings) as session:
        flags = list(session.scalars(select(Job.held).order_by(Job.id)))
    assert flags == [True, True, True, True]  # job 2 ran as it was, held when it was set running


def test_holding_many_jobs_holds_none_when_one_is_anothers(settings):
    mine = submitting.submit_all(settings, [spec.command_spec(["true"], cwd="/", user="ann")] * 2)
    theirs = submitting.submit(settings, spec.command_spec(["true"], cwd="/", user="bob"))
    with pytest.raises(NotAllowed, match=f"job {theirs.id} belongs to bob"):
        jobs.set_held_all(settings, [mine[0].id, theirs.id, mine[1].id], True, user="ann")
    with write_scope(settings) as session:
        assert not any(session.scalars(select(Job.held)))


def test_the_queue_lists_the_newest_ended_jobs_by_when_they_ended_and_only_the_asking_users(settings):
    made = submitting.submit_all(settings, [spec.command_spec(["true"], cwd="/", user=u) for u in "abab"] +
                                 [spec.command_spec(["true"], cwd="/", user="a")])
    ids = [j.id for j in made]
    now = utcnow()
    with write_scope(settings) as session:  # ended in the order 3, 1, 4, 2; the last still waits
        for job_id, ago in zip(ids[:4], (30, 10, 40, 20), strict=True):
            session.execute(update(Job).where(Job.id == job_id).values(state=State.SUCCEEDED,
                                                                       ended_at=now - timedelta(seconds=ago)))
    with write_scope(settings) as session:
        assert [j.id for j in jobs.list_jobs(session, ended_limit=2)] == [ids[4], ids[1], ids[3]]
        assert [j.id for j in jobs.list_jobs(session, ended_limit=9, user="a")] == [ids[4], ids[0], ids[2]]
        assert [j.id for j in jobs.list_jobs(session, ended_limit=0)] == [ids[4]]


def test_an_admins_hold_of_a_users_job_is_the_admins_to_release(settings):
    # The owner released what an admin held (SLURM keeps an admin hold for the admins to lift).
    job = submitting.submit(settings, spec.command_spec(["true"], cwd="/", user="ann")).id
    assert jobs.set_held_all(settings, [job], True, user="root") == {job: None}
    with write_scope(settings) as session:
        row = jobs.get_job(session, job)
        assert (row.held, row.admin_hold) == (True, True)
        assert display.result_summary(row) == "held by an admin"
    with pytest.raises(NotAllowed, match=f"job {job} was held by an admin; only an admin may release it"):
        jobs.set_held_all(settings, [job], False, user="ann")
    with write_scope(settings) as session:
        assert jobs.get_job(session, job).held  # nothing changed
    assert jobs.set_held_all(settings, [job], False, user="root") == {job: None}
    # The owner's own hold stays the owner's.
    assert jobs.set_held_all(settings, [job], True, user="ann") == {job: None}
    with write_scope(settings) as session:
        row = jobs.get_job(session, job)
        assert (row.held, row.admin_hold) == (True, False) and display.result_summary(row) == "held"
    # An admin's hold of a job its owner held already makes it the admins' (the owner released it).
    assert jobs.set_held_all(settings, [job], True, user="root") == {job: None}
    with write_scope(settings) as session:
        assert jobs.get_job(session, job).admin_hold
        assert "held by an admin; only an admin's `gpuq release" in why(session, settings, job)
    with pytest.raises(NotAllowed):
        jobs.set_held_all(settings, [job], False, user="ann")
    assert jobs.set_held_all(settings, [job], True, user="root") == {job: f"job {job} is already held"}


def test_an_arrays_tasks_an_admin_held_are_one_line_that_says_so(use_settings):
    assert invoke(["submit", "--array", "0-3", "--", "true"]).exit_code == 0  # jobs 1-4, root's
    with write_scope(use_settings) as session:
        session.execute(update(Job).values(user="ann"))  # ann's array, which root holds
    jobs.set_held_all(use_settings, [1, 2, 3, 4], True, user="root")
    out = invoke(["status"]).output
    assert "held by an admin (4 tasks)" in out, out
