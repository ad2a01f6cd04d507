"""A command's CPU time, as seff and sacct give it (TotalCPU): its worker reaps its main process with
the kernel's count of it and every process of it that was waited for, and `gpuq stats ID` gives the
CPU seconds and the cores used on average, against its --cpus; `gpuq stats --array` sums them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from gpuq.service.constants import State
from gpuq.workers.command import _reap
from tests.conftest import cli_submit, run_cli, wait_for_state

pytestmark = pytest.mark.timeout(180)

# Spins 0.6 s of CPU itself and 0.4 s in a child it waits for; then exits with the code it is given.
BURN = """
import subprocess, sys, time
def spin(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass
child = subprocess.Popen([sys.executable, "-c",
    "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass"])
spin(0.6)
child.wait()
sys.exit(int(sys.argv[1]))
"""


def _stats(settings, job_id: int) -> dict:
    out = run_cli(["stats", str(job_id), "--json"], settings)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("code, state", [(0, State.SUCCEEDED), (3, State.FAILED)])
def test_stats_give_a_commands_cpu_seconds_with_those_of_its_waited_for_children(stack, tmp_path, code, state):
    s = stack.settings
    job_id = cli_submit(s, ["--", sys.executable, "-c", BURN, str(code)], cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == state, stack.logs()
    got = _stats(s, job_id)
    assert 0.9 <= got["cpu_s"] <= 5.0, got  # the child's 0.4 s counted: without it, under 0.9
    text = run_cli(["stats", str(job_id)], s).stdout
    assert f"       CPU  {got['cpu_s']:.1f} s, {got['cpu_s'] / got['wall_s']:.2f} cores on average\n" in text, text


def test_stats_read_a_commands_cores_against_its_cpus(stack, tmp_path):
    s = stack.settings
    job_id = cli_submit(s, ["--cpus", "4", "--", sys.executable, "-c", BURN, "0"], cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    got = _stats(s, job_id)
    cores = got["cpu_s"] / got["wall_s"]
    assert f"{cores:.2f} cores on average ({cores / 4:.0%} of its --cpus 4)" in run_cli(["stats", str(job_id)],
                                                                                        s).stdout


def test_a_workload_has_no_cpu_time_of_its_own_and_its_stats_say_nothing_of_it(stack, tmp_path):
    s = stack.settings
    job_id = cli_submit(s, ["matmul", "--size", "32", "--repeat", "2"], cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    assert _stats(s, job_id)["cpu_s"] is None
    assert "CPU" not in run_cli(["stats", str(job_id)], s).stdout


def test_array_stats_sum_their_commands_cpu_seconds(stack, tmp_path):
    s = stack.settings
    out = run_cli(["submit", "--parsable", "--array", "0-2", "--", sys.executable, "-c", BURN, "0"], s, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    array_id = int(out.stdout)
    stats = run_cli(["stats", "--array", str(array_id), "--json"], s)
    for job_id in [t["job_id"] for t in json.loads(stats.stdout)["per_task"]]:
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    data = json.loads(run_cli(["stats", "--array", str(array_id), "--json"], s).stdout)
    assert data["cpu_s"] == pytest.approx(sum(t["cpu_s"] for t in data["per_task"])) and data["cpu_s"] >= 2.7
    assert f"       CPU  {data['cpu_s']:.1f} s over its tasks" in run_cli(["stats", "--array", str(array_id)], s).stdout
    csv_head = run_cli(["stats", "--array", str(array_id), "--csv"], s).stdout.splitlines()[0]
    assert csv_head.endswith(",samples,cpu_s,host_mem_peak_mib")


@pytest.mark.parametrize("argv, code", [
    (["sh", "-c", "exit 7"], 7),
    (["sh", "-c", "kill -TERM $$"], -signal.SIGTERM),
])
def test_reaping_gives_the_exit_code_as_popen_does_with_the_cpu_used(argv, code):
    proc = subprocess.Popen(argv)
    got, cpu_s = _reap(proc)
    assert got == proc.returncode == code
    assert proc.poll() == code  # Popen knows it ended: nothing is waited for twice
    assert cpu_s is not None and cpu_s >= 0
