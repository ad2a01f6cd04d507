"""GPU memory per process on simulated GPUs, and the watchdog that holds a shared job to its share:
real processes declare simulated memory, the device and the probe read it like NVML's list, and
the watchdog stops only a job over its share for longer than the grace."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuq.service import constants as c
from gpuq.service.devices import GpuProcess, open_devices
from gpuq.service.settings import Settings
from gpuq.service.simulated_memory import ENV_VARIABLE, hold, memory_dir
from gpuq.workers.execute import job_env
from gpuq.workers.job import JobRun
from gpuq.workers.probe import GpuProbe
from gpuq.workers.share_watch import ShareWatch

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


def holder_pid(proc: subprocess.Popen[str]) -> int:
    """The pid holding the memory: the process itself, or the one child of its shell."""
    kids = psutil.Process(proc.pid).children(recursive=True)
    return kids[0].pid if kids else proc.pid


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
    # By default the stack's own, in its home: in /tmp its name could be known, and another user who
    # made it first kept a root stack's workers from starting; two stacks counted each other's jobs.
    assert memory_dir(settings.with_overrides(fake_gpu_memory_dir="")) == settings.home / "simulated-gpu-memory"


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


class Job:
    """A job's per-process lists as a test sets them: what ShareWatch reads."""

    def __init__(self) -> None:
        self.pids = {10, 11}
        self.gpus: dict[int, tuple[GpuProcess, ...] | None] = {0: (), 1: ()}

    def uses(self, gpu: int, *mib: int, foreign: int = 0) -> None:
        procs = [GpuProcess(pid=pid, memory_mib=m) for pid, m in zip(sorted(self.pids), mib, strict=False)]
        self.gpus[gpu] = (*procs, GpuProcess(pid=99, memory_mib=foreign))

    def watch(self, share_mib: int = 3072, grace_s: float = 5.0) -> ShareWatch:
        return ShareWatch(share_mib, grace_s, lambda pid: pid in self.pids, lambda: self.gpus)


def test_a_job_under_its_share_is_never_stopped_whatever_others_use():
    job = Job()
    watch = job.watch()
    job.uses(1, 1000, 2000, foreign=60000)  # 3000 MiB of the job's, under 3072; others' count not
    assert all(watch.look(t) is None for t in range(0, 100, 5))
    assert watch.peak_mib == 3000


def test_a_job_over_its_share_for_less_than_the_grace_goes_on():
    job = Job()
    watch = job.watch(grace_s=5.0)
    job.uses(1, 4000)
    assert watch.look(0.0) is None
    assert watch.look(4.9) is None


def test_a_job_over_its_share_for_the_grace_is_stopped_with_what_it_used_on_which_gpu():
    job = Job()
    watch = job.watch(share_mib=3072, grace_s=5.0)
    job.uses(1, 4000, 4090)
    assert watch.look(0.0) is None
    assert watch.look(5.0) == "used 7.9 GiB of its 3.0 GiB share on GPU 1"
    job.uses(1, 0)
    assert watch.look(6.0) == "used 7.9 GiB of its 3.0 GiB share on GPU 1", "the reason stays"


def test_going_back_under_the_share_starts_the_grace_anew():
    job = Job()
    watch = job.watch(grace_s=5.0)
    job.uses(0, 3100)
    assert watch.look(0.0) is None
    assert watch.look(4.0) is None
    job.uses(0, 3000)
    assert watch.look(4.5) is None
    job.uses(0, 3100)
    assert watch.look(5.0) is None
    assert watch.look(9.9) is None
    assert watch.look(10.0) == "used 3100 MiB of its 3072 MiB share on GPU 0"


def test_readings_not_available_never_stop_a_job():
    job = Job()
    watch = job.watch(grace_s=1.0)
    job.gpus = {0: None, 1: None}
    assert all(watch.look(t) is None for t in range(0, 30))
    job.uses(1, 9000)
    job.gpus[1] = tuple(GpuProcess(pid=p.pid, memory_mib=None) for p in job.gpus[1] or ())
    assert watch.look(31.0) is None and watch.look(60.0) is None, "a process whose memory NVML cannot tell"


