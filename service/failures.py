"""Why a job failed, in one word (constants.FAILURES): from what a built-in workload raised, or
from how a command ended and what it printed last. (A failure its GPU's health explains is
judged on the worker, which reads the GPU: workers/gpu_fault.py.)"""

from __future__ import annotations

import re

from gpuq.service import constants as c

# What CUDA, cuBLAS/cuDNN and PyTorch print when a device allocation fails.
_CUDA_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|"
                       r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation")
# What CUDA and NVML say when the GPU itself failed under a program: an uncorrectable ECC error
# (Xid 48, 94, 95), an uncorrectable NVLink error (Xid 74), a GPU gone (Xid 79). CUDA's messages
# and their enum names both, as PyTorch, NCCL and a C program print one or the other. Not what a
# program's own bug brings (an illegal address, Xid 13 and 31): that is its own failure.
_GPU_FAULT = re.compile(r"uncorrectable ECC error encountered|uncorrectable NVLink error|"
                        r"CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable|CUDA_ERROR_NVLINK_UNCORRECTABLE|"
                        r"cudaErrorNvlinkUncorrectable|CUDA_ERROR_CONTAINED|cudaErrorContained|GPU is lost|"
                        r"fallen off the bus")


def from_exception(exc: BaseException) -> str:
    """A built-in workload's exception: a GPU hardware error (CUDA's message for it), CUDA out of
    memory (``torch.cuda.OutOfMemoryError``, or an older torch's RuntimeError with the message) or
    any other error."""
    if _GPU_FAULT.search(str(exc)):
        return c.FAILURE_GPU_ERROR
    if type(exc).__name__ == "OutOfMemoryError" or _CUDA_OOM.search(str(exc)):
        return c.FAILURE_CUDA_OOM
    return c.FAILURE_ERROR


def from_exit(exit_code: int | None, oom_killed: bool, output_tail: str) -> str:
    """A command that ended badly: killed by the OOM killer, its GPU failed under it or out of
    CUDA memory (its last output says so), or simply a non-zero exit. Its output alone never
    drains a GPU (any program may print those words); NVML's readings do (workers/gpu_fault.py)."""
    if oom_killed:
        return c.FAILURE_HOST_OOM
    if _GPU_FAULT.search(output_tail):
        return c.FAILURE_GPU_ERROR
    if _CUDA_OOM.search(output_tail):
        return c.FAILURE_CUDA_OOM
    return c.FAILURE_EXIT


def explain(failure: str, exit_code: int | None, limit_mib: int | None = None,
            held_mib: int | None = None) -> str:
    """The sentence that goes with a command's failure class. ``held_mib``: the worker, not the
    kernel, stopped the job, holding that much past its limit (no memory cgroup on its node)."""
    if failure == c.FAILURE_HOST_OOM:
        if held_mib is not None:
            return f"out of host memory: stopped by gpuq holding {held_mib} MiB, past its limit of {limit_mib} MiB"
        limit = f" (its limit: {limit_mib} MiB)" if limit_mib else ""
        return f"out of host memory: killed by the kernel's OOM killer{limit}"
    if failure == c.FAILURE_CUDA_OOM:
        return f"CUDA out of memory ({exit_reason(exit_code)})"
    if failure == c.FAILURE_GPU_ERROR:
        return f"a GPU hardware error, as CUDA reported it in its output ({exit_reason(exit_code)})"
    return exit_reason(exit_code)


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exited with status {code}"


def signal_name(signum: int) -> str:
    """SIGKILL for 9; "signal N" for a number no signal has."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
