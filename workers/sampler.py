"""The worker's device sampler: reads its GPU every ``sample_interval`` seconds, tags each reading
with the job running at the time, and writes them to SQL in batches (every SAMPLE_BATCH readings
and when a job ends). Once an hour it also rolls its GPU's samples past retention into minute
aggregates. Liveness is the heartbeat's business, not this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from gpuq.service import constants as c
from gpuq.service import samples
from gpuq.service.db import write_scope
from gpuq.service.models import utcnow
from gpuq.service.settings import Settings
from gpuq.workers.probe import GpuProbe

log = logging.getLogger("gpuq.worker")

# Readings kept while the database cannot be reached, at most: an hour at 1 Hz, then the oldest go.
MAX_PENDING = 3600


class Sampler(threading.Thread):
    """Samples until stopped; ``current_job()`` says which job the worker is running (or None)."""

    def __init__(self, settings: Settings, gpu_id: int, probe: GpuProbe,
                 current_job: Callable[[], int | None]) -> None:
        super().__init__(name="sampler", daemon=True)
        self.settings, self.gpu_id, self.probe, self.current_job = settings, gpu_id, probe, current_job
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        # Held while a batch is written: a job's end waits for a batch taken before it to be in SQL
        # before the job's summary is read from SQL (``end_rows``).
        self._writing = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._last_at: float | None = None
        self._last_energy_mj: int | None = None
        # The job that started since the last reading, when (the monotonic clock's) and its row's
        # started_at (``job_started``): the next reading's interval reaches back past that start,
        # and only the part after it is the job's.
        self._job_start: tuple[int, float, datetime | None] | None = None
        # How many batches it has taken to write: a job that started when this stood where it
        # stands at its end has every reading of its own in the sampler's hands (``end_rows``).
        self.flushes = 0

    def run(self) -> None:
        interval = self.settings.sample_interval
        next_sample = time.monotonic()
        next_rollup = next_sample
        while not self.stopped.wait(max(next_sample - time.monotonic(), 0.0)):
            # Keep the beat on a fixed grid: a slow flush does not push every later sample back.
            next_sample = max(next_sample + interval, time.monotonic())
            try:
                # The first reading is written at once: `gpuq devices` on a stack just up shows
                # the GPU's temperature and power (only samples carry them), not n/a for 5 s.
                if self.sample() >= c.SAMPLE_BATCH or self.flushes == 0:
                    self.flush()
                if time.monotonic() >= next_rollup:
                    next_rollup = time.monotonic() + c.ROLLUP_EVERY
                    samples.rollup(self.settings, utcnow(), self.gpu_id)
            except Exception:
                log.exception("device sampling failed; retrying")
        self.flush()

    def sample(self, job_id: int | None = None) -> int:
        """Take one reading (tagged ``job_id``, else the current job); returns how many wait to be written."""
        reading = self.probe.read()
        with self._lock:
            now = time.monotonic()
            interval = self.settings.sample_interval if self._last_at is None else now - self._last_at
            self._last_at = now
            energy = None
            if reading.energy_mj is not None and self._last_energy_mj is not None \
                    and reading.energy_mj >= self._last_energy_mj:
                energy = (reading.energy_mj - self._last_energy_mj) / 1000.0
            elif reading.power_w is not None:
                energy = reading.power_w * interval
            self._last_energy_mj = reading.energy_mj
            job = job_id if job_id is not None else self.current_job()
            at = utcnow()
            before, started_at = self._before_start(job, now, interval)
            if before > 0:
                # The GPU's own time before the job began (between jobs, or before the first), read
                # with the same values: charged to the job, it was an idle interval in every job's
                # summary (utilisation 0 until its first kernel). Stamped just before the job's
                # start, as the span it stands for ends there: ``samples.record`` and the end's
                # totals in hand give an untagged reading stamped after the start to the job.
                share = before / interval
                stamp = started_at - timedelta(microseconds=1) if started_at else at
                self._pending.append(samples.sample_row(self.gpu_id, None, stamp, before, reading,
                                                        None if energy is None else energy * share))
                interval -= before
                energy = None if energy is None else energy * (1 - share)
            self._pending.append(samples.sample_row(self.gpu_id, job, at, interval, reading, energy))
            del self._pending[:-MAX_PENDING]
            return len(self._pending)

    def job_started(self, job_id: int, started_at: datetime | None) -> None:
        """The worker started ``job_id`` just now, its row stamped ``started_at`` (no reading: a
        flood of short jobs would read the GPU hundreds of times a second)."""
        with self._lock:
            self._job_start = (job_id, time.monotonic(), started_at)

    def _before_start(self, job: int | None, now: float, interval: float) -> tuple[float, datetime | None]:
        """Of a reading of ``job`` over ``interval`` seconds to ``now``, the seconds before the job
        started, and its row's start (the first reading after its start only; else 0 and None).
        Called under the lock."""
        started, self._job_start = self._job_start, None
        if started is None or job is None or started[0] != job:
            return 0.0, None
        return min(max(interval - (now - started[1]), 0.0), interval), started[2]

    def flush(self) -> None:
        """Write the readings taken so far in one transaction; kept for the next try if it fails."""
        with self._writing:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    return
                self.flushes += 1  # counted as the batch is taken: a job's end compares after ``end_rows``
            try:
                with write_scope(self.settings) as session:
                    samples.record(session, self.gpu_id, batch)
            except Exception:
                with self._lock:
                    self._pending[:0] = batch
                raise

    def end_rows(self, job_id: int) -> list[dict[str, Any]]:
        """One last reading of a job that ended, and every reading not written yet, handed over to
        be written in the transaction that ends the job (``put_back`` if that fails).

        The last reading is left out when the GPU was read less than ``END_READING_GAP`` ago (at
        most a tenth of the interval). Taken at every end, a flood of jobs of a few milliseconds read
        each GPU hundreds of times a second: as many device_samples rows, and about a sixth of the
        CPU each such job cost on PostgreSQL. A job that short and read by nobody has no reading of
        its own (its summary says 0 samples), which is all a reading could say of it anyway: NVML's
        utilisation counters average over a sixth of a second or more."""
        gap = min(c.END_READING_GAP, self.settings.sample_interval / 10)
        with self._lock:
            recent = self._last_at is not None and time.monotonic() - self._last_at < gap
        if not recent:
            try:
                self.sample(job_id)
            except Exception:
                log.exception("job %s: could not take its last device reading", job_id)
        # A batch taken to write before now is committed first: the job's summary, read from SQL
        # when some of its readings were written, must see all of them (on PostgreSQL nothing else
        # orders the two transactions).
        with self._writing, self._lock:
            rows, self._pending = self._pending, []
        return rows

    def put_back(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            self._pending[:0] = rows
            del self._pending[:-MAX_PENDING]

    def job_ended(self, job_id: int) -> None:
        """Close a job's record: one last reading of it, and everything written before its summary."""
        try:
            self.sample(job_id)
            self.flush()
        except Exception:
            log.exception("job %s: could not write its last device samples", job_id)

    def stop(self) -> None:
        self.stopped.set()
