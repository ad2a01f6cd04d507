"""The ride-out's edges (cli/client.py): it keeps `gpuq wait --timeout`'s deadline, it begins at a
wait's first read when the server's socket is there but refuses (a server killed or restarting),
a server that is not there at all is still one line and exit 69 at once, and `gpuq alloc` waiting
for its GPU rides out a restart as `gpuq run` does.

Real `gpuq server` processes, killed with SIGKILL (which leaves their socket behind, as a crash
does) and started again on it; the client's behaviour does not depend on the database, so SQLite
only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from gpuq.cli import client as client_module
from gpuq.cli.client import Client, Overdue
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import ConfigError, Unreachable
from tests.conftest import Stack, cli_submit, run_cli, start_stack, wait_for_state
from tests.test_follow_restart import RESTART_GAP, _newest_job, _until

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)]

NO_SERVER = "gpuq: no gpuq server answers at {}: {} (start one with `gpuq up`, or set GPUQ_SERVER)\n"


def _server_with_a_held_job(settings, tmp_path: Path) -> tuple[Stack, int]:
    """A `gpuq server` alone (no scheduler, no worker) and a held job of the test's, which waits
    until it is cancelled."""
    st = Stack(settings, tmp_path / "logs")
    st.start_server()
    return st, cli_submit(settings, ["--hold", "--", "true"])


def _kill_server(st: Stack) -> None:
    """SIGKILL the server: its socket stays, refusing connections, as after a crash."""
    server = st.procs["server"]
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    assert st.settings.server_socket.is_socket()


def _gpuq(st: Stack, args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuq.cli", *args], env={**st.env, **env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ended(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_wait_timeout_is_kept_while_the_server_is_away_and_the_wait_ends_as_a_timed_out_one(settings, tmp_path):
    st, job = _server_with_a_held_job(settings, tmp_path)
    try:
        started = time.monotonic()
        waiter = _gpuq(st, ["wait", str(job), "--timeout", "4"])
        time.sleep(2.0)  # it has looked at the job by now (or rides out from its first look: the same end)
        assert waiter.poll() is None
        _kill_server(st)
        code, out, err = _ended(waiter)
        took = time.monotonic() - started
        # Its 4 s, plus its own start: not the 30 s a ride-out would take.
        assert 4.0 <= took < 4.0 + 4.0, took
        assert code == c.EXIT_TIMEOUT and out == "", (code, err)
        assert err.startswith(f"gpuq: still waiting after 4 s: job {job} (") and err.count("\n") == 1, err
    finally:
        st.stop()


def test_wait_and_logs_f_started_while_the_server_restarts_ride_it_out_to_the_jobs_end(settings, tmp_path):
    st, job = _server_with_a_held_job(settings, tmp_path)
    try:
        _kill_server(st)
        waiter = _gpuq(st, ["wait", str(job)])
        follower = _gpuq(st, ["logs", "-f", str(job)])
        time.sleep(RESTART_GAP)
        # Their first read found the socket refusing: a server on its way back, not none.
        assert waiter.poll() is None and follower.poll() is None
        st.start_server()  # on the socket the dead one left behind
        cancelled = run_cli(["cancel", str(job)], settings)
        assert cancelled.returncode == 0, cancelled.stderr
        assert _ended(waiter) == (c.EXIT_JOB_FAILED, f"job {job} cancelled\n", "")
        # Its first read may find the job still held (said on stderr, gpuq logs of a job not started) or
        # already cancelled: either way no output, and exit 0.
        code, out, err = _ended(follower)
        assert (code, out) == (0, ""), (code, out, err)
        assert err in ("", f"gpuq: job {job} has not started: pending (held); its output follows once it runs\n"), err
    finally:
        st.stop()


def test_a_submit_made_while_the_server_restarts_waits_for_it_and_makes_its_job_once(settings, tmp_path):
    # A lab's submit loop met a server restarting (its socket refusing) with exit 69 and a lost job;
    # the submit's idempotency key makes asking again safe.
    st, held = _server_with_a_held_job(settings, tmp_path)
    try:
        _kill_server(st)
        submit = _gpuq(st, ["submit", "--hold", "--name", "through-a-restart", "--", "true"])
        time.sleep(RESTART_GAP)
        assert submit.poll() is None
        st.start_server()
        code, out, err = _ended(submit)
        assert code == 0 and out.startswith("submitted job "), (code, out, err)
        listed = run_cli(["status", "--json"], settings)
        names = [j["name"] for j in json.loads(listed.stdout)["jobs"]]
        assert names.count("through-a-restart") == 1, names
    finally:
        st.stop()


def test_a_wait_with_no_server_there_at_all_still_fails_at_once_naming_where_it_looked(settings, tmp_path):
    nowhere = f"/tmp/gpuqt-{uuid.uuid4().hex[:12]}.sock"
    for args in (["wait", "1"], ["wait", "1", "--timeout", "60"], ["logs", "-f", "1"], ["attach", "1"]):
        began = time.monotonic()
        out = run_cli(args, settings, extra_env={"GPUQ_SERVER": nowhere})
        assert out.returncode == c.EXIT_UNAVAILABLE == 69, (args, out.stderr)
        assert out.stderr == NO_SERVER.format(nowhere, "no socket there"), args
        assert time.monotonic() - began < 10.0, args  # the command's start, not a 30 s ride-out
    # A file that is not a socket refuses too, but no server left it: no ride-out either.
    (tmp_path / "not-a-socket").write_text("")
    began = time.monotonic()
    with pytest.raises(Unreachable, match="connection refused"):
        Client(str(tmp_path / "not-a-socket")).get("/whoami", ride_out=True)
    assert time.monotonic() - began < 1.0


def test_a_wait_whose_restarting_server_never_comes_back_gives_up_after_gpuq_ride_out_with_exit_69(
        settings, tmp_path):
    st, job = _server_with_a_held_job(settings, tmp_path)
    try:
        _kill_server(st)
        began = time.monotonic()
        code, out, err = _ended(_gpuq(st, ["wait", str(job)], GPUQ_RIDE_OUT="1.5"))
        assert 1.5 <= time.monotonic() - began < 1.5 + 8.0
        assert (code, out, err) == (69, "", NO_SERVER.format(settings.server_socket, "connection refused"))
        bad = _ended(_gpuq(st, ["wait", str(job)], GPUQ_RIDE_OUT="soon"))
        assert bad == (c.EXIT_CONFIG, "", "gpuq: GPUQ_RIDE_OUT must be seconds (0 or more), got 'soon'\n")
    finally:
        st.stop()


def test_a_gpuq_run_that_gives_up_on_its_server_says_its_kept_job_ends_once_a_server_is_back(settings, tmp_path):
    st = Stack(settings, tmp_path / "logs")
    st.start_server()
    try:
        run = _gpuq(st, ["run", "--hold", "--", "true"], GPUQ_RIDE_OUT="1.5")
        _until(lambda: _newest_job(settings) is not None, 30, "the run's job queued")
        job = _newest_job(settings)
        time.sleep(0.5)
        _kill_server(st)
        code, out, err = _ended(run)
        said = NO_SERVER.format(settings.server_socket, "connection refused").removesuffix("\n")
        assert (code, out) == (c.EXIT_UNAVAILABLE, ""), err
        assert err.splitlines()[-1] == (f"{said}; job {job} is kept by this gpuq run, so a server back ends it as "
                                        "client_lost (GPUQ_RIDE_OUT=1.5: a longer one waits longer)"), err
    finally:
        st.stop()


def test_a_wait_whose_timeout_passes_before_a_restarting_server_answers_ends_as_timed_out(settings, tmp_path):
    st, job = _server_with_a_held_job(settings, tmp_path)
    try:
        _kill_server(st)
        code, out, err = _ended(_gpuq(st, ["wait", str(job), "--timeout", "1"]))
        assert (code, out, err) == (c.EXIT_TIMEOUT, "", f"gpuq: still waiting after 1 s: job {job} (unknown)\n")
        code, out, err = _ended(_gpuq(st, ["wait", str(job), "--timeout", "0.5", "--json"]))
        assert code == c.EXIT_TIMEOUT and json.loads(out) == {str(job): None}, err
        code, out, err = _ended(_gpuq(st, ["wait", "--array", "7", "--timeout", "1"]))
        assert (code, out, err) == (c.EXIT_TIMEOUT, "", "gpuq: still waiting after 1 s: the jobs of array 7\n")
    finally:
        st.stop()


def test_a_ride_out_stops_at_its_callers_deadline_and_says_that_bound_not_the_whole_ride_out(
        settings, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(client_module, "RIDE_OUT_QUIET_SECONDS", 0.3)
    st, _ = _server_with_a_held_job(settings, tmp_path)
    try:
        client = Client(str(settings.server_socket))
        assert client.get("/whoami")["uid"] is not None
        _kill_server(st)
        began = time.monotonic()
        with pytest.raises(Overdue, match="no gpuq server answers at") as overdue:
            client.get("/whoami", ride_out=True, deadline=began + 1.0)
        assert 1.0 <= time.monotonic() - began < 1.5
        assert overdue.value.exit_code == c.EXIT_UNAVAILABLE  # uncaught, it is the usual line and exit 69
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith("; trying again for up to 1 s\n"), err
        # Without a deadline, the ride-out's own time: the usual Unreachable, not Overdue.
        monkeypatch.setenv("GPUQ_RIDE_OUT", "0.5")
        with pytest.raises(Unreachable) as gone:
            client.get("/whoami", ride_out=True)
        assert not isinstance(gone.value, Overdue)
        monkeypatch.setenv("GPUQ_RIDE_OUT", "-1")
        with pytest.raises(ConfigError):
            client.get("/whoami", ride_out=True)
    finally:
        st.stop()


@contextmanager
def _one_gpu_stack(settings, tmp_path: Path) -> Iterator[tuple[Stack, Callable[[list[str]], subprocess.Popen]]]:
    """A stack of one GPU, and a way to start `gpuq` processes on it: they and the stack are gone
    after (the server resumed first if a test stopped it)."""
    st = start_stack(settings.with_overrides(fake_gpus=1), tmp_path / "logs")
    started: list[subprocess.Popen] = []

    def start(args: list[str]) -> subprocess.Popen:
        started.append(_gpuq(st, args))
        return started[-1]

    try:
        yield st, start
    finally:
        server = psutil.Process(st.procs["server"].pid)
        if server.is_running() and server.status() == psutil.STATUS_STOPPED:
            server.resume()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        st.stop()


def _run_until_running(settings, start: Callable[[list[str]], subprocess.Popen]) -> tuple[subprocess.Popen, int]:
    """`gpuq run -- sleep 60` started and its job running: the process and the job's id."""
    run = start(["run", "--", "sleep", "60"])
    _until(lambda: _newest_job(settings) is not None, 30, "gpuq run submitted its job")
    job = _newest_job(settings)
    wait_for_state(settings, job, {State.RUNNING})
    return run, job


