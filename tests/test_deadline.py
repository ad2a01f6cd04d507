"""`--deadline` (sbatch's): a submit the job could never meet is refused in one line; a pending job
that could no longer end by its deadline is cancelled by the scheduler, saying why; one that can
runs as any other."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from gpuq.service import constants as c
from gpuq.service import deadline
from gpuq.service.changes import NO_DEADLINE, Changes
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job, utcnow
from gpuq.service.rights import Caller
from gpuq.service.scheduler import Scheduler
from gpuq.service.update import update_all
from tests.conftest import cli_submit, run_cli, wait_for_state
from tests.test_scheduling import register, state_of, submit
from tests.test_snapshot import job_count

pytestmark = pytest.mark.timeout(120)

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(("at", "begin", "limit", "refused"), [
    (NOW - timedelta(seconds=1), None, None, "--deadline 2026-11-28 11:59:59 UTC is past already"),
    (NOW + timedelta(hours=1), NOW + timedelta(hours=2), None,
     "--deadline 2026-11-28 13:00:00 UTC is not after its --begin 2026-11-28 14:00:00 UTC"),
    (NOW + timedelta(hours=1), None, 7200, "--deadline 2026-11-28 13:00:00 UTC comes before the job could end: "
                                           "its time limit of 2:00:00 from now ends at 2026-11-28 14:00:00 UTC"),
    (NOW + timedelta(hours=3), NOW + timedelta(hours=2), 7200,
     "its time limit of 2:00:00 from its --begin ends at 2026-11-28 16:00:00 UTC"),
])
def test_a_deadline_the_job_could_never_meet_is_refused(at, begin, limit, refused):
    with pytest.raises(InvalidSpec, match=refused):
        deadline.check(at, begin, limit, NOW)


def test_a_deadline_the_job_can_meet_is_taken():
    deadline.check(NOW + timedelta(hours=2), None, 7200, NOW)  # ends right at it
    deadline.check(NOW + timedelta(minutes=1), None, None, NOW)  # no limit: it must start by then
    deadline.check(None, None, 60, NOW)


def test_a_pending_job_misses_its_deadline_once_its_limit_from_now_passes_it_or_without_one_once_it_came():
    at = NOW + timedelta(hours=1)
    assert deadline.missed(at, 1800, NOW) is None
    assert deadline.missed(at, 1800, NOW + timedelta(minutes=30)) is None
    assert deadline.missed(at, 1800, NOW + timedelta(minutes=31)) == (
        "deadline: its time limit of 0:30:00 would end past 2026-11-28 13:00:00 UTC")
    assert deadline.missed(at, None, NOW + timedelta(minutes=59)) is None
    assert deadline.missed(at, None, at) == "deadline: not started by 2026-11-28 13:00:00 UTC"


def test_submit_refuses_a_deadline_before_the_jobs_time_limit_could_end_and_writes_nothing(use_settings, tmp_path):
    out = run_cli(["submit", "-t", "2h", "--deadline", "30m", "--", "true"], use_settings, cwd=tmp_path)
    assert out.returncode == c.EXIT_USAGE and out.stderr.count("\n") == 1, out.stderr
    assert "--deadline" in out.stderr and "comes before the job could end: its time limit of 2:00:00" in out.stderr
    bad = run_cli(["submit", "--deadline", "someday", "--", "true"], use_settings, cwd=tmp_path)
    assert bad.returncode == c.EXIT_USAGE, bad.stderr
    assert "gpuq: --deadline takes a time of day (16:00, or SLURM's midnight" in bad.stderr, bad.stderr
    assert job_count(use_settings) == 0


@pytest.mark.slow
def test_a_job_waiting_past_its_deadline_is_cancelled_and_one_within_it_runs(stack, tmp_path):
    s = stack.settings
    # Held, so they wait: one without a limit whose deadline comes in 3 s, one whose 5 s limit
    # from now passes its deadline of 8 s from submit after about 3 s.
    unbounded = cli_submit(s, ["--hold", "--deadline", "3s", "--", "true"], cwd=tmp_path)
    bounded = cli_submit(s, ["--hold", "-t", "5s", "--deadline", "8s", "--", "true"], cwd=tmp_path)
    on_time = cli_submit(s, ["--deadline", "1h", "-t", "10m", "--", "true"], cwd=tmp_path)
    shown = json.loads(run_cli(["show", "--json", str(bounded)], s).stdout)
    assert shown["deadline_at"] and "deadline " in run_cli(["show", str(bounded)], s).stdout
    why = run_cli(["why", str(bounded)], s).stdout
    assert "it is held" in why and "it is cancelled unless it starts by " in why and "less its time limit)" in why
    assert wait_for_state(s, on_time, c.END_STATES, timeout=30) == c.State.SUCCEEDED
    for job_id, why in ((unbounded, "deadline: not started by "),
                        (bounded, "deadline: its time limit of 0:00:05 would end past ")):
        assert wait_for_state(s, job_id, c.END_STATES, timeout=30) == c.State.CANCELLED
        ended = json.loads(run_cli(["show", "--json", str(job_id)], s).stdout)
        assert ended["reason"].startswith(why), ended
        assert ended["started_at"] is None
    assert run_cli(["wait", str(bounded)], s).returncode == c.EXIT_JOB_FAILED
    listed = run_cli(["status", "-o", "id,state,reason", "-j", str(bounded)], s).stdout
    assert "cancelled" in listed and "deadline: its time limit" in listed, listed


def test_a_pass_cancels_a_pending_job_that_could_no_longer_end_by_its_deadline_and_places_one_that_can(settings):
    s = settings.with_overrides(place_at_submit=False)
    register(s, "a", 2)
    later = (utcnow() + timedelta(hours=2)).isoformat()
    late, fits = submit(s, time="1h", deadline=later), submit(s, time="10m", deadline=later)
    with write_scope(s) as session:  # an hour and a half later, as the pass will see it
        for job_id in (late, fits):
            session.get(Job, job_id).deadline_at = utcnow() + timedelta(minutes=30)
    Scheduler(s).schedule_once()
    state, reason, _ = state_of(s, late)
    assert state == c.State.CANCELLED and reason.startswith("deadline: its time limit of 1:00:00 would end past ")
    assert state_of(s, fits)[0] == c.State.DISPATCHED


def test_update_gives_checks_and_clears_a_pending_jobs_deadline(settings):
    s = settings.with_overrides(place_at_submit=False)
    register(s, "a", 1)
    job = submit(s, time="1h", hold=True)
    ann = Caller(5001, "ann")
    [refused] = update_all(s, [job], Changes(deadline_at=utcnow() + timedelta(minutes=30)), ann)
    assert refused.refused.startswith(f"job {job}: --deadline ") and "its time limit of 1:00:00 from now" in \
        refused.refused and not refused.changed
    later = (utcnow() + timedelta(hours=2)).replace(microsecond=0)
    [given] = update_all(s, [job], Changes(deadline_at=later), ann)
    assert given.changed == {"deadline_at": [None, later]}, given
    [longer] = update_all(s, [job], Changes(time_limit_s=3 * 3600), ann)  # would end past it
    assert "comes before the job could end: its time limit of 3:00:00" in longer.refused
    assert Changes.of({"deadline": "none"}).deadline_at == NO_DEADLINE
    [cleared] = update_all(s, [job], Changes.of({"deadline": "None"}), ann)
    assert cleared.changed == {"deadline_at": [later, None]}
    [longer] = update_all(s, [job], Changes(time_limit_s=3 * 3600), ann)
    assert longer.refused is None and longer.changed == {"time_limit_s": [3600, 3 * 3600]}


def test_gpuq_update_deadline_prints_both_sides(use_settings, tmp_path):
    job = cli_submit(use_settings, ["--hold", "--", "true"], cwd=tmp_path)
    given = run_cli(["update", str(job), "--deadline", "2026-12-24T09:00"], use_settings)
    assert given.returncode == 0 and given.stdout.startswith(f"job {job}: deadline none → 2026-12-24 "), given
    cleared = run_cli(["update", str(job), "--deadline", "none"], use_settings)
    assert cleared.returncode == 0 and cleared.stdout.strip().endswith("→ none"), cleared
