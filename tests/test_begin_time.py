"""`--begin` (sbatch's): a job that may start no sooner than a moment waits for "begin time" until
then, read in the submitter's own clock and zone; `gpuq update --begin` moves it."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from gpuq.service import constants as c
from gpuq.service import spec, submitting
from gpuq.service.changes import Changes
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.explain import why
from gpuq.service.models import Job
from gpuq.service.rights import Caller
from gpuq.service.scheduler import Scheduler
from gpuq.service.units import parse_begin
from gpuq.service.update import update_all
from tests.conftest import run_cli
from tests.test_scheduling import register, state_of, submit

pytestmark = pytest.mark.timeout(120)
ANN = Caller(5001, "ann")
NOW = datetime(2026, 11, 27, 15, 30, tzinfo=timezone(timedelta(hours=1)))  # 14:30 UTC, an hour east


@pytest.mark.parametrize("text,moment", [
    ("now", "14:30"), ("2h", "16:30"), ("90m", "16:00"), ("now+1hour", "15:30"), ("now+60", "14:31"),
    ("16:00", "15:00"),  # today's, in the submitter's zone
    ("15:00", "2026-11-28 14:00"),  # past already: tomorrow's
    ("2026-12-24T09:00+00:00", "2026-12-24 09:00"),
    # SLURM's words: each time of day its next coming, in the submitter's zone.
    ("noon", "2026-11-28 11:00"), ("fika", "2026-11-28 14:00"), ("teatime", "15:00"), ("midnight", "23:00"),
    ("today", "14:30"), ("Tomorrow", "23:00")])
def test_begin_reads_a_wait_a_time_of_day_or_a_date_in_the_submitters_zone(text, moment):
    expected = f"{moment}:00" if " " in moment else f"2026-11-27 {moment}:00"
    assert parse_begin(text, NOW).strftime("%Y-%m-%d %H:%M:%S") == expected


@pytest.mark.parametrize("text,says", [("2", "--begin takes a time of day"), ("soon", "--begin takes"),
                                       ("now+5parsecs", "--begin takes"), ("25:00", "is not a time of day"),
                                       ("400d", "more than 366 days ahead"),
                                       ("2028-01-01T00:00+00:00", "more than 366 days ahead")])
def test_a_begin_that_is_no_moment_or_too_far_is_refused(text, says):
    with pytest.raises(InvalidSpec, match=says):
        parse_begin(text, NOW)


@pytest.fixture
def settings(settings):
    return settings.with_overrides(place_at_submit=False)


def at(minutes: float) -> str:
    return (datetime.now(UTC) + timedelta(minutes=minutes)).isoformat()


def test_a_job_waits_for_its_begin_time_while_later_jobs_start_and_update_begin_now_frees_it(settings):
    register(settings, "a", 1)
    later = submit(settings, begin=at(60))
    past = submit(settings, begin=at(-1))  # a moment gone: at once
    assert (state_of(settings, later)[1], state_of(settings, past)[1]) == ("begin time", None)  # from the submit on
    Scheduler(settings).schedule_once()
    assert state_of(settings, later)[:2] == (State.PENDING, "begin time")
    assert state_of(settings, past)[0] == State.DISPATCHED
    with write_scope(settings) as session:
        said = why(session, settings, later)
    assert said.startswith(f"job {later} waits (begin time): it may start from ") and "UTC (--begin), in 0:5" in said
    assert said.endswith(f"`gpuq update {later} --begin now` lets it start sooner")
    with write_scope(settings) as session:
        session.get(Job, past).state = State.SUCCEEDED  # its GPU free again
        from gpuq.service.models import Allocation

        session.query(Allocation).delete()
    [outcome] = update_all(settings, [later], Changes.of({"begin": at(0)}), ANN)
    assert set(outcome.as_json()["changed"]) == {"begin_at"} and outcome.refused is None
    Scheduler(settings).schedule_once()
    assert state_of(settings, later)[0] == State.DISPATCHED
    [started] = update_all(settings, [later], Changes.of({"begin": at(30)}), ANN)
    assert started.refused == f"job {later} is dispatched; only a pending job's begin time can be changed"


def test_a_failed_dependency_cancels_a_job_before_its_begin_time_and_a_held_one_at_once(settings):
    # Neither a later moment nor a release could let them run: their --after chains learn it now,
    # not once the begin time comes (the pass looked at the begin time first).
    register(settings, "a", 1)
    first = submit(settings, hold=True)
    later = submit(settings, after=str(first), begin=at(60))
    held = submit(settings, after=str(first), hold=True)
    waiting = submit(settings, after_any=str(first), begin=at(60))  # any end will do: still waits
    with write_scope(settings) as session:
        session.get(Job, first).state = State.FAILED
    Scheduler(settings).schedule_once()
    never = f"dependency never satisfied: job {first} failed"
    assert state_of(settings, later)[:2] == state_of(settings, held)[:2] == (State.CANCELLED, never)
    assert state_of(settings, waiting)[:2] == (State.PENDING, "begin time")


def test_a_submit_places_no_job_whose_begin_time_is_to_come(settings):
    register(settings, "a", 2)
    placing = settings.with_overrides(place_at_submit=True)
    make = lambda extra: spec.command_spec(["true"], user="ann")  # noqa: E731
    [goes] = submitting.submit_all(placing, spec.expand(make, spec.Scheduling(), None, []))
    [waits] = submitting.submit_all(placing, spec.expand(make, spec.Scheduling(begin=at(30)), None, []))
    assert state_of(settings, goes.id)[0] == State.DISPATCHED and state_of(settings, waits.id)[0] == State.PENDING
    with pytest.raises(InvalidSpec, match="submit field 'begin' must name its time zone"):
        spec.Scheduling(begin="2026-12-01T10:00").fields()


def test_begin_through_the_cli_is_shown_and_updated_and_a_bad_one_is_one_line(use_settings, tmp_path):
    s = use_settings
    register(s, s.node, 1)
    out = run_cli(["submit", "--json", "--begin", "2h", "--", "true"], s, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    begin = datetime.fromisoformat(job["begin_at"])
    assert abs((begin - datetime.now(UTC) - timedelta(hours=2)).total_seconds()) < 60
    shown = run_cli(["show", str(job["id"])], s).stdout
    assert f"not before {begin.astimezone():%Y-%m-%d %H:%M}" in shown
    moved = run_cli(["update", str(job["id"]), "--begin", "now"], s)
    assert moved.returncode == 0 and moved.stdout.startswith(f"job {job['id']}: begin {begin.astimezone():%Y-%m-%d}")
    bad = run_cli(["submit", "--begin", "soon", "--", "true"], s, cwd=tmp_path)
    assert (bad.returncode, bad.stdout) == (c.EXIT_USAGE, "")
    assert bad.stderr.startswith("gpuq: --begin takes a time of day (16:00, or SLURM's midnight")