def test_alloc_waiting_for_its_gpu_rides_out_a_server_restart_and_then_gets_the_gpu(settings, tmp_path):
    with _one_gpu_stack(settings, tmp_path) as (st, start):
        busy = cli_submit(settings, ["--", "sleep", "6"])
        wait_for_state(settings, busy, {State.RUNNING})
        alloc = start(["alloc", "--", sys.executable, "-c", "print('held')"])
        _until(lambda: _newest_job(settings) != busy, 30, "gpuq alloc queued its allocation")
        held = _newest_job(settings)
        time.sleep(1.0)  # it is waiting: keepalive and a look at its state
        assert alloc.poll() is None and wait_for_state(settings, held, {State.PENDING}, timeout=1) == State.PENDING
        _kill_server(st)
        time.sleep(RESTART_GAP)
        assert alloc.poll() is None
        st.start_server()
        code, out, err = _ended(alloc)
        assert code == 0 and out == "held\n", (code, err, st.logs())
        assert "no gpuq server answers" not in err and f"gpuq: allocation {held}: GPU 0 on" in err, err
        assert wait_for_state(settings, held, c.END_STATES) == State.SUCCEEDED


def test_ctrl_c_on_gpuq_run_while_the_server_restarts_still_cancels_the_job(settings, tmp_path):
    with _one_gpu_stack(settings, tmp_path) as (st, start):
        run, job = _run_until_running(settings, start)
        _kill_server(st)
        run.send_signal(signal.SIGINT)  # its cancel meets the refusing socket: asked again, not given up
        time.sleep(RESTART_GAP)
        assert run.poll() is None
        st.start_server()
        code, _, err = _ended(run)
        assert code == 130 and "cancelling job" in err, (code, err)
        assert wait_for_state(settings, job, c.END_STATES) == State.CANCELLED


