"""What a worker holds while it runs (``WorkerState``): who it is and its running job's lease
(service/leases.Lease), shared by the thread that runs jobs, the heartbeat, the sampler and the
watch thread."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpuq.service import constants as c
from gpuq.service.leases import Lease
from gpuq.service.settings import Settings
from gpuq.workers.guard import Guard
from gpuq.workers.watch import Watch


@dataclass
class SharedRun:
    """A shared job running on this worker in a thread of its own; ``used_mib``: what its processes
    use of the GPU's memory at the last look (its thread writes it, the heartbeat reads it)."""

    lease: Lease
    thread: threading.Thread
    used_mib: int | None = None


@dataclass
class WorkerState:
    """Who this worker is: its settings, node, GPU, and whether it was told to stop.

    Locking: no lock guards it; each field has one writer, and the others read it whole.

    - ``settings``, ``node``, ``gpu_index``, ``gpu_id``, ``name``, ``queue``, ``app`` and ``sampler``
      are set by ``workers/main.py`` before the first task runs, and only read afterwards.
    - ``job_id``, ``lease`` and ``_woke`` are written only by the task thread (Celery's solo pool:
      the thread running ``run_job`` and ``run_rank``). The sampler thread reads ``job_id`` once per
      reading, and may tag one with a job that just ended, or leave one untagged as a job starts
      (its end counts that one by its time: ``end._totals_in_hand``). The heartbeat thread reads
      ``lease`` once per beat, and marks it lost only if ``state.lease`` is still that lease.
      ``_woke`` and ``ranks_run`` are the task thread's alone.
    - The Events are thread-safe: ``interrupt`` and ``stopping`` are set by the shutdown handler in
      ``workers/main.py`` (or its grace timer's thread), ``gpu_lost`` by the heartbeat thread; the
      task thread reads them, and the watch thread ``interrupt`` and ``gpu_lost``.
    - ``gpu_health`` is written by the heartbeat thread alone, a whole string (or None) at a time;
      a job's start reads it once (workers/gpu_fault.py).
    - ``watch`` keeps its own lock between the task thread and the watch thread (see ``Watch``).
    - ``shared``: the task thread adds a shared job's run as it starts it, that run's own thread
      removes it at its end, the heartbeat copies it (``list(...)``) once per beat; each a single
      dict operation, atomic under the interpreter's lock.
    """

    settings: Settings
    node: str
    gpu_index: int
    gpu_id: int
    name: str
    # Its GPU's Celery queue (what a job taken from the next-up list records as its first GPU's).
    queue: str = ""
    # The Celery app, to ask the job's other GPUs' workers to run their ranks.
    app: Any = None
    # Set on the second shutdown request: stop the running job now instead of letting it finish.
    interrupt: threading.Event = field(default_factory=threading.Event)
    # The job (or rank of one) running here now, which the device sampler tags its readings with.
    job_id: int | None = None
    # The device sampler (workers/sampler.py), if sampling is on.
    sampler: Any = None
    # This node's GPUs (service/devices.py): shared jobs' memory is read per process through it.
    devices: Any = None
    # The CPU cores near each of this node's GPUs, by index (``GpuInfo.cores``): a job bound to
    # cores takes its GPUs' first (workers/core_binding.py).
    gpu_cores: dict[int, frozenset[int]] = field(default_factory=dict)
    # The lease of the job running here; the heartbeat renews it.
    lease: Lease | None = None
    # The ranks this worker ran, (job id, rank, meeting point): a rank message sent again (after
    # Redis restarted empty) for a rank that already ran here is dropped. The task thread's alone.
    ranks_run: set[tuple[int, int, str]] = field(default_factory=set)
    # Set by the heartbeat when NVML says this GPU is lost: the running job stops.
    gpu_lost: threading.Event = field(default_factory=threading.Event)
    # Why the GPU is unhealthy as the heartbeat last read it (``GpuReading.unhealthy``; None: healthy,
    # or it cannot tell): a job that fails tells a new fault from one it started with by it.
    gpu_health: str | None = None
    # Set on the first shutdown request: the running job finishes, and no next one is taken.
    stopping: threading.Event = field(default_factory=threading.Event)
    # When it last woke the scheduler for a list that runs short (time.monotonic()).
    _woke: float = -math.inf
    # Looks whether the running job must stop (started with the first job).
    watch: Watch = field(default_factory=Watch)
    # The shared jobs running here beside each other (workers/shared.py), by job id: their leases,
    # which the heartbeat renews too, and their threads.
    shared: dict[int, SharedRun] = field(default_factory=dict)
    # The lease guard (workers/guard.py): the thread that starts a command puts its process group
    # under it and takes it off at its end, the heartbeat moves the groups' deadlines on.
    guard: Guard | None = None

    def cores_near(self, gpu_indices: tuple[int, ...]) -> frozenset[int]:
        """The CPU cores near any of these GPUs of this node (empty: none known)."""
        return frozenset().union(*(self.gpu_cores.get(i, frozenset()) for i in gpu_indices))

    @contextmanager
    def guarding(self, lease: Lease | None, on_start: Callable[[int], None] | None = None
                 ) -> Iterator[Callable[[int], None]]:
        """An ``on_start`` for a job's command (``run_command``) that puts its process group under
        the lease guard, ``lease`` renewed, and takes it off when the command is over."""
        started: list[int] = []

        def start(pid: int) -> None:
            started.append(pid)
            if self.guard is not None and lease is not None:
                self.guard.watch(pid, lease)
            if on_start is not None:
                on_start(pid)

        try:
            yield start
        finally:
            for pid in started:
                if self.guard is not None:
                    self.guard.forget(pid)

    def wake_due(self) -> bool:
        """Whether to look if the next-up list runs short (and wake the scheduler if so): once per
        NEXT_UP_WAKE_SPACING at most, as the scheduler needs one wake-up, not one per job."""
        now = time.monotonic()
        if now - self._woke < c.NEXT_UP_WAKE_SPACING:
            return False
        self._woke = now
        return True

    def wait_gpu_back(self) -> None:
        """Before a job starts on a GPU marked lost, wait for the heartbeat's next look (two
        heartbeats at most). A GPU an admin resumed a moment ago is given jobs at once, while
        ``gpu_lost`` is cleared only by the heartbeat that sees it read again and undrained: a job
        dispatched in between failed as gpu_lost. One on a GPU still lost fails as before."""
        deadline = time.monotonic() + 2 * self.settings.heartbeat_interval + 1.0
        while self.gpu_lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)

    def may_take_next(self) -> bool:
        return not (self.stopping.is_set() or self.interrupt.is_set() or self.gpu_lost.is_set())

    def flush_mark(self) -> int | None:
        """The device sampler's count of batches taken to write (``Sampler.flushes``); None
        without a sampler."""
        return self.sampler.flushes if self.sampler is not None else None

    def job_started(self, job_id: int, started_at: datetime | None) -> None:
        """``started_at``: the job's row's, for the device sampler's first reading of it."""
        self.job_id = job_id
        if self.sampler is not None:
            self.sampler.job_started(job_id, started_at)

    def job_ended(self, job_id: int) -> None:
        """The job's last device readings are written before anything reads them for its summary."""
        if self.sampler is not None:
            self.sampler.job_ended(job_id)
        self.job_id = None


