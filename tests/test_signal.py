"""`--signal [B:]SIG[@SECONDS]` (sbatch's): a command is sent a signal that long before its time
limit stops it, so that a training run can save a checkpoint; to all of its processes, or with
``B:`` to its main process alone. Real workers and real signals."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job
from gpuq.service.units import JobSignal
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state

pytestmark = pytest.mark.timeout(120)

# A process noting when SIGUSR1 reaches it: a line in a file named for it.
NOTE = """
import os, signal, sys, time
where = sys.argv[1]
def note(who):
    def handler(signum, frame):
        with open(os.path.join(where, who), "a") as f:
            f.write(repr(time.time()) + "\\n")
    return handler
"""
# A job of two processes, each noting when SIGUSR1 reached it, then waiting for its time limit.
MARKS = NOTE + """
if os.fork() == 0:
    signal.signal(signal.SIGUSR1, note("child"))
    time.sleep(60)
    os._exit(0)
signal.signal(signal.SIGUSR1, note("main"))
time.sleep(60)
"""


@pytest.mark.parametrize("text,expected", [
    ("USR1@120", ("USR1", 120, False)), ("SIGUSR2", ("USR2", 60, False)), ("B:usr1@0", ("USR1", 0, True)),
    (f"{int(signal.SIGUSR1)}@5", ("USR1", 5, False)), ("b:TERM@30", ("TERM", 30, True))])
def test_signal_reads_sbatchs_form_with_sixty_seconds_by_default(text, expected):
    sent = JobSignal.parse(text)
    assert (sent.name, sent.before_s, sent.main_only) == expected
    assert JobSignal.parse(sent.text) == sent


@pytest.mark.parametrize("text,says", [
    ("", r"--signal takes \[B:\]SIGNAL\[@SECONDS\]"), ("USR1@1.5", "--signal takes"), ("USR1@-1", "--signal takes"),
    ("R:USR1", "R: is not B:"), ("FOO@10", "FOO is no signal here"), ("99", "99 is no signal here"),
    ("KILL@10", "SIGKILL cannot be caught"), ("USR1@70000", "more than 65535 seconds")])
def test_a_signal_that_is_malformed_uncatchable_or_too_early_is_refused(text, says):
    with pytest.raises(InvalidSpec, match=says):
        JobSignal.parse(text)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def one_gpu(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1)


def jobs_in(settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def test_the_signal_reaches_every_process_of_the_job_before_its_time_limit_and_b_the_main_one_alone(one_gpu, tmp_path):
    s = one_gpu.settings
    for flag, expected in (("USR1@2", {"main", "child"}), ("B:USR1@2", {"main"})):
        where = tmp_path / flag.replace(":", "_")
        where.mkdir()
        job = cli_submit(s, ["--time", "4s", "--signal", flag, "--", sys.executable, "-c", MARKS, str(where)])
        assert wait_for_state(s, job, c.END_STATES, timeout=60) == State.TIMED_OUT, one_gpu.logs()
        assert {p.name for p in where.iterdir()} == expected
        with write_scope(s) as session:
            ran = jobs.get_job(session, job)
            started, ended = ran.started_at.timestamp(), ran.ended_at.timestamp()
        # Once each: a checkpoint asked for twice is saved twice.
        assert [len((where / who).read_text().splitlines()) for who in sorted(expected)] == [1] * len(expected)
        noted = float((where / "main").read_text())
        # Sent as the limit neared, and the job went on after it until the limit stopped it.
        assert started + 1 < noted < ended - 1, (started, noted, ended)
        logs = run_cli(["logs", str(job)], s).stdout
        to = "its main process" if flag.startswith("B:") else "the job"
        assert f"[gpuq: SIGUSR1 sent to {to}, 2 s before its time limit (--signal)]" in logs
    shown = run_cli(["show", str(job)], s).stdout
    assert "SIGUSR1 2 s before its time limit (main process)" in shown


def test_a_time_limit_raised_after_the_signal_was_sent_asks_for_it_again_before_the_new_limit(one_gpu, tmp_path):
    # The checkpoint the first signal asked for is not the last, once the job may run on.
    s = one_gpu.settings
    job = cli_submit(s, ["--time", "5s", "--signal", "USR1@3", "--", sys.executable, "-c", MARKS, str(tmp_path)])
    deadline = time.monotonic() + 30
    while not (tmp_path / "main").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "main").exists(), one_gpu.logs()
    raised = run_cli(["update", str(job), "--time", "12s"], s)  # root (this test) may raise a started job's
    assert raised.returncode == 0, raised.stderr
    assert wait_for_state(s, job, c.END_STATES, timeout=60) == State.TIMED_OUT, one_gpu.logs()
    first, second = map(float, (tmp_path / "main").read_text().split())
    with write_scope(s) as session:
        ran = jobs.get_job(session, job)
        started, ended = ran.started_at.timestamp(), ran.ended_at.timestamp()
    # Once before each limit: about 2 s in (5 - 3), then about 9 s in (12 - 3), and it ran to 12 s.
    assert first - started < 4 and 7 < second - started < 11 and ended - started > 11, (started, first, second, ended)
    assert run_cli(["logs", str(job)], s).stdout.count("[gpuq: SIGUSR1 sent to the job, 3 s before its time limit") == 2


def test_a_job_that_ends_before_its_signals_moment_is_never_signalled(one_gpu, tmp_path):
    s = one_gpu.settings
    job = cli_submit(s, ["--time", "1h", "--signal", "USR1@60", "--", sys.executable, "-c", "print('done')"])
    assert wait_for_state(s, job, c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
    assert "--signal" not in run_cli(["logs", str(job)], s).stdout


@pytest.mark.parametrize("args,says", [
    (["--signal", "USR1", "matmul", "--size", "8"], "--signal is for a command (after --)"),
    (["--signal", "USR1@10", "--", "true"], "--signal USR1@10 is sent ahead of a time limit: give --time"),
    (["--time", "1m", "--signal", "USR1@60", "--", "true"], "--signal USR1@60: 60 s before a time limit of 0:01:00"),
    (["--time", "1h", "--signal", "STOP", "--", "true"], "--signal SIGSTOP cannot be caught"),
])
def test_a_signal_the_job_could_not_be_sent_is_one_line_exit_2_and_nothing_written(one_gpu, args, says):
    s = one_gpu.settings
    before = jobs_in(s)
    refused = run_cli(["submit", *args], s)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.count("\n") == 1 and says in refused.stderr, refused.stderr
    assert jobs_in(s) == before


def test_a_job_scripts_gpuq_line_gives_the_signal_and_a_resubmit_keeps_it(one_gpu, tmp_path):
    s = one_gpu.settings
    script = Path(tmp_path / "train.sh")
    script.write_text("#!/bin/sh\n#GPUQ --time 1h --signal B:USR2@300\ntrue\n")
    script.chmod(0o755)
    job = cli_submit(s, ["--hold", "--", "./train.sh"], cwd=tmp_path)
    again = run_cli(["resubmit", "--json", str(job)], s)
    assert again.returncode == 0, again.stderr
    with write_scope(s) as session:
        assert [j.signal for j in session.scalars(select(Job).where(Job.id >= job).order_by(Job.id))] == \
            ["B:USR2@300", "B:USR2@300"]
    assert run_cli(["cancel", str(job), str(json.loads(again.stdout)["id"])], s).returncode == 0


# `gpuq cancel --signal [B:]SIG` (scancel's): a signal sent to a running job now, by its worker.

# A job of two processes, each noting each SIGUSR1 that reached it (a line in a file named for it)
# and saying it is ready once its handler is set; it runs until cancelled.
READY_MARKS = NOTE + """
who = "child" if os.fork() == 0 else "main"
signal.signal(signal.SIGUSR1, note(who))
open(os.path.join(where, who + ".ready"), "w").close()
while True:
    time.sleep(0.05)
