"""Why a job failed, in one word (constants.FAILURES): from what a built-in workload raised, or
from how a command ended and what it printed last."""

from __future__ import annotations

import re

from gpuq.service import constants as c

# What CUDA, cuBLAS/cuDNN and PyTorch print when a device allocation fails.
_CUDA_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|"
                       r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation")


def from_exception(exc: BaseException) -> str:
    """A built-in workload's exception: CUDA out of memory (``torch.cuda.OutOfMemoryError``, or an
    older torch's RuntimeError with the message) or any other error."""
    if type(exc).__name__ == "OutOfMemoryError" or _CUDA_OOM.search(str(exc)):
        return c.FAILURE_CUDA_OOM
    return c.FAILURE_ERROR


def from_exit(exit_code: int | None, oom_killed: bool, output_tail: str) -> str:
    """A command that ended badly: killed by the OOM killer, out of CUDA memory (its last output
    says so), or simply a non-zero exit."""
    if oom_killed:
        return c.FAILURE_HOST_OOM
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
