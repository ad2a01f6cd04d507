"""`gpuq history`: the jobs that ended over a period, as sacct lists them, on both databases: the
caller's own by default, narrowed by state, name (an array's tasks too, shell patterns matched
case-sensitively with SQL's own wildcards taken literally) and array, newest first, with counts
over the whole period; bad input one line and exit 2."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import constants as c
from gpuq.service import history, spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job, utcnow

pytestmark = pytest.mark.timeout(120)

DAY = timedelta(days=1)


def ended(settings, user: str, name: str, state: str, ago: timedelta, tasks: int = 0) -> list[int]:
    """Submit a job (or an array of ``tasks``) of ``user``'s and mark it ended ``ago``; its ids."""
    one = spec.command_spec(["true"], cwd="/", user=user, name=name)
    made = submitting.submit_all(settings, [replace(one, name=f"{name}[{i}]", array_index=i) for i in range(tasks)]
                                 if tasks else [one])
    ids = [j.id for j in made]
    now = utcnow()
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id.in_(ids)).values(
            state=state, submitted_at=now - ago - timedelta(seconds=90), started_at=now - ago - timedelta(seconds=30),
            ended_at=now - ago, exit_code=0 if state == State.SUCCEEDED else 1))
    return ids


def query(**fields) -> history.HistoryQuery:
    now = utcnow()
    return history.HistoryQuery(since=fields.pop("since", now - DAY), until=fields.pop("until", now), **fields)


def listed(settings, **fields) -> list[int]:
    with write_scope(settings) as session:
        return [j.id for j in history.ended_jobs(session, query(**fields)).jobs]


def test_ended_jobs_are_those_of_the_period_newest_first_narrowed_by_user_state_name_and_array(settings):
    old = ended(settings, "ann", "train", State.SUCCEEDED, timedelta(days=3))
    a = ended(settings, "ann", "train", State.FAILED, timedelta(hours=5))
    b = ended(settings, "ann", "eval", State.SUCCEEDED, timedelta(hours=2))
    sweep = ended(settings, "ann", "train", State.TIMED_OUT, timedelta(hours=1), tasks=3)
    bob = ended(settings, "bob", "train", State.SUCCEEDED, timedelta(hours=3))
    submitting.submit(settings, spec.command_spec(["true"], cwd="/", user="ann", name="train"))  # waits: not history
    assert listed(settings) == [*sorted(sweep, reverse=True), *b, *bob, *a]
    assert listed(settings, user="ann", states=(State.FAILED, State.TIMED_OUT)) == [*sorted(sweep, reverse=True), *a]
    # A name is the job of that name and the tasks of the array of that name (train[0] ...).
    assert listed(settings, user="ann", name="train") == [*sorted(sweep, reverse=True), *a]
    assert listed(settings, array_id=sweep[0]) == sorted(sweep, reverse=True)
    assert listed(settings, since=utcnow() - timedelta(days=4)) == [*sorted(sweep, reverse=True), *b, *bob, *a, *old]
    assert listed(settings, since=utcnow() - timedelta(hours=4), until=utcnow() - timedelta(minutes=90)) == [*b, *bob]
    with write_scope(settings) as session:
        found = history.ended_jobs(session, query(user="ann", limit=2))
    assert [j.id for j in found.jobs] == sorted(sweep, reverse=True)[:2]
    assert found.counts == {State.TIMED_OUT: 3, State.SUCCEEDED: 1, State.FAILED: 1} and found.total == 5


def test_a_name_pattern_takes_star_and_question_mark_case_sensitively_and_sqls_wildcards_literally(settings):
    lr = ended(settings, "ann", "lr_0.1", State.SUCCEEDED, timedelta(hours=1))
    other = ended(settings, "ann", "lrX0.1", State.SUCCEEDED, timedelta(hours=1))
    upper = ended(settings, "ann", "LR-big", State.SUCCEEDED, timedelta(hours=1))
    pct = ended(settings, "ann", "50%", State.SUCCEEDED, timedelta(hours=1))
    assert sorted(listed(settings, name="lr*")) == sorted(lr + other)
    assert listed(settings, name="lr_*") == lr  # "_" is not LIKE's one character here
    assert listed(settings, name="lr_0.1") == lr
    assert listed(settings, name="L*") == upper  # SQLite's LIKE would take lr_0.1 too
    assert listed(settings, name="5?%") == pct and listed(settings, name="%") == []