@pytest.mark.timeout(90)
def test_a_real_job_that_grows_past_its_share_is_reported_after_the_grace(tmp_path):
    settings = simulated(tmp_path)
    devices = open_devices(settings)
    grace = 1.0
    job = start_holding(settings, 1, "--mib", "500", "--then-mib", "3000", "--after", "2", "--seconds", "60",
                        shell=True)
    root = psutil.Process(job.pid)

    def pids() -> set[int]:
        return {job.pid, *(p.pid for p in root.children(recursive=True))}

    seen: list[tuple[GpuProcess, ...] | None] = []

    def readings() -> dict[int, tuple[GpuProcess, ...] | None]:
        seen.append(devices.read(1).processes)
        return {1: seen[-1]}

    watch = ShareWatch(2000, grace, lambda pid: pid in pids(), readings)
    try:
        assert holder_pid(job) != job.pid, "a process tree: the shell and the holder it started"
        over_at = reason = None
        deadline = time.monotonic() + 30
        while reason is None and time.monotonic() < deadline:
            now = time.monotonic()
            reason = watch.look(now)
            held = sum(p.memory_mib or 0 for p in seen[-1] or ())
            if held <= 2000:
                assert reason is None, "stopped while under its share"
            elif over_at is None:
                over_at = now
            time.sleep(0.1)
    finally:
        stop(job)
    assert {sum(p.memory_mib or 0 for p in r or ()) for r in seen} == {500, 3000}
    assert reason == "used 2.9 GiB of its 2.0 GiB share on GPU 1"
    assert over_at is not None and now - over_at >= grace


def test_mps_is_seen_by_its_control_pipe_or_socket_and_pins_a_shared_jobs_memory_on_each_gpu(tmp_path):
    from gpuq.workers import mps

    assert not mps.running(str(tmp_path))  # no daemon: no pipe
    (tmp_path / "control").write_text("")
    assert not mps.running(str(tmp_path))  # a plain file is not the daemon's pipe
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    assert mps.running(str(tmp_path))
    (tmp_path / "control").unlink()
    # Driver 580 (the lent H100) makes its control a Unix socket, not a pipe.
    with socket.socket(socket.AF_UNIX) as control:
        control.bind(str(tmp_path / "control"))
        assert mps.running(str(tmp_path))
    assert mps.memory_limit_env(2, 3072) == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M,1=3072M"}


def daemon_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    """A listening control where MPS's daemon keeps it, as driver 580 makes it (a Unix socket)."""
    from gpuq.workers import mps

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(mps, "_daemon_directory", None)
    control = socket.socket(socket.AF_UNIX)
    control.bind(str(tmp_path / "control"))
    return control


def test_under_mps_a_shared_job_is_pinned_to_its_share_and_context_reserve(tmp_path, monkeypatch):
    # The room it was placed with and the watchdog's limit: under MPS the CUDA context itself counts
    # against the pinned limit (seen on the lent H100: pinned to 1 GiB, 510 MiB were left for a job).
    from gpuq.workers.mps import OUTSIDE, Server, placement

    with daemon_at(tmp_path, monkeypatch):
        for found in ([], [Server(pid=50, uid=1001, clients=3)], [Server(pid=50, uid=0, clients=0)]):
            # No server yet, this user's own, or another user's with no client left (the daemon
            # hands over at once): the job joins.
            placed = placement(1001, 2, 1524, set, ask=lambda _d, found=found: found)
            assert placed.env == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path),
                                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1524M,1=1524M"}, found
            assert placed.note is None
        # A whole-GPU job stays out, with nothing said: MPS gives it nothing and would hold others.
        assert placement(1001, 2, None, lambda: {"bob"}, ask=lambda _d: []).env == {"CUDA_MPS_PIPE_DIRECTORY": OUTSIDE}
    (tmp_path / "control").unlink()
    assert placement(1001, 2, 1524, lambda: {"bob"}, ask=lambda _d: []).env == {}  # no daemon: nothing of MPS


def test_under_mps_a_job_runs_outside_it_while_another_users_jobs_may_be_its_clients(tmp_path, monkeypatch):
    # Seen on the lent H100: a client of another user waits in its first CUDA call until the MPS
    # server's clients have all ended (for ever beside a root worker's warm context), and a job
    # placed a moment ago, still importing torch, is no client of the daemon's yet.
    from gpuq.workers.mps import OUTSIDE, Server, placement

    asked = []

    def ask(directory):
        asked.append(directory)
        return [Server(pid=50, uid=0, clients=1), Server(pid=51, uid=1001, clients=0)]

    with daemon_at(tmp_path, monkeypatch):
        placed = placement(1001, 1, 1524, lambda: {"bob", "ann"}, ask=ask)
        assert placed.env == {"CUDA_MPS_PIPE_DIRECTORY": OUTSIDE} and asked == []  # SQL was enough
        assert placed.note == ("gpuq: MPS serves ann, bob's jobs on this node now, and would keep this one waiting "
                               "until they end: it runs outside MPS, held to its share by gpuq's watchdog")
        placed = placement(1001, 1, 1524, set, ask=ask)  # a client outside gpuq: root's
        assert placed.env == {"CUDA_MPS_PIPE_DIRECTORY": OUTSIDE} and asked == [str(tmp_path)]
        assert placed.note.startswith("gpuq: MPS serves root's jobs on this node now")
        placed = placement(1001, 1, 1524, set, ask=lambda _d: None)  # the daemon did not answer
        assert placed.env == {"CUDA_MPS_PIPE_DIRECTORY": OUTSIDE}
        assert placed.note == ("gpuq: this node's MPS daemon did not say whom it serves: it runs outside MPS, "
                               "held to its share by gpuq's watchdog")
    assert not Path(OUTSIDE).exists()  # no daemon can be there


