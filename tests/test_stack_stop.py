"""A second stop of the local stack waits for the one under way rather than interrupt its jobs, and
`gpuq up` over a killed supervisor's leftovers says what they are (real stacks, real signals)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.models import Job
from tests.conftest import run_cli, settings_env, wait_for_state
from tests.test_local_stack import _processes_of, _up_on_one_gpu

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def stopping_file(settings):
    """The mark of a stop under way (service/stop_mark.py's stopping_file)."""
    return settings.run_dir / "stopping.json"


def _supervisor(settings) -> psutil.Process:
    return psutil.Process(int((settings.run_dir / "supervisor.pid").read_text()))


def _clean_up(settings) -> None:
    run_cli(["down", "--grace", "0"], settings, timeout=120)
    for p in _processes_of(settings):
        try:
            p.kill()
        except psutil.Error:
            pass


def _job(settings, job_id: int) -> tuple[str, str | None, int | None]:
    with write_scope(settings) as session:
        job = session.get(Job, job_id)
        return job.state, job.failure, job.exit_code


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _wait_for_log(settings, text: str, timeout: float = 20.0) -> None:
    log = settings.log_dir / "supervisor.log"
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not in {log}"
        time.sleep(0.05)


def test_a_second_down_waits_for_the_stop_under_way_and_its_job_finishes(tmp_path):
    # Two `gpuq down --grace 60` a second apart: the second was taken by the supervisor for a second
    # Ctrl-C and interrupted the running job at once (failed, interrupted, after 2.7 s).
    settings = _up_on_one_gpu(tmp_path)
    first = None
    try:
        sup = _supervisor(settings)
        job_id = int(run_cli(["submit", "--", "sleep", "6"], settings).stdout.split()[-1])
        wait_for_state(settings, job_id, {"running"})
        # A mark left by a `gpuq down` that died before its request was had blocks nothing.
        stopping_file(settings).write_text(json.dumps({"supervisor": sup.pid, "since": time.time() - 600,
                                                       "by": _dead_pid(), "taken": False}))
        first = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "down", "--grace", "60"],
                                 env=settings_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        _wait_for_log(settings, "stopping: warm shutdown")
        time.sleep(0.5)
        t0 = time.monotonic()
        second = run_cli(["down", "--grace", "60"], settings, timeout=150)
        took = time.monotonic() - t0
        out, err = first.communicate(timeout=150)
    finally:
        if first is not None and first.poll() is None:
            first.kill()
        _clean_up(settings)
    assert _job(settings, job_id) == (c.State.SUCCEEDED, None, 0)
    assert second.returncode == 0, second.stdout + second.stderr
    lines = second.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[1] == "gpuq is down", second.stdout
    assert re.fullmatch(rf"gpuq is already stopping \(since \d\d:\d\d:\d\d, pid {sup.pid}\): waiting for it",
                        lines[0]), lines[0]
    assert first.returncode == 0 and out.strip() == "gpuq is down", out + err
    assert took < 60  # it waited for the job's end, not for its own grace
    assert "second stop request" not in (settings.log_dir / "supervisor.log").read_text()
    assert _processes_of(settings) == []
    assert not stopping_file(settings).exists() and not (settings.run_dir / "supervisor.pid").exists()


