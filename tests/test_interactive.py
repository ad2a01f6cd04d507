"""Interactive use against a real stack (server, scheduler, a worker per simulated GPU): `gpuq run`
streams a job and exits with its status, `gpuq attach` follows one, and `gpuq alloc` holds GPUs
for a shell in the user's own terminal, with nothing left behind when it ends.

The client runs as a real `gpuq` process, on a pseudo-terminal where terminal semantics matter
(lines as they come, Ctrl-C, a shell's prompt)."""

from __future__ import annotations

import os
import pwd
import re
import select
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from gpuq.cli.follow import exit_code_of
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import read_scope
from gpuq.service.jobs import get_job, job_gpus
from tests.conftest import output_of, run_cli, settings_env, stack_on_database

pytestmark = pytest.mark.timeout(240)

KEEPALIVE = 2.0  # the stack's alloc_keepalive: a lost client is noticed within this (and a second)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, kill_grace=2.0, alloc_keepalive=KEEPALIVE)


class Terminal:
    """A `gpuq` process on a pseudo-terminal: what it wrote there, and keys typed into it."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env={**env, "TERM": "xterm", "COLUMNS": "120"},
                                     start_new_session=True, preexec_fn=_take_terminal)
        os.close(slave)
        self.text = ""

    def read_until(self, needle: str, timeout: float = 60.0, after: int = 0) -> str:
        """Everything written so far, once ``needle`` is in it past its first ``after`` characters;
        AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while needle not in self.text[after:]:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)) and self.proc.poll() is not None:
                raise AssertionError(f"{needle!r} not written in {timeout} s; got:\n{self.text}")
        return self.text

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the process closed the terminal
            return False
        self.text += data.decode(errors="replace")
        return bool(data)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        code = self.proc.wait(max(deadline - time.monotonic(), 0.1))
        while self._read(0.05) and self.proc.poll() is not None and select.select([self.master], [], [], 0)[0]:
            pass
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def _take_terminal() -> None:
    """In the child, its own session's leader by now: make the pseudo-terminal (its stdin) its
    controlling terminal, as a login shell's is, so Ctrl-C typed there is a SIGINT to its foreground
    process group. Ctrl-C and Ctrl-\\ as a terminal's shell leaves them: a test run started in the
    background (`pytest &`) has them ignored, and an ignored signal stays ignored across exec."""
    import fcntl
    import signal
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []

    def open_terminal(args: list[str], env: dict[str, str]) -> Terminal:
        opened.append(Terminal(args, env))
        return opened[-1]

    yield open_terminal
    for t in opened:
        t.close()


def job_of(settings, job_id: int):
    with read_scope(settings) as session:
        job = get_job(session, job_id)
        gpus = [g.index for g in job_gpus(session, job_id)]
        session.expunge(job)
    return job, gpus


def newest_job(settings) -> int:
    from sqlalchemy import func, select

    from gpuq.service.models import Job

    with read_scope(settings) as session:
        return session.scalar(select(func.max(Job.id)))


def wait_until(check, timeout: float = 30.0, what: str = "") -> float:
    """Seconds until ``check()`` held; AssertionError after ``timeout``."""
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - began


def killed_until_its_end(client: subprocess.Popen, settings, job_id: int, what: str) -> float:
    """`kill -9` a client that keeps job ``job_id``; the seconds until the job ended (AssertionError
    past the keepalive bound and ten seconds)."""
    client.kill()
    client.wait(10)
    return wait_until(lambda: job_of(settings, job_id)[0].state in c.END_STATES, timeout=KEEPALIVE + 10, what=what)


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line is ``marker`` (a test's own `sleep N.NNN`; not a `gpuq`
    command that names it)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if " ".join(p.info["cmdline"] or []) == marker and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def unique_sleep() -> str:
    """A sleep's argument no other process has: how a test finds what a job left behind."""
    return f"{300 + int(uuid.uuid4().int % 100_000) / 1000:.3f}"


# ---- gpuq run ------------------------------------------------------------------------------------

