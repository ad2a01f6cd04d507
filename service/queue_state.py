"""The queue's state as a scheduling pass sees it, and what the pass decides: the pending jobs
(``JobRequest``), the live GPUs (``GpuState``), and the placements, waits and reservation of a
decision. Plain data: service/queue_read.py makes it from SQL, ``policy.decide`` reads it."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from gpuq.service import gpu_limits
from gpuq.service.node_use import NodeUse, node_uses


@dataclass(frozen=True)
class Preemptible:
    """A running job that may be preempted, as the GPUs it holds (or shares) see it."""

    job_id: int
    priority: int
    started: float  # epoch s


# The memory held back on a GPU for each shared job's CUDA context, MiB (GPUQ_SHARED_CONTEXT_MIB's default).
SHARED_CONTEXT_MIB = 512
# Slack for sums of charged fractions against the user GPU limit (floating point).
LIMIT_SLACK = 1e-9


@functools.lru_cache(maxsize=1024)
def is_model(model: str, gpu_type: str) -> bool:
    """Whether a GPU named ``model`` (NVML's name: "NVIDIA A100-SXM4-80GB") is of ``gpu_type``
    (`--gpu-type a100`): the type, its letters and digits lowercased, is one or more consecutive
    words of the name ("a100", "3090", "rtx3090", "RTX 3090"), never part of one: an A10 job on an
    A100 would be another GPU than the one asked for."""
    words = re.findall(r"[a-z0-9]+", model.lower())
    want = "".join(re.findall(r"[a-z0-9]+", gpu_type.lower()))
    for start in range(len(words)):
        joined = ""
        for word in words[start:]:
            joined += word
            if joined == want:
                return True
            if len(joined) >= len(want):
                break
    return False


@dataclass(frozen=True)
class GpuState:
    """A live GPU on a node that takes jobs: free, busy with a whole-GPU job (``busy_until``), or
    partly used by shared jobs (``shares``; never both)."""

    id: int
    node: str
    index: int
    queue: str
    memory_total_mib: int
    memory_used_mib: int = 0
    foreign_mib: int = 0  # used by processes gpuq did not start
    # None: no whole-GPU job. Else the time (epoch s) its job is expected to end; inf when it has no limit.
    busy_until: float | None = None
    # The shared jobs gpuq runs on it, each as (expected end, epoch s, inf with no time limit; MiB of
    # its share and context reserve): room opens as each leaves.
    shares: tuple[tuple[float, int], ...] = ()
    model: str = ""  # NVML's name of it ("NVIDIA H100 80GB HBM3"), what --gpu-type picks by
    # Its whole-GPU job, where that one is preemptible and not asked to stop yet; None: none.
    preemptible: Preemptible | None = None
    # Its whole-GPU job was asked to stop by a preemption: the GPU is free once it has.
    preempted: bool = False
    # Of ``shares``: those of preemptible shared jobs that may be preempted now, (job, expected end,
    # MiB), and those of shared jobs being stopped by a preemption, (expected end, MiB): room being freed.
    preemptible_shares: tuple[tuple[Preemptible, float, int], ...] = ()
    preempted_shares: tuple[tuple[float, int], ...] = ()
    # Its whole-GPU job is preemptible but started less than GPUQ_PREEMPT_EXEMPT ago: when it may be
    # preempted (epoch s). Only the forecast reads it: the passes see the job as any other till then.
    exempt_until: float | None = None
    # Its node's maintenance window (epoch s; `gpuq drain --at --until`, service/node_drains.py):
    # until ``closes_at`` only a job that ends by then starts on it; from ``reopens_at`` (None:
    # until resumed) it is in service again. None: no window to come.
    closes_at: float | None = None
    reopens_at: float | None = None

    @property
    def shared_mib(self) -> int:
        """The shares and context reserves of its shared jobs together."""
        return sum(mib for _, mib in self.shares)

    @property
    def shared_jobs(self) -> int:
        return len(self.shares)

    @property
    def freeing_mib(self) -> int:
        """The room the shared jobs being preempted free once they have stopped."""
        return sum(mib for _, mib in self.preempted_shares)

    @property
    def firm_shares(self) -> list[tuple[float, int]]:
        """Its shares that no preemption will take: neither preemptible nor being preempted."""
        firm = list(self.shares)
        for end, mib in [*((e, m) for _, e, m in self.preemptible_shares), *self.preempted_shares]:
            firm.remove((end, mib))
        return firm

    @property
    def shared_until(self) -> float | None:
        """When the last of its shared jobs is expected to end (inf: one has no time limit); None: none."""
        return max((end for end, _ in self.shares), default=None)

    @property
    def free_mib(self) -> int:
        if self.shared_jobs:  # their memory is theirs: what is free once they leave
            return self.memory_total_mib - self.foreign_mib
        return self.memory_total_mib - max(self.memory_used_mib, self.foreign_mib)

    @property
    def room_mib(self) -> int:
        """Memory one more shared job may take now: what neither the shared jobs' shares and
        reserves nor other programs hold."""
        return self.memory_total_mib - self.shared_mib - self.foreign_mib

    def open_until(self, end: float) -> bool:
        """Whether a job ending at ``end`` (inf: no time limit) ends before its node drains."""
        return self.closes_at is None or end <= self.closes_at

    def open_from(self, start: float, length: float) -> float:
        """The first moment from ``start`` a job of ``length`` seconds may run on it, its node's
        window aside: ``start`` if it ends before the window, else the window's end (inf: none)."""
        if self.closes_at is None or start + length <= self.closes_at:
            return start
        return math.inf if self.reopens_at is None else max(start, self.reopens_at)

    def fits(self, job: JobRequest) -> bool:
        """Whether this GPU, once free of gpuq jobs, suits whole-GPU ``job``'s memory request
        (a shared job's room: service/packing.py).

        A GPU that other programs use counts as busy for their memory: a job that did not say how
        much memory it needs is not put beside them.
        """
        if not self.is_of(job):
            return False
        if job.mem_mib is None:
            return self.foreign_mib == 0
        return self.free_mib >= job.mem_mib

    def is_of(self, job: JobRequest) -> bool:
        """Whether this GPU is of the type ``job`` asked for (`--gpu-type`), or it asked for none."""
        return job.gpu_type is None or is_model(self.model, job.gpu_type)


@dataclass(frozen=True)
class JobRequest:
    """A pending job that could start now (not held, dependencies met)."""

    id: int
    user: str
    gpus: int
    priority: int = 0
    submitted: float = 0.0
    mem_mib: int | None = None  # a shared job: its share on each GPU
    node: str | None = None
    time_limit_s: int | None = None
    shared: bool = False  # may share its GPUs with other shared jobs, held to mem_mib on each
    gpu_type: str | None = None  # `--gpu-type`: only GPUs whose model is of it (``is_model``)
    # `--dependency singleton`: placed by a pass alone, which knows its name's other jobs; a worker
    # takes a listed job without looking (``next_up_choice``).
    singleton: bool = False
    exclude: frozenset[str] = frozenset()  # `--exclude`: nodes it may not run on
    array: int | None = None  # a task of an array with a limit (`--array 0-99%4`): its array's id
    preemptible: bool = False  # `--preemptible`: after every other job, past the user limit, stopped for them
    cpus: float | None = None  # `--cpus`: the cores it reserves on its node (service/node_use.py); None: none
    host_mem_mib: int | None = None  # `--host-mem`: the host memory it reserves there; None: none

    def __post_init__(self) -> None:
        if self.shared and self.mem_mib is None:
            raise ValueError(f"job {self.id}: a shared job needs a memory request (its share)")

    def may_use(self, node: str) -> bool:
        """Whether it may run on ``node``: the one it asked for (`--node`), if any, and not one it
        excluded (`--exclude`)."""
        return (self.node is None or node == self.node) and node not in self.exclude


@dataclass(frozen=True)
class Placement:
    job_id: int
    gpus: tuple[GpuState, ...]  # rank order; gpus[0]'s worker runs the job (as the pass found them)
    shared: bool = False  # the job shares these GPUs (its share: its mem_mib)
    # What it reserves on their node ((kind, amount): `--cpus`, `--host-mem`), checked again as it is written.
    needs: tuple[tuple[str, float], ...] = ()


@dataclass
class QueueState:
    now: float
    jobs: list[JobRequest]
    gpus: list[GpuState]
    gpu_hours: dict[str, float] = field(default_factory=dict)  # recent GPU-hours per user, decayed (fair share)
    # GPUs each user's jobs hold now: a shared job counts its charged fraction of each of its GPUs
    # (packing.charged_gpus), as fair share charges it.
    gpus_in_use: dict[str, float] = field(default_factory=dict)
    user_gpu_limit: int = 0  # 0: unlimited
    # Some users' own limits in its place (service/gpu_limits.py; 0: unlimited): read by ``limit_of``.
    user_gpu_limits: dict[str, int] = field(default_factory=dict)
    # Each user's running jobs, (expected end, GPUs charged), where the reader knows them: what the
    # expected starts count down to under the limit (service/forecast.py). Empty: not known.
    user_holds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    shared_context_mib: int = SHARED_CONTEXT_MIB  # held back on a GPU for each shared job's CUDA context
    # Each node's CPU cores and host memory, and the running jobs' reservations of them (`--cpus`,
    # `--host-mem`), by kind (node_use.KINDS).
    node_use: dict[str, NodeUse] = field(default_factory=node_uses)
    # Each running preemptible job still within GPUQ_PREEMPT_EXEMPT, by id: when it may be preempted.
    # Until then its node's cores and memory are its own, in the forecast too (a scavenger's after).
    exempt_until: dict[int, float] = field(default_factory=dict)

    def limit_of(self, user: str) -> int:
        """The GPUs ``user``'s jobs may hold at once; 0: no limit."""
        return gpu_limits.limit_of(user, self.user_gpu_limit, self.user_gpu_limits)

    @property
    def limited(self) -> bool:
        """Whether any user is held to a GPU limit."""
        return gpu_limits.any_limit(self.user_gpu_limit, self.user_gpu_limits)


@dataclass(frozen=True)
class Reservation:
    job_id: int
    node: str
    start: float  # when the job can start at the latest (the shadow time)
    gpu_ids: frozenset[int]
    shared_mib: int | None = None  # a shared job's: the room it needs on each GPU; None: whole GPUs
    # What it needs of its node then ((kind, amount): `--cpus`, `--host-mem`), kept for it there.
    needs: tuple[tuple[str, float], ...] = ()


@dataclass
class Decision:
    placements: list[Placement]
    waiting: dict[int, str]  # job id -> reason
    reservation: Reservation | None = None
    # The eligible jobs in queue order, as decide walked them.
    order: list[JobRequest] = field(default_factory=list)
    # Running preemptible jobs to stop and requeue: job id -> the waiting job that takes its GPUs.
    preemptions: dict[int, int] = field(default_factory=dict)
    # The GPUs each waiting job that preempts holds for itself until they are free (as a placement).
    claims: list[Placement] = field(default_factory=list)
    # The waiting job no reservation could protect (a job on its GPUs has no time limit): no job
    # after it in the queue starts before it does.
    blocked_by: int | None = None
