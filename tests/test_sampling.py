"""A worker's device sampling: plausible simulated readings from real CPU work, "not available"
as None, batches in SQL tagged with the running job, energy from the counter where there is one."""

from __future__ import annotations

import subprocess
import sys
import time

from sqlalchemy import event, select

from gpuq.service import constants as c
from gpuq.service.db import get_engine, write_scope
from gpuq.service.devices import GpuInfo, GpuReading, NoDevices, SimulatedDevices
from gpuq.service.models import Allocation, DeviceSample, utcnow
from gpuq.workers.probe import SIM_IDLE_W, GpuProbe
from gpuq.workers.sampler import Sampler
from tests.test_usage import add_gpu, add_job


def test_a_simulated_gpu_reads_busy_while_its_job_burns_cpu_and_idle_after():
    probe = GpuProbe(SimulatedDevices(1, 4096, "n"), 0)
    probe.read()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # Read again (for up to 6 s) while the suite's other process holds the machine's cores: a
        # second in which the spinning job got under 30% of a core says nothing of the probe.
        deadline = time.monotonic() + 6.0
        while True:
            time.sleep(1.0)
            busy = probe.read()
            if busy.utilization >= 30 or time.monotonic() >= deadline:
                break
    finally:
        spin.kill()
        spin.wait()
    time.sleep(0.5)
    probe.read()
    time.sleep(0.5)
    idle = probe.read()
    assert busy.utilization >= 30, busy
    assert busy.power_w > SIM_IDLE_W and busy.memory_total_mib == 4096
    assert spin.pid in {p.pid for p in busy.processes} and all(p.gpuq for p in busy.processes)
    assert idle.utilization < c.IDLE_UTILIZATION and idle.power_w < busy.power_w
    assert spin.pid not in {p.pid for p in idle.processes}


def test_a_gpu_that_cannot_tell_reads_none_not_an_exception():
    reading = GpuProbe(NoDevices("no NVML"), 0).read()
    assert reading == GpuReading()


class CounterGpu:
    """A GPU with an energy counter (as Volta and later have), for the sampler's energy rule."""

    kind, why_none = "counter", ""

    def __init__(self) -> None:
        self.energy_mj = 1_000

    def list(self):
        return [GpuInfo(index=0, uuid="GPU-counter", name="Counter GPU", memory_total_mib=1024)]

    def read(self, index: int) -> GpuReading:
        self.energy_mj += 3_000
        return GpuReading(utilization=50, power_w=999.0, energy_mj=self.energy_mj)


def test_energy_comes_from_the_counter_when_the_gpu_has_one(settings):
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
    sampler = Sampler(settings, gpu, GpuProbe(CounterGpu(), 0), lambda: None)
    for _ in range(3):
        sampler.sample()
    sampler.flush()
    with write_scope(settings) as s:
        energy = list(s.scalars(select(DeviceSample.energy_j).order_by(DeviceSample.id)))
    # The first sample has no previous counter value: power x interval; then the counter's deltas.
    assert energy == [999.0 * settings.sample_interval, 3.0, 3.0]


def test_sampler_writes_batches_tagged_with_the_running_job(settings):
    settings = settings.with_overrides(sample_interval=0.05)
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
        job = add_job(s, "ann", "n", utcnow(), None)
    commits = []
    event.listen(get_engine(settings), "commit", lambda conn: commits.append(1))
    sampler = Sampler(settings, gpu, GpuProbe(SimulatedDevices(1, 1024, "n"), 0), lambda: job)
    started = time.monotonic()
    sampler.start()
    time.sleep(1.0)
    sampler.stop()
    sampler.join(5)
    took = time.monotonic() - started
    with write_scope(settings) as s:
        rows = list(s.scalars(select(DeviceSample).order_by(DeviceSample.sampled_at)))
    assert len(rows) >= 10 and {r.job_id for r in rows} == {job}
    # A transaction per batch, plus the first reading, the last partial batch, the start-up
    # roll-up and this test's read: never one per sample.
    assert len(commits) <= len(rows) / c.SAMPLE_BATCH + 4
    assert sum(r.interval_s for r in rows) <= took + settings.sample_interval
    assert all(r.utilization is not None and r.power_w is not None and r.processes for r in rows)



def test_a_gpus_first_reading_is_in_sql_at_once_so_devices_shows_its_temperature_and_power(settings):
    # A 10-minute interval: a batch of SAMPLE_BATCH readings would take 50 minutes.
    settings = settings.with_overrides(sample_interval=600.0)
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
    sampler = Sampler(settings, gpu, GpuProbe(SimulatedDevices(1, 1024, "n"), 0), lambda: None)
    sampler.start()
    try:
        deadline, rows = time.monotonic() + 10, []
        while not rows and time.monotonic() < deadline:
            time.sleep(0.1)
            with write_scope(settings) as s:
                rows = list(s.scalars(select(DeviceSample)))
    finally:
        sampler.stop()
        sampler.join(5)
    assert len(rows) == 1 and rows[0].temperature_c is not None and rows[0].power_w is not None


