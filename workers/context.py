"""What a built-in workload is handed when it runs: its parameters, devices, and ways to report."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuq.service.errors import JobCancelled
from gpuq.workers.owner_files import OwnerFiles


@dataclass
class WorkloadContext:
    """The running job as a workload sees it.

    ``devices`` are the torch devices of the job's GPUs in rank order, or ``[cpu]`` when the node
    has no CUDA (the seeds' ``try_gpu()`` fallback). A workload calls ``check_cancelled()`` between
    steps so that `gpuq cancel` stops it within one step.
    """

    job_id: int
    params: dict[str, Any]
    devices: list[Any]
    log: Callable[[str], None] = print
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_metric: Callable[[dict[str, Any]], None] | None = None
    # The paths a user names (a checkpoint, a data directory) are opened through this, with the
    # job owner's rights: the worker may be root.
    files: OwnerFiles = field(default_factory=OwnerFiles)

    @property
    def device(self) -> Any:
        """The job's first device."""
        return self.devices[0]

    def check_cancelled(self) -> None:
        """Raise JobCancelled if the job was cancelled."""
        if self.cancelled.is_set():
            raise JobCancelled(f"job {self.job_id} cancelled")

    def metric(self, **values: Any) -> None:
        """Record one row of progress (an epoch's loss and accuracy, say) while the job runs."""
        if self.on_metric is not None:
            self.on_metric(values)
