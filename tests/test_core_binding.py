"""A command with --cpus runs on cores of its own (GPUQ_CPU_BIND=cores, the default), on a real
stack: two jobs running at once on a node of two cores each get one, the one near their GPU
(GPUQ_FAKE_GPU_CORES stands in for NVML's CPU affinity), and everything they start runs there; a
job without --cpus runs on every core; the node's record is empty once they end."""

from __future__ import annotations

import json
import os
import time

import pytest

from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.workers import core_binding
from gpuq.workers.cgroup import CGROUP_ROOT, JobCgroup
from gpuq.workers.job_processes import cgroup_prefix
from tests.conftest import cli_submit, output_of, run_cli, stack_on_database, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores the tests may run on")]

# Simulated GPU 0 is near core 1, GPU 1 near core 0: a job takes its GPU's core, not the lowest.
NEAR = {0: 1, 1: 0}
# What a job reports of where it runs: from a process its shell started (it inherits the cores).
REPORT = ("python3 -c 'import os, json; print(json.dumps({\"cores\": sorted(os.sched_getaffinity(0)), "
          "\"listed\": os.environ.get(\"GPUQ_CORES\"), \"gpu\": os.environ[\"CUDA_VISIBLE_DEVICES\"]}))'")
# A process of the job that asks for every core (as `taskset -c 0-N` would), then says where it runs.
WIDEN = ("python3 -c 'import os; os.sched_setaffinity(0, range(os.cpu_count())); "
         "print(\"widened\", sorted(os.sched_getaffinity(0)))'")


def _cpusets() -> bool:
    """Whether this machine lets a worker make a job's cpuset (root, cgroup v1 or a delegated v2)."""
    probe = JobCgroup.create(f"gpuq-cpuset-probe-{os.getpid()}", None, None, (min(os.sched_getaffinity(0)),))
    if probe is None:
        return False
    try:
        return bool(probe.cores)
    finally:
        probe.remove()


