"""What the node says about the job's devices: NVML (what nvidia-smi shows) and torch.cuda.

Missing pieces are values, not crashes: a node without the NVIDIA driver reports NVML as not
available with the reason, and a node without CUDA reports that the job fell back to the CPU.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from gpuq.workers.context import WorkloadContext

MIB = 2**20


def nvml_report() -> dict[str, Any]:
    """Driver, CUDA driver version and every GPU NVML sees; ``available: False`` and why, if none."""
    try:
        import pynvml
    except ImportError as e:
        return {"available": False, "reason": f"pynvml is not installed ({e})"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        # NVMLError_LibraryNotFound / DriverNotLoaded: this node has no NVIDIA GPU to offer.
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append({"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)),
                         "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                         "total_mib": mem.total // MIB, "used_mib": mem.used // MIB,
                         "free_mib": mem.free // MIB})
        return {"available": True, "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}", "gpus": gpus}
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    finally:
        pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cuda_device(device: torch.device) -> dict[str, Any]:
    """One CUDA device as torch sees it: name, memory, compute capability, UUID."""
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    uuid = str(getattr(props, "uuid", "") or "")
    return {"device": str(device), "name": props.name, "total_mib": total // MIB,
            "free_mib": free // MIB, "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "uuid": ("GPU-" + uuid) if uuid and not uuid.startswith("GPU-") else uuid}


def cpu_device() -> dict[str, Any]:
    """The CPU standing in for the job's GPUs: its name, cores, torch threads and memory."""
    import psutil

    memory = psutil.virtual_memory()
    return {"device": "cpu", "name": _cpu_name(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "total_mib": memory.total // MIB, "free_mib": memory.available // MIB}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(ctx: WorkloadContext) -> dict[str, Any]:
    devices = list(ctx.devices)
    cuda = torch.cuda.is_available()
    nvml = nvml_report()
    if cuda:
        described = [cuda_device(d) for d in devices if d.type == "cuda"]
        job_uuids = {d["uuid"] for d in described}
        for gpu in nvml.get("gpus", []):
            gpu["in_job"] = gpu["uuid"] in job_uuids
    else:
        described = [cpu_device()]
    result = {
        "job_devices": [str(d) for d in devices],
        "count": len(devices),
        "cuda_available": cuda,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "fell_back_to_cpu": all(d.type == "cpu" for d in devices),
        "devices": described,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "driver_version": nvml.get("driver_version"),
        "cuda_driver_version": nvml.get("cuda_driver_version"),
        "nvml": nvml,
    }
    if result["fell_back_to_cpu"]:
        ctx.log(f"device-info: no CUDA here ({nvml.get('reason', 'torch sees no GPU')}); "
                f"{len(devices)} simulated GPU(s) on the cpu")
    else:
        for d in described:
            ctx.log(f"device-info: {d['device']} {d['name']}, {d['free_mib']}/{d['total_mib']} MiB "
                    f"free, compute {d['compute_capability']}")
        ctx.log(f"device-info: driver {result['driver_version']}, CUDA driver "
                f"{result['cuda_driver_version']}, torch CUDA {result['torch_cuda_version']}")
    return result
