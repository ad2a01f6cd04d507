"""The share watchdog: whether a shared job keeps to its GPU memory share.

Each look sums, on each of the job's GPUs, the memory of the job's processes in that GPU's
per-process list (NVML's ``nvmlDeviceGetComputeRunningProcesses``, or the simulated GPU's same
list). A job over its share on a GPU for the grace period or longer is to be stopped: a CUDA
context and a caching allocator may overshoot for a moment without the job being at fault.
Pure logic: the caller polls ``look`` at each sample and stops the job (failure class
``gpu_mem_exceeded``) when it returns a reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpuq.service.devices import GpuProcess

# What a job's GPUs' per-process lists are: by GPU index, None where the GPU cannot tell now.
Readings = Mapping[int, tuple[GpuProcess, ...] | None]


class ShareWatch:
    """Watches one job held to ``share_mib`` MiB on each of its GPUs.

    ``owns(pid)`` says whether a process in a GPU's list is one of the job's (asked of the few
    processes on its GPUs, not of every process of the machine: a look stays cheap on a node of
    hundreds); ``readings()`` gives the per-process lists of its GPUs.
    A reading of None (not available) is no evidence either way: it neither stops the job nor
    ends a stretch over the share; a process whose memory the GPU cannot tell counts as none.
    """

    def __init__(self, share_mib: int, grace_s: float, owns: Callable[[int], bool],
                 readings: Callable[[], Readings]) -> None:
        self.share_mib, self.grace_s = share_mib, grace_s
        self._owns, self._readings = owns, readings
        # By GPU: when the job went over its share there, and the most it has used since.
        self._over: dict[int, tuple[float, int]] = {}
        self._reason: str | None = None
        # The most the job's processes held on any one of its GPUs, MiB (for its usage summary),
        # and what they held at the last look (for `gpuq status`).
        self.peak_mib: int | None = None
        self.used_mib: int | None = None

    def look(self, now: float) -> str | None:
        """Why the job must stop (e.g. "used 7.9 GiB of its 3.0 GiB share on GPU 1"), once it has
        been over its share on some GPU for the grace or longer; else None. ``now`` is a monotonic
        clock's. Once it gave a reason it keeps giving it."""
        if self._reason is not None:
            return self._reason
        owned: dict[int, bool] = {}  # by pid, asked once a look (a process may be on several GPUs)

        def ours(pid: int) -> bool:
            if pid not in owned:
                owned[pid] = self._owns(pid)
            return owned[pid]

        latest: int | None = None
        for index, processes in sorted(self._readings().items()):
            if processes is None:
                continue
            used = sum(p.memory_mib or 0 for p in processes if ours(p.pid))
            self.peak_mib = max(self.peak_mib or 0, used)
            latest = self.used_mib = max(latest or 0, used)
            if used <= self.share_mib:
                self._over.pop(index, None)  # back under: the next stretch over starts its grace anew
                continue
            since, most = self._over.get(index, (now, used))
            most = max(most, used)
            self._over[index] = (since, most)
            if now - since >= self.grace_s:
                held, share = _figures(most, self.share_mib)
                self._reason = f"used {held} of its {share} share on GPU {index}"
                return self._reason
        return None


def _figures(used_mib: int, share_mib: int) -> tuple[str, str]:
    """Both in GiB to a tenth, or in MiB where a tenth of a GiB cannot tell them apart."""
    used, share = f"{used_mib / 1024:.1f}", f"{share_mib / 1024:.1f}"
    if used == share:
        return f"{used_mib} MiB", f"{share_mib} MiB"
    return f"{used} GiB", f"{share} GiB"