def test_run_streams_lines_as_they_are_printed_not_at_the_end(stack, terminals):
    script = "import time; print('first line', flush=True); time.sleep(4); print('second line')"
    t = terminals(["run", "--", sys.executable, "-c", script], stack.env)
    t.read_until("first line", timeout=60)
    assert t.proc.poll() is None and "second line" not in t.text  # the job still runs: streamed, not replayed
    assert t.wait() == 0
    assert "second line" in t.text


def test_run_keeps_stdout_and_stderr_apart_and_exits_with_the_commands_code(stack):
    out = run_cli(["run", "--", "sh", "-c", "echo to-out; echo to-err >&2; echo more-out; exit 3"], stack.settings)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "to-out\nmore-out\n"
    assert "to-err" in out.stderr and "to-out" not in out.stderr
    # A program named as srun takes one, without --: the words after it are its own.
    named = run_cli(["run", "sh", "-c", "echo named $0 $1; exit 4", "--gpus", "2"], stack.settings)
    assert (named.returncode, named.stdout) == (4, "named --gpus 2\n"), named.stderr


def test_run_exits_128_plus_the_signal_124_past_its_time_and_prints_a_workloads_result(stack):
    killed = run_cli(["run", "--", "sh", "-c", "kill -9 $$"], stack.settings)
    assert killed.returncode == 128 + 9, killed.stderr
    assert "killed by SIGKILL" in killed.stderr
    late = run_cli(["run", "--time", "1s", "--", "sleep", unique_sleep()], stack.settings)
    assert late.returncode == c.EXIT_RUN_TIMED_OUT and "timed_out" in late.stderr, late.stderr
    workload = run_cli(["run", "matmul", "--size", "32", "--repeat", "2"], stack.settings)
    assert workload.returncode == 0, workload.stderr
    assert "matmul:" in workload.stdout and "gflops" in workload.stdout.split("result")[1]


def test_ctrl_c_cancels_the_run_and_nothing_of_the_job_is_left(stack, terminals):
    marker = unique_sleep()
    t = terminals(["run", "--", "sh", "-c", f"echo started; sleep {marker}; echo never"], stack.env)
    t.read_until("started")
    job_id = newest_job(stack.settings)
    t.type("\x03")  # Ctrl-C: a SIGINT to the terminal's foreground process group, as a person's
    t.read_until("cancelling job")
    assert t.wait() == c.EXIT_RUN_CANCELLED
    job, _ = job_of(stack.settings, job_id)
    assert job.state == State.CANCELLED
    assert processes_with(f"sleep {marker}") == []
    assert "never" not in t.text


def test_a_closed_terminal_cancels_the_run(stack, terminals):
    t = terminals(["run", "--", "sh", "-c", f"echo started; sleep {unique_sleep()}"], stack.env)
    t.read_until("started")
    job_id = newest_job(stack.settings)
    t.proc.send_signal(signal.SIGHUP)
    assert t.wait() == 128 + signal.SIGHUP
    wait_until(lambda: job_of(stack.settings, job_id)[0].state == State.CANCELLED, what="cancelled")


def test_a_terminated_run_cancels_its_job_says_so_and_exits_as_sigterm_would(stack):
    marker = unique_sleep()
    run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--", "sh", "-c", f"echo started; sleep {marker}"],
                           env=stack.env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout.readline().strip() == "started"
    job_id = newest_job(stack.settings)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
    assert err.strip().splitlines()[-1] == f"gpuq: SIGTERM: cancelled job {job_id}"
    wait_until(lambda: job_of(stack.settings, job_id)[0].state == State.CANCELLED, what="cancelled")
    wait_until(lambda: processes_with(f"sleep {marker}") == [], what="its processes gone")