@pytest.fixture(scope="module", params=["sqlite"])
def two_cores(request, tmp_path_factory, redis_url):
    """Two simulated GPUs on a node that offers its jobs two CPU cores, each GPU near one."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=2, node_cpus=2,
                                 fake_gpu_cores="1 0", fake_gpu_names="NVIDIA A100-SXM4-80GB,NVIDIA H100 80GB HBM3")


def _report(settings, job_id) -> dict:
    lines = [line for line in output_of(settings, job_id).splitlines() if line.startswith("{")]
    assert len(lines) == 1, output_of(settings, job_id)
    return json.loads(lines[0])


def test_two_jobs_of_one_core_each_run_at_once_on_their_own_core_near_their_gpu(two_cores, tmp_path):
    s = two_cores.settings
    wait = "while [ ! -e go ]; do sleep 0.1; done"
    ids = [cli_submit(s, ["--cpus", "1", "-t", "5m", "--", "sh", "-c", f"{REPORT}; {wait}"], cwd=tmp_path)
           for _ in range(2)]
    try:
        for job_id in ids:
            assert wait_for_state(s, job_id, (State.RUNNING,)) == State.RUNNING, two_cores.logs()
        # Running from its worker's claim on; its cores are taken as its command starts, which its
        # report line says it has.
        deadline = time.monotonic() + 30
        while not all("{" in output_of(s, job_id) for job_id in ids):
            assert time.monotonic() < deadline, two_cores.logs()
            time.sleep(0.1)
        # While both run, the node's record holds one core for each, and `gpuq show` gives it (SLURM's CPU_IDs).
        record = json.loads(core_binding.record_path(s, s.node).read_text())
        assert sorted((e["job"], len(e["cores"])) for e in record) == [(ids[0], 1), (ids[1], 1)]
        for e in record:
            shown = run_cli(["show", str(e["job"])], s).stdout
            assert f"     cores  {e['cores'][0]} of testnode\n" in shown, shown
            assert json.loads(run_cli(["show", "--json", str(e["job"])], s).stdout)["cores"] == str(e["cores"][0])
    finally:
        (tmp_path / "go").touch()  # or a failure here holds both GPUs for the tests after it
    for job_id in ids:
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    reports = [_report(s, job_id) for job_id in ids]
    assert {r["gpu"] for r in reports} == {"0", "1"}
    for r in reports:
        assert r["cores"] == [NEAR[int(r["gpu"])]] and r["listed"] == str(NEAR[int(r["gpu"])]), reports
    assert json.loads(core_binding.record_path(s, s.node).read_text()) == []
    ended = json.loads(run_cli(["show", "--json", str(ids[0])], s).stdout)
    assert ended["cores"] is None and "\n     cores  " not in run_cli(["show", str(ids[0])], s).stdout


def test_a_job_asking_all_the_cores_runs_on_them_and_one_asking_none_on_every_core(two_cores, tmp_path):
    s = two_cores.settings
    every = sorted(os.sched_getaffinity(0))
    whole = cli_submit(s, ["--cpus", "2", "-t", "5m", "--", "sh", "-c", REPORT], cwd=tmp_path)
    unbound = cli_submit(s, ["-t", "5m", "--", "sh", "-c", REPORT], cwd=tmp_path)
    for job_id in (whole, unbound):
        assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    assert _report(s, whole)["cores"] == every[:2] and _report(s, whole)["listed"] == "0-1"
    assert _report(s, unbound)["cores"] == every and _report(s, unbound)["listed"] is None


@pytest.mark.parametrize("model, gpu", [("a100", 0), ("h100", 1)])
def test_a_fraction_of_a_core_runs_on_the_whole_core_near_its_gpu(two_cores, tmp_path, model, gpu):
    s = two_cores.settings
    job_id = cli_submit(s, ["--cpus", "0.5", "--gpu-type", model, "-t", "5m", "--", "sh", "-c", f"{REPORT}; nproc"],
                        cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    report = _report(s, job_id)
    assert report["gpu"] == str(gpu) and report["cores"] == [NEAR[gpu]]
    lines = output_of(s, job_id).splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("{"))) + 1] == "1"  # nproc: the cores it may use
    deadline = time.monotonic() + 10
    while json.loads(core_binding.record_path(s, s.node).read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(core_binding.record_path(s, s.node).read_text()) == []


def test_an_allocations_shell_and_what_it_runs_are_on_the_cores_of_its_own(two_cores, tmp_path):
    s = two_cores.settings
    out = run_cli(["alloc", "--cpus", "1", "--gpu-type", "a100", "--", "sh", "-c", f"{REPORT}; nproc"], s, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    report = json.loads(next(x for x in lines if x.startswith("{")))
    # The worker put the shell's gate on GPU 0's core before it let it through: the shell and the
    # python it started inherit it.
    assert report["gpu"] == "0" and report["cores"] == [NEAR[0]], out.stdout
    # And told them, as a command is: the gate asked the server once its worker had chosen them.
    assert report["listed"] == str(NEAR[0]), out.stdout
    assert lines[lines.index(next(x for x in lines if x.startswith("{"))) + 1] == "1"


def test_a_process_that_widens_its_affinity_stays_on_its_jobs_cores_where_a_cpuset_holds_them(two_cores, tmp_path):
    if not _cpusets():
        pytest.skip("this machine lets a worker make no cpuset: a job's cores are its affinity alone")
    s = two_cores.settings
    job_id = cli_submit(s, ["--cpus", "1", "--gpu-type", "a100", "-t", "5m", "--", "sh", "-c", WIDEN], cwd=tmp_path)
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
    assert f"widened [{NEAR[0]}]" in output_of(s, job_id).splitlines(), output_of(s, job_id)
    # An allocation's shell: the gate was put in the cpuset before the shell started.
    out = run_cli(["alloc", "--cpus", "1", "--gpu-type", "h100", "--", "sh", "-c", WIDEN], s, cwd=tmp_path)
    assert out.returncode == 0 and f"widened [{NEAR[1]}]" in out.stdout.splitlines(), out
    # Both cpusets went with their jobs.
    prefixes = tuple(cgroup_prefix(s, worker) for worker in two_cores.workers)
    assert not [p for p in CGROUP_ROOT.joinpath("cpuset").rglob("gpuq-*") if p.name.startswith(prefixes)]


def test_a_preemptible_job_on_another_model_of_gpu_is_preempted_for_the_cores_a_waiting_job_needs(two_cores, tmp_path):
    """The H100's preemptible job holds both of the node's cores; a job asking for the free A100 and
    one core has it stopped for them, though it could never use its GPU."""
    s = two_cores.settings
    scavenger = cli_submit(s, ["--preemptible", "--no-requeue", "--gpu-type", "h100", "--cpus", "2", "-t", "5m", "--",
                               "sleep", "120"], cwd=tmp_path)
    assert wait_for_state(s, scavenger, (State.RUNNING,)) == State.RUNNING, two_cores.logs()
    urgent = cli_submit(s, ["--gpu-type", "a100", "--cpus", "1", "-t", "5m", "--", "sh", "-c", REPORT], cwd=tmp_path)
    try:
        assert wait_for_state(s, urgent, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, two_cores.logs()
        # --no-requeue: it ends cancelled, its failure the preemption.
        assert wait_for_state(s, scavenger, (State.CANCELLED,)) == State.CANCELLED, two_cores.logs()
    finally:
        run_cli(["cancel", str(scavenger)], s)
    with write_scope(s) as session:
        stopped = jobs.get_job(session, scavenger)
    assert (stopped.failure, stopped.reason.startswith(f"preempted by job {urgent} ")) == (c.FAILURE_PREEMPTED, True)
    assert _report(s, urgent)["gpu"] == "0" and _report(s, urgent)["cores"] == [NEAR[0]]
