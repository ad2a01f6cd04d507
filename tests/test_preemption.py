"""Preemptible jobs on a real stack (`gpuq submit --preemptible`, SLURM's scavenger QOS with
PreemptMode=REQUEUE): one runs on a GPU nobody waits for; a job that is not preemptible and
needs that GPU has it stopped (SIGTERM first) and requeued under its own id, its attempt kept as
preempted; it runs again once the GPU is free."""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest
from sqlalchemy import select

from gpuq.service import jobs
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.models import EarlierAttempt
from tests.conftest import cli_submit, output_of, run_cli, stack_on_database, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

# The first attempt spins a moment (CPU time its record keeps), leaves a mark and runs until
# stopped, saying when SIGTERM came; an attempt that finds the mark ends at once.
SCAVENGER = ("trap 'echo got SIGTERM; exit 143' TERM; if [ -e mark ]; then echo second; "
             "else i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; touch mark; echo first; sleep 120 & wait; fi")


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def one_gpu(request, tmp_path_factory, redis_url):
    """A stack of one simulated GPU: a second job there has to preempt the first."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1, preempt_grace=5.0)


def _job(settings, job_id):
    with write_scope(settings) as session:
        return jobs.get_job(session, job_id)


def test_a_waiting_job_preempts_a_preemptible_one_which_is_requeued_and_runs_again(one_gpu, tmp_path):
    s = one_gpu.settings
    scavenger = cli_submit(s, ["--preemptible", "-t", "10m", "--", "sh", "-c", SCAVENGER], cwd=tmp_path)
    assert wait_for_state(s, scavenger, (State.RUNNING,)) == State.RUNNING
    deadline = time.monotonic() + 60
    while not (tmp_path / "mark").exists():
        assert time.monotonic() < deadline, "the preemptible job's command never began"
        time.sleep(0.05)
    assert "preemptible" in run_cli(["show", str(scavenger)], s).stdout

    urgent = cli_submit(s, ["-t", "5m", "--", "echo", "urgent"], cwd=tmp_path)
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    assert wait_for_state(s, scavenger, (State.SUCCEEDED, State.FAILED, State.CANCELLED)) == State.SUCCEEDED, \
        one_gpu.logs()

    job = _job(s, scavenger)
    reason = f"preempted by job {urgent} of {job.user}"
    # One attempt stopped by the preemption: neither a retry nor a requeue of the lost-worker cap's.
    assert [(a["state"], a["failure"], a["reason"], a["requeue"]) for a in job.attempts] == [
        ("preempted", None, reason, True)]
    assert job.requeues == 0 and job.exit_code == 0
    out = output_of(s, scavenger)
    assert out.index("first") < out.index("got SIGTERM") < out.index("second")
    # Its CPU time is kept with the attempt (the usage summary is the last attempt's), and the
    # attempt's row says why the job ran again.
    cpu_s = job.attempts[0]["cpu_s"]
    assert cpu_s > 0
    with write_scope(s) as session:
        assert session.execute(select(EarlierAttempt.cause, EarlierAttempt.cpu_s)
                               .where(EarlierAttempt.job_id == scavenger)).all() == [("preempted", cpu_s)]
    assert f"attempt 1  {reason} on gpu" in run_cli(["show", str(scavenger)], s).stdout
    # Its host memory peak too, which the job's summary (the second attempt's) does not give.
    peak = job.attempts[0]["host_mem_peak_mib"]
    assert peak > 0
    assert f"(CPU {cpu_s:.1f} s, host memory {peak} MiB at its peak)" in run_cli(["show", str(scavenger)], s).stdout
    # The urgent job started only once the preempted one had let its GPU go.
    assert _job(s, urgent).started_at >= datetime.fromisoformat(job.attempts[0]["ended_at"])


def test_a_job_that_is_not_preemptible_is_never_preempted(one_gpu, tmp_path):
    s = one_gpu.settings
    first = cli_submit(s, ["-t", "5m", "--", "sleep", "3"], cwd=tmp_path)
    assert wait_for_state(s, first, (State.RUNNING,)) == State.RUNNING
    second = cli_submit(s, ["--priority", "10", "-t", "5m", "--", "true"], cwd=tmp_path)
    assert wait_for_state(s, first, (State.SUCCEEDED, State.FAILED, State.CANCELLED)) == State.SUCCEEDED
    assert _job(s, first).attempts == []
    assert wait_for_state(s, second, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED


# A shared scavenger: its first attempt runs until stopped, the next ends at once (a mark of its own).
SHARED_SCAVENGER = ("trap 'echo got SIGTERM; exit 143' TERM; if [ -e mark_$GPUQ_JOB_ID ]; then echo second; "
                    "else touch mark_$GPUQ_JOB_ID; echo first; sleep 120 & wait; fi")


def test_shared_preemptible_jobs_give_a_shared_job_the_room_it_needs_and_a_whole_job_the_gpu(one_gpu, tmp_path):
    s = one_gpu.settings
    scavengers = []
    for _ in range(2):  # 2 GiB and a 0.5 GiB context each, side by side on the 8 GiB GPU
        scavengers.append(cli_submit(s, ["--shared", "--mem", "2G", "--preemptible", "-t", "10m", "--", "sh", "-c",
                                         SHARED_SCAVENGER], cwd=tmp_path))
        deadline = time.monotonic() + 60
        while not (tmp_path / f"mark_{scavengers[-1]}").exists():
            assert time.monotonic() < deadline, one_gpu.logs()
            time.sleep(0.05)
    first, second = scavengers
    # 4.5 GiB of room wanted, 3 GiB left: one scavenger stops, the latest started; the other runs on beside it.
    urgent = cli_submit(s, ["--shared", "--mem", "4G", "-t", "5m", "--", "echo", "urgent"], cwd=tmp_path)
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    assert wait_for_state(s, second, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    assert [a["state"] for a in _job(s, second).attempts] == ["preempted"]
    assert _job(s, first).state == State.RUNNING and _job(s, first).attempts == []
    # A whole-GPU job needs every share gone: the scavenger left is stopped for it.
    whole = cli_submit(s, ["-t", "5m", "--", "echo", "whole"], cwd=tmp_path)
    assert wait_for_state(s, whole, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    assert wait_for_state(s, first, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    assert [a["reason"] for a in _job(s, first).attempts] == [f"preempted by job {whole} of {_job(s, whole).user}"]
    for scavenger in scavengers:
        out = output_of(s, scavenger)
        assert out.index("first") < out.index("got SIGTERM") < out.index("second"), out


def test_why_and_show_say_who_preempts_whom_while_the_preempted_job_stops(one_gpu, tmp_path):
    s = one_gpu.settings
    # It ignores SIGTERM: it stops only at SIGKILL, GPUQ_PREEMPT_GRACE (5 s here) later.
    stubborn = cli_submit(s, ["--preemptible", "-t", "10m", "--", "sh", "-c",
                              "trap '' TERM; touch began; sleep 120"], cwd=tmp_path)
    assert wait_for_state(s, stubborn, (State.RUNNING,)) == State.RUNNING
    urgent = cli_submit(s, ["-t", "5m", "--", "sleep", "2"], cwd=tmp_path)
    deadline = time.monotonic() + 5
    said = ""
    while "(preempting)" not in said and time.monotonic() < deadline:
        said = run_cli(["why", str(urgent)], s).stdout
        time.sleep(0.1)
    assert said == (f"job {urgent} waits (preempting): the preemptible job {stubborn} (root) on its GPUs is being "
                    f"stopped and requeued; it starts once they have (within GPUQ_PREEMPT_GRACE, 5 s)\n"), said
    shown = run_cli(["show", str(stubborn)], s).stdout
    assert f"running (being preempted: preempted by job {urgent} of root)" in shown, shown
    listed = run_cli(["status"], s).stdout
    assert f"preempted by job {urgent} of root" in listed and "preempting" in listed, listed
    assert wait_for_state(s, urgent, (State.RUNNING,), timeout=30) == State.RUNNING
    # Back in the queue, behind every job that is not preemptible.
    assert _job(s, stubborn).state == State.PENDING
    assert "it is preemptible (--preemptible)" in run_cli(["why", str(stubborn)], s).stdout
    assert run_cli(["cancel", str(stubborn)], s).returncode == 0
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED


@pytest.mark.timeout(30)
def test_an_allocation_cannot_be_preemptible():
    from gpuq.server.submission import _allocation, _fields
    from gpuq.service.errors import InvalidSpec

    with pytest.raises(InvalidSpec, match=r"^an allocation \(gpuq alloc\) takes no --preemptible$"):
        _allocation(_fields({"preemptible": True, "node": "n", "interactive": True}), "ann", None)


def test_update_makes_a_pending_job_preemptible_or_not_shared_or_whole(one_gpu, tmp_path):
    s = one_gpu.settings
    held = cli_submit(s, ["--hold", "--", "true"], cwd=tmp_path)
    out = run_cli(["update", str(held), "--preemptible"], s)
    assert (out.returncode, out.stdout) == (0, f"job {held}: preemptible no → yes\n"), out.stderr
    assert _job(s, held).preemptible and "preemptible" in run_cli(["show", str(held)], s).stdout
    out = run_cli(["update", str(held), "--no-preemptible"], s)
    assert (out.returncode, out.stdout) == (0, f"job {held}: preemptible yes → no\n"), out.stderr
    assert not _job(s, held).preemptible
    # A shared job may be preemptible too (stopped for the room its share holds).
    shared = cli_submit(s, ["--hold", "--shared", "--mem", "1G", "--", "true"], cwd=tmp_path)
    out = run_cli(["update", str(shared), "--preemptible"], s)
    assert (out.returncode, out.stdout) == (0, f"job {shared}: preemptible no → yes\n"), out.stderr
    assert _job(s, shared).preemptible
    for job_id in (held, shared):
        run_cli(["cancel", str(job_id)], s)


def test_a_running_job_made_preemptible_is_preempted_for_a_waiting_job_and_runs_again(one_gpu, tmp_path):
    s = one_gpu.settings
    # Its first attempt runs until stopped; the next ends at once.
    running = cli_submit(s, ["-t", "10m", "--", "sh", "-c", "if [ -e again ]; then echo second; else touch again; "
                                                           "sleep 120 & wait; fi"], cwd=tmp_path)
    assert wait_for_state(s, running, (State.RUNNING,)) == State.RUNNING
    waiting = cli_submit(s, ["-t", "5m", "--", "echo", "urgent"], cwd=tmp_path)
    time.sleep(1.5)  # passes go by: a job that is not preemptible is never stopped
    assert (_job(s, running).state, _job(s, waiting).state) == (State.RUNNING, State.PENDING)
    out = run_cli(["update", str(running), "--preemptible"], s)
    assert (out.returncode, out.stdout) == (0, f"job {running}: preemptible no → yes\n"), out.stderr
    assert wait_for_state(s, waiting, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    assert wait_for_state(s, running, (State.SUCCEEDED, State.FAILED, State.CANCELLED)) == State.SUCCEEDED, \
        one_gpu.logs()
    job = _job(s, running)
    assert [a["reason"] for a in job.attempts] == [f"preempted by job {waiting} of {job.user}"]
    assert output_of(s, running).strip().endswith("second")


@pytest.fixture(scope="module", params=["sqlite"])
def limited(request, tmp_path_factory, redis_url):
    """Two simulated GPUs, each user held to one at a time."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=2, user_gpu_limit=1)