def test_a_second_hang_up_while_gpuq_run_cancels_its_job_still_cancels_it_and_leaves_with_129(settings, tmp_path):
    # A closed ssh session sends SIGHUP, then SIGTERM: the second, raised inside the cancel's
    # request, left a traceback (exit 1) and the job running.
    with _one_gpu_stack(settings, tmp_path) as (st, start):
        run, job = _run_until_running(settings, start)
        time.sleep(0.5)  # following its output
        server = psutil.Process(st.procs["server"].pid)
        server.suspend()  # the cancel's request waits for an answer
        run.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        server.resume()
        code, _, err = _ended(run)
        assert code == 129 and "Traceback" not in err and f"SIGHUP: cancelled job {job}" in err, (code, err)
        assert wait_for_state(settings, job, c.END_STATES) == State.CANCELLED


def test_with_the_machines_socket_gone_a_moment_a_user_is_told_its_queue_is_down_not_to_start_their_own(
        database_url, shared_dir):
    # Root's socket missing (a restart, a `gpuq down`): the client looked at the user's own socket
    # and said "start one with `gpuq up`", which made a second queue beside the machine's.
    if os.geteuid() != 0:
        pytest.skip("makes the machine's socket folder and runs the client as another user")
    from gpuq.service.settings import SYSTEM_SOCKET

    folder = Path(SYSTEM_SOCKET).parent
    made = not folder.exists()
    if Path(SYSTEM_SOCKET).exists():
        pytest.skip("a machine stack is up here")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={shared_dir}", f"GPUQ_HOME={shared_dir / 'home'}",
               "GPUQ_CONFIG=/nonexistent/gpuq-test.toml"]
        done = subprocess.run(["runuser", "-u", "nobody", "--", *env, sys.executable, "-m", "gpuq.cli", "status"],
                              capture_output=True, text=True, timeout=60, cwd=shared_dir)
        assert done.returncode == c.EXIT_UNAVAILABLE, done.stderr
        assert done.stderr == (f"gpuq: no gpuq server answers at {shared_dir / 'home' / 'gpuq.sock'}: no socket "
                               f"there (nor at the machine's {SYSTEM_SOCKET}: its gpuq is down or restarting; try "
                               "again in a moment, or ask whoever runs it)\n"), done.stderr
    finally:
        if made:
            folder.rmdir()


