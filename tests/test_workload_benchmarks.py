"""The benchmark workloads (device-info, matmul, norm-log, multi-matmul, copy) on the CPU."""

from __future__ import annotations

import importlib
import json
import threading
import time

import pytest
import torch

from gpuq.service.errors import JobCancelled
from gpuq.service.workloads import get_workload
from gpuq.workers.context import WorkloadContext

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(name: str, params: dict, gpus: int = 1) -> dict:
    """Validate ``params`` as gpuq submit would, then run the workload's entry on ``gpus`` CPUs."""
    w = get_workload(name)
    module, function = w.entry.split(":")
    lines: list[str] = []
    ctx = WorkloadContext(1, w.validate(params, gpus), [CPU] * gpus, log=lines.append)
    result = getattr(importlib.import_module(module), function)(ctx)
    assert lines, "a workload says what it does in the job's log"
    assert json.loads(json.dumps(result)) == result
    return result


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: see the GPU test below")
def test_device_info_on_a_cpu_node_says_it_fell_back_and_nvml_is_absent():
    result = run("device-info", {}, gpus=2)
    assert result["fell_back_to_cpu"] is True and result["cuda_available"] is False
    assert result["count"] == 2 and result["job_devices"] == ["cpu", "cpu"]
    assert result["nvml"]["available"] is False and result["nvml"]["reason"]
    assert result["driver_version"] is None
    assert result["devices"][0]["device"] == "cpu" and result["devices"][0]["total_mib"] > 0
    assert {"torch_version", "torch_cuda_version", "cuda_driver_version", "cuda_device_count"} <= set(result)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_info_on_a_gpu_reports_it_from_both_torch_and_nvml():
    w = get_workload("device-info")
    module, function = w.entry.split(":")
    lines: list[str] = []
    ctx = WorkloadContext(1, w.validate({}, 1), [torch.device("cuda", 0)], log=lines.append)
    result = getattr(importlib.import_module(module), function)(ctx)
    assert result["fell_back_to_cpu"] is False and result["cuda_available"] is True
    assert result["job_devices"] == ["cuda:0"] and result["cuda_device_count"] >= 1
    assert result["nvml"]["available"] is True and result["driver_version"]
    assert torch.cuda.get_device_name(0) in json.dumps(result)


def test_matmul_reports_its_speed_and_the_cpu_baseline():
    result = run("matmul", {"size": 32, "repeat": 4, "warmup": 1, "cpu_baseline": True})
    assert {"device", "seconds", "gflops", "tflops", "cpu_seconds", "speedup_vs_cpu"} <= set(result)
    assert result["gflops"] > 0


def test_norm_log_times_both_ways_of_logging_and_they_log_the_same_norms():
    result = run("norm-log", {"steps": 100, "size": 16, "warmup": 2})
    assert {"device", "steps", "size", "seconds_item", "seconds_on_device", "ratio", "norms_match",
            "last_norm", "simulated"} <= set(result)
    assert result["norms_match"] is True and result["steps"] == 100
    assert result["seconds_item"] > 0 and result["seconds_on_device"] > 0
    assert result["last_norm"] > 0


def test_multi_matmul_runs_on_two_simulated_gpus_and_says_the_figure_is_meaningless():
    result = run("multi-matmul", {"size": 64, "repeat": 3, "warmup": 1}, gpus=2)
    assert {"devices", "seconds_one_device", "seconds_two_devices", "scaling", "simulated",
            "note"} <= set(result)
    assert result["simulated"] is True and result["scaling"] > 0


def test_copy_measures_memcpy_on_the_cpu_and_says_so():
    result = run("copy", {"mib": 1, "repeat": 2, "warmup": 1})
    assert result["host_to_device_gbps"] > 0 and result["device_to_host_gbps"] > 0
    assert result["device_to_device_gbps"] > 0 and result["device_to_device"] == "cpu -> cpu"
    assert result["pinned"] is False and result["simulated"] is True and "memcpy" in result["note"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, params, gpus", [
    ("matmul", {"size": 256, "repeat": 1_000_000, "warmup": 0}, 1),
    ("norm-log", {"steps": 10_000_000, "size": 32, "warmup": 0}, 1),
    ("multi-matmul", {"size": 256, "repeat": 100_000, "warmup": 0}, 2),
    ("copy", {"mib": 8, "repeat": 10_000, "warmup": 0}, 2),
])
def test_cancel_stops_a_long_benchmark_quickly(name, params, gpus):
    w = get_workload(name)
    module, function = w.entry.split(":")
    ctx = WorkloadContext(1, w.validate(params, gpus), [CPU] * gpus, log=lambda line: None)
    threading.Timer(0.5, ctx.cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(JobCancelled):
        getattr(importlib.import_module(module), function)(ctx)
    assert time.monotonic() - started < 10