def test_run_into_a_pipe_whose_reader_left_cancels_its_job_and_exits_141_as_sigpipe(stack):
    # `gpuq run ... | head -1`: the rest of the output was followed to the job's end and thrown
    # away, and the exit was 1 (Python's failed flush) whatever the job did. srun dies of SIGPIPE.
    marker = unique_sleep()
    run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--", "sh", "-c",
                            f"echo first; sleep {marker} & while :; do sleep 0.2; echo more; done"],
                           env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout.readline().strip() == "first"
    job_id = newest_job(stack.settings)
    run.stdout.close()  # the reader leaves, as head does once it has its line
    err = run.stderr.read()
    assert run.wait(60) == 128 + signal.SIGPIPE, err
    assert err.strip().splitlines()[-1] == f"gpuq: its output's reader is gone (broken pipe): cancelled job {job_id}"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    wait_until(lambda: job_of(stack.settings, job_id)[0].state == State.CANCELLED, what="cancelled")
    wait_until(lambda: processes_with(f"sleep {marker}") == [], what="its processes gone")


def test_a_killed_run_ends_its_job_as_client_lost_within_the_keepalive_bound_and_a_live_one_keeps_it(stack):
    # The job waits on its stdin (this test holds the pipe's write end), idle past the bound while
    # its client lives; `kill -9` of the client ends the job, which asked for a retry in vain.
    marker = unique_sleep()
    run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--retries", "1", "--", "sh", "-c",
                            f"echo started; sleep {marker} & cat; echo input-ended"], env=stack.env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert run.stdout.readline() == b"started\n"
        job_id = newest_job(stack.settings)
        run.stdin.write(b"partial\n")
        run.stdin.flush()
        assert run.stdout.readline() == b"partial\n"
        time.sleep(2 * KEEPALIVE + 1)  # idle past the bound, its client alive: still running
        assert job_of(stack.settings, job_id)[0].state == State.RUNNING
        shown = run_cli(["show", str(job_id)], stack.settings).stdout
        assert re.search(rf"^   kept by  its gpuq run, heard from [\d.]+ s ago; silent for {KEEPALIVE:g} s, it ends "
                         r"the job \(client_lost\)$", shown, re.M), shown
        took = killed_until_its_end(run, stack.settings, job_id, "the job's end")
    finally:
        if run.poll() is None:
            run.kill()
        run.stdin.close()
    job, _ = job_of(stack.settings, job_id)
    assert (job.state, job.failure) == (State.FAILED, c.FAILURE_CLIENT_LOST)
    assert job.reason == (f"its client (gpuq run) was not heard from for {KEEPALIVE:g} s (GPUQ_ALLOC_KEEPALIVE); "
                          "everything it started was stopped")
    assert output_of(stack.settings, job_id).startswith("started\npartial\n[gpuq: stopping the job: SIGTERM")
    assert processes_with(f"sleep {marker}") == []  # what it started in the background too
    # The bound, the watch's look (a fifth of a second), the stop and its record: seconds, where
    # the job waited on its read until its time limit before.
    assert took <= KEEPALIVE + 0.5 + 2.5, took


def test_a_killed_run_whose_job_waits_has_it_cancelled_as_client_lost(stack):
    before = newest_job(stack.settings)
    run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--hold", "--", "true"], env=stack.env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: newest_job(stack.settings) != before, what="the held job queued")
        job_id = newest_job(stack.settings)
        time.sleep(KEEPALIVE + 1)  # past the bound, its client alive: still waiting
        assert job_of(stack.settings, job_id)[0].state == State.PENDING
        killed_until_its_end(run, stack.settings, job_id, "the waiting job cancelled")
    finally:
        if run.poll() is None:
            run.kill()
    job, _ = job_of(stack.settings, job_id)
    assert (job.state, job.failure, job.reason) == (State.CANCELLED, c.FAILURE_CLIENT_LOST,
                                                    "its client (gpuq run) stopped answering while it waited")


