"""A job's CPU limit (`gpuq submit --cpus`, as docker --cpus; GPUQ_CPUS_PER_GPU as SLURM's
DefCpuPerGPU): the cores a command's processes may use together, held to by a cgroup's CPU quota,
and said in the job's output when the quota held it back."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from gpuq.service.constants import State
from gpuq.service.errors import InvalidSpec
from gpuq.service.job_cpus import cpu_variables
from gpuq.service.units import parse_cpus
from gpuq.workers.cgroup import JobCgroup
from tests.conftest import cli_submit, output_of, run_cli, settings_env, stack_on_database, wait_for_state

pytestmark = pytest.mark.timeout(180)

# Spins for 1.5 s of wall time, then prints the CPU it had over that time, and its CPU quota as
# the kernel reads it from its own cgroup (v1's cpu hierarchy or v2's cpu.max).
SPIN = """
import os, time
t0, c0 = time.monotonic(), os.times()
while time.monotonic() - t0 < 1.5:
    pass
c1 = os.times()
print("share", round((c1.user + c1.system - c0.user - c0.system) / (time.monotonic() - t0), 3))
for line in open("/proc/self/cgroup"):
    _, controllers, path = line.strip().split(":", 2)
    if "cpu" in controllers.split(","):
        print("quota", open(f"/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us").read().strip())
"""


def _can_hold_cpus() -> bool:
    probe = JobCgroup.create(f"gpuq-cpu-probe-{os.getpid()}", None, 0.5)
    if probe is None:
        return False
    try:
        return probe.cpus is not None
    finally:
        probe.remove()


@pytest.mark.parametrize("text, cpus", [("4", 4.0), (" 0.5 ", 0.5), ("2.25", 2.25), ("0.01", 0.01), ("4096", 4096)])
def test_cpus_takes_a_number_of_cores(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["0", "-1", "0.001", "4097", "two", "", "nan", "inf", "1e400"])
def test_cpus_out_of_range_or_not_a_number_is_refused_in_one_line(text):
    with pytest.raises(InvalidSpec) as err:
        parse_cpus(text)
    assert str(err.value).startswith("--cpus takes a number of CPU cores from 0.01 to 4096, e.g. 4 or 0.5; got ")
    assert "\n" not in str(err.value)


def test_a_cgroup_quota_holds_a_busy_process_to_its_cores_and_counts_the_throttling():
    if not _can_hold_cpus():
        pytest.skip("no writable CPU cgroup here")
    group = JobCgroup.create(f"gpuq-cpu-test-{os.getpid()}", None, 0.2)
    assert group is not None and group.cpus == 0.2
    try:
        proc = subprocess.run([sys.executable, "-c", SPIN], capture_output=True, text=True, timeout=30,
                              preexec_fn=group.join)
        got = dict(line.split() for line in proc.stdout.splitlines())
        assert float(got["share"]) <= 0.3, proc.stdout
        if not group.v2:
            assert got["quota"] == "20000"
        periods, throttled = group.throttled()
        assert periods >= 10 and throttled >= periods // 2, (periods, throttled)
    finally:
        group.remove()
    assert not group.path.exists()
    assert group.cpu_path is None or not group.cpu_path.exists()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, tmp_path_factory, redis_url):
    """Two simulated GPUs; a command given no --cpus is held to 1.5 cores for each of its GPUs."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, cpus_per_gpu=1.5)


