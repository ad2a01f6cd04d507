"""The GPUs of this node, behind one small interface: NVML on a GPU machine, simulated elsewhere.

A metric a device cannot report is ``None`` ("not available"), never an exception; only opening
the devices can fail, and "no NVIDIA library or driver here" means "no GPUs", not a crash.
"""

from __future__ import annotations

import os
import re
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpuq.service.core_sets import from_mask, parse_list
from gpuq.service.errors import ConfigError, InvalidSpec
from gpuq.service.settings import Settings
from gpuq.service.xids import XidWatch

if TYPE_CHECKING:
    from gpuq.service.simulated_memory import SimulatedMemory


@dataclass(frozen=True)
class GpuInfo:
    """What does not change while a GPU is up."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    simulated: bool = False
    # The CPU cores near it (its NUMA node's, as NVML's CPU affinity gives them), which a job bound
    # to cores takes first (service/core_sets.py); empty: not known.
    cores: frozenset[int] = frozenset()


# NVIDIA MPS's server: the driver's own process where an MPS daemon runs (workers/mps.py), which
# stays up between its clients. Its memory (66 MiB on the lent H100) is no other program's use: as
# foreign memory it kept every whole-GPU job that gave no --mem waiting, for ever.
MPS_SERVER = "nvidia-cuda-mps-server"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU; ``gpuq`` says whether it is the worker's or its job's."""

    pid: int
    memory_mib: int | None = None
    name: str | None = None
    gpuq: bool = False
    user: str | None = None

    @property
    def foreign(self) -> bool:
        """Another program's use of the GPU: neither gpuq's nor MPS's server."""
        return not self.gpuq and self.name != MPS_SERVER


@dataclass(frozen=True)
class GpuReading:
    """One reading of a GPU's state; None where the device cannot tell."""

    memory_used_mib: int | None = None
    utilization: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    memory_utilization: int | None = None
    memory_total_mib: int | None = None
    sm_clock_mhz: int | None = None
    # The GPU's energy counter (mJ since the driver loaded); None on GPUs without one (pre-Volta).
    energy_mj: int | None = None
    processes: tuple[GpuProcess, ...] | None = None
    # Why the GPU is gone (NVML's GPU_IS_LOST or RESET_REQUIRED); None while it works.
    lost: str | None = None
    # Why the GPU should take no new job until it is reset or repaired, by its memory's health
    # (``NvmlDevices.health``) or a hardware Xid (service/xids.py); None while it is healthy or
    # cannot tell. Unlike a lost GPU, it still runs the job it has.
    unhealthy: str | None = None


class Devices(Protocol):
    """The GPUs of this node."""

    kind: str  # "nvml", "simulated" or "none"
    why_none: str  # when there are no GPUs, why

    def list(self) -> list[GpuInfo]: ...

    def read(self, index: int) -> GpuReading: ...


class NoDevices:
    """A node with no GPU gpuq can use."""

    kind = "none"

    def __init__(self, why: str) -> None:
        self.why_none = why

    def list(self) -> list[GpuInfo]:
        return []

    def read(self, index: int) -> GpuReading:
        return GpuReading()


class SimulatedDevices:
    """``count`` fake GPUs for laptops, CI and demos; the torch work of their jobs runs on the CPU.

    Their readings come from the worker (``read`` returns what the worker last measured of its
    job's processes), so a busy simulated GPU shows real load. Processes that declare simulated GPU
    memory in ``memory`` (service/simulated_memory.py) are in its per-process list, as NVML's.
    """

    kind = "simulated"
    why_none = ""

    def __init__(self, count: int, memory_mib: int, node: str, foreign: str = "",
                 faults: Path | None = None, memory: SimulatedMemory | None = None, names: str = "",
                 cores: str = "") -> None:
        self._foreign = parse_foreign(foreign)
        self._memory = memory
        # A file ``<faults>/<node>.<index>.lost`` makes that GPU read as lost, the way NVML reports
        # one that fell off the bus, and ``<node>.<index>.unhealthy`` as unhealthy (its first line
        # the reason, as NVML's counters would give one): tests and drills inject the faults
        # without a broken GPU.
        self._node, self._faults = node, faults
        self._gpus = [
            GpuInfo(index=i, uuid=f"GPU-sim-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{node}/{i}')}",
                    name=name, memory_total_mib=memory_mib, simulated=True, cores=near)
            for i, (name, near) in enumerate(zip(parse_names(names, count), parse_cores(cores, count), strict=True))
        ]

    def list(self) -> list[GpuInfo]:
        return list(self._gpus)

    def read(self, index: int) -> GpuReading:
        """Only its per-process list (the foreign processes it was told to show, and those that
        declared simulated memory on it) and whether it was told it is lost or unhealthy; the
        worker's probe measures the rest."""
        lost = unhealthy = None
        if self._faults is not None:
            if (self._faults / f"{self._node}.{index}.lost").exists():
                lost = "simulated GPU marked lost"
            unhealthy = _marked_unhealthy(self._faults / f"{self._node}.{index}.unhealthy")
        declared = self._memory.processes(index) if self._memory is not None else ()
        return GpuReading(processes=(*self._foreign.get(index, ()), *declared), lost=lost, unhealthy=unhealthy)


