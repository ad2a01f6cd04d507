"""Device stats for real: workers on simulated GPUs sample a busy and an idle job, `gpuq status`
flags the idle one, `gpuq devices` shows who is on which GPU, and each job's summary is stored."""

from __future__ import annotations

import json
import sys
import time

import pytest

from gpuq.service.db import write_scope
from gpuq.service.models import JobUsage
from tests.conftest import run_cli, stack_on_database
from tests.test_end_to_end import submit, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

BUSY_SECONDS = 14
IDLE_SECONDS = 14


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def sampled_stack(request, tmp_path_factory, redis_url):
    """A stack sampling at 5 Hz whose idle window is 2.5 s, so the idle flag shows within a test."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, sample_interval=0.2, idle_window=2.5)


def cli_json(args, settings):
    out = run_cli([*args, "--json"], settings)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_busy_and_an_idle_job_are_sampled_flagged_shown_and_summarised(sampled_stack, tmp_path):
    s = sampled_stack.settings
    spin = f"import time\nt = time.time()\nwhile time.time() - t < {BUSY_SECONDS}: pass"
    busy = submit(s, ["--name", "spin", "--", sys.executable, "-c", spin], cwd=tmp_path)
    idle = submit(s, ["--name", "nap", "--", "sleep", str(IDLE_SECONDS)], cwd=tmp_path)
    wait_for_state(s, busy, ("running",))
    wait_for_state(s, idle, ("running",))
    time.sleep(s.idle_window + 1.5)  # the idle window, and a batch of samples written after it

    devices = cli_json(["devices"], s)
    gpus = {d["job_id"]: d for d in devices}
    assert busy in gpus and idle in gpus, (devices, run_cli(["status"], s).stdout)
    assert gpus[idle]["user"] and gpus[idle]["job_name"] == "nap"
    assert "sleep" in {p["name"] for p in gpus[idle]["processes"]} and gpus[idle]["foreign"] == []
    assert gpus[busy]["utilization"] > gpus[idle]["utilization"]
    assert gpus[busy]["temperature_c"] is not None and gpus[busy]["power_w"] is not None

    status = cli_json(["status"], s)
    flags = {j["id"]: j["idle"] for j in status["jobs"]}
    assert flags[idle] is True and flags[busy] is False, status
    shown = run_cli(["status"], s).stdout
    assert "idle GPU" in next(ln for ln in shown.splitlines() if ln.strip().startswith(str(idle)))

    for job in (busy, idle):
        wait_for_state(s, job, ("succeeded",), timeout=60)
    with write_scope(s) as session:
        stored = {j: session.get(JobUsage, j) for j in (busy, idle)}
    assert all(u is not None and u.samples >= 5 for u in stored.values()), sampled_stack.logs()
    b, i = cli_json(["stats", str(busy)], s), cli_json(["stats", str(idle)], s)
    assert b["utilization_mean"] > 40 and i["utilization_mean"] < 10, (b, i)
    assert i["idle_s"] >= 0.6 * i["wall_s"] and b["idle_s"] < 0.5 * b["wall_s"]
    assert b["energy_j"] > i["energy_j"] > 0
    assert b["gpu_hours"] == pytest.approx(b["wall_s"] / 3600)
    assert b["wall_s"] >= BUSY_SECONDS and i["wall_s"] >= IDLE_SECONDS

    report = cli_json(["stats", "--since", "1h"], s)
    (user,) = [u for u in report["users"] if u["name"] == status["jobs"][0]["user"]]
    assert user["jobs"] >= 2 and user["gpu_hours"] > 0 and user["energy_j"] > 0
    assert [n["name"] for n in report["nodes"]] == ["testnode"]
