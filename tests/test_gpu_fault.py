"""A failure its GPU explains is the GPU's: CUDA's words for a hardware error in a job's output, or
NVML reading one of its GPUs lost or newly unhealthy as the job ends (workers/gpu_fault.py). The
whole path, on a real stack, is in test_faults.py."""

import pytest

from gpuq.service import constants as c
from gpuq.service import failures
from gpuq.service.constants import State
from gpuq.service.devices import SimulatedDevices
from gpuq.service.settings import Settings
from gpuq.workers.gpu_fault import blamed_on_gpu, fault_under
from gpuq.workers.job import JobRun
from gpuq.workers.state import WorkerState

pytestmark = pytest.mark.timeout(30)

ROWS = "row remapping pending (1 rows for uncorrectable errors): reset the GPU (nvidia-smi -r)"


@pytest.mark.parametrize("said", [
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "NCCL WARN Cuda failure 'uncorrectable NVLink error detected during the execution'",
    "CUDA_ERROR_ECC_UNCORRECTABLE", "cudaErrorContained",
    "Unable to determine the device handle for GPU0000:41:00.0: GPU is lost. Reboot the system",
])
def test_cudas_words_for_a_hardware_error_in_a_commands_output_make_its_failure_a_gpu_error(said):
    tail = f"epoch 3\n{said}\nTraceback ...\n"
    assert failures.from_exit(1, False, tail) == c.FAILURE_GPU_ERROR
    assert failures.explain(c.FAILURE_GPU_ERROR, 1).endswith("(exited with status 1)")
    assert failures.from_exception(RuntimeError(said)) == c.FAILURE_GPU_ERROR


def test_a_programs_own_cuda_errors_and_an_oom_kill_stay_its_own():
    assert failures.from_exit(1, False, "CUDA error: an illegal memory access was encountered") == c.FAILURE_EXIT
    assert failures.from_exit(1, False, "CUDA error: out of memory") == c.FAILURE_CUDA_OOM
    # The kernel's OOM kill is what ended it, whatever it printed before.
    assert failures.from_exit(-9, True, "uncorrectable ECC error encountered") == c.FAILURE_HOST_OOM
    assert failures.from_exception(ValueError("bad batch")) == c.FAILURE_ERROR


def test_a_gpu_error_is_requeued_as_the_machinerys_failures_are():
    assert c.FAILURE_GPU_ERROR in c.INFRA_FAILURES and c.FAILURE_GPU_ERROR in c.FAILURES


@pytest.fixture
def node(tmp_path):
    """A worker of GPU 0 on a node of two simulated GPUs whose faults are marked in ``faults``."""
    faults = tmp_path / "faults"
    faults.mkdir()
    state = WorkerState(settings=Settings(home=tmp_path), node="n1", gpu_index=0, gpu_id=1, name="gpu0@n1",
                        devices=SimulatedDevices(2, 1024, "n1", faults=faults))
    return state, faults


def a_job(*indices: int) -> JobRun:
    return JobRun(id=7, name="train", kind=c.KIND_COMMAND, workload=None, params={}, argv=["python", "train.py"],
                  cwd="/tmp", gpu_indices=indices, gpu_queues=tuple(f"q{i}" for i in indices))


FAILED = {"state": State.FAILED, "failure": c.FAILURE_EXIT, "exit_code": 1, "reason": "exited with status 1"}


def test_a_job_that_failed_as_its_gpu_went_unhealthy_is_the_gpus_failure_with_both_reasons(node):
    state, faults = node
    (faults / "n1.0.unhealthy").write_text(ROWS + "\n")
    fault = fault_under(state, a_job(0), FAILED, health_at_start=None)
    assert fault is not None and (fault.index, fault.unhealthy, fault.lost) == (0, ROWS, None)
    assert fault.drain_reason == f"GPU unhealthy: {ROWS}"
    end = blamed_on_gpu(state, a_job(0), FAILED, fault)
    assert end["failure"] == c.FAILURE_GPU_ERROR and end["exit_code"] == 1 and end["state"] == State.FAILED
    assert end["reason"] == (f"GPU error: gpu 0 on n1 went unhealthy while it ran ({ROWS}); "
                             "the job's own end: exited with status 1")


def test_a_gpu_unhealthy_for_the_same_reason_when_the_job_started_explains_nothing_new(node):
    state, faults = node
    (faults / "n1.0.unhealthy").write_text(ROWS)
    assert fault_under(state, a_job(0), FAILED, health_at_start=ROWS) is None
    # Its counters moved on while the job ran: a new fault.
    more = ROWS.replace("(1 rows", "(2 rows")
    (faults / "n1.0.unhealthy").write_text(more)
    assert fault_under(state, a_job(0), FAILED, health_at_start=ROWS).unhealthy == more


def test_a_jobs_other_gpu_gone_or_unhealthy_is_blamed_and_a_lost_one_is_gpu_lost(node):
    state, faults = node
    (faults / "n1.1.lost").touch()
    fault = fault_under(state, a_job(0, 1), FAILED, health_at_start=None)
    assert (fault.index, fault.lost) == (1, "simulated GPU marked lost")
    assert fault.drain_reason == "GPU lost: simulated GPU marked lost"
    assert blamed_on_gpu(state, a_job(0, 1), FAILED, fault)["failure"] == c.FAILURE_GPU_LOST
    (faults / "n1.1.lost").unlink()
    (faults / "n1.1.unhealthy").write_text(ROWS)
    assert fault_under(state, a_job(0, 1), FAILED, health_at_start=None).index == 1
    assert fault_under(state, a_job(0), FAILED, health_at_start=None) is None  # not this job's GPU


@pytest.mark.parametrize("end", [
    {"state": State.SUCCEEDED, "exit_code": 0},
    {"state": State.CANCELLED, "failure": c.FAILURE_CANCELLED, "reason": "cancelled by user"},
    {"state": State.TIMED_OUT, "failure": c.FAILURE_TIMEOUT, "reason": "time limit of 0:01:00 reached"},
    {"state": State.FAILED, "failure": c.FAILURE_CUDA_OOM, "exit_code": 1, "reason": "CUDA out of memory"},
    {"state": State.FAILED, "failure": c.FAILURE_HOST_OOM, "exit_code": -9, "reason": "out of host memory"},
])
def test_an_end_a_gpu_fault_cannot_explain_is_left_as_it_is(node, end):
    state, faults = node
    (faults / "n1.0.unhealthy").write_text(ROWS)
    assert fault_under(state, a_job(0), end, health_at_start=None) is None


def test_a_gpu_that_reads_healthy_blames_nothing(node):
    state, _ = node
    assert fault_under(state, a_job(0, 1), FAILED, health_at_start=None) is None