def _marked_unhealthy(path: Path) -> str | None:
    """A simulated GPU's health fault: its file's first line (or a word that it is marked), None
    without the file."""
    try:
        said = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return None
    except OSError:
        said = []
    return (said[0].strip()[:200] if said and said[0].strip() else "") or "simulated GPU marked unhealthy"


SIMULATED_NAME = "Simulated GPU"
# A model name as NVML gives one: letters, digits, spaces and - _ . ( ) /, up to its 96 bytes.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/-]{0,95}")


def parse_names(text: str, count: int) -> list[str]:
    """``count`` simulated GPUs' names from ``"NVIDIA A100-SXM4-80GB,NVIDIA GeForce RTX 3090"``:
    by index, the last naming the rest; ConfigError for one NVML could not have given."""
    names = [t.strip() for t in text.split(",")] if text.strip() else [SIMULATED_NAME]
    for name in names:
        if not _MODEL_NAME.fullmatch(name):
            raise ConfigError(f"fake_gpu_names takes model names separated by commas (letters, digits, spaces, "
                              f"- _ . ( ) /; up to 96 each); got {name[:100]!r}")
    return [names[min(i, len(names) - 1)] for i in range(count)]


def parse_cores(text: str, count: int) -> list[frozenset[int]]:
    """``count`` simulated GPUs' near CPU cores from ``"0-15 16-31"``: a list for each GPU by index,
    separated by spaces (those past the lists: none known); ConfigError for a list that is not one."""
    lists = text.split()
    try:
        parsed = [parse_list(item) for item in lists]
    except InvalidSpec as exc:
        raise ConfigError(f"fake_gpu_cores takes a list of CPU cores for each GPU, separated by spaces "
                          f"(as 0-15 16-31): {exc}") from None
    return [parsed[i] if i < len(parsed) else frozenset() for i in range(count)]


