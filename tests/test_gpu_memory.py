"""GPU memory per process on simulated GPUs: real processes declare simulated memory, and the
device and the probe read it like NVML's list."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpuq.service import constants as c
from gpuq.service.devices import open_devices
from gpuq.service.settings import Settings
from gpuq.service.simulated_memory import ENV_VARIABLE, hold, memory_dir
from gpuq.workers.execute import job_env
from gpuq.workers.job import JobRun
from gpuq.workers.probe import GpuProbe

pytestmark = pytest.mark.timeout(60)

HOLD = [sys.executable, "-m", "gpuq.workers.simulated_memory"]


def simulated(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", fake_gpus=2, node="memnode", key_prefix="gpuqmemtest",
                    fake_gpu_memory_dir=str(tmp_path / "gpu-memory"))


def env_on(settings: Settings, gpu: int) -> dict[str, str]:
    """What a command job on simulated GPU ``gpu`` gets from its worker."""
    job = JobRun(id=7, name="hold", kind=c.KIND_COMMAND, workload=None, params={}, argv=None, cwd=None,
                 gpu_indices=(gpu,), gpu_queues=("q",))
    return job_env(job, settings.node, settings=settings)


def start_holding(settings: Settings, gpu: int, *args: str, shell: bool = False) -> subprocess.Popen[str]:
    """A real job process holding simulated memory; returns once it said it holds it."""
    argv = ["sh", "-c", " ".join([*HOLD, *args]) + "; true"] if shell else [*HOLD, *args]
    proc = subprocess.Popen(argv, env={**env_on(settings, gpu), "PATH": os.environ["PATH"]},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("holding "), "the holder did not start"
    return proc


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(10)


def test_a_job_process_holding_simulated_memory_is_in_the_gpus_list_and_the_probes_reading_until_it_dies(tmp_path):
    settings = simulated(tmp_path)
    devices = open_devices(settings)
    probe = GpuProbe(devices, 1)
    proc = start_holding(settings, 1, "--mib", "3000", "--seconds", "30")
    try:
        listed = devices.read(1).processes
        reading = probe.read()
        other_gpu = devices.read(0).processes
    finally:
        stop(proc)  # SIGKILL: it cannot take its file away itself
    assert listed is not None and [(p.pid, p.memory_mib) for p in listed] == [(proc.pid, 3000)]
    assert other_gpu == ()
    assert reading.memory_used_mib is not None and reading.memory_used_mib >= 3000
    mine = [p for p in reading.processes or () if p.pid == proc.pid]
    assert [(p.memory_mib, p.gpuq) for p in mine] == [(3000, True)], "counted once, at its word, as the job's"
    assert devices.read(1).processes == ()
    after = probe.read()
    assert proc.pid not in {p.pid for p in after.processes or ()}
    assert after.memory_used_mib is not None and after.memory_used_mib < 3000
    assert list(memory_dir(settings).iterdir()) == [], "a dead process's file is cleaned up"


def test_a_holder_stopped_by_sigterm_takes_its_memory_away(tmp_path):
    settings = simulated(tmp_path)
    devices = open_devices(settings)
    proc = start_holding(settings, 0, "--mib", "100")
    assert [p.pid for p in devices.read(0).processes or ()] == [proc.pid]
    stop(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    assert list(memory_dir(settings).iterdir()) == []


def test_the_directory_is_sticky_and_world_writable_and_jobs_get_it_only_on_simulated_gpus(tmp_path):
    settings = simulated(tmp_path)
    open_devices(settings)
    assert stat.S_IMODE(memory_dir(settings).stat().st_mode) == 0o1777
    assert env_on(settings, 1)[ENV_VARIABLE] == str(tmp_path / "gpu-memory")
    assert ENV_VARIABLE not in env_on(settings.with_overrides(fake_gpus=0), 1)
    default = memory_dir(settings.with_overrides(fake_gpu_memory_dir=""))
    assert default.parent == Path("/tmp") and "gpuqmemtest" in default.name and "memnode" in default.name


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another uid takes root")
def test_a_file_naming_a_process_of_another_uid_is_ignored_and_removed(tmp_path):
    settings = simulated(tmp_path)
    devices = open_devices(settings)
    nobody = 65534
    mine = subprocess.Popen(["sleep", "30"])
    theirs = subprocess.Popen(["sleep", "30"], user=nobody)
    try:
        claim_on_mine = hold(memory_dir(settings), 0, 4000, pid=mine.pid)
        assert [p.pid for p in devices.read(0).processes or ()] == [mine.pid]  # counted while its owner's
        os.chown(claim_on_mine, nobody, nobody)  # another user says root's process holds memory
        hold(memory_dir(settings), 0, 4000, pid=theirs.pid)  # root's file says nobody's does
        assert devices.read(0).processes == ()
        assert list(memory_dir(settings).iterdir()) == []
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()


def test_a_file_from_before_its_pid_was_reused_is_ignored(tmp_path):
    settings = simulated(tmp_path)
    devices = open_devices(settings)
    # A file that names this process but another start time: a dead holder's, whose pid came back.
    (memory_dir(settings) / f"gpu0.{os.getpid()}").write_text("5000 1\n")
    assert devices.read(0).processes == ()
    hold(memory_dir(settings), 0, 5000)
    assert [(p.pid, p.memory_mib) for p in devices.read(0).processes or ()] == [(os.getpid(), 5000)]