# A follower's read, its answer waiting while the process is stopped past its timeout: by a handler
# of SIGTSTP that stops it, as `gpuq run`'s does (cli/keep_alive.py), so the read's wait is broken
# off and, once it goes on, finds its time spent.
_STOPPED_READ = """
import os, signal, sys
from gpuq.cli.client import Client
signal.signal(signal.SIGTSTP, lambda *_: os.kill(os.getpid(), signal.SIGSTOP))
client = Client(sys.argv[1], timeout=2.5)
client.get("/whoami")  # the client's imports done: the next read is at once
print("asking", flush=True)
answer = client.get(f"/jobs/{sys.argv[2]}/output", ride_out=True, wait=1.5, state="pending")
print("answered", answer["state"], flush=True)
"""


def test_a_read_stopped_past_its_timeout_by_ctrl_z_is_asked_again_not_taken_for_a_hung_server(settings, tmp_path):
    st, job = _server_with_a_held_job(settings, tmp_path)
    reader = subprocess.Popen([sys.executable, "-c", _STOPPED_READ, str(settings.server_socket), str(job)],
                              env=st.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert reader.stdout.readline() == "asking\n"
        time.sleep(0.7)  # its read waits for the answer: the server gives it 1.5 s on
        reader.send_signal(signal.SIGTSTP)  # Ctrl-Z
        _until(lambda: psutil.Process(reader.pid).status() == psutil.STATUS_STOPPED, 10, "the reader stopped")
        time.sleep(4.0)  # past its timeout
        reader.send_signal(signal.SIGCONT)
        code, out, err = _ended(reader)
        assert (code, out) == (0, "answered pending\n"), err
    finally:
        if reader.poll() is None:
            reader.kill()
        st.stop()