def test_preemptible_jobs_run_past_the_user_gpu_limit_and_count_against_none_of_it(limited, tmp_path):
    s = limited.settings
    held = cli_submit(s, ["-t", "5m", "--", "sleep", "60"], cwd=tmp_path)
    assert wait_for_state(s, held, (State.RUNNING,)) == State.RUNNING
    # The user holds their one GPU: their preemptible jobs take the other one, one after the other.
    extra = [cli_submit(s, ["--preemptible", "-t", "5m", "--", "sleep", "0.5"], cwd=tmp_path) for _ in range(3)]
    for job_id in extra:
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, limited.logs()
    assert _job(s, held).state == State.RUNNING
    # A job that is not preemptible is still held to the limit.
    waits = cli_submit(s, ["-t", "5m", "--", "true"], cwd=tmp_path)
    deadline = time.monotonic() + 10
    while _job(s, waits).reason != "user limit":
        assert time.monotonic() < deadline, _job(s, waits).reason
        time.sleep(0.1)
    assert run_cli(["cancel", str(held), str(waits)], s).returncode == 0


def test_a_two_gpu_preemptible_job_is_preempted_whole_for_a_one_gpu_job_and_runs_again_on_both(limited, tmp_path):
    s = limited.settings
    gang = cli_submit(s, ["--preemptible", "--gpus", "2", "-t", "10m", "--", "sh", "-c", SCAVENGER], cwd=tmp_path)
    assert wait_for_state(s, gang, (State.RUNNING,)) == State.RUNNING
    deadline = time.monotonic() + 60
    while not (tmp_path / "mark").exists():
        assert time.monotonic() < deadline, "the preemptible job's command never began"
        time.sleep(0.05)
    urgent = cli_submit(s, ["-t", "5m", "--", "sleep", "1"], cwd=tmp_path)
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, limited.logs()
    assert wait_for_state(s, gang, (State.SUCCEEDED, State.FAILED, State.CANCELLED)) == State.SUCCEEDED, \
        limited.logs()
    job = _job(s, gang)
    assert [a["state"] for a in job.attempts] == ["preempted"] and job.gpus == 2
    assert "second" in output_of(s, gang)