def parse_foreign(text: str) -> dict[int, list[GpuProcess]]:
    """``"1:12000:4242:bob,..."``: on simulated GPU 1, pid 4242 of bob holds 12000 MiB."""
    out: dict[int, list[GpuProcess]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            index, mib, pid, user = item.split(":")
            out.setdefault(int(index), []).append(
                GpuProcess(pid=int(pid), memory_mib=int(mib), name="simulated", user=user))
        except ValueError:
            raise ConfigError(f"fake_gpu_foreign takes GPU:MIB:PID:USER[,...]; got {item!r}") from None
    return out


class NvmlDevices:
    """The NVIDIA GPUs of this node through NVML (nvidia-ml-py), numbered in PCI bus order."""

    kind = "nvml"
    why_none = ""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        # Each GPU's Xid events (service/xids.py), watched from its first reading on; None: NVML gives none.
        self._xids: dict[int, XidWatch | None] = {}

    def _handle(self, index: int) -> Any:
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def list(self) -> list[GpuInfo]:
        n = self._nvml
        out = []
        for i in range(n.nvmlDeviceGetCount()):
            h = self._handle(i)
            name = n.nvmlDeviceGetName(h)
            uuid = n.nvmlDeviceGetUUID(h)
            out.append(GpuInfo(
                index=i,
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                name=name.decode() if isinstance(name, bytes) else name,
                memory_total_mib=n.nvmlDeviceGetMemoryInfo(h).total // 2**20,
                cores=self._cores(h),
            ))
        return out

    def _cores(self, handle: Any) -> frozenset[int]:
        """The CPU cores near the GPU (NVML's CPU affinity, a mask of 64-bit words); empty where NVML
        cannot tell (a GPU with no NUMA affinity reported, an older driver)."""
        words = _na(lambda: self._nvml.nvmlDeviceGetCpuAffinity(handle, -(-(os.cpu_count() or 1) // 64)), self._nvml)
        return from_mask(words) if words is not None else frozenset()

    def read(self, index: int) -> GpuReading:
        n = self._nvml
        try:
            h = self._handle(index)
        except n.NVMLError:
            return GpuReading()
        try:
            memory = n.nvmlDeviceGetMemoryInfo(h)
        except n.NVMLError as exc:
            if exc.value in (n.NVML_ERROR_GPU_IS_LOST, n.NVML_ERROR_RESET_REQUIRED):
                return GpuReading(lost=f"NVML: {exc}")
            memory = None
        rates = _na(lambda: n.nvmlDeviceGetUtilizationRates(h), n)
        return GpuReading(
            memory_used_mib=None if memory is None else memory.used // 2**20,
            memory_total_mib=None if memory is None else memory.total // 2**20,
            utilization=None if rates is None else rates.gpu,
            memory_utilization=None if rates is None else rates.memory,
            temperature_c=_na(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU), n),
            power_w=_na(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0, n),
            sm_clock_mhz=_na(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM), n),
            energy_mj=_na(lambda: n.nvmlDeviceGetTotalEnergyConsumption(h), n),
            processes=self._processes(h),
            unhealthy=self.health(h) or self.xid_fault(index, h),
        )

    def health(self, h: Any) -> str | None:
        """Why the GPU needs a reset or a repair before it takes new work, from NVML's memory
        counters, as DCGM's health watches and NVIDIA's memory error guidance judge them: a failed
        row remap (repair), a row remap or page retirement pending (they take effect at the next
        reset), uncorrectable ECC errors since the driver loaded. None where all is well, or where
        the GPU keeps no such counter (no ECC; no row remapping before Ampere)."""
        n = self._nvml
        rows = _na(lambda: n.nvmlDeviceGetRemappedRows(h), n)
        if rows is not None:
            _, uncorrectable_rows, pending, failed = rows
            if failed:
                return "row remapping failed: memory errors it can no longer set aside (repair the GPU)"
            if pending:
                return (f"row remapping pending ({uncorrectable_rows} rows for uncorrectable errors): reset the "
                        "GPU (nvidia-smi -r)")
        if _na(lambda: n.nvmlDeviceGetRetiredPagesPendingStatus(h), n) == n.NVML_FEATURE_ENABLED:
            return "retired pages pending: reset the GPU (nvidia-smi -r)"
        errors = _na(lambda: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                           n.NVML_VOLATILE_ECC), n)
        if errors:
            return (f"{errors} uncorrectable ECC error{'s' if errors != 1 else ''} since the driver loaded: reset "
                    "the GPU (nvidia-smi -r)")
        return None

    def xid_fault(self, index: int, h: Any) -> str | None:
        """Why GPU ``index`` needs a reset by its Xid events since this process first read it (a
        hardware one: service/xids.py); None while it has had none, or where NVML gives none."""
        if index not in self._xids:
            self._xids[index] = XidWatch.open(self._nvml, h)
        watch = self._xids[index]
        return watch.look() if watch is not None else None

    def _processes(self, h: Any) -> tuple[GpuProcess, ...] | None:
        n = self._nvml
        compute = _na(lambda: n.nvmlDeviceGetComputeRunningProcesses(h), n)
        graphics = _na(lambda: n.nvmlDeviceGetGraphicsRunningProcesses(h), n)
        if compute is None and graphics is None:
            return None
        seen: dict[int, GpuProcess] = {}
        for p in [*(compute or []), *(graphics or [])]:
            used = getattr(p, "usedGpuMemory", None)
            # NVML reports "not available" memory as None or as a huge sentinel value.
            mib = used // 2**20 if isinstance(used, int) and used < 2**60 else None
            seen.setdefault(p.pid, GpuProcess(pid=p.pid, memory_mib=mib))
        return tuple(seen.values())


def _na(read: Callable[[], Any], nvml: Any) -> Any:
    try:
        return read()
    except (nvml.NVMLError, AttributeError):
        # AttributeError: an older nvidia-ml-py without that call is "not available" too.
        return None


def open_devices(settings: Settings) -> Devices:
    """This node's GPUs: simulated when ``fake_gpus`` is set, else NVML, else none (with why)."""
    if settings.fake_gpus:
        from gpuq.service.simulated_memory import SimulatedMemory, memory_dir  # it imports this module

        return SimulatedDevices(settings.fake_gpus, settings.fake_gpu_memory_mib, settings.node,
                                settings.fake_gpu_foreign, settings.home / "simulated-faults",
                                SimulatedMemory.open(memory_dir(settings)), settings.fake_gpu_names,
                                settings.fake_gpu_cores)
    try:
        import pynvml
    except ImportError:
        return NoDevices("nvidia-ml-py is not installed")
    try:
        return NvmlDevices()
    except pynvml.NVMLError as exc:
        # NVMLError_LibraryNotFound / DriverNotLoaded / NoPermission: no NVIDIA GPU we can use here.
        return NoDevices(f"NVML: {exc}")