def test_the_jobs_that_may_be_mps_clients_are_the_other_shared_commands_placed_on_the_node(settings):
    from sqlalchemy import update

    from gpuq.service import inventory, jobs, spec, submitting
    from gpuq.service.celery_app import queue_name
    from gpuq.service.db import write_scope
    from gpuq.service.models import Allocation, Job

    devices = open_devices(settings.with_overrides(fake_gpus=8, node="a"))
    with write_scope(settings) as session:
        gpu = [inventory.register(session, "a", g, queue_name(settings, "a", g.index), f"gpu{g.index}@a", 1)
               for g in devices.list()]
    made = {}
    for name, user, node, state, shared, kind in (
            ("self", "ann", "a", c.State.RUNNING, True, c.KIND_COMMAND),
            ("bob-shared", "bob", "a", c.State.RUNNING, True, c.KIND_COMMAND),
            ("cy-placed", "cy", "a", c.State.DISPATCHED, True, c.KIND_COMMAND),
            ("dee-alloc", "dee", "a", c.State.RUNNING, True, c.KIND_INTERACTIVE),  # its shell stays out
            ("eve-whole", "eve", "a", c.State.RUNNING, False, c.KIND_COMMAND),
            ("fay-builtin", "fay", "a", c.State.RUNNING, True, c.KIND_WORKLOAD),
            ("gus-ended", "gus", "a", c.State.SUCCEEDED, True, c.KIND_COMMAND),
            ("hal-elsewhere", "hal", "b", c.State.RUNNING, True, c.KIND_COMMAND)):
        job_id = submitting.submit_all(settings.with_overrides(place_at_submit=False),  # placed by hand below
                                       [spec.command_spec(["true"], user=user)])[0].id
        with write_scope(settings) as session:
            session.execute(update(Job).where(Job.id == job_id).values(state=state, node=node, kind=kind))
            session.add(Allocation(job_id=job_id, gpu_id=gpu[len(made)], rank=0, share_mib=1024 if shared else None))
        made[name] = job_id
    with write_scope(settings) as session:
        assert jobs.possible_mps_clients(session, "a", made["self"]) == {"bob", "cy"}
        assert jobs.possible_mps_clients(session, "b", made["self"]) == {"hal"}


def test_a_worker_keeps_its_own_cuda_context_out_of_mps_and_still_finds_the_daemon(tmp_path, monkeypatch):
    from gpuq.workers import mps

    with socket.socket(socket.AF_UNIX) as control:
        control.bind(str(tmp_path / "control"))
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
        monkeypatch.setattr(mps, "_daemon_directory", None)
        mps.keep_out()
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == mps.OUTSIDE
        assert mps.pipe_directory() == str(tmp_path) and mps.running()
        mps.keep_out()  # twice (a test, a restart of serve): still the daemon's folder
        assert mps.pipe_directory() == str(tmp_path)


def test_the_daemons_servers_are_read_from_its_control_program(tmp_path, monkeypatch):
    # nvidia-cuda-mps-control answers one question a line on stdin; here a stand-in answers as
    # driver 580's did on the lent H100 (a pid a line), for a server that is a real process of ours.
    from gpuq.workers import mps

    server = subprocess.Popen(["sleep", "30"])
    try:
        program = tmp_path / "bin" / "nvidia-cuda-mps-control"
        program.parent.mkdir()
        program.write_text(f"""#!/bin/sh
[ "$CUDA_MPS_PIPE_DIRECTORY" = {tmp_path} ] || exit 1
read question
case "$question" in
  get_server_list) echo {server.pid} ;;
  "get_client_list {server.pid}") printf '701\\n702\\n' ;;
  *) exit 1 ;;
esac
""")
        program.chmod(0o755)
        monkeypatch.setenv("PATH", f"{program.parent}:{os.environ['PATH']}")
        assert mps.servers(str(tmp_path)) == [mps.Server(pid=server.pid, uid=os.getuid(), clients=2)]
        assert mps.servers(str(tmp_path / "elsewhere")) is None  # the program failed: no answer
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        assert mps.servers(str(tmp_path)) is None  # no such program
    finally:
        server.kill()
        server.wait()