@pytest.fixture(scope="module", params=["sqlite"])
def exempt(request, tmp_path_factory, redis_url):
    """One simulated GPU, a preemptible job exempt from preemption for its first 3 s."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1, preempt_exempt="3s")


def test_a_preemptible_job_runs_its_exempt_time_before_it_is_preempted(exempt, tmp_path):
    s = exempt.settings
    scavenger = cli_submit(s, ["--preemptible", "-t", "10m", "--", "sh", "-c", SCAVENGER], cwd=tmp_path)
    assert wait_for_state(s, scavenger, (State.RUNNING,)) == State.RUNNING
    # Expected once the scavenger's 3 s are over, not at the end of its 10 minutes' limit.
    estimate = run_cli(["submit", "--test-only", "-t", "5m", "--", "true"], s, cwd=tmp_path)
    wait = re.search(r", in (\d+):(\d\d):(\d\d)", estimate.stdout + estimate.stderr)
    assert wait and int(wait[1]) * 3600 + int(wait[2]) * 60 + int(wait[3]) <= 3, estimate
    urgent = cli_submit(s, ["-t", "5m", "--", "true"], cwd=tmp_path)
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED), timeout=30) == State.SUCCEEDED, exempt.logs()
    job = _job(s, scavenger)
    attempt = job.attempts[0]
    assert attempt["state"] == "preempted"
    ran = datetime.fromisoformat(attempt["ended_at"]) - datetime.fromisoformat(attempt["started_at"])
    assert ran.total_seconds() >= 3, ran
    run_cli(["cancel", str(scavenger)], s)


@pytest.fixture(scope="module", params=["sqlite"])
def graced(request, tmp_path_factory, redis_url):
    """One simulated GPU; a cancel gives a job 30 s after SIGTERM, a preemption 1 s."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1, kill_grace=30.0,
                                 preempt_grace=1.0)