def test_ctrl_z_lets_go_of_the_job_which_outlives_the_stopped_run_and_fg_follows_it_again(stack, terminals):
    t = terminals(["run", "--", "sh", "-c", f"echo started; sleep {KEEPALIVE + 6}; echo done"], stack.env)
    t.read_until("started")
    job_id = newest_job(stack.settings)
    t.type("\x1a")  # Ctrl-Z: a SIGTSTP to the terminal's foreground process group
    t.read_until(f"gpuq: job {job_id} goes on without this gpuq run while it is stopped; fg follows it again")
    assert job_of(stack.settings, job_id)[0].keepalive_at is None
    # Its own SIGTSTP does not stop it here (its process group is orphaned: the kernel drops it), so
    # it is stopped as a shell's job would be, past the keepalive bound.
    t.proc.send_signal(signal.SIGSTOP)
    time.sleep(KEEPALIVE + 1.5)
    assert job_of(stack.settings, job_id)[0].state == State.RUNNING
    t.proc.send_signal(signal.SIGCONT)  # fg: kept again
    wait_until(lambda: job_of(stack.settings, job_id)[0].keepalive_at is not None, timeout=10, what="kept again")
    assert t.wait() == 0
    assert "done" in t.text
    assert job_of(stack.settings, job_id)[0].state == State.SUCCEEDED


def test_a_run_resumed_by_fg_keeps_its_job_again_so_killed_then_its_job_ends_as_client_lost(stack, terminals):
    t = terminals(["run", "--", "sh", "-c", "echo started; sleep 60"], stack.env)
    t.read_until("started")
    job_id = newest_job(stack.settings)
    t.type("\x1a")
    t.read_until("fg follows it again")
    t.proc.send_signal(signal.SIGSTOP)
    t.proc.send_signal(signal.SIGCONT)  # fg
    wait_until(lambda: job_of(stack.settings, job_id)[0].keepalive_at is not None, timeout=10, what="kept again")
    said = len(t.text)
    t.type("\x1a")  # its Ctrl-Z lets go once more
    t.read_until("fg follows it again", after=said)
    assert job_of(stack.settings, job_id)[0].keepalive_at is None
    t.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: job_of(stack.settings, job_id)[0].keepalive_at is not None, timeout=10, what="kept again")
    took = killed_until_its_end(t.proc, stack.settings, job_id, "the job's end")
    job, _ = job_of(stack.settings, job_id)
    assert (job.state, job.failure) == (State.FAILED, c.FAILURE_CLIENT_LOST)
    assert took <= KEEPALIVE + 0.5 + 2.5, took


def test_a_run_let_go_and_then_killed_leaves_its_job_running(stack, terminals):
    t = terminals(["run", "--", "sh", "-c", f"echo started; sleep {KEEPALIVE + 4}; echo done"], stack.env)
    t.read_until("started")
    job_id = newest_job(stack.settings)
    t.type("\x1a")
    t.read_until("fg follows it again")
    t.proc.kill()
    assert wait_until(lambda: job_of(stack.settings, job_id)[0].state in c.END_STATES, timeout=KEEPALIVE + 30,
                      what="its end") > KEEPALIVE
    assert job_of(stack.settings, job_id)[0].state == State.SUCCEEDED
    assert output_of(stack.settings, job_id) == "started\ndone\n"


def test_the_api_keeps_one_job_alive_for_its_client_not_an_array_nor_a_job_nobody_keeps(stack, tmp_path):
    from gpuq.cli.client import Client, Refused

    client = Client(str(stack.settings.server_socket))
    body = {"command": ["true"], "cwd": str(tmp_path), "keep_alive": True, "hold": True}
    with pytest.raises(Refused, match="keep_alive keeps one job") as refused:
        client.post("/jobs", {**body, "array": "0-1"})
    assert refused.value.exit_code == c.EXIT_USAGE
    kept = client.post("/jobs", body)["jobs"][0]["id"]
    plain = client.post("/jobs", {**body, "keep_alive": False})["jobs"][0]["id"]
    try:
        held = client.post(f"/jobs/{kept}/keepalive")
        # The scheduler's next whole pass writes a held job's reason: before it, there is none yet.
        assert held["reason"] in (None, "held"), held
        assert held | {"keepalive_s": 0, "reason": None} == {
            "id": kept, "state": State.PENDING, "reason": None, "run_id": "", "gpu_indices": [], "node": None,
            "deadline": None, "keepalive_s": 0, "failure": None, "exit_code": None, "env": {}}
        with pytest.raises(Refused, match="is not kept by a client") as refused:
            client.post(f"/jobs/{plain}/keepalive")
        assert refused.value.exit_code == c.EXIT_CONFLICT
    finally:
        run_cli(["cancel", str(kept), str(plain)], stack.settings)


