"""Devices: NVML where there is a GPU, simulated GPUs on demand, and "no GPU" is not a crash."""

import pytest

from gpuq.service.devices import open_devices
from gpuq.service.settings import Settings


def test_simulated_gpus_have_stable_identities_per_node(tmp_path):
    # Its own home: simulated GPUs make their memory folder there, and the default home of a test
    # run as root is the machine's stack's, /var/lib/gpuq (a suite left it behind, mode 0755).
    a = open_devices(Settings(home=tmp_path, fake_gpus=3, node="a")).list()
    again = open_devices(Settings(home=tmp_path, fake_gpus=3, node="a")).list()
    other = open_devices(Settings(home=tmp_path, fake_gpus=3, node="b")).list()
    assert [g.index for g in a] == [0, 1, 2]
    assert a == again and {g.uuid for g in a}.isdisjoint({g.uuid for g in other})
    assert all(g.simulated and g.memory_total_mib == Settings().fake_gpu_memory_mib for g in a)


def test_no_nvidia_library_means_no_gpus_not_a_crash():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    except pynvml.NVMLError:
        pass
    devices = open_devices(Settings(fake_gpus=0))
    assert devices.kind == "none" and devices.list() == []
    assert "NVML" in devices.why_none
    assert devices.read(0).utilization is None  # "not available" is a value


@pytest.mark.skipif("not __import__('shutil').which('nvidia-smi')", reason="needs an NVIDIA GPU")
def test_nvml_lists_the_gpus_nvidia_smi_shows():
    import subprocess

    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    devices = open_devices(Settings(fake_gpus=0))
    assert devices.kind == "nvml" and len(devices.list()) == listed
    reading = devices.read(0)
    assert reading.memory_used_mib is not None