def test_a_preempted_job_gets_gpuq_preempt_grace_after_sigterm_not_the_cancels_grace(graced, tmp_path):
    s = graced.settings
    # Its first attempt ignores SIGTERM; the one after the preemption ends at once.
    stubborn = cli_submit(s, ["--preemptible", "-t", "10m", "--", "sh", "-c",
                              "if [ -e mark ]; then exit 0; fi; touch mark; trap '' TERM; sleep 120"], cwd=tmp_path)
    assert wait_for_state(s, stubborn, (State.RUNNING,)) == State.RUNNING
    deadline = time.monotonic() + 60
    while not (tmp_path / "mark").exists():
        assert time.monotonic() < deadline, "the preemptible job's command never began"
        time.sleep(0.05)
    urgent = cli_submit(s, ["-t", "5m", "--", "true"], cwd=tmp_path)
    # SIGKILLed 1 s after SIGTERM: the urgent job runs long before the cancel's 30 s.
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED), timeout=15) == State.SUCCEEDED, graced.logs()
    assert "[gpuq: stopping the job: SIGTERM, then SIGKILL after 1 s]" in output_of(s, stubborn)
    assert wait_for_state(s, stubborn, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, graced.logs()
    assert [a["state"] for a in _job(s, stubborn).attempts] == ["preempted"]


def _run_preempted(s, tmp_path, *options: str) -> tuple[int, str, str, int]:
    """`gpuq run --preemptible OPTIONS` of SCAVENGER, preempted by a job submitted once its command
    began: the run's exit code, stdout and stderr, and the preempting job's id."""
    import subprocess
    import sys

    from tests.conftest import settings_env

    run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--preemptible", *options, "-t", "10m", "--",
                            "sh", "-c", SCAVENGER], env=settings_env(s), cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "mark").exists():
            assert time.monotonic() < deadline and run.poll() is None, "the preemptible job's command never began"
            time.sleep(0.05)
        urgent = cli_submit(s, ["-t", "5m", "--", "true"], cwd=tmp_path)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    return run.returncode, out, err, urgent


def test_gpuq_run_of_a_preemptible_job_follows_it_through_its_preemption_to_its_end(one_gpu, tmp_path):
    s = one_gpu.settings
    code, out, err, urgent = _run_preempted(s, tmp_path)
    assert code == 0, err
    assert out.index("first") < out.index("got SIGTERM") < out.index("second"), out
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED


def test_a_preemptible_job_with_no_requeue_ends_preempted_and_gpuq_run_exits_125(one_gpu, tmp_path):
    from gpuq.service import constants as c

    s = one_gpu.settings
    code, out, err, urgent = _run_preempted(s, tmp_path, "--no-requeue", "--name", "once")
    assert code == c.EXIT_RUN_GPUQ, err
    assert out.index("first") < out.index("got SIGTERM") and "second" not in out, out
    assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, one_gpu.logs()
    from gpuq.service.models import Job

    with write_scope(s) as session:
        [once] = session.scalars(select(Job.id).where(Job.name == "once")).all()
    job = _job(s, once)
    reason = f"preempted by job {urgent} of {job.user}, not requeued (no requeue)"
    assert (job.state, job.failure, job.reason, job.attempts) == (State.CANCELLED, c.FAILURE_PREEMPTED, reason, [])
    assert f"gpuq: job {job.id} cancelled [preempted]: {reason}" in err
    assert "no requeue" in run_cli(["show", str(job.id)], s).stdout