def test_gpuqs_words_after_output_that_ends_inside_a_line_start_a_line_of_their_own(stack, terminals):
    t = terminals(["run", "--", "sh", "-c", "printf partial; kill -9 $$"], stack.env)
    assert t.wait() == 128 + 9
    job_id = newest_job(stack.settings)
    assert f"partial\r\ngpuq: job {job_id} failed" in t.text, t.text  # not "partialgpuq: job ..."


def test_detach_leaves_a_running_job_and_attach_follows_it_to_its_exit_status(stack):
    # Past the keepalive bound: a detached job outlives its client, which keeps it no longer.
    detached = run_cli(["run", "--detach", "--", "sh", "-c", f"echo one; sleep {KEEPALIVE + 2}; echo two >&2; exit 5"],
                       stack.settings)
    assert detached.returncode == 0, detached.stderr
    job_id = newest_job(stack.settings)
    assert job_of(stack.settings, job_id)[0].state == State.RUNNING
    assert "kept by" not in run_cli(["show", str(job_id)], stack.settings).stdout
    attached = run_cli(["attach", str(job_id)], stack.settings)
    assert attached.returncode == 5
    assert attached.stdout == "one\n" and "two" in attached.stderr


# ---- gpuq alloc ----------------------------------------------------------------------------------

def test_alloc_gives_a_shell_its_gpu_which_is_busy_while_it_lives_and_free_after_exit(stack, terminals, tmp_path):
    marker = unique_sleep()
    t = terminals(["alloc"], {**stack.env, "SHELL": "/bin/sh", "PS1": "alloc$ ", "XDG_CACHE_HOME": str(tmp_path)})
    t.read_until("alloc$ ")
    job_id = newest_job(stack.settings)
    job, gpus = job_of(stack.settings, job_id)
    assert job.kind == c.KIND_INTERACTIVE and job.state == State.RUNNING and len(gpus) == 1
    t.type("echo CVD=$CUDA_VISIBLE_DEVICES JOB=$GPUQ_JOB_ID ALLOC=$GPUQ_ALLOC\n")
    t.read_until(f"CVD={gpus[0]} JOB={job_id} ALLOC={job_id}")
    # A step as salloc's shell runs one: gpuq's srun (kept in the user's cache) runs it here.
    t.type("srun -n 1 --gres=gpu:1 sh -c 'echo STEP=$CUDA_VISIBLE_DEVICES/$GPUQ_ALLOC'; srun -n 2 true\n")
    t.read_until(f"STEP={gpus[0]}/{job_id}")
    t.read_until("gpuq srun: --ntasks 2: the job has 1 task (a SLURM script asks for more")
    assert (tmp_path / "gpuq" / "slurm-bin" / "srun").is_file()
    status = run_cli(["status", "--json"], stack.settings)
    busy = [g for g in __import__("json").loads(status.stdout)["gpus"] if g["index"] == gpus[0]]
    assert busy and busy[0]["job_id"] == job_id
    t.type(f"sleep {marker} &\n")
    wait_until(lambda: processes_with(f"sleep {marker}"), what="the background sleep started")
    t.type("exit 7\n")
    assert t.wait() == 7
    job, _ = job_of(stack.settings, job_id)
    assert job.state == State.FAILED and job.exit_code == 7
    assert processes_with(f"sleep {marker}") == []  # what the shell left running was stopped with it
    free = __import__("json").loads(run_cli(["status", "--json"], stack.settings).stdout)["gpus"]
    assert [g["job_id"] for g in free if g["index"] == gpus[0]] == [None]


