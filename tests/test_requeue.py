"""`gpuq requeue` (scontrol requeue and requeuehold): a running job is stopped as a cancel stops it
and waits again under its own id, its attempt kept and charged; what is not running is refused
in one line, and only its owner, root and the admins may ask."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import NotAllowed
from gpuq.service.models import EarlierAttempt
from tests.conftest import cli_submit, output_of, run_cli, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

# The first attempt leaves a mark and runs on; an attempt that finds the mark ends at once.
TWICE = "if [ -e mark ]; then echo second; else touch mark; echo first; sleep 120; fi"


def started(settings, job_id: int, mark) -> None:
    """Once the job runs and its command has begun (its mark is there)."""
    import time

    assert wait_for_state(settings, job_id, (State.RUNNING,)) == State.RUNNING
    deadline = time.monotonic() + 60
    while not mark.exists():
        assert time.monotonic() < deadline, "the job's command never began"
        time.sleep(0.05)


def test_requeue_stops_a_running_job_and_runs_it_again_under_its_id_with_the_attempt_kept(stack, tmp_path):
    s = stack.settings
    job_id = cli_submit(s, ["-t", "5m", "--", "sh", "-c", TWICE], cwd=tmp_path)
    started(s, job_id, tmp_path / "mark")
    asked = run_cli(["requeue", str(job_id)], s)
    assert (asked.returncode, asked.stdout, asked.stderr) == (0, f"job {job_id} requeued\n", "")
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED, State.CANCELLED)) == State.SUCCEEDED, stack.logs()
    with write_scope(s) as session:
        job = jobs.get_job(session, job_id)
        earlier = session.scalars(select(EarlierAttempt).where(EarlierAttempt.job_id == job_id)).all()
    # One attempt before, stopped on the asker's word: neither a retry nor a requeue of the cap's.
    assert [(a["state"], a["failure"], a["reason"], a["requeue"]) for a in job.attempts] == [
        ("requeued", None, "requeued by root", True)]
    assert job.requeues == 0 and job.exit_code == 0
    # The GPU time the first attempt held is charged, as a retried job's is.
    assert len(earlier) == 1 and earlier[0].charged == 1.0
    # It says why the job ran again, with the attempt's CPU seconds (a command's, reaped).
    assert earlier[0].cause == "requeued" and earlier[0].cpu_s == job.attempts[0]["cpu_s"] >= 0
    assert "second" in output_of(s, job_id)
    assert "attempt 1  requeued by root on gpu" in run_cli(["show", str(job_id)], s).stdout


def test_requeue_hold_leaves_it_waiting_held_until_released(stack, tmp_path):
    s = stack.settings
    job_id = cli_submit(s, ["-t", "5m", "--", "sh", "-c", TWICE], cwd=tmp_path)
    started(s, job_id, tmp_path / "mark")
    asked = run_cli(["requeue", "--hold", str(job_id)], s)
    assert (asked.returncode, asked.stdout) == (0, f"job {job_id} requeued and held\n"), asked.stderr
    assert wait_for_state(s, job_id, (State.PENDING,)) == State.PENDING
    with write_scope(s) as session:
        job = jobs.get_job(session, job_id)
        assert job.held and job.reason == "requeued and held by root" and job.started_at is None
    # The scheduler's whole passes leave the hold's words as they are (they wrote "held" over them).
    import time

    time.sleep(2 * s.scheduler_interval + 0.2)
    with write_scope(s) as session:
        assert jobs.get_job(session, job_id).reason == "requeued and held by root"
    shown = run_cli(["show", str(job_id)], s).stdout
    assert "pending" in shown and "held" in shown
    assert run_cli(["release", str(job_id)], s).returncode == 0
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()


@pytest.mark.timeout(60)
def test_requeue_of_a_job_not_running_is_one_line_exit_4_and_changes_nothing(use_settings, tmp_path):
    s = use_settings
    held = cli_submit(s, ["--hold", "--", "true"], cwd=tmp_path)
    out = run_cli(["requeue", str(held)], s)
    assert out.returncode == c.EXIT_CONFLICT and out.stdout == ""
    assert out.stderr == f"gpuq: job {held} is pending; only a running job can be requeued\n"
    cancelled = cli_submit(s, ["--", "true"], cwd=tmp_path)
    assert run_cli(["cancel", str(cancelled)], s).returncode == 0
    out = run_cli(["requeue", str(cancelled)], s)
    assert out.returncode == c.EXIT_CONFLICT and "(gpuq resubmit runs an ended one again)" in out.stderr
    with write_scope(s) as session:
        assert jobs.get_job(session, held).held and jobs.get_job(session, held).state == State.PENDING
    out = run_cli(["requeue", "999999"], s)
    assert out.returncode == c.EXIT_NOT_FOUND and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_only_a_jobs_owner_root_and_the_admins_may_requeue_it(settings):
    from gpuq.service import spec, submitting

    job = submitting.submit_all(settings, spec.expand(lambda _: spec.command_spec(["true"], user="ann"),
                                                      spec.Scheduling(hold=True), None, []))[0]
    with pytest.raises(NotAllowed):
        jobs.requeue_all(settings, [job.id], user="bob")
    # Its owner is told why not (it waits), which is no refusal of rights.
    assert jobs.requeue_all(settings, [job.id], user="ann") == {
        job.id: f"job {job.id} is pending; only a running job can be requeued"}


@pytest.mark.timeout(30)
def test_a_running_job_asked_to_stop_reads_requeueing_or_cancelling_by_what_was_asked():
    from types import SimpleNamespace

    from gpuq.service import display, lifecycle

    def asked(reason: str) -> str:
        return display.stopping(SimpleNamespace(reason=reason))

    assert asked(lifecycle.requeued_by("ann", hold=False)) == asked(lifecycle.requeued_by("ann", hold=True)) == \
        c.REQUEUEING
    assert asked(lifecycle.cancelled_by("ann")) == c.CANCELLING
    assert asked(display.preempted_by(7, "bob")) == c.BEING_PREEMPTED  # the scheduler's, for job 7 of bob


@pytest.mark.timeout(60)
def test_an_admins_requeue_hold_of_another_users_job_is_an_admin_hold_its_owner_cannot_release(settings):
    from gpuq.service import lifecycle, spec, submitting
    from gpuq.service.models import Job

    settings = settings.with_overrides(admins="carol")
    made = submitting.submit_all(settings, spec.expand(lambda _: spec.command_spec(["true"], user="ann"),
                                                       spec.Scheduling(), None, []))
    own = submitting.submit_all(settings, spec.expand(lambda _: spec.command_spec(["true"], user="carol"),
                                                      spec.Scheduling(), None, []))
    ids = [made[0].id, own[0].id]
    with write_scope(settings) as session:  # as a worker's claim leaves them: running, with a lease
        session.execute(Job.__table__.update().where(Job.id.in_(ids)).values(state=State.RUNNING, lease_token="t"))
    assert jobs.requeue_all(settings, ids, hold=True, user="carol") == {i: None for i in ids}
    with write_scope(settings) as session:
        for job_id in ids:
            assert lifecycle.end_attempt(session, job_id, State.CANCELLED, token="t")
    with write_scope(settings) as session:
        anns, carols = jobs.get_job(session, ids[0]), jobs.get_job(session, ids[1])
    assert (anns.state, anns.held, anns.admin_hold) == (State.PENDING, True, True)
    assert anns.reason == "requeued and held by an admin (carol)"
    assert anns.attempts[0]["state"] == "requeued"
    # Her own job is her own hold, as `gpuq requeue --hold` of one's own job always was.
    assert (carols.held, carols.admin_hold, carols.reason) == (True, False, "requeued and held by carol")
    with pytest.raises(NotAllowed, match=f"job {ids[0]} was held by an admin; only an admin may release it"):
        jobs.set_held_all(settings, [ids[0]], False, user="ann")
    assert jobs.set_held_all(settings, [ids[0]], False, user="carol") == {ids[0]: None}
    with write_scope(settings) as session:
        assert not jobs.get_job(session, ids[0]).held
