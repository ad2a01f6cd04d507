"""GPUQ_IDLE_LIMIT: a running job whose GPUs sat mostly idle for that long is cancelled by the
scheduler, as `gpuq cancel` would, its reason saying why; a busy job, a young one and one already
being stopped are left as they are."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from gpuq.service import constants as c
from gpuq.service import idle_limit
from gpuq.service.db import write_scope
from gpuq.service.models import Job
from tests.conftest import cli_submit, run_cli, settings_env, stack_on_database, wait_for_state
from tests.test_usage import NOW, add_gpu, add_job, add_samples

pytestmark = pytest.mark.timeout(180)

LIMIT_S = 600


def limited(settings, limit: str = "10m"):
    return dataclasses.replace(settings, idle_limit=limit)


def test_a_job_idle_through_the_whole_limit_is_asked_to_cancel_and_the_others_are_left(settings):
    s = limited(settings)
    limit = timedelta(seconds=LIMIT_S)
    step = LIMIT_S / 20
    with write_scope(s) as session:
        gpu = add_gpu(session, "n1", 0)
        idle = add_job(session, "ann", "n1", NOW - 2 * limit, None)
        busy = add_job(session, "bob", "n1", NOW - 2 * limit, None)
        young = add_job(session, "cid", "n1", NOW - limit / 2, None)  # idle, but for less than the limit
        stopping = add_job(session, "dee", "n1", NOW - 2 * limit, None)
        session.get(Job, stopping).cancel_requested_at = NOW - timedelta(seconds=5)
        session.get(Job, stopping).reason = "cancelled by dee"
        add_samples(session, gpu, idle, NOW - limit, [0] * 19 + [90], step=step)  # one busy moment: still idle
        add_samples(session, gpu, busy, NOW - limit, [3, 80] * 10, step=step)
        add_samples(session, gpu, young, NOW - limit / 2, [0] * 10, step=step)
        add_samples(session, gpu, stopping, NOW - limit, [0] * 20, step=step)

    assert idle_limit.end_idle_jobs(s, NOW) == [idle]

    with write_scope(s) as session:
        rows = {j: session.get(Job, j) for j in (idle, busy, young, stopping)}
        assert rows[idle].cancel_requested_at is not None and rows[idle].state == c.State.RUNNING
        assert rows[idle].reason == ("cancelled by the idle limit: its GPUs were mostly under 10% for 0:10:00 "
                                     "(GPUQ_IDLE_LIMIT)")
        assert rows[busy].cancel_requested_at is None and rows[young].cancel_requested_at is None
        assert rows[stopping].reason == "cancelled by dee"
    # Asked once: the next look finds it being stopped already.
    assert idle_limit.end_idle_jobs(s, NOW + timedelta(seconds=60)) == []


def test_without_an_idle_limit_no_job_is_cancelled_however_idle(settings):
    with write_scope(settings) as session:
        gpu = add_gpu(session, "n1", 0)
        job = add_job(session, "ann", "n1", NOW - timedelta(hours=2), None)
        add_samples(session, gpu, job, NOW - timedelta(hours=1), [0] * 60, step=60)
    assert settings.idle_limit_s == 0 and idle_limit.end_idle_jobs(settings, NOW) == []
    assert idle_limit.end_idle_jobs(limited(settings, "30m"), NOW) == [job]


def test_the_jobs_of_users_exempt_from_the_idle_limit_run_on_however_idle(settings):
    with write_scope(settings) as session:
        gpu = add_gpu(session, "n1", 0)
        jobs = {user: add_job(session, user, "n1", NOW - timedelta(hours=2), None) for user in ("ann", "bob", "cid")}
        for job in jobs.values():
            add_samples(session, gpu, job, NOW - timedelta(hours=1), [0] * 60, step=60)
    s = dataclasses.replace(limited(settings, "30m"), idle_limit_exempt=" ann, cid ")
    assert s.idle_exempt_users == {"ann", "cid"}
    assert idle_limit.end_idle_jobs(s, NOW) == [jobs["bob"]]
    assert idle_limit.end_idle_jobs(dataclasses.replace(s, idle_limit_exempt="ann,bob,cid"), NOW) == []


def test_the_scheduler_looks_a_tenth_of_the_limit_apart_between_a_second_and_a_minute():
    assert idle_limit.check_every(4) == 1.0
    assert idle_limit.check_every(120) == 12.0
    assert idle_limit.check_every(8 * 3600) == c.IDLE_LIMIT_CHECK_EVERY


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def idle_stack(request, tmp_path_factory, redis_url):
    """A stack sampling at 5 Hz whose idle limit is 4 s."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, sample_interval=0.2, idle_window=2.0,
                                 idle_limit="4s")


