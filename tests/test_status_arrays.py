"""`gpuq status` shows an array's pending tasks as one line for each reason they wait (as squeue
writes ``1234_[5-9999]``), `-r` shows each task, and --json every job."""

import json

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.display import ranges
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
    assert job_lines(invoke(["status", "--me"]).output) == rows
    document = json.loads(invoke(["status", "--json"]).output)
    assert [j["id"] for j in document["jobs"]] == list(range(1, 10)) and "arrays" not in document


def test_a_long_array_name_is_cut_before_the_tasks_brackets(use_settings):
    name = "a fairly long name for a sweep of learning rates"
    assert invoke(["submit", "--array", "0-3", "--hold", "--name", name, "--", "true"]).exit_code == 0
    cell = job_lines(invoke(["status"]).output)[0][2]
    assert cell == name[:24] + "…[0-3]" and len(cell) == 30  # the column's width
