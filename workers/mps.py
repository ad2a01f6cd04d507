"""NVIDIA MPS on a node: where an MPS control daemon runs, a shared job's CUDA allocations beyond
its share are refused by the driver itself (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), on top of the
worker's watchdog, which stops a job only after it went over.

MPS runs one server per user at a time on a GPU: while one user's jobs use it, another user's
client waits until that server exits. So on a GPU shared by several users' jobs, MPS serialises
them rather than running them side by side; gpuq leaves MPS to the admins (enable it on GPUs
where one user's small jobs share, e.g. a user's own stack), and only sets the limit when the
daemon's control pipe is there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# The default pipe directory of `nvidia-cuda-mps-control -d`; CUDA_MPS_PIPE_DIRECTORY moves it.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def running(pipe_directory: str | None = None) -> bool:
    """Whether an MPS control daemon listens here: its ``control`` exists, a named pipe in older
    drivers and a Unix socket in newer ones (driver 580 on the lent H100)."""
    directory = Path(pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)
    try:
        mode = (directory / "control").stat().st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:
        return False


def memory_limit_env(gpus: int, share_mib: int) -> dict[str, str]:
    """The variable that pins a client's device memory on each of its ``gpus`` visible GPUs (CUDA
    numbers them 0.. in the order CUDA_VISIBLE_DEVICES lists them) to ``share_mib``."""
    return {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{i}={share_mib}M" for i in range(gpus))}
