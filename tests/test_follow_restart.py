"""The commands that follow a job (`gpuq run`, `attach`, `wait`, `logs -f`) ride out a restart of
their server, as the stack's supervisor makes one: the job goes on without the server, and so do
they, to its end and its exit code. A server that stays away is given up on, with exit 69, after
client.RIDE_OUT_SECONDS; only reads are asked again this way."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from gpuq.cli import client as client_module
from gpuq.cli.client import Client
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import read_scope
from gpuq.service.errors import Unreachable
from gpuq.service.models import Job
from tests.conftest import output_of, serving, start_stack, wait_for_state

pytestmark = pytest.mark.timeout(180)

# How long the server stays dead: about what the supervisor takes to start it again (its restart
# delay, 1 s, and the server's start).
RESTART_GAP = 2.0


def _newest_job(settings) -> int | None:
    with read_scope(settings) as session:
        return session.scalar(select(func.max(Job.id)))


def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def test_run_attach_wait_and_logs_f_ride_out_a_server_killed_and_restarted_and_exit_with_the_jobs_end(
        settings, tmp_path):
    st = start_stack(settings.with_overrides(fake_gpus=1), tmp_path / "logs")
    gpuq = [sys.executable, "-m", "gpuq.cli"]
    followers: dict[str, subprocess.Popen] = {}
    outputs = {name: (tmp_path / f"{name}.out", tmp_path / f"{name}.err") for name in ("run", "attach", "logs", "wait")}

    def start(name: str, args: list[str]) -> None:
        out, err = outputs[name]
        with open(out, "w") as stdout, open(err, "w") as stderr:
            followers[name] = subprocess.Popen([*gpuq, *args], env=st.env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                                               stdout=stdout, stderr=stderr)

    try:
        before = _newest_job(settings)
        script = "import time; print('before', flush=True); time.sleep(10); print('after', flush=True)"
        start("run", ["run", "--", sys.executable, "-c", script])
        _until(lambda: _newest_job(settings) != before, 60, "gpuq run queued its job")
        job = _newest_job(settings)
        _until(lambda: "before" in output_of(settings, job), 60, "the job printed its first line")
        start("attach", ["attach", str(job)])
        start("logs", ["logs", "-f", str(job)])
        start("wait", ["wait", str(job)])
        # Each has had its first answers (attach and logs -f have printed the first line; wait,
        # started with them, has looked at the job's state by now): they are following it.
        for name in ("run", "attach", "logs"):
            _until(lambda name=name: "before" in outputs[name][0].read_text(), 30, f"{name} printed the first line")
        time.sleep(1.0)
        assert all(p.poll() is None for p in followers.values())

        server = st.procs["server"]
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        time.sleep(RESTART_GAP)
        st.start_server()  # on the socket the dead one left behind
        # Killed and back while the job ran: the followers had to ride the restart out.
        assert "after" not in output_of(settings, job)

        codes = {name: p.wait(60) for name, p in followers.items()}
        said = {name: (out.read_text(), err.read_text()) for name, (out, err) in outputs.items()}
        assert wait_for_state(settings, job, c.END_STATES) == State.SUCCEEDED
        assert codes == {"run": 0, "attach": 0, "logs": 0, "wait": 0}, (said, st.logs())
        assert said["run"][0] == said["attach"][0] == said["logs"][0] == "before\nafter\n"
        assert said["wait"][0] == f"job {job} succeeded\n"
        for name, (_, err) in said.items():
            assert "no gpuq server answers" not in err, (name, err)
            assert err.count("is not answering") <= 1, (name, err)  # said once at most, after a quiet while
    finally:
        for p in followers.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        st.stop()


def test_a_read_rides_out_a_gone_server_for_a_bounded_time_says_so_once_then_exits_69(settings, monkeypatch,
                                                                                          capsys):
    monkeypatch.setattr(client_module, "RIDE_OUT_SECONDS", 1.5)
    monkeypatch.setattr(client_module, "RIDE_OUT_QUIET_SECONDS", 0.5)
    with serving(settings) as own:
        client = Client(str(own.server_socket))
        assert client.get("/whoami")["uid"] is not None
    # The server is gone for good now. A plain read, and a post (a cancel), give up at once.
    for ask in (lambda: client.get("/whoami"), lambda: client.post("/jobs/1/cancel")):
        began = time.monotonic()
        with pytest.raises(Unreachable, match="no gpuq server answers at"):
            ask()
        assert time.monotonic() - began < 1.0
    assert capsys.readouterr().err == ""
    # A follower's read tries again, quietly, then says so once, then gives up with the same line.
    began = time.monotonic()
    with pytest.raises(Unreachable, match="no gpuq server answers at") as gone:
        client.get("/whoami", ride_out=True)
    took = time.monotonic() - began
    assert gone.value.exit_code == c.EXIT_UNAVAILABLE
    assert 1.5 <= took < 1.5 + 2.0, took
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gpuq: the server at {own.server_socket} is not answering (")
    assert err.endswith("); trying again for up to 1.5 s\n"), err
    # A client that never reached a server is not riding out a restart: there is none to wait for.
    never = Client(str(own.server_socket))
    began = time.monotonic()
    with pytest.raises(Unreachable):
        never.get("/whoami", ride_out=True)
    assert time.monotonic() - began < 1.0


def test_a_client_leaving_on_a_hang_up_lets_the_next_hang_ups_and_ctrl_c_pass():
    # A closed ssh session sends SIGHUP then SIGTERM; one that came as `gpuq run` said why it
    # left (after its cancel's request) raised there, a traceback instead of the line and 129.
    import os

    from gpuq.cli.follow import HangUp, hang_up_raises, leaving

    with hang_up_raises():
        with leaving():
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                os.kill(os.getpid(), s)  # delivered at once to this thread: nothing is raised
        with pytest.raises(HangUp):  # and afterwards a hang-up is one again
            os.kill(os.getpid(), signal.SIGTERM)


def test_run_forwarding_its_stdin_rides_out_a_server_killed_and_restarted_and_its_job_reads_every_line_once(
        settings, tmp_path):
    st = start_stack(settings.with_overrides(fake_gpus=1), tmp_path / "logs")
    # A producer writing a numbered line every 50 ms through the restart: the job prints what it read.
    producer = "import sys, time\nfor i in range(120):\n    print(i, flush=True)\n    time.sleep(0.05)"
    reader = "import sys; lines = sys.stdin.read().split(); print(len(lines), lines == [str(i) for i in range(120)])"
    shell = (f"{sys.executable} -c {shlex.quote(producer)} | {sys.executable} -m gpuq.cli run -- {sys.executable} "
             f"-c {shlex.quote(reader)}")
    run = subprocess.Popen(shell, shell=True, env=st.env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        before = _newest_job(settings)
        _until(lambda: _newest_job(settings) != before, 60, "gpuq run queued its job")
        time.sleep(1.0)  # a second of lines sent
        server = st.procs["server"]
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        time.sleep(RESTART_GAP)
        st.start_server()
        out, err = run.communicate(timeout=90)
        assert (run.returncode, out) == (0, "120 True\n"), (out, err, st.logs())
        assert "stopped forwarding" not in err, err
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        st.stop()


def test_a_runs_job_outlives_a_server_away_longer_than_the_keepalive_and_its_run_keeps_it_after(settings, tmp_path):
    # Its client cannot speak while the server is away, so that silence is not counted: the job
    # runs on, and once the server is back the run follows it to its end.
    keepalive = 4.0
    st = start_stack(settings.with_overrides(fake_gpus=1, alloc_keepalive=keepalive), tmp_path / "logs")
    script = "import time; print('before', flush=True); time.sleep(12); print('after', flush=True)"
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        run = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", "--", sys.executable, "-c", script],
                               env=st.env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
    try:
        before = _newest_job(settings)
        _until(lambda: _newest_job(settings) != before, 60, "gpuq run queued its job")
        job = _newest_job(settings)
        _until(lambda: "before" in output_of(settings, job), 60, "the job printed its first line")
        server = st.procs["server"]
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        time.sleep(keepalive + 3)  # away past the keepalive: its client silent all along
        with read_scope(settings) as session:
            assert session.get(Job, job).state == State.RUNNING
        st.start_server()
        assert run.wait(60) == 0, (out.read_text(), err.read_text(), st.logs())
        assert out.read_text() == "before\nafter\n"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        st.stop()
