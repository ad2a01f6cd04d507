"""scripts/gpu_check.py, the check to run on a new GPU node, passes every check here (on one
simulated GPU where there is no NVIDIA GPU) and leaves no process or file behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import venv_reachable_by_everyone

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
CHECKS = {"up", "devices", "health", "workloads", "command", "cores", "shared", "watchdog", "detached", "other-user",
          "run-alloc", "stats", "gpu-type", "mps"}


def test_the_gpu_check_passes_every_check_and_leaves_nothing_behind(tmp_path):
    if os.geteuid() == 0:
        venv_reachable_by_everyone()  # the other user's job runs this venv's gpuq and python
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {r["check"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    assert set(results) == CHECKS
    skipped = {"mps", "health"} | ({"other-user"} if os.geteuid() != 0 else set())  # MPS, NVML: NVIDIA's only
    assert {k for k, r in results.items() if r["verdict"] != "PASS"} == skipped, done.stdout
    assert "gpu_mem_exceeded" in results["watchdog"]["detail"]
    assert "gpu_mem_exceeded" in results["detached"]["detail"] and "gone" in results["detached"]["detail"]
    assert "TFLOP/s" in results["workloads"]["detail"] and "gpuq_gpu_up" in results["stats"]["detail"]
    assert re.match(r"--cpus 1 on core \d+ \(GPUQ_CORES \d+\) of GPU 0; no NVML", results["cores"]["detail"])
    assert "--gpu-type simulated on 'Simulated GPU': succeeded; --gpu-type zz9: exit 2" in results["gpu-type"]["detail"]
    worker_log = (tmp_path / "out" / "logs" / "worker-gpu0.log").read_text()
    assert "superuser privileges" not in worker_log  # a root worker is root by design: no warning
    base = re.search(r"stack in (/tmp/gpuq-check-\S+)", done.stdout)
    assert base and not Path(base.group(1)).exists()
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GPUQ_HOME", "").startswith(base.group(1)):
                left.append(p)
        except psutil.Error:
            continue
    assert left == []