@pytest.mark.parametrize("fields,message", [
    ({"states": ("running",)}, "an ended job's state is one of"),
    ({"states": ()}, "an ended job's state is one of"),
    ({"limit": 0}, "--limit must be from 1"),
    ({"limit": history.MAX_LISTED + 1}, "--limit must be from 1"),
])
def test_a_query_that_makes_no_sense_is_refused_before_it_reads(fields, message):
    with pytest.raises(InvalidSpec, match=message):
        query(**fields)
    with pytest.raises(InvalidSpec, match="--since must be before --until"):
        query(since=utcnow(), until=utcnow() - DAY)


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_gpuq_history_lists_my_ended_jobs_with_counts_and_everyones_with_all(use_settings):
    import getpass

    me = getpass.getuser()
    mine = ended(use_settings, me, "train", State.FAILED, timedelta(hours=1), tasks=3)
    ended(use_settings, me, "eval", State.SUCCEEDED, timedelta(hours=2))
    theirs = ended(use_settings, "bob", "bobs", State.SUCCEEDED, timedelta(minutes=30))
    out = invoke("history", "-n", "2")
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[1].split() == ["ID", "USER", "NAME", "STATE", "EXIT", "GPUS", "NODE", "ENDED", "WAITED", "RAN",
                                "RESULT", "/", "REASON"]
    rows = [line.split() for line in lines[2:4]]
    assert [r[0] for r in rows] == [str(i) for i in sorted(mine, reverse=True)[:2]]
    # ENDED is a date and a time: two words
    assert rows[0][1:5] == [me, "train[2]", "failed", "1"] and rows[0][9:11] == ["1:00", "30.0s"]
    assert lines[-1].startswith("4 jobs ended from ") and lines[-1].endswith(
        ": 3 failed, 1 succeeded (the 2 newest listed: -n for more)")
    everyone = json.loads(invoke("history", "--all", "--json").output)
    assert [j["id"] for j in everyone["jobs"]][0] == theirs[0] and everyone["total"] == 5
    assert "output" not in everyone["jobs"][0] and "env" not in everyone["jobs"][0]
    named = json.loads(invoke("history", "--user", "bob", "--json", "--state", "succeeded,failed").output)
    assert [j["id"] for j in named["jobs"]] == theirs
    assert invoke("history", "--user", "daemon").output.startswith("no job ended from ")  # an account, no job
    # No account and no job: a mistyped name is said (sacct's "Invalid user id"), not an empty period.
    nobody_here = invoke("history", "--user", "carol")
    assert nobody_here.exit_code == 2 and nobody_here.output == (
        "gpuq: --user carol: no such user here, and no job of theirs\n"), nobody_here.output


def test_history_noheader_gives_the_job_lines_alone_and_parsable_splits_on_bars(use_settings):
    import getpass

    me = getpass.getuser()
    first = ended(use_settings, me, "train|big " + "x" * 40, State.FAILED, timedelta(hours=2))[0]
    second = ended(use_settings, me, "eval", State.SUCCEEDED, timedelta(hours=1))[0]
    bare = invoke("history", "-h")
    assert bare.exit_code == 0, bare.output
    assert [line.split()[:2] for line in bare.output.splitlines()] == [[str(second), me], [str(first), me]]
    parsed = invoke("history", "-P", "-o", "id,name,state,exit_code")
    assert parsed.exit_code == 0, parsed.output
    # The whole name (cut at 30 in the table), its "|" shown as "/" so that each line splits in four.
    assert parsed.output == (f"ID|NAME|STATE|EXIT\n{second}|eval|succeeded|0\n"
                             f"{first}|train/big {'x' * 40}|failed|1\n")
    default = invoke("history", "-P", "-h").output.splitlines()
    assert [line.split("|")[0] for line in default] == [str(second), str(first)]
    assert {len(line.split("|")) for line in default} == {11}
    # Nothing ended: nothing at all, for a script (the table says "no job ended ...").
    assert invoke("history", "-h", "--state", "cancelled").output == ""
    assert invoke("history", "-P", "--state", "cancelled").output == (
        "ID|USER|NAME|STATE|EXIT|GPUS|NODE|ENDED|WAITED|RAN|RESULT / REASON\n")
    assert invoke("history", "-P", "-h", "--state", "cancelled").output == ""