"""


def marks(where: Path, who: str) -> int:
    path = where / who
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_until(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def asked_of(settings, job_id: int) -> tuple:
    with write_scope(settings) as session:
        job = jobs.get_job(session, job_id)
        return job.signal_asked, job.signal_asked_at


@pytest.mark.parametrize("text,expected", [
    ("USR1", ("USR1", False)), ("sigusr2", ("USR2", False)), ("B:INT", ("INT", True)), ("b:10", ("USR1", True)),
    ("KILL", ("KILL", False)), ("STOP", ("STOP", False))])
def test_cancel_signal_reads_scancels_form_any_signal_and_no_time(text, expected):
    sent = JobSignal.parse_now(text)
    assert (sent.name, sent.main_only) == expected
    assert JobSignal.parse_now(sent.asked_text) == sent


@pytest.mark.parametrize("text,says", [
    ("", r"--signal takes \[B:\]SIGNAL, e\.g\."), ("USR1@60", "no @TIME"), ("R:USR1", "R: is not B:"),
    ("FOO", "FOO is no signal here"), ("0", "0 is no signal here")])
def test_a_cancel_signal_that_is_malformed_or_timed_is_refused(text, says):
    with pytest.raises(InvalidSpec, match=says):
        JobSignal.parse_now(text)


def test_cancel_signal_reaches_every_process_of_a_running_job_and_b_its_main_one_alone_and_the_job_runs_on(
        one_gpu, tmp_path):
    s = one_gpu.settings
    job = cli_submit(s, ["--time", "2m", "--", sys.executable, "-c", READY_MARKS, str(tmp_path)])
    assert wait_until(lambda: (tmp_path / "main.ready").exists() and (tmp_path / "child.ready").exists()), \
        one_gpu.logs()
    sent = run_cli(["cancel", "--signal", "USR1", str(job)], s)
    assert (sent.returncode, sent.stdout, sent.stderr) == (0, f"job {job}: SIGUSR1 sent\n", ""), sent
    assert wait_until(lambda: marks(tmp_path, "main") == 1 and marks(tmp_path, "child") == 1), one_gpu.logs()
    sent = run_cli(["cancel", "-s", "B:USR1", str(job)], s)
    assert (sent.returncode, sent.stdout) == (0, f"job {job}: SIGUSR1 sent to its main process\n"), sent
    assert wait_until(lambda: marks(tmp_path, "main") == 2), one_gpu.logs()
    time.sleep(1)  # five more looks of its watch: each ask is sent once, and only where it was asked
    assert (marks(tmp_path, "main"), marks(tmp_path, "child")) == (2, 1)
    with write_scope(s) as session:
        assert jobs.get_job(session, job).state == State.RUNNING  # a signal is no cancel
    logs = run_cli(["logs", str(job)], s).stdout
    assert "[gpuq: SIGUSR1 sent to the job, as asked (gpuq cancel --signal)]" in logs
    assert "[gpuq: SIGUSR1 sent to its main process, as asked (gpuq cancel --signal)]" in logs
    assert run_cli(["cancel", str(job)], s).returncode == 0
    assert wait_for_state(s, job, c.END_STATES) == State.CANCELLED


# A task of a SLURM script's step (cli/srun.py) noting when SIGUSR1 reaches it, by its rank.
TASK_MARKS = NOTE + """
who = "task" + os.environ["SLURM_PROCID"]
signal.signal(signal.SIGUSR1, note(who))
open(os.path.join(where, who + ".ready"), "w").close()
while True:
    time.sleep(0.05)
