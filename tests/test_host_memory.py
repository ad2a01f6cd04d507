"""A command's host memory peak, as seff's Memory Utilized gives it: its worker looks at what the
job's processes hold that the kernel cannot drop (in its memory cgroup, anonymous and shared
memory; without one, their resident memory summed), and `gpuq stats` gives the peak against its
--host-mem; `gpuq stats --array`, the highest of its tasks and whose."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from gpuq.service.constants import State
from gpuq.workers.cgroup import JobCgroup
from gpuq.workers.host_memory import FIRST_LOOK_SECONDS, HostMemory
from gpuq.workers.job_processes import tree
from tests.conftest import cli_submit, run_cli, wait_for_state

pytestmark = pytest.mark.timeout(180)

# Holds MiB of anonymous memory (argv[1]) and of shared memory (argv[2], a file in /dev/shm), and
# writes a file of MiB (argv[3]) into the page cache; says so, then waits for its stdin to close
# (or 1.5 s, in a job, where stdin is /dev/null).
HOLD = """
import os, sys, time
anon = bytearray(int(sys.argv[1]) * 2**20)
for i in range(0, len(anon), 4096):
    anon[i] = 1
shm = f"/dev/shm/gpuq-test-{os.getpid()}"
with open(shm, "wb") as f:
    f.write(b"x" * int(sys.argv[2]) * 2**20)
cache = f"{sys.argv[4]}/cache-{os.getpid()}"
with open(cache, "wb") as f:
    f.write(b"y" * int(sys.argv[3]) * 2**20)
print("holding", flush=True)
t = time.monotonic()
while time.monotonic() - t < 1.5 and not sys.stdin.read(1):
    time.sleep(0.05)
os.unlink(shm)
os.unlink(cache)
"""


def _holding(anon: int, shm: int, cache: int, where, cgroup: JobCgroup | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(anon), str(shm), str(cache), str(where)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=cgroup.join if cgroup is not None else None)
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    return proc


def _peak(memory: HostMemory) -> int:
    time.sleep(FIRST_LOOK_SECONDS + 0.05)
    memory.look()
    assert memory.peak_mib is not None
    return memory.peak_mib


def test_in_its_cgroup_a_job_holds_its_anonymous_and_shared_memory_not_the_page_cache(tmp_path):
    cgroup = JobCgroup.create(f"gpuq-test-peak-{uuid.uuid4().hex[:8]}", None)
    if cgroup is None:
        pytest.skip("no memory cgroup for jobs here")
    try:
        proc = _holding(120, 60, 200, tmp_path, cgroup)
        try:
            memory = HostMemory(cgroup, lambda: [], lambda: [])
            # 180 MiB and the interpreter's own; the 200 MiB of page cache it wrote are not counted.
            assert 180 <= _peak(memory) < 300, memory.peak_mib
        finally:
            proc.communicate("x")
    finally:
        cgroup.kill_all(5)
        cgroup.remove()


def test_without_a_cgroup_a_job_holds_the_resident_memory_of_its_process_tree(tmp_path):
    proc = _holding(150, 0, 0, tmp_path)
    try:
        memory = HostMemory(None, lambda: [], functools.partial(tree, proc.pid))
        assert 150 <= _peak(memory) < 300, memory.peak_mib
        assert memory.look() is None  # no limit of the worker's to pass
    finally:
        proc.communicate("x")


def test_without_a_cgroup_a_limit_is_held_by_the_sum_and_said_in_mib(tmp_path):
    import psutil

    proc = _holding(150, 0, 0, tmp_path)
    try:
        memory = HostMemory(None, lambda: [psutil.Process(proc.pid)], lambda: [], limit_mib=100)
        time.sleep(FIRST_LOOK_SECONDS + 0.05)
        over = memory.look()
        assert over is not None and over >= 150 and memory.peak_mib >= over
    finally:
        proc.communicate("x")


def test_a_job_over_before_the_first_look_has_no_peak():
    memory = HostMemory(None, lambda: [], functools.partial(tree, os.getpid()))
    assert memory.look() is None and memory.peak_mib is None


def _stats(settings, *args: str) -> dict:
    out = run_cli(["stats", *args, "--json"], settings)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_stats_give_a_commands_host_memory_peak_against_its_host_mem(stack, tmp_path):
    s = stack.settings
    held = cli_submit(s, ["--host-mem", "1G", "--", sys.executable, "-c", HOLD, "150", "0", "0", str(tmp_path)],
                      cwd=tmp_path)
    quick = cli_submit(s, ["--", "true"], cwd=tmp_path)
    for job_id in (held, quick):
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    got = _stats(s, str(held))
    assert 150 <= got["host_mem_peak_mib"] < 400 and got["host_mem_mib"] == 1024, got
    text = run_cli(["stats", str(held)], s).stdout
    peak = got["host_mem_peak_mib"]
    assert f"host memory  {peak} MiB at its peak ({round(100 * peak / 1024)}% of its --host-mem 1024 MiB)\n" \
        in text, text
    assert _stats(s, str(quick))["host_mem_peak_mib"] is None  # over before the first look
    assert "host memory" not in run_cli(["stats", str(quick)], s).stdout


def test_array_stats_give_the_highest_host_memory_peak_of_its_tasks_and_whose(stack, tmp_path):
    s = stack.settings
    out = run_cli(["submit", "--parsable", "--array", "1-2", "--", sys.executable, "-c",
                   HOLD.replace("int(sys.argv[1])", "100 * int(os.environ['GPUQ_ARRAY_INDEX'])"), "0", "0", "0",
                   str(tmp_path)], s, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    array_id = int(out.stdout)
    tasks = [t["job_id"] for t in _stats(s, "--array", str(array_id))["per_task"]]
    for job_id in tasks:
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    data = _stats(s, "--array", str(array_id))
    peaks = {t["job_id"]: t["host_mem_peak_mib"] for t in data["per_task"]}
    assert 200 <= peaks[tasks[1]] and peaks[tasks[0]] < peaks[tasks[1]], peaks
    assert (data["host_mem_peak_mib"], data["host_mem_peak_task"]) == (peaks[tasks[1]], tasks[1])
    assert f"host memory  peak {peaks[tasks[1]]} MiB (job {tasks[1]})" in run_cli(
        ["stats", "--array", str(array_id)], s).stdout
