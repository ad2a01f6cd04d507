"""A command's processes at its end: its process group is signalled only while its main process,
whose pid is the group's id, is not reaped (after that the number may be another group's), and
its exit status is the main process's own whoever waited for the rest."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import pytest

from gpuq.service.db import write_scope
from gpuq.service.models import utcnow
from gpuq.workers.command import run_command
from gpuq.workers.output import OutputSink
from tests.test_usage import add_job

pytestmark = pytest.mark.timeout(60)
ENV = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}


@pytest.fixture
def group_signals(monkeypatch):
    """The signals sent to process groups, each checked to reach a group whose leader is not reaped
    (a zombie still holds its number; a number with no process is free for the next one)."""
    real, sent = os.killpg, []

    def checked(pgid: int, sig: int) -> None:
        assert os.path.exists(f"/proc/{pgid}"), f"signal {sig} sent to group {pgid} after its leader was reaped"
        sent.append(sig)
        real(pgid, sig)

    monkeypatch.setattr(os, "killpg", checked)
    return sent


def sink_of(settings) -> OutputSink:
    with write_scope(settings) as session:
        job = add_job(session, "ann", "n", utcnow(), None)
    return OutputSink(settings, job, 0)


@pytest.mark.parametrize("argv,code", [(["true"], 0), ([sys.executable, "-c", "import sys; sys.exit(3)"], 3),
                                       ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"],
                                        -signal.SIGKILL)])
def test_a_command_that_leaves_nothing_behind_ends_with_its_own_status_and_no_signal(settings, group_signals,
                                                                                    argv, code):
    sink = sink_of(settings)
    outcome = run_command(argv, "/", ENV, sink, threading.Event(), 1.0, verify_within=2.0)
    sink.stop()
    assert (outcome.exit_code, outcome.cancelled, outcome.leftover) == (code, False, ())
    assert group_signals == []


def test_what_a_command_leaves_in_another_session_is_killed_and_its_group_signalled_before_it_is_reaped(
        settings, group_signals, tmp_path):
    # The child leaves the group and the session (setsid): once the main process is reaped, its
    # group is empty and its number free, and a signal to it could reach a group made meanwhile.
    started = tmp_path / "child"
    child = tmp_path / "child.py"
    child.write_text(f"import os, time\nos.setsid()\nopen({str(started)!r}, 'w').close()\ntime.sleep(60)\n")
    main = tmp_path / "main.py"
    main.write_text(f"import os, subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(child)!r}])\n"
                    f"while not os.path.exists({str(started)!r}):\n    time.sleep(0.02)\n")
    argv = [sys.executable, str(main)]
    sink = sink_of(settings)
    outcome = run_command(argv, "/", ENV, sink, threading.Event(), 1.0, verify_within=3.0)
    sink.stop()
    assert started.exists() and (outcome.exit_code, outcome.leftover) == (0, ())
    assert group_signals == [signal.SIGKILL]  # sent while the main process, a zombie, held the number


def test_a_cancelled_command_and_a_child_left_in_its_group_are_stopped_and_its_status_is_the_signal(
        settings, group_signals):
    sink = sink_of(settings)
    cancelled = threading.Event()
    # The main process waits on a child of its group that ignores SIGTERM: the grace ends with SIGKILL.
    argv = [sys.executable, "-c", "import signal, subprocess, sys; "
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); print('up', flush=True); "
            "child.wait()"]
    timer = threading.Timer(1.0, cancelled.set)
    timer.start()
    try:
        outcome = run_command(argv, "/", ENV, sink, cancelled, 0.5, verify_within=2.0)
    finally:
        timer.cancel()
    sink.stop()
    assert outcome.cancelled and outcome.leftover == ()
    assert outcome.exit_code == -signal.SIGTERM  # its own end, read when the worker reaped it
    assert group_signals[0] == signal.SIGTERM and signal.SIGKILL in group_signals


def test_a_job_process_left_a_zombie_counts_as_ended_though_nobody_reaps_it_yet():
    """A job's process other than its main one is not the worker's child: once it ended, its pid
    stays until its parent (or init, where it was orphaned) reaps it, which may be late or never.
    The stop waits for it to end, not to be reaped: a cancel here waited 0.7 s for this VM's init."""
    import subprocess
    import time

    import psutil

    from gpuq.workers.job_processes import wait_ended

    # A parent that never reaps its child: the child stays a zombie while the parent sleeps.
    parent = subprocess.Popen([sys.executable, "-c", "import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                               "print(pid, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 10
        while child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        began = time.monotonic()
        assert wait_ended([child], 5) == []
        assert time.monotonic() - began < 1
        # A process that runs on is still there when the time is up.
        assert wait_ended([psutil.Process(parent.pid)], 0.1) == [psutil.Process(parent.pid)]
    finally:
        parent.kill()
        parent.wait()


@pytest.fixture
def job_cgroup():
    """A real memory cgroup for one command, where this machine lets the tests make one (root)."""
    from gpuq.workers.cgroup import JobCgroup

    group = JobCgroup.create(f"gpuq-finder-test-{os.getpid()}", None)
    if group is None:
        pytest.skip("this machine lets the worker make no cgroup")
    yield group
    group.remove()


def test_a_command_held_by_its_cgroup_is_found_from_it_alone_even_one_that_ended_before_it_was_looked_at(
        settings, job_cgroup, tmp_path, monkeypatch):
    """Its child says it joined the cgroup, so the worker need not read every process of the machine
    (nor their environments) at its end: what left its tree, group and session and dropped its run
    id is in the cgroup still, and a stranger that copied the run id is no process of the job."""
    import subprocess
    import time

    import psutil

    from gpuq.service.process_end import alive
    from gpuq.workers import command

    made = []

    class Seen(command.Finder):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(command, "Finder", Seen)
    sink = sink_of(settings)
    # `true` is over before run_command's Popen returns to the worker: only the child's word says it joined.
    assert run_command(["true"], "/", ENV, sink, threading.Event(), 1.0, job_cgroup).exit_code == 0
    assert made[-1].contained

    said, go = tmp_path / "run_id", tmp_path / "go"
    left = tmp_path / "left"
    script = (f"echo $GPUQ_RUN_ID > {said}; (env -u GPUQ_RUN_ID setsid sh -c 'echo $$ > {left}; exec sleep 60' &); "
              f"while [ ! -e {go} ]; do sleep 0.05; done")
    ended: dict = {}
    runner = threading.Thread(target=lambda: ended.update(outcome=run_command(
        ["sh", "-c", script], "/", ENV, sink, threading.Event(), 1.0, job_cgroup, verify_within=3.0)))
    runner.start()
    deadline = time.monotonic() + 20
    while not (said.exists() and left.exists() and left.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stranger = subprocess.Popen(["sleep", "60"], env={**ENV, "GPUQ_RUN_ID": said.read_text().strip()})
    try:
        go.touch()
        runner.join(20)
        sink.stop()
        assert made[-1].contained and ended["outcome"].exit_code == 0 and ended["outcome"].leftover == ()
        with contextlib.suppress(psutil.NoSuchProcess):  # stopped with the job (init may not have reaped it yet)
            assert not alive(psutil.Process(int(left.read_text())))
        assert stranger.poll() is None  # not the job's: left alone
    finally:
        stranger.kill()
        stranger.wait()