@pytest.mark.slow
def test_an_idle_job_is_cancelled_at_the_limit_and_its_user_told_while_a_busy_one_runs_on(idle_stack, tmp_path):
    s = idle_stack.settings
    spin = "import time\nt = time.time()\nwhile time.time() - t < 60: pass"
    busy = cli_submit(s, ["--name", "spin", "--", sys.executable, "-c", spin], cwd=tmp_path)
    wait_for_state(s, busy, ("running",))
    started = time.monotonic()
    # The user's own view: `gpuq run` of a job that sleeps on its GPU ends when the limit cancels it,
    # `gpuq status` having flagged it meanwhile with when it would be.
    run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--", "sleep", "60"], cwd=tmp_path,
                           env=settings_env(s), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    flagged = ""
    while run.poll() is None and not flagged and time.monotonic() - started < 30:
        flagged = next((ln for ln in run_cli(["status"], s).stdout.splitlines() if "sleep 60" in ln and
                        "idle GPU" in ln), "")
    out, err = run.communicate(timeout=30)
    took = time.monotonic() - started
    assert "idle GPU: mostly under 10% for the last 2 s; cancelled at 0:00:04 idle" in flagged, flagged
    assert run.returncode == c.EXIT_JOB_FAILED, (out, err, idle_stack.logs())
    assert "cancelled by the idle limit: its GPUs were mostly under 10% for 0:00:04 (GPUQ_IDLE_LIMIT)" in err
    assert 4 <= took < 30, took
    with write_scope(s) as session:
        (idle,) = [j for j in session.query(Job).filter(Job.id != busy).all()]
        assert idle.state == c.State.CANCELLED and idle.failure == c.FAILURE_CANCELLED
        assert idle.reason.startswith("cancelled by the idle limit") and not idle.attempts
        assert session.get(Job, busy).state == c.State.RUNNING  # busy all along: never flagged, never cancelled
    assert "cancelled by the idle limit" in run_cli(["show", str(idle.id)], s).stdout
    cancel = run_cli(["cancel", str(busy)], s)
    assert cancel.returncode == 0, cancel.stderr
    wait_for_state(s, busy, ("cancelled",))


@pytest.mark.slow
def test_an_allocation_left_idle_is_ended_at_the_limit_and_its_terminal_told(idle_stack, tmp_path):
    s = idle_stack.settings
    started = time.monotonic()
    held = run_cli(["alloc", "--", "sleep", "60"], s, cwd=tmp_path, timeout=60)
    took = time.monotonic() - started
    assert held.stderr.splitlines()[-1].endswith(" cancelled by the idle limit: its GPUs were mostly under 10% for "
                                                 "0:00:04 (GPUQ_IDLE_LIMIT)"), (held.returncode, held.stderr)
    assert held.returncode == c.EXIT_JOB_FAILED and 4 <= took < 30, (held.returncode, took)


@pytest.fixture(scope="module", params=["sqlite"])
def exempt_stack(request, tmp_path_factory, redis_url):
    """A stack as ``idle_stack``, whose idle limit exempts the user the suite runs as."""
    import getpass

    yield from stack_on_database(request, tmp_path_factory, redis_url, sample_interval=0.2, idle_window=2.0,
                                 idle_limit="4s", idle_limit_exempt=getpass.getuser())


@pytest.mark.slow
def test_an_exempt_users_idle_job_is_flagged_with_no_time_and_runs_past_the_limit(exempt_stack, tmp_path):
    s = exempt_stack.settings
    job = cli_submit(s, ["--", "sleep", "7"], cwd=tmp_path)
    wait_for_state(s, job, ("running",))
    flagged, began = "", time.monotonic()
    while not flagged and time.monotonic() - began < 30:
        flagged = next((ln for ln in run_cli(["status"], s).stdout.splitlines() if "sleep 7" in ln and
                        "idle GPU" in ln), "")
    assert flagged.rstrip().endswith("idle GPU: mostly under 10% for the last 2 s"), flagged
    assert wait_for_state(s, job, c.END_STATES, timeout=30) == c.State.SUCCEEDED  # 7 s, past the 4 s limit
