"""NVIDIA's Xid errors, the driver's word for a GPU fault (the kernel log's "NVRM: Xid", NVML's
critical Xid events): which of them mean the GPU itself must be reset or repaired, and a watch over
one GPU's events that ``NvmlDevices.read`` looks at without waiting.

A hardware Xid leaves NVML's memory counters clean when it is not a memory error: an NVLink error,
the GPU's system processor (GSP) failing, its micro-controller halting. Those the counters already
tell (a row remap pending or failed, uncorrectable ECC errors: Xids 63, 64, 92, 94, 95) are judged
there (``NvmlDevices.health``); those a program's own bug raises (13, 31, 43, 45) are its own.
"""

from __future__ import annotations

from typing import Any

# Xid: what it is, and what the GPU needs (from NVIDIA's Xid catalogue).
HARDWARE: dict[int, tuple[str, str]] = {
    48: ("double-bit ECC error", "reset the GPU"),
    61: ("internal micro-controller breakpoint", "reset the GPU"),
    62: ("internal micro-controller halt", "reset the GPU"),
    74: ("NVLink error", "reset the GPU and check its NVLinks"),
    79: ("the GPU has fallen off the bus", "reboot the node"),
    119: ("GSP RPC timeout", "reset the GPU"),
    120: ("GSP error", "reset the GPU"),
    140: ("unrecovered ECC error", "reset the GPU"),
}
# The most events one look takes: a GPU throwing thousands cannot hold up a heartbeat.
MOST_A_LOOK = 64


def fault_of(xid: int) -> str | None:
    """The reason a GPU with this Xid takes no new job, or None for one that is not the GPU's. Its
    worker keeps it while it runs: a reset needs the GPU unused, so gpuq's worker stops first."""
    if xid not in HARDWARE:
        return None
    what, needs = HARDWARE[xid]
    return f"Xid {xid} ({what}): {needs} (`gpuq down` on its node first, `gpuq up` after)"


class XidWatch:
    """One GPU's critical Xid events through NVML's event set. The first hardware Xid is kept for
    as long as this process lives: nothing NVML reads says the GPU was reset since."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._events = nvml.nvmlEventSetCreate()
        nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        self.fault: str | None = None

    @classmethod
    def open(cls, nvml: Any, handle: Any) -> XidWatch | None:
        """A watch over the GPU's events, or None where NVML gives none (not supported on this GPU
        or driver, MIG, no right to them, an nvidia-ml-py without the calls)."""
        try:
            return cls(nvml, handle)
        except (nvml.NVMLError, AttributeError):
            return None

    def look(self) -> str | None:
        """The GPU's hardware fault as its events tell it, taking those waiting without waiting for
        more; None while it has had none."""
        n = self._nvml
        for _ in range(MOST_A_LOOK):
            try:
                event = n.nvmlEventSetWait_v2(self._events, 0)
            except n.NVMLError:  # NVML_ERROR_TIMEOUT: none waiting (any other error: none this look)
                break
            if self.fault is None:
                self.fault = fault_of(int(event.eventData))
        return self.fault