def test_alloc_time_limit_warns_then_kills_a_sleep_left_in_the_background(stack, terminals):
    marker = unique_sleep()
    t = terminals(["alloc", "--time", "4s", "--", "sh", "-c", f"sleep {marker} & sleep {marker}"], stack.env)
    t.read_until("allocation")
    wait_until(lambda: len(processes_with(f"sleep {marker}")) == 2, what="both sleeps started")
    assert t.wait() == c.EXIT_RUN_TIMED_OUT
    assert "ends in" in t.text and "timed_out" in t.text
    assert processes_with(f"sleep {marker}") == []


def _left_by_the_shell_is_stopped_with_the_allocation(stack, terminals, script: str) -> None:
    """``script`` (a sh script, ``{sleep}`` in it) leaves a sleep behind: it is stopped with the allocation."""
    marker = unique_sleep()
    t = terminals(["alloc", "--", "sh", "-c", script.format(sleep=f"sleep {marker}")], stack.env)
    t.read_until("allocation")
    wait_until(lambda: len(processes_with(f"sleep {marker}")) == 1, what="the sleep started")
    assert t.wait() == 0
    wait_until(lambda: processes_with(f"sleep {marker}") == [], timeout=20, what="the sleep stopped")


def test_an_allocations_command_run_without_its_run_id_is_stopped_with_it(stack, terminals):
    # `env -i python train.py &` in the shell dropped GPUQ_RUN_ID: it ran on after the allocation.
    # In a session of its own, too: the terminal's hang-up at the end does not reach it.
    _left_by_the_shell_is_stopped_with_the_allocation(stack, terminals, "env -u GPUQ_RUN_ID setsid {sleep} & sleep 3")


def test_a_process_the_allocations_shell_detaches_at_once_is_in_its_cgroup_and_stopped_with_it(stack, terminals):
    # It drops the run id, leaves the shell's tree (its subshell exits at once) and its session,
    # all before the worker's first look: it outlived the allocation. The shell now starts behind
    # a gate the worker opens once it has put it in the allocation's cgroup.
    from gpuq.workers.cgroup import JobCgroup

    probe = JobCgroup.create(f"gpuq-test-probe-{os.getpid()}", None)
    if probe is None:
        pytest.skip("no cgroup for a job here: the worker finds an allocation's processes by looking")
    probe.remove()
    _left_by_the_shell_is_stopped_with_the_allocation(stack, terminals,
                                                      "(env -u GPUQ_RUN_ID setsid {sleep} &); sleep 2")


def test_kill_9_of_the_alloc_client_frees_the_gpu_within_the_keepalive_bound(stack):
    marker = unique_sleep()
    client = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "alloc", "--", "sleep", marker],
                              env=settings_env(stack.settings), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(processes_with(f"sleep {marker}")) == 1, what="the allocation's command started")
        job_id = newest_job(stack.settings)
        took = killed_until_its_end(client, stack.settings, job_id, "the allocation ended")
    finally:
        if client.poll() is None:
            client.kill()
    job, _ = job_of(stack.settings, job_id)
    assert job.failure == c.FAILURE_CLIENT_LOST
    # The documented bound: the keepalive setting, the worker's look (half a second), the stop.
    assert took <= KEEPALIVE + 1.0 + 2.0 + 2.0, took
    assert processes_with(f"sleep {marker}") == []


def test_gpuq_cancel_ends_an_allocation_stops_its_command_and_its_gpu_time_is_sampled(stack):
    from sqlalchemy import func, select

    from gpuq.service.models import DeviceSample

    marker = unique_sleep()
    client = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "alloc", "--", "sleep", marker],
                              env=settings_env(stack.settings), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(processes_with(f"sleep {marker}")) == 1, what="the allocation's command started")
        job_id = newest_job(stack.settings)
        time.sleep(1.5)  # a few of the worker's samples (every 0.5 s here)
        cancel = run_cli(["cancel", str(job_id)], stack.settings)
        assert cancel.returncode == 0, cancel.stderr
        assert client.wait(30) == c.EXIT_JOB_FAILED  # as `gpuq wait`'s: 130 is the user's own Ctrl-C
    finally:
        if client.poll() is None:
            client.kill()
    assert f"gpuq: job {job_id} cancelled by {pwd.getpwuid(os.getuid()).pw_name}" in client.stderr.read()
    assert job_of(stack.settings, job_id)[0].state == State.CANCELLED
    assert processes_with(f"sleep {marker}") == []
    with read_scope(stack.settings) as session:
        samples = session.scalar(select(func.count()).select_from(DeviceSample).where(DeviceSample.job_id == job_id))
    assert samples >= 1


