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


class _Nvml:
    """NVML's memory health calls as a GPU answers them: each a value, or None where the GPU keeps
    no such counter (NVML_ERROR_NOT_SUPPORTED)."""

    NVML_FEATURE_ENABLED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 1, 0

    class NVMLError(Exception):
        pass

    def __init__(self, rows=None, pages=None, ecc=None):
        self.answers = {"rows": rows, "pages": pages, "ecc": ecc}

    def _answer(self, name):
        if self.answers[name] is None:
            raise self.NVMLError("Not Supported")
        return self.answers[name]

    def nvmlDeviceGetRemappedRows(self, h):
        return self._answer("rows")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._answer("pages")

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter):
        assert (error_type, counter) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        return self._answer("ecc")


@pytest.mark.parametrize("answers,says", [
    ({"rows": (4, 0, 0, 0), "pages": 0, "ecc": 0}, None),  # corrected rows remapped: healthy
    ({}, None),  # a GPU without the counters (no ECC, before Ampere) cannot tell: not drained for it
    ({"rows": (0, 2, 1, 0)}, "row remapping pending (2 rows for uncorrectable errors): reset the GPU (nvidia-smi -r)"),
    ({"rows": (0, 2, 1, 1)}, "row remapping failed: memory errors it can no longer set aside (repair the GPU)"),
    ({"pages": 1}, "retired pages pending: reset the GPU (nvidia-smi -r)"),
    ({"rows": (0, 0, 0, 0), "ecc": 3}, "3 uncorrectable ECC errors since the driver loaded: reset the GPU "
                                       "(nvidia-smi -r)"),
    ({"ecc": 1}, "1 uncorrectable ECC error since the driver loaded: reset the GPU (nvidia-smi -r)"),
])
def test_nvmls_memory_counters_say_when_a_gpu_needs_a_reset_or_a_repair(answers, says):
    from gpuq.service.devices import NvmlDevices

    devices = NvmlDevices.__new__(NvmlDevices)  # NVML's answers, not a driver's
    devices._nvml = _Nvml(**answers)
    assert devices.health(object()) == says


def test_a_simulated_gpu_marked_unhealthy_reads_so_with_its_marks_first_line(tmp_path):
    faults = tmp_path / "simulated-faults"
    faults.mkdir()
    devices = open_devices(Settings(home=tmp_path, fake_gpus=2, node="a"))
    assert devices.read(0).unhealthy is None
    (faults / "a.0.unhealthy").write_text("2 uncorrectable ECC errors since the driver loaded\nmore\n")
    (faults / "a.1.unhealthy").write_text("")
    assert devices.read(0).unhealthy == "2 uncorrectable ECC errors since the driver loaded"
    assert devices.read(1).unhealthy == "simulated GPU marked unhealthy"
    assert devices.read(0).lost is None


class _Events:
    """NVML's event calls as a GPU answers them: the Xids waiting, taken one a call, then
    NVML_ERROR_TIMEOUT; or registration refused (NVML_ERROR_NOT_SUPPORTED) where ``supported`` is false."""

    nvmlEventTypeXidCriticalError = 8

    class NVMLError(Exception):
        pass

    def __init__(self, *xids: int, supported: bool = True):
        self.waiting, self.supported, self.registered = list(xids), supported, []

    def nvmlEventSetCreate(self):
        return object()

    def nvmlDeviceRegisterEvents(self, handle, types, events):
        if not self.supported:
            raise self.NVMLError("Not Supported")
        self.registered.append((handle, types))

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # a heartbeat never waits for the GPU
        if not self.waiting:
            raise self.NVMLError("Timeout")
        return type("Event", (), {"eventData": self.waiting.pop(0)})()


def _nvml_devices(nvml):
    from gpuq.service.devices import NvmlDevices

    devices = NvmlDevices.__new__(NvmlDevices)  # NVML's answers, not a driver's
    devices._nvml, devices._xids = nvml, {}
    return devices


def test_a_hardware_xid_makes_the_gpu_unhealthy_for_good_and_a_programs_own_xids_do_not():
    from gpuq.service.xids import fault_of

    nvml = _Events(13, 31)  # a kernel's illegal address, an MMU fault: the program's own
    devices = _nvml_devices(nvml)
    assert devices.xid_fault(0, "h0") is None
    assert nvml.registered == [("h0", nvml.nvmlEventTypeXidCriticalError)]  # once, at the first look
    nvml.waiting += [31, 74, 79]
    said = devices.xid_fault(0, "h0")
    assert said == fault_of(74) == ("Xid 74 (NVLink error): reset the GPU and check its NVLinks (`gpuq down` on "
                                    "its node first, `gpuq up` after)")
    assert nvml.registered == [("h0", nvml.nvmlEventTypeXidCriticalError)]
    assert devices.xid_fault(0, "h0") == said  # kept: no event says the GPU was reset since
    assert devices.xid_fault(1, "h1") is None  # each GPU its own events
    assert fault_of(79).startswith("Xid 79 (the GPU has fallen off the bus): reboot the node")


def test_a_gpu_whose_events_nvml_does_not_give_is_read_without_them():
    devices = _nvml_devices(_Events(48, supported=False))
    assert devices.xid_fault(0, "h0") is None and devices._xids == {0: None}


def test_a_flood_of_events_is_taken_a_bounded_number_a_look():
    from gpuq.service.xids import MOST_A_LOOK

    nvml = _Events(*[13] * (MOST_A_LOOK + 10), 48)
    devices = _nvml_devices(nvml)
    assert devices.xid_fault(0, "h0") is None and len(nvml.waiting) == 11
    assert devices.xid_fault(0, "h0").startswith("Xid 48 (double-bit ECC error)")