@pytest.mark.parametrize("args,words", [
    (["--state", "running"], "an ended job's state is one of"),
    (["-h", "--json"], "--noheader and --parsable are the table's"),
    (["-P", "--json"], "--noheader and --parsable are the table's"),
    (["--since", "soon"], "bad --since 'soon'"),
    (["--since", "1d", "--until", "2d"], "--since must be before --until"),
    (["--all", "--user", "bob"], "--all and --user cannot be used together"),
    (["--user", ""], "--user needs a user name"),  # not read as "mine"
    (["--user", " "], "--user needs a user name"),
    (["--user", "a\x00b"], "no such user here"),  # pwd's "embedded null byte": the server failed, 70
    (["--limit", "0"], "--limit"),
    (["--array", "x"], "--array"),
])
def test_bad_history_input_is_one_line_and_exit_2(use_settings, args, words):
    out = invoke("history", *args)
    assert out.exit_code == c.EXIT_USAGE, out.output
    assert words in out.output and len(out.output.strip().splitlines()) == 1, out.output


def test_gpuq_status_user_lists_one_users_jobs_as_squeue_u_does(use_settings):
    import getpass

    me = getpass.getuser()
    mine = ended(use_settings, me, "mine", State.SUCCEEDED, timedelta(minutes=5))
    theirs = ended(use_settings, "bob", "bobs", State.SUCCEEDED, timedelta(minutes=5))
    listed = json.loads(invoke("status", "--user", "bob", "--json").output)["jobs"]
    assert [j["id"] for j in listed] == theirs
    assert [j["id"] for j in json.loads(invoke("status", "-u", me, "--json").output)["jobs"]] == mine
    assert invoke("status", "-u", "bob").output.count("bobs") == 1
    for args, words in ((["--user", "carol"], "gpuq: --user carol: no such user here, and no job of theirs"),
                        (["--user", " "], "gpuq: --user needs a user name"),
                        (["--me", "--user", "bob"], "gpuq: --me and --user cannot be used together")):
        out = invoke("status", *args)
        assert out.exit_code == c.EXIT_USAGE and out.output.startswith(words), out.output
        assert len(out.output.strip().splitlines()) == 1


def test_gpuq_status_state_and_name_narrow_the_queue_as_squeue_t_and_n_do(use_settings):
    s = use_settings
    failed = ended(s, "ann", "train", State.FAILED, timedelta(minutes=5))
    succeeded = ended(s, "ann", "train", State.SUCCEEDED, timedelta(minutes=4))
    other = ended(s, "ann", "eval", State.FAILED, timedelta(minutes=3))
    make = lambda extra: spec.command_spec(["true"], cwd="/", user="ann", name="train")  # noqa: E731
    waiting = [j.id for j in submitting.submit_all(s, spec.expand(make, spec.Scheduling(), None, []))]
    tasks = [j.id for j in submitting.submit_all(s, spec.expand(make, spec.Scheduling(), "0-2", []))]

    def ids(*args: str) -> list[int]:
        out = invoke("status", "--json", *args)
        assert out.exit_code == 0, out.output
        return [j["id"] for j in json.loads(out.output)["jobs"]]

    assert ids("-t", "failed") == failed + other
    assert ids("-t", "F", "--name", "train") == failed
    assert ids("--state", "pending,CD", "--name", "train") == waiting + tasks + succeeded
    assert ids("--name", "tr*") == waiting + tasks + failed + succeeded
    assert ids("-t", "failed", "-n", "1") == other  # the newest ended of those asked for
    assert ids("-t", "running") == []
    table = invoke("status", "-t", "PD").output  # an array's pending tasks: one line, as always
    assert "train[0-2]" in table and "eval" not in table and table.count("pending") == 2, table
    assert invoke("status", "-t", "R").output.startswith("no jobs")
    for args, words in ((["-t", "done"], "gpuq: --state takes pending, dispatched, running"),
                        (["--name", " "], "gpuq: --name needs a name or a pattern")):
        out = invoke("status", *args)
        assert out.exit_code == c.EXIT_USAGE and out.output.startswith(words), out.output
        assert len(out.output.strip().splitlines()) == 1