def test_a_jobs_end_waits_for_a_batch_being_written_so_its_summary_sees_every_reading(tmp_path, redis_url):
    # A batch the sampler took before the job ended, still being written (here: queued behind
    # another process's write), must be in SQL before the job's end reads its readings back.
    import threading

    from gpuq.service import db
    from gpuq.service.db import read_scope
    from tests.conftest import make_settings, settings_env
    from tests.test_sqlite_writers import HOLD

    s = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url)
    db.upgrade(s)
    with write_scope(s) as session:
        gpu = add_gpu(session, "n", 0)
        job = add_job(session, "ann", "n", utcnow(), None)
    sampler = Sampler(s, gpu, GpuProbe(SimulatedDevices(1, 1024, "n"), 0), lambda: job)
    for _ in range(3):
        sampler.sample()
    holder = subprocess.Popen([sys.executable, "-c", HOLD], env=settings_env(s), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        flusher = threading.Thread(target=sampler.flush)
        flusher.start()
        deadline = time.monotonic() + 10
        while sampler.flushes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.flushes == 1  # the batch is taken; its write waits for the other process
        handed: list[list] = []
        ender = threading.Thread(target=lambda: handed.append(sampler.end_rows(job)))
        ender.start()
        ender.join(0.5)
        assert ender.is_alive()  # the job's end waits for the batch
        holder.stdin.write("\n")
        holder.stdin.flush()
        ender.join(10)
        assert not ender.is_alive()
        with read_scope(s) as session:
            written = session.scalars(select(DeviceSample).where(DeviceSample.job_id == job)).all()
        assert len(written) == 3 and len(handed[0]) == 1  # the batch in SQL, the last reading in hand
        flusher.join(10)
    finally:
        holder.kill()
        holder.wait(10)


def test_a_jobs_end_reads_its_gpu_unless_it_was_read_a_moment_ago(settings, monkeypatch):
    # Under a flood of jobs of a few milliseconds, a reading at every end read each GPU hundreds of
    # times a second (and wrote as many rows): the last reading waits END_READING_GAP, at most a
    # tenth of the interval, after the GPU's previous one.
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
    sampler = Sampler(settings.with_overrides(sample_interval=600.0), gpu, GpuProbe(CounterGpu(), 0), lambda: None)
    monkeypatch.setattr(c, "END_READING_GAP", 30.0)
    assert [r["job_id"] for r in sampler.end_rows(1)] == [1]  # never read before
    assert sampler.end_rows(2) == []  # read a moment ago, at 1's end
    sampler.sample()
    assert [r["job_id"] for r in sampler.end_rows(3)] == [None]  # the periodic one, handed over: none of 3's
    monkeypatch.setattr(c, "END_READING_GAP", 0.0)
    assert [r["job_id"] for r in sampler.end_rows(4)] == [4]
    # Capped at a tenth of the interval: sampled every 0.1 s, a GPU read 0.02 s ago is read again.
    sampler.settings = settings.with_overrides(sample_interval=0.1)
    monkeypatch.setattr(c, "END_READING_GAP", 30.0)
    time.sleep(0.02)
    assert [r["job_id"] for r in sampler.end_rows(5)] == [5]


def test_a_jobs_first_reading_charges_it_only_the_time_since_it_started(settings):
    # The reading after a job's start spans time before it too: that part is the GPU's own (an idle
    # second charged to every job's summary otherwise), with its share of the energy.
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
    running: list[int] = []
    sampler = Sampler(settings.with_overrides(sample_interval=600.0), gpu, GpuProbe(CounterGpu(), 0),
                      lambda: running[0] if running else None)
    sampler.sample()
    time.sleep(0.4)
    with write_scope(settings) as s:  # running, on this GPU: the writes tag its GPU's readings after its start
        started_at = utcnow()
        job = add_job(s, "ann", "n", started_at, None)
        s.add(Allocation(job_id=job, gpu_id=gpu, rank=0))
    running.append(job)
    sampler.job_started(job, started_at)
    time.sleep(0.2)
    sampler.sample()
    sampler.sample()  # the one after: all the job's
    sampler.flush()
    with write_scope(settings) as s:
        rows = [(r.job_id, r.interval_s, r.energy_j) for r in s.scalars(select(DeviceSample).order_by(DeviceSample.id))]
    (_, _, _), (gap_job, gap, gap_energy), (first_job, first, first_energy), (then_job, _, then_energy) = rows
    assert gap_job is None and first_job == then_job == job
    assert 0.35 <= gap <= 0.5 and 0.15 <= first <= 0.3
    assert abs(gap_energy + first_energy - 3.0) < 1e-9 and then_energy == 3.0
    assert abs(gap_energy / first_energy - gap / first) < 1e-6