"""


def test_cancel_signal_reaches_each_task_of_a_slurm_scripts_step_once_and_the_scripts_trap_through_srun(
        one_gpu, tmp_path):
    s = one_gpu.settings
    (tmp_path / "task.py").write_text(TASK_MARKS)
    # Its script passes on the B: signal to srun (once told to), which passes it on to its tasks.
    (tmp_path / "step.sbatch").write_text(
        "#!/bin/bash\n#SBATCH --ntasks-per-node=2 -t 2\n"
        f"srun {sys.executable} task.py {tmp_path} &\nstep=$!\n"
        "trap '[ -e pass-on ] && kill -USR1 $step' USR1\nwhile kill -0 $step 2>/dev/null; do wait $step; done\n")
    job = cli_submit(s, ["step.sbatch"], cwd=tmp_path)
    assert wait_until(lambda: all((tmp_path / f"task{r}.ready").exists() for r in (0, 1))), one_gpu.logs()
    # To every process of the job: srun too, which passes on none of it (each task has it once).
    sent = run_cli(["cancel", "--signal", "USR1", str(job)], s)
    assert sent.returncode == 0, sent
    assert wait_until(lambda: marks(tmp_path, "task0") == 1 and marks(tmp_path, "task1") == 1), one_gpu.logs()
    time.sleep(1)
    assert (marks(tmp_path, "task0"), marks(tmp_path, "task1")) == (1, 1)
    # To the script alone: its trap sends it to srun, which passes it on to each task.
    (tmp_path / "pass-on").touch()
    sent = run_cli(["cancel", "-s", "B:USR1", str(job)], s)
    assert sent.returncode == 0, sent
    assert wait_until(lambda: marks(tmp_path, "task0") == 2 and marks(tmp_path, "task1") == 2), one_gpu.logs()
    assert run_cli(["cancel", str(job)], s).returncode == 0
    assert wait_for_state(s, job, c.END_STATES) == State.CANCELLED


def test_cancel_signal_kill_ends_the_job_as_killed_by_it(one_gpu, tmp_path):
    s = one_gpu.settings
    job = cli_submit(s, ["--time", "2m", "--", sys.executable, "-c", READY_MARKS, str(tmp_path)])
    assert wait_until(lambda: (tmp_path / "main.ready").exists()), one_gpu.logs()
    assert run_cli(["cancel", "-s", "KILL", str(job)], s).returncode == 0
    assert wait_for_state(s, job, c.END_STATES) == State.FAILED, one_gpu.logs()
    assert "SIGKILL" in run_cli(["show", str(job)], s).stdout


def test_a_signal_for_jobs_that_are_not_running_commands_is_sent_to_none_exit_4_and_nothing_written(one_gpu):
    s = one_gpu.settings
    held = cli_submit(s, ["--hold", "--", "true"])
    done = cli_submit(s, ["--", "true"])
    assert wait_for_state(s, done, c.END_STATES) == State.SUCCEEDED
    refused = run_cli(["cancel", "--signal", "USR1", str(held), str(done)], s)
    assert refused.returncode == c.EXIT_CONFLICT, refused
    assert refused.stdout == (f"job {held}: no signal sent: pending, not running\n"
                              f"job {done}: no signal sent: succeeded, not running\n")
    assert asked_of(s, held) == asked_of(s, done) == (None, None)
    for bad, says in ((["-s", "USR1@10", str(held)], "no @TIME"), (["-s", "NOPE", str(held)], "NOPE is no signal"),
                      (["-s", "USR1", "999999"], "no job 999999")):
        wrong = run_cli(["cancel", *bad], s)
        assert wrong.returncode in (2, 3) and wrong.stdout == "" and says in wrong.stderr, wrong
        assert wrong.stderr.count("\n") == 1, wrong.stderr
    assert asked_of(s, held) == (None, None)
    assert run_cli(["cancel", str(held)], s).returncode == 0


def test_a_signal_for_a_running_workload_or_another_users_job_is_refused_in_the_service(one_gpu):
    from gpuq.service.errors import NotAllowed
    from gpuq.service.job_signals import signal_all, why_not

    s = one_gpu.settings
    assert why_not(State.RUNNING, c.KIND_WORKLOAD).startswith("a built-in workload")
    assert why_not(State.RUNNING, c.KIND_INTERACTIVE).startswith("an allocation")
    assert why_not(State.DISPATCHED, c.KIND_COMMAND) == "not started yet (dispatched)"
    assert why_not(State.RUNNING, c.KIND_COMMAND) is None
    held = cli_submit(s, ["--hold", "--", "true"])
    with pytest.raises(NotAllowed, match="belongs to"):
        signal_all(s, [held], JobSignal.parse_now("USR1"), "nobody-of-this-job")
    assert asked_of(s, held) == (None, None)
    # Through the server: a built-in workload runs inside gpuq's worker, and takes no signal.
    workload = cli_submit(s, ["sleep", "--seconds", "30"])
    assert wait_for_state(s, workload, (State.RUNNING,)) == State.RUNNING
    refused = run_cli(["cancel", "-s", "USR1", str(workload)], s)
    assert refused.returncode == c.EXIT_CONFLICT and "no signal sent: a built-in workload" in refused.stdout, refused
    assert asked_of(s, workload) == (None, None)
    assert run_cli(["cancel", str(held), str(workload)], s).returncode == 0


def test_cancel_signal_of_an_array_sends_it_to_its_running_tasks_and_counts_the_others_in_one_line(one_gpu, tmp_path):
    s = one_gpu.settings  # one GPU: one task runs, two wait
    for index in range(3):  # before the submit: its first task may start (and write there) at once
        (tmp_path / str(index)).mkdir()
    made = run_cli(["submit", "--json", "--time", "2m", "-a", "0-2", "--", sys.executable, "-c", READY_MARKS,
                    str(tmp_path / "{index}")], s)
    assert made.returncode == 0, made.stderr
    array = json.loads(made.stdout)[0]["array_id"]
    assert wait_until(lambda: (tmp_path / "0" / "main.ready").exists()), one_gpu.logs()
    sent = run_cli(["cancel", "--signal", "USR1", "--array", str(array)], s)
    assert (sent.returncode, sent.stdout) == (
        0, f"SIGUSR1 sent to 1 running job of array {array}; not to 2 (pending, not running)\n"), sent
    assert wait_until(lambda: marks(tmp_path / "0", "main") == 1), one_gpu.logs()
    mine = run_cli(["cancel", "-s", "B:USR1", "--me"], s)  # as `gpuq cancel --me`: a line for each job
    ids = [j["id"] for j in json.loads(made.stdout)]
    assert (mine.returncode, mine.stdout) == (0, f"job {ids[0]}: SIGUSR1 sent to its main process\n" + "".join(
        f"job {i}: no signal sent: pending, not running\n" for i in ids[1:])), mine
    assert wait_until(lambda: marks(tmp_path / "0", "main") == 2), one_gpu.logs()
    assert run_cli(["cancel", "--array", str(array)], s).returncode == 0


def test_a_signal_is_asked_no_earlier_than_the_jobs_start_when_its_workers_clock_runs_ahead(settings):
    from datetime import timedelta

    from sqlalchemy import update

    from gpuq.service import spec, submitting
    from gpuq.service.job_signals import signal_all
    from gpuq.service.models import utcnow

    # A worker on another node, its clock 30 s ahead of the server's, started the job: an ask stamped
    # by the server's clock alone would read as before the start, and the worker would drop it.
    job = submitting.submit(settings.with_overrides(place_at_submit=False), spec.command_spec(["true"], cwd="/")).id
    ahead = utcnow() + timedelta(seconds=30)
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job).values(state=State.RUNNING, started_at=ahead))
    before = utcnow()
    assert signal_all(settings, [job], JobSignal.parse_now("B:USR2"))[0].not_sent is None
    assert asked_of(settings, job) == ("B:USR2", ahead)
    with write_scope(settings) as session:  # a job started by the server's clock or behind it: asked now
        session.execute(update(Job).where(Job.id == job).values(started_at=before - timedelta(seconds=30)))
    signal_all(settings, [job], JobSignal.parse_now("USR1"))
    asked, at = asked_of(settings, job)
    assert asked == "USR1" and before <= at <= utcnow()