def _shown(settings, job_id):
    out = run_cli(["show", "--json", str(job_id)], settings)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_command_is_held_to_its_cpus_and_told_it_wanted_more(stack, tmp_path):
    if not _can_hold_cpus():
        pytest.skip("no writable CPU cgroup here")
    s = stack.settings
    job_id = cli_submit(s, ["--cpus", "0.2", "--", sys.executable, "-c", SPIN], cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    out = output_of(s, job_id)
    got = dict(line.split(None, 1) for line in out.splitlines() if line.startswith(("share ", "quota ")))
    assert float(got["share"]) <= 0.3, out
    if "quota" in got:
        assert got["quota"] == "20000", out
    assert "[gpuq: held to --cpus 0.2: it wanted more CPU in " in out
    assert _shown(s, job_id)["cpus"] == 0.2
    assert "0.2 CPU cores" in run_cli(["show", str(job_id)], s).stdout


def test_a_job_under_its_cpus_hears_nothing_of_them(stack, tmp_path):
    s = stack.settings
    job_id = cli_submit(s, ["--cpus", "2", "--", "sh", "-c", "echo done"], cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED
    out = output_of(s, job_id)
    assert out == "done\n" or (not _can_hold_cpus() and "is not held to on" in out), out


def test_cpus_per_gpu_holds_a_command_that_gives_none_and_a_job_script_may_set_it(stack, tmp_path):
    s = stack.settings
    two = cli_submit(s, ["--gpus", "2", "--hold", "--", "true"], cwd=tmp_path)
    assert _shown(s, two)["cpus"] == 3.0  # 1.5 for each of its GPUs
    workload = cli_submit(s, ["--hold", "matmul", "--size", "64"], cwd=tmp_path)
    assert _shown(s, workload)["cpus"] is None  # it runs in its worker, which no job's limit holds
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n#GPUQ --cpus 6\n#GPUQ --hold\ntrue\n")
    script.chmod(0o755)
    scripted = cli_submit(s, ["--", "./train.sh"], cwd=tmp_path)
    assert _shown(s, scripted)["cpus"] == 6.0
    resubmitted = run_cli(["resubmit", "--json", str(scripted)], s)
    assert resubmitted.returncode == 0, resubmitted.stderr
    assert _shown(s, json.loads(resubmitted.stdout)["id"])["cpus"] == 6.0
    assert run_cli(["cancel", str(two), str(workload), str(scripted), str(json.loads(resubmitted.stdout)["id"])],
                   s).returncode == 0


@pytest.mark.parametrize("args, line", [
    (["--cpus", "0", "--", "true"],
     "gpuq: --cpus takes a number of CPU cores from 0.01 to 4096, e.g. 4 or 0.5; got '0'"),
    (["--cpus", "lots", "--", "true"],
     "gpuq: --cpus takes a number of CPU cores from 0.01 to 4096, e.g. 4 or 0.5; got 'lots'"),
    (["--cpus", "2", "matmul"], "gpuq: --cpus limits a command's processes; a built-in workload runs in its worker"),
])
def test_a_bad_cpus_is_refused_in_one_line_and_nothing_is_queued(stack, tmp_path, args, line):
    s = stack.settings
    before = json.loads(run_cli(["status", "--json"], s).stdout)["jobs"]
    out = run_cli(["submit", *args], s, cwd=tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
    assert json.loads(run_cli(["status", "--json"], s).stdout)["jobs"] == before


def test_an_allocation_s_shell_is_held_to_its_cpus(stack, tmp_path):
    if not _can_hold_cpus():
        pytest.skip("no writable CPU cgroup here")
    out = run_cli(["alloc", "--cpus", "0.2", "--", sys.executable, "-c", SPIN], stack.settings, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.startswith(("share ", "quota ")))
    assert float(got["share"]) <= 0.3, out.stdout


@pytest.mark.parametrize("cpus, threads", [(0.01, 1), (0.5, 1), (1, 1), (2.99, 2), (16, 16)])
def test_openmp_gets_a_thread_for_each_whole_core_asked_for_and_at_least_one(cpus, threads):
    assert cpu_variables(cpus, {}) == {"GPUQ_CPUS": f"{cpus:g}", "OMP_NUM_THREADS": str(threads)}
    assert cpu_variables(cpus, {"OMP_NUM_THREADS": "7"}) == {"GPUQ_CPUS": f"{cpus:g}"}  # the job's own wins
    assert cpu_variables(None, {}) == {}


# What a job's processes are told of their cores, and how many threads torch's CPU pool starts.
SAYS_CORES = ("import os, torch; print('cores', os.environ.get('GPUQ_CPUS'), os.environ.get('OMP_NUM_THREADS'), "
              "torch.get_num_threads())")


def test_a_command_is_told_its_cpus_and_torch_starts_a_thread_for_each_core(stack, tmp_path):
    s = stack.settings
    held = cli_submit(s, ["--cpus", "2.5", "--", sys.executable, "-c", SAYS_CORES], cwd=tmp_path)
    own = cli_submit(s, ["--cpus", "2.5", "--env", "OMP_NUM_THREADS=3", "--", sys.executable, "-c", SAYS_CORES],
                     cwd=tmp_path)
    default = cli_submit(s, ["--", sys.executable, "-c", SAYS_CORES], cwd=tmp_path)  # GPUQ_CPUS_PER_GPU's 1.5
    said = {}
    for job_id in (held, own, default):
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED), timeout=120) == State.SUCCEEDED, \
            stack.logs()
        said[job_id] = next(line for line in output_of(s, job_id).splitlines() if line.startswith("cores "))
    assert said[held] == "cores 2.5 2 2"
    assert said[own].startswith("cores 2.5 3 ")  # its own setting wins (torch takes at most the machine's cores)
    assert said[default] == "cores 1.5 1 1"


def test_an_allocation_s_shell_is_told_its_cpus(stack, tmp_path):
    env = settings_env(stack.settings)
    del env["OMP_NUM_THREADS"]  # the tests' own, which a terminal's would beat
    out = subprocess.run([sys.executable, "-m", "gpuq.cli", "alloc", "--cpus", "2.5", "--", "sh", "-c",
                          "echo cores $GPUQ_CPUS $OMP_NUM_THREADS"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cores 2.5 2\n" in out.stdout


@pytest.mark.parametrize("value", ["-1", "5000"])
def test_cpus_per_gpu_out_of_range_is_refused_naming_the_setting(value):
    from gpuq.service.errors import ConfigError
    from gpuq.service.settings import load_settings

    refused = r"^setting cpus_per_gpu must (not be negative|be between 0 \(no limit\) and 4096)"
    with pytest.raises(ConfigError, match=refused):
        load_settings({"GPUQ_CPUS_PER_GPU": value, "GPUQ_CONFIG": "/nonexistent/gpuq.toml"})


def test_update_changes_a_pending_command_s_cpus_but_not_a_workload_s_or_a_running_job_s(stack, tmp_path):
    s = stack.settings
    held = cli_submit(s, ["--hold", "--cpus", "2", "--", "true"], cwd=tmp_path)
    out = run_cli(["update", str(held), "--cpus", "0.5"], s)
    assert (out.returncode, out.stdout) == (0, f"job {held}: CPU cores 2 → 0.5\n"), out.stderr
    assert _shown(s, held)["cpus"] == 0.5
    out = run_cli(["update", str(held), "--cpus", "none"], s)
    assert (out.returncode, out.stdout) == (0, f"job {held}: CPU cores 0.5 → none\n"), out.stderr
    assert _shown(s, held)["cpus"] is None
    out = run_cli(["update", str(held), "--cpus", "0"], s)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.startswith("gpuq: --cpus takes a number of CPU cores") and out.stderr.count("\n") == 1

    workload = cli_submit(s, ["--hold", "matmul", "--size", "64"], cwd=tmp_path)
    out = run_cli(["update", str(workload), "--cpus", "2"], s)
    assert out.returncode == 4 and out.stderr == (f"gpuq: job {workload} is a built-in workload: it runs in its "
                                                  "worker, which --cpus cannot hold\n")
    assert _shown(s, workload)["cpus"] is None

    running = cli_submit(s, ["--", "sleep", "30"], cwd=tmp_path)
    assert wait_for_state(s, running, (State.RUNNING,)) == State.RUNNING
    out = run_cli(["update", str(running), "--cpus", "1"], s)
    assert out.returncode == 4 and out.stderr == (f"gpuq: job {running} is running; only a pending job's CPU cores "
                                                  "can be changed\n")
    assert run_cli(["cancel", str(held), str(workload), str(running)], s).returncode == 0


def _fake_tree(tmp_path, monkeypatch, lines: list[str]):
    """A cgroup file system of plain directories under ``tmp_path``, and a worker whose
    /proc/self/cgroup reads ``lines``: the layouts this machine has not (v2, systemd's v1)."""
    from gpuq.workers import cgroup

    monkeypatch.setattr(cgroup, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cgroup, "_own_lines", lambda: lines)
    return cgroup


def test_on_cgroup_v2_the_quota_is_cpu_max_in_the_jobs_own_cgroup_where_cpu_is_delegated(tmp_path, monkeypatch):
    cgroup = _fake_tree(tmp_path, monkeypatch, ["0::/system.slice/gpuq.service"])
    own = tmp_path / "system.slice" / "gpuq.service"
    own.mkdir(parents=True)
    (own / "cgroup.subtree_control").write_text("cpu memory pids\n")
    group = cgroup.JobCgroup.create("gpuq-job1", 2048, 1.5)
    assert group is not None and group.v2 and group.cpus == 1.5 and group.cpu_path is None
    assert (own / "gpuq-job1" / "memory.max").read_text() == str(2048 * 2**20)
    assert (own / "gpuq-job1" / "cpu.max").read_text() == "150000 100000"
    (own / "gpuq-job1" / "cpu.stat").write_text("usage_usec 900\nnr_periods 40\nnr_throttled 12\n"
                                                "throttled_usec 5000\n")
    assert group.throttled() == (40, 12)
    # Memory delegated but not cpu: the job runs in its cgroup, its --cpus not held (its output says so).
    (own / "cgroup.subtree_control").write_text("memory\n")
    unheld = cgroup.JobCgroup.create("gpuq-job2", None, 1.5)
    assert unheld is not None and unheld.cpus is None and unheld.throttled() is None
    assert not (own / "gpuq-job2" / "cpu.max").exists()


def test_on_systemds_cgroup_v1_the_quota_is_made_in_the_cpu_and_cpuacct_hierarchy(tmp_path, monkeypatch):
    cgroup = _fake_tree(tmp_path, monkeypatch, ["5:cpu,cpuacct:/user.slice", "4:memory:/user.slice"])
    (tmp_path / "memory" / "user.slice").mkdir(parents=True)
    (tmp_path / "cpu,cpuacct" / "user.slice").mkdir(parents=True)  # systemd mounts it so, cpu a link to it
    group = cgroup.JobCgroup.create("gpuq-job3", None, 0.25)
    assert group is not None and not group.v2 and group.cpus == 0.25
    held = tmp_path / "cpu,cpuacct" / "user.slice" / "gpuq-job3"
    assert group.cpu_path == held
    assert (held / "cpu.cfs_quota_us").read_text() == "25000" and (held / "cpu.cfs_period_us").read_text() == "100000"
    (held / "cpu.stat").write_text("nr_periods 8\nnr_throttled 8\nthrottled_time 123456\n")
    assert group.throttled() == (8, 8)


def test_on_cgroup_v2_a_jobs_cores_are_its_cpuset_where_cpuset_is_delegated(tmp_path, monkeypatch):
    cgroup = _fake_tree(tmp_path, monkeypatch, ["0::/system.slice/gpuq.service"])
    own = tmp_path / "system.slice" / "gpuq.service"
    own.mkdir(parents=True)
    (own / "cgroup.subtree_control").write_text("cpu cpuset memory\n")
    group = cgroup.JobCgroup.create("gpuq-job4", None, 2, (3, 5))
    assert group is not None and group.cores == (3, 5) and group.cpuset_path is None
    assert (own / "gpuq-job4" / "cpuset.cpus").read_text() == "3,5"
    # Not delegated: the job runs in its cgroup on its cores by affinity alone.
    (own / "cgroup.subtree_control").write_text("cpu memory\n")
    loose = cgroup.JobCgroup.create("gpuq-job5", None, 2, (3, 5))
    assert loose is not None and loose.cores == () and not (own / "gpuq-job5" / "cpuset.cpus").exists()


def test_on_cgroup_v1_a_jobs_cores_are_a_cpuset_of_its_own_with_its_parents_memory_nodes(tmp_path, monkeypatch):
    cgroup = _fake_tree(tmp_path, monkeypatch, ["6:cpuset:/lab", "5:cpu,cpuacct:/lab", "4:memory:/lab"])
    for hierarchy in ("memory", "cpu,cpuacct", "cpuset"):
        (tmp_path / hierarchy / "lab").mkdir(parents=True)
    (tmp_path / "cpuset" / "lab" / "cpuset.mems").write_text("0-1\n")
    group = cgroup.JobCgroup.create("gpuq-job6", None, 1, (2,))
    confined = tmp_path / "cpuset" / "lab" / "gpuq-job6"
    assert group is not None and group.cores == (2,) and group.cpuset_path == confined
    assert (confined / "cpuset.cpus").read_text() == "2" and (confined / "cpuset.mems").read_text() == "0-1"
    # A process is put in all three of its directories, and they all go with it.
    for path in (group.path, group.cpu_path, confined):
        (path / "cgroup.procs").write_text("")
    assert group.place(4242)
    assert all((path / "cgroup.procs").read_text() == "4242" for path in (group.path, group.cpu_path, confined))
    for path in (group.path, group.cpu_path, confined):  # the kernel's files go with their directory; these do not
        for file in path.iterdir():
            file.unlink()
    group.remove()
    assert not group.path.exists() and not group.cpu_path.exists() and not confined.exists()


def test_a_jobs_cpuset_keeps_a_process_that_widens_its_affinity_on_its_cores():
    """The real kernel's cpuset, where this machine lets the tests make one (root, cgroup v1 or a
    delegated v2): a process of the job asks for every core and is kept on its own."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        pytest.skip("needs two cores the tests may run on")
    group = JobCgroup.create(f"gpuq-cpuset-test-{os.getpid()}", None, 1, cores[-1:])
    if group is None or not group.cores:
        pytest.skip("this machine lets the worker make no cpuset")
    widen = ("import os\ntry:\n    os.sched_setaffinity(0, range(os.cpu_count()))\nexcept OSError:\n    pass\n"
             "print(sorted(os.sched_getaffinity(0)))\n"
             f"try:\n    os.sched_setaffinity(0, {{{cores[0]}}})\nexcept OSError as exc:\n    print(exc.errno)")
    try:
        out = subprocess.run([sys.executable, "-c", widen], preexec_fn=group.join, capture_output=True, text=True,
                             timeout=30)
    finally:
        group.remove()
    assert out.stdout.split("\n")[:2] == [str([cores[-1]]), str(errno.EINVAL)], out
