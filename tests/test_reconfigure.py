"""`gpuq reconfigure`: a running stack takes up an edited config file, its server and scheduler at
once and each worker after its running job, which goes on; an edit it cannot take is refused in
one line with nothing changed (a real `gpuq up` stack, real signals)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from gpuq.cli.stack import _server_pid
from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.models import Job
from tests.conftest import free_port, make_settings, settings_env, wait_for_state
from tests.test_local_stack import _processes_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# Given by the file, not the environment, so that an edit of the file reaches the stack.
FROM_FILE = ("GPUQ_MAX_TIME", "GPUQ_DEFAULT_TIME", "GPUQ_FAKE_GPUS", "GPUQ_MAX_PRIORITY")


def _gpuq(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _settings_served(env: dict[str, str]) -> dict:
    shown = _gpuq(env, "config", "--json")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return json.loads(shown.stdout)["settings"]


def _worker_pid(settings) -> int:
    return next(p.pid for p in _processes_of(settings) if "gpuq.workers" in " ".join(p.cmdline()))


def test_reconfigure_takes_up_an_edited_file_without_stopping_the_running_job(tmp_path):
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                             redis_port=free_port(), fake_gpus=1)
    config = tmp_path / "config.toml"
    config.write_text('fake_gpus = 1\nmax_time = "1h"\nmax_priority = 10\n')
    env = {k: v for k, v in settings_env(settings).items() if k not in FROM_FILE} | {"GPUQ_CONFIG": str(config)}
    env["GPUQ_SHUTDOWN_GRACE"] = "1"  # a `gpuq down` would interrupt the job after 1 s; a reconfigure does not
    up = _gpuq(env, "up", "--timeout", "150", timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        too_long = _gpuq(env, "submit", "--time", "90m", "--", "true")
        assert too_long.returncode == 2 and "(GPUQ_MAX_TIME)" in too_long.stderr, too_long
        job_id = int(_gpuq(env, "submit", "--", "sleep", "8").stdout.split()[-1])
        wait_for_state(settings, job_id, {"running"})
        worker = _worker_pid(settings)

        config.write_text('fake_gpus = 1\nmax_time = "2h"\nmax_priority = 15\n')
        assert _gpuq(env, "reconfigure").returncode == 0
        # A second one while the worker still finishes its job: not a second stop, which would interrupt it.
        config.write_text('fake_gpus = 1\nmax_time = "2h"\nmax_priority = 20\n')
        done = _gpuq(env, "reconfigure")
        assert done.returncode == 0, done.stdout + done.stderr
        said = done.stdout.splitlines()
        assert said[0] == ("gpuq reconfigured: changed: GPUQ_MAX_PRIORITY; restarting the server and "
                           "the scheduler now, each worker once its running job ends"), said
        assert said[1].startswith("the server answers again on the new settings (pid "), said
        # The server runs on the new file: the limit it checks, and what `gpuq config` says.
        assert _gpuq(env, "submit", "--hold", "--time", "90m", "--", "true").returncode == 0
        shown = _settings_served(env)
        assert (shown["max_priority"]["value"], shown["max_priority"]["source"]) == (20, "file"), shown
        # The worker stops warm: its job runs on to its end, and only then is the worker replaced.
        assert psutil.pid_exists(worker) and _worker_pid(settings) == worker
        assert wait_for_state(settings, job_id, c.END_STATES, timeout=60) == "succeeded"
        with write_scope(settings) as session:
            assert session.get(Job, job_id).exit_code == 0
        psutil.Process(worker).wait(30)  # it goes once its job has ended, and another takes its GPU
        after = _gpuq(env, "run", "--", "true", timeout=120)
        assert after.returncode == 0, after.stdout + after.stderr
        assert _worker_pid(settings) != worker

        # What a running stack cannot take up, and a file that is not valid: refused, nothing changed.
        server = _server_pid(settings.server_socket)
        config.write_text('fake_gpus = 2\nmax_time = "3h"\n')
        refused = _gpuq(env, "reconfigure")
        assert refused.returncode == c.EXIT_CONFIG and refused.stderr.strip() == (
            "gpuq: reconfigure refused: GPUQ_FAKE_GPUS changed, which a running stack cannot take up: `gpuq down` "
            "and `gpuq up` to apply; nothing changed"), refused
        config.write_text('max_time = "soon"\n')
        env_ok = {**env, "GPUQ_MAX_TIME": "2h"}  # the command's own read passes; the stack's does not
        bad = _gpuq(env_ok, "reconfigure")
        assert bad.returncode == c.EXIT_CONFIG and bad.stderr.startswith(
            "gpuq: reconfigure refused: the settings are not valid, nothing changed: "), bad
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert _server_pid(settings.server_socket) == server  # the same server, on the same settings
        shown = _settings_served(env_ok)
        assert (shown["max_time"]["value"], shown["max_time"]["source"]) == ("2h", "given"), shown
    finally:
        config.write_text('fake_gpus = 1\n')
        down = _gpuq(env, "down", "--grace", "0")
        for p in _processes_of(settings):
            p.kill()
    assert down.returncode == 0, down.stdout + down.stderr