def test_allocs_never_share_a_gpu_and_a_waiting_one_whose_client_died_is_cancelled(stack):
    marker = unique_sleep()
    env = settings_env(stack.settings)
    first = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "alloc", "--gpus", "2", "--", "sleep", marker],
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = None
    try:
        wait_until(lambda: processes_with(f"sleep {marker}"), what="the first allocation's command started")
        holder = newest_job(stack.settings)
        second = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "alloc", "--", "true"], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(lambda: newest_job(stack.settings) > holder, what="the second allocation queued")
        waiter = newest_job(stack.settings)
        time.sleep(1.0)
        assert job_of(stack.settings, waiter)[0].state == State.PENDING  # both GPUs are the first one's
        # A third, told to stop while it waits: cancelled, and it says so on a line of its own.
        third = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "alloc", "--", "true"], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: newest_job(stack.settings) > waiter, what="the third allocation queued")
        stopped = newest_job(stack.settings)
        time.sleep(1.0)
        third.send_signal(signal.SIGTERM)
        _, err = third.communicate(timeout=30)
        assert third.returncode == 128 + signal.SIGTERM, err
        assert err.splitlines()[-1] == f"gpuq: SIGTERM: cancelled allocation {stopped} before it started", err
        assert job_of(stack.settings, stopped)[0].state == State.CANCELLED
        second.kill()
        second.wait(10)
        wait_until(lambda: job_of(stack.settings, waiter)[0].state == State.CANCELLED, timeout=KEEPALIVE + 10,
                   what="the abandoned allocation cancelled")
        assert job_of(stack.settings, waiter)[0].failure == c.FAILURE_CLIENT_LOST
        assert job_of(stack.settings, holder)[0].state == State.RUNNING
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        first.wait(30)


def test_sigterm_to_alloc_ends_a_command_that_ignores_hangups_and_frees_the_gpus(stack):
    marker = unique_sleep()
    # As under nohup: the command ignores SIGHUP, the hang-up a closed terminal sends.
    client = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "alloc", "--", "sh", "-c",
                               f"trap '' HUP; sleep {marker}; echo never"], env=settings_env(stack.settings),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: processes_with(f"sleep {marker}"), what="the allocation's command started")
        job_id = newest_job(stack.settings)
        client.send_signal(signal.SIGTERM)
        out, err = client.communicate(timeout=30)  # SIGHUP, then SIGTERM 2 s on, then SIGKILL
        assert b"never" not in out
        # As `gpuq run` leaves on SIGTERM: a line, and 143 (not the hung-up shell's own code).
        assert client.returncode == 128 + signal.SIGTERM, err
        assert err.decode().strip().splitlines()[-1] == f"gpuq: SIGTERM: ended allocation {job_id}", err
        wait_until(lambda: job_of(stack.settings, job_id)[0].state in c.END_STATES, what="the allocation ended")
        wait_until(lambda: processes_with(f"sleep {marker}") == [], what="the command's sleep stopped")
    finally:
        if client.poll() is None:
            client.kill()