def test_up_over_a_killed_supervisors_stack_says_so_and_a_down_after_a_sigterm_waits(tmp_path):
    # `gpuq up` after `kill -9` of the supervisor said "a gpuq server that is not this stack's
    # already answers" (69): it was this stack's, orphaned.
    settings = _up_on_one_gpu(tmp_path)
    try:
        sup = _supervisor(settings)
        left = sup.children(recursive=True)
        sup.kill()
        sup.wait(10)
        again = run_cli(["up", "--timeout", "60"], settings, timeout=90)
        assert again.returncode == c.EXIT_CONFLICT, again.stdout + again.stderr
        assert again.stderr.strip() == (
            f"gpuq: gpuq's supervisor (pid {sup.pid}) died and left this stack's server, scheduler and workers "
            "running; `gpuq down` stops them, then `gpuq up`")
        assert all(p.is_running() for p in left)  # `up` stopped nothing
        down = run_cli(["down", "--grace", "0"], settings, timeout=120)
        assert down.returncode == 0 and down.stdout.strip() == "gpuq is down", down.stdout + down.stderr
        assert _processes_of(settings) == []

        # Up again; a stop from elsewhere (a service manager's SIGTERM), then `gpuq down`: it
        # waits for that stop, and the running job finishes.
        up = run_cli(["up", "--timeout", "150"], settings, timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        sup = _supervisor(settings)
        job_id = int(run_cli(["submit", "--", "sleep", "4"], settings).stdout.split()[-1])
        wait_for_state(settings, job_id, {"running"})
        sup.send_signal(signal.SIGTERM)
        _wait_for_log(settings, "stopping: warm shutdown")
        down = run_cli(["down", "--grace", "60"], settings, timeout=150)
    finally:
        _clean_up(settings)
    assert down.returncode == 0, down.stdout + down.stderr
    lines = down.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("gpuq is already stopping (since ") and lines[1] == "gpuq is down"
    assert _job(settings, job_id) == (c.State.SUCCEEDED, None, 0)
    assert "second stop request" not in (settings.log_dir / "supervisor.log").read_text()
    assert _processes_of(settings) == []


def test_up_on_an_older_database_upgrades_it_and_says_from_which_revision(tmp_path):
    # It upgraded in silence: on a database other nodes share, their older gpuq met a schema it did not know.
    from gpuq.migrations.versions import HEAD
    from gpuq.service import db
    from tests.conftest import free_port, make_settings

    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                             redis_port=free_port(), fake_gpus=1)
    settings.home.mkdir(parents=True)
    db.upgrade(settings, "0016")
    db.dispose_engines()
    try:
        up = run_cli(["up", "--timeout", "150"], settings, timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        assert (f"gpuq: upgraded the database at {settings.database} from schema revision 0016 to {HEAD} (every "
                "node's gpuq must be this version now)") in up.stdout.splitlines(), up.stdout
        assert "new, empty queue" not in up.stdout
    finally:
        _clean_up(settings)
    assert db.current_revision(settings) == HEAD


def test_up_with_fewer_gpus_retires_the_ones_gone_and_says_so(tmp_path):
    # GPUQ_FAKE_GPUS 2 then 1 (a GPU taken out): GPU 1 stayed listed offline for ever.
    from tests.conftest import free_port, make_settings

    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                             redis_port=free_port(), fake_gpus=2)
    try:
        assert run_cli(["up", "--timeout", "150"], settings, timeout=180).returncode == 0
        assert run_cli(["down"], settings, timeout=120).returncode == 0
        one = settings.with_overrides(fake_gpus=1)
        up = run_cli(["up", "--timeout", "150"], one, timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        assert ("gpuq: GPU 1 of node testnode is no longer here: no longer listed nor given out (it comes back if "
                "its worker registers it again)") in up.stdout.splitlines(), up.stdout
        shown = json.loads(run_cli(["status", "--json"], one).stdout)
        assert [(g["node"], g["index"], g["online"]) for g in shown["gpus"]] == [("testnode", 0, True)]
        too_many = run_cli(["submit", "--gpus", "2", "--", "true"], one)
        assert too_many.returncode == c.EXIT_USAGE and "--gpus 2 is more than any node has" in too_many.stderr
    finally:
        _clean_up(settings)


def test_down_removes_the_default_simulated_memory_folder_of_its_stack(tmp_path):
    # It was left in /tmp, and shared by every stack of the same user, prefix and node.
    from gpuq.service.simulated_memory import memory_dir
    from tests.conftest import free_port, make_settings

    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'home' / 'gpuq.db'}", "",
                             redis_port=free_port(), fake_gpus=1, fake_gpu_memory_dir="")
    folder = memory_dir(settings)
    try:
        assert run_cli(["up", "--timeout", "150"], settings, timeout=180).returncode == 0
        assert folder.is_dir() and folder.parent == settings.home and folder.stat().st_mode & 0o7777 == 0o1777
        assert run_cli(["down"], settings, timeout=120).returncode == 0
        assert not folder.exists()
    finally:
        _clean_up(settings)
        shutil.rmtree(folder, ignore_errors=True)