def test_a_shared_allocation_whose_command_outgrows_its_share_is_stopped_as_gpu_mem_exceeded(stack):
    # The shell of `gpuq alloc --shared` runs in the user's terminal, not under the worker: its
    # processes are found by their run id, and the share watchdog sums what they hold on the GPU.
    # On simulated GPUs the shell is told where to say so, as a job is.
    hold = [sys.executable, "-m", "gpuq.workers.simulated_memory", "--mib", "4000", "--seconds", unique_sleep()]
    started = time.monotonic()
    out = run_cli(["alloc", "--shared", "--mem", "1G", "--", *hold], stack.settings, timeout=60)
    assert out.returncode == c.EXIT_RUN_GPUQ, out.stderr
    assert "gpu_mem_exceeded" in out.stderr and "share on GPU" in out.stderr, out.stderr
    assert time.monotonic() - started < 30  # the grace (3 s) and a look for its processes (2 s), not its 300 s
    job, _ = job_of(stack.settings, newest_job(stack.settings))
    assert job.state == State.FAILED and job.failure == c.FAILURE_GPU_MEM_EXCEEDED
    assert job.reason.startswith("used 3.9 GiB of its"), job.reason
    assert processes_with(" ".join(hold)) == []


def test_alloc_on_a_node_without_gpuq_gpus_is_one_line_and_writes_nothing(stack):
    before = newest_job(stack.settings)
    out = run_cli(["alloc"], stack.settings, extra_env={"GPUQ_NODE": "login-node-1"})
    assert out.returncode == c.EXIT_USAGE
    assert out.stderr.count("\n") == 1 and "node login-node-1 has no gpuq GPUs" in out.stderr
    assert newest_job(stack.settings) == before


def test_an_allocations_command_killed_by_a_signal_is_recorded_as_one_and_no_command_is_bad_input(stack):
    killed = run_cli(["alloc", "--", "sh", "-c", "kill -9 $$"], stack.settings)
    assert killed.returncode == 128 + 9, killed.stderr
    job, _ = job_of(stack.settings, newest_job(stack.settings))
    assert (job.exit_code, job.reason) == (-9, "its shell or command was killed by SIGKILL")  # as `gpuq run`'s
    nothing = run_cli(["alloc", "--"], stack.settings)
    assert nothing.returncode == c.EXIT_USAGE and nothing.stderr == "gpuq: no command given after --\n", nothing


def test_an_allocation_cannot_be_resubmitted(stack):
    done = run_cli(["alloc", "--", "true"], stack.settings)
    assert done.returncode == 0, done.stderr
    again = run_cli(["resubmit", str(newest_job(stack.settings))], stack.settings)
    assert again.returncode == c.EXIT_USAGE and "run gpuq alloc again" in again.stderr


def test_exit_codes_of_each_kind_of_end():
    assert exit_code_of({"state": "succeeded", "exit_code": 0}) == 0
    assert exit_code_of({"state": "failed", "failure": "exit", "exit_code": 3}) == 3
    assert exit_code_of({"state": "failed", "failure": "exit", "exit_code": -15}) == 143
    assert exit_code_of({"state": "failed", "failure": "error", "exit_code": None}) == 1
    assert exit_code_of({"state": "timed_out", "failure": "timeout"}) == c.EXIT_RUN_TIMED_OUT
    # Cancelled, not by this terminal's Ctrl-C (130, which follow() gives): `gpuq wait`'s code.
    assert exit_code_of({"state": "cancelled", "failure": "cancelled"}) == c.EXIT_JOB_FAILED
    for lost in (c.FAILURE_WORKER_LOST, c.FAILURE_INTERRUPTED, c.FAILURE_GPU_LOST, c.FAILURE_CLIENT_LOST,
                 c.FAILURE_GPU_MEM_EXCEEDED, c.FAILURE_GPU_ERROR):
        assert exit_code_of({"state": "failed", "failure": lost}) == c.EXIT_RUN_GPUQ
    # Preempted and not requeued (--no-requeue): cancelled, but by gpuq, not by someone.
    assert exit_code_of({"state": "cancelled", "failure": c.FAILURE_PREEMPTED}) == c.EXIT_RUN_GPUQ


def test_the_waiting_line_words_every_reason_a_job_waits_for():
    from gpuq.cli.follow import _WAITS_FOR
    from gpuq.service.policy import REASONS

    assert set(_WAITS_FOR) == set(REASONS)
