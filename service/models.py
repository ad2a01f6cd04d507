"""The SQL schema as SQLAlchemy 2.0 typed models. It changes only through an Alembic migration."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from gpuq.service import constants as c
from gpuq.service.constants import State

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


_STATES = ", ".join(f"'{s}'" for s in c.ALL_STATES)


class Job(Base):
    """One submitted job: a built-in workload or a user command, and everything known about its run."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(f"state IN ({_STATES})", name="state"),
        CheckConstraint(f"kind IN ('{c.KIND_WORKLOAD}', '{c.KIND_COMMAND}', '{c.KIND_INTERACTIVE}')", name="kind"),
        CheckConstraint("gpus >= 1", name="gpus_positive"),
        # Fair share reads the jobs that ended since its last pass, `gpuq status` the newest ended
        # ones; `gpuq history` counts a period's jobs by state and user from the index alone.
        Index("ix_jobs_ended_at_state_user", "ended_at", "state", "user"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(c.MAX_NAME_LENGTH))
    user: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    workload: Mapped[str | None] = mapped_column(String(64))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    argv: Mapped[list[str] | None] = mapped_column(JSON)
    cwd: Mapped[str | None] = mapped_column(Text)
    gpus: Mapped[int] = mapped_column(Integer, default=1)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16), default=State.PENDING)
    # Why it waits, or why it ended the way it did, in a sentence.
    reason: Mapped[str | None] = mapped_column(Text)
    node: Mapped[str | None] = mapped_column(String(255))
    worker: Mapped[str | None] = mapped_column(String(255))
    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Scheduling requests: free memory per GPU, a node, a time limit, retries, dependencies.
    mem_mib: Mapped[int | None] = mapped_column(Integer)
    # Nodes it may not run on (`--exclude a,b`); None: none.
    exclude_nodes: Mapped[list[str] | None] = mapped_column(JSON)
    on_node: Mapped[str | None] = mapped_column(String(255))
    time_limit_s: Mapped[int | None] = mapped_column(Integer)
    max_retries: Mapped[int] = mapped_column(Integer, default=0)
    # Earlier attempts of a retried job: [{started_at, ended_at, state, reason, worker}, ...].
    attempts: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    held: Mapped[bool] = mapped_column(default=False)
    # Held by an admin (not its owner): only an admin may release it, as SLURM's admin hold.
    admin_hold: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Job ids this one waits for, each as ``after_kind`` says (units.AFTER_KINDS): all succeeded
    # (afterok), ended (afterany), ended other than succeeded (afternotok) or started (after).
    after: Mapped[list[int] | None] = mapped_column(JSON)
    after_kind: Mapped[str] = mapped_column(String(16), default="afterok", server_default="afterok")
    # sbatch's `--dependency singleton`: it waits while another job of its user and name is started,
    # or pending ahead of it as a singleton (``queue_read.singletons_held``).
    singleton: Mapped[bool] = mapped_column(default=False, server_default=false())
    # `--preemptible`: after every other job, past its user's GPU limit, and stopped and requeued when
    # a job that is not preemptible needs its GPUs (service/preemption.py).
    preemptible: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Requeued after a failure of the machinery (constants.INFRA_FAILURES: its worker or GPU lost,
    # its GPU failed under it, its worker shut down)? True (`--requeue`), False (`--no-requeue`), or
    # None: as SLURM's default has it here, if it asked for retries (lifecycle.requeues_on_infra).
    requeue: Mapped[bool | None] = mapped_column(nullable=True)
    # Its stdin is what the `gpuq run` that submitted it forwards (service/job_input.py), where it is
    # not a terminal; false: /dev/null.
    stdin: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Array and sweep tasks share the id of their first task; each has its index.
    array_id: Mapped[int | None] = mapped_column(Integer, index=True)
    array_index: Mapped[int | None] = mapped_column(Integer)
    # At most this many of its array's tasks run at once (`--array 0-99%4`); None: no such limit.
    array_limit: Mapped[int | None] = mapped_column(Integer)
    # It waits for "begin time" until then (`--begin`, sbatch's); None: it may start at once.
    begin_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Cancelled while pending once it could no longer end by then (`--deadline`, sbatch's): its start
    # plus its time limit past it, or without a limit, not started by then. None: no deadline.
    # Indexed: a whole pass seeks the pending jobs that have one, out of any number that do not.
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    # A command's output copied to the user's files as well (`--output`, `--error`), patterns unfilled.
    output_file: Mapped[str | None] = mapped_column(Text)
    error_file: Mapped[str | None] = mapped_column(Text)
    # A signal sent ahead of its time limit (`--signal USR1@120`, units.JobSignal's text); None: none.
    signal: Mapped[str | None] = mapped_column(Text)
    # A signal asked of it while it runs (`gpuq cancel --signal`, units.JobSignal.parse_now's text)
    # and when: its worker sends it once for each asking after the job's start; None: none asked.
    signal_asked: Mapped[str | None] = mapped_column(Text)
    signal_asked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Only GPUs of this type (`--gpu-type a100`: words of the GPU's name, policy.is_model); None: any.
    gpu_type: Mapped[str | None] = mapped_column(Text)
    # Extra environment for a command (GPUQ_ARRAY_INDEX, sweep values).
    env: Mapped[dict[str, str] | None] = mapped_column(JSON)
    # Where the ranks of a job run one per GPU worker meet (torch.distributed init_method);
    # written by rank 0's worker when it starts the job.
    rendezvous: Mapped[str | None] = mapped_column(String(255))
    # The running job's lease: only the worker holding this token may write the job's end, and it
    # must renew the lease before it expires or the reaper takes the job back.
    lease_token: Mapped[str | None] = mapped_column(String(32))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Times it was put back after an infrastructure failure (capped by the max_requeues setting).
    requeues: Mapped[int] = mapped_column(Integer, default=0)
    # Why it failed or stopped, one of constants.FAILURES; None while it runs or if it succeeded.
    failure: Mapped[str | None] = mapped_column(String(16))
    # Host memory limit of a command job's processes (a memory cgroup), MiB; None: no limit.
    host_mem_mib: Mapped[int | None] = mapped_column(Integer)
    # CPU cores a command job's processes may use together (a cgroup's CPU quota, `--cpus`, or
    # GPUQ_CPUS_PER_GPU for each of its GPUs); None: no limit.
    cpus: Mapped[float | None] = mapped_column(Float)
    # The code as it was at submit (a command submitted in a git work tree): commit, uncommitted
    # changes, the diff against the commit (cut at GPUQ_GIT_DIFF_MAX_BYTES, git_diff_cut then true),
    # and with --snapshot the copy of the work tree the job runs from.
    git_commit: Mapped[str | None] = mapped_column(String(64))
    git_dirty: Mapped[bool | None] = mapped_column()
    git_diff: Mapped[str | None] = mapped_column(Text)
    git_diff_cut: Mapped[bool | None] = mapped_column()
    snapshot: Mapped[str | None] = mapped_column(Text)
    # When gpuq removed that copy, past GPUQ_SNAPSHOT_RETENTION_DAYS (service/snapshot_retention.py).
    snapshot_removed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # An allocation (kind interactive): when its client (`gpuq alloc`) last said it is alive, and
    # the exit code of the shell or command it ran, once the client has ended it.
    keepalive_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    client_exit_code: Mapped[int | None] = mapped_column(Integer)
    # May share its GPUs with other shared jobs, each held to its --mem (mem_mib) there.
    shared: Mapped[bool] = mapped_column(default=False, server_default=false())
    # What share of each of its GPUs a shared job was placed with (its share and context reserve
    # over the GPU's memory), what fair share and accounting charge it; None: whole GPUs.
    gpu_share: Mapped[float | None] = mapped_column(Float)

    allocations: Mapped[list[Allocation]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="Allocation.rank"
    )


# Each user's waiting jobs in their queue order (priority, then submission): a quick scheduler
# pass reads every user's first few through it, seeks, not a sort of the whole queue, and finds
# the users with waiting jobs by skipping from one to the next. It leads with the state, so it
# serves every read of the jobs in some state too (one index fewer to write at each job's start
# and end than the (state, priority, id) one it replaced).
Index("ix_jobs_queue_order", Job.state, Job.held, Job.user, Job.priority.desc(), Job.submitted_at, Job.id)


class Gpu(Base):
    """One GPU of one node, as its worker last reported it."""

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(255))
    # NVML index: PCI bus order, the order CUDA uses too once CUDA_DEVICE_ORDER=PCI_BUS_ID.
    index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(255))
    memory_total_mib: Mapped[int] = mapped_column(Integer)
    memory_used_mib: Mapped[int | None] = mapped_column(Integer)
    utilization: Mapped[int | None] = mapped_column(Integer)
    # Memory held by processes gpuq did not start, and those processes: [{pid, user, mib, name}].
    foreign_mib: Mapped[int | None] = mapped_column(Integer)
    foreign: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    simulated: Mapped[bool] = mapped_column(default=False)
    # The Celery queue its worker listens on, and the worker's name (gpu<index>@<node>).
    queue: Mapped[str] = mapped_column(String(255))
    worker: Mapped[str | None] = mapped_column(String(255))
    worker_pid: Mapped[int | None] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The CPU cores and host memory its node offers jobs (`--cpus` and `--host-mem` reserve them:
    # service/node_use.py), as its worker reports them: GPUQ_NODE_CPUS, else the cores the worker may
    # run on; GPUQ_NODE_HOST_MEM_MIB, else the machine's memory. Kept with each GPU rather than on the
    # node's row: every worker of a node registers at once, and the node counts only while a GPU of it
    # is live. None: not reported (a worker older than this), not counted.
    node_cpus: Mapped[int | None] = mapped_column(Integer)
    node_host_mem_mib: Mapped[int | None] = mapped_column(Integer)
    # Set when this one GPU must not be given out until an admin resumes it: "GPU lost", or a
    # stopped job's processes that would not go away.
    drain_reason: Mapped[str | None] = mapped_column(Text)
    # Set by its node's `gpuq up` when the GPU is no longer there (taken out, or left out of
    # GPUQ_FAKE_GPUS): no longer listed nor counted; the row stays for its samples. A worker that
    # registers it again clears it.
    retired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    # The whole job on it, or the shared jobs' shares.
    allocations: Mapped[list[Allocation]] = relationship(back_populates="gpu")


class Node(Base):
    """A node's administrative state: drained nodes finish their jobs and start no new ones; a node
    to drain at a set time (a maintenance window) starts only jobs that end by then."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    drained: Mapped[bool] = mapped_column(default=False)
    drain_reason: Mapped[str | None] = mapped_column(Text)
    drained_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    drained_by: Mapped[str | None] = mapped_column(String(255))  # the admin, as `sinfo -R` names them
    # A drain planned ahead, a maintenance window (`gpuq drain NODE --at TIME --until TIME`): from
    # ``drain_at`` on the node is drained, and before only jobs whose time limit ends by then start
    # there; at ``drain_until`` (None: never) it is in service again. ``drained`` stays False.
    drain_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    drain_until: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Allocation(Base):
    """A GPU held by a job, whole or a share of its memory. The unique index on gpu_id among whole
    allocations is what makes double-booking impossible; shares of one GPU are the scheduler's to
    pack (``allocating.allocate`` checks their sum in the placing transaction)."""

    __tablename__ = "allocations"
    __table_args__ = (
        Index("uq_allocations_gpu_id", "gpu_id", unique=True, sqlite_where=text("share_mib IS NULL"),
              postgresql_where=text("share_mib IS NULL")),
        # Every lookup of what holds a GPU (a take's "is it free", the scheduler's read): the
        # partial index above serves only those that also say "whole".
        Index("ix_allocations_gpu_id", "gpu_id"),
        UniqueConstraint("job_id", "rank"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # No index of its own: the unique (job_id, rank) key serves a job's lookups, and one index
    # fewer is a page fewer to write at every job's start and end.
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    # 0 for the GPU whose worker runs the job; the order CUDA_VISIBLE_DEVICES lists them in.
    rank: Mapped[int] = mapped_column(Integer)
    # A shared job's: its share plus the context reserve, MiB, on this GPU; None: the whole GPU.
    share_mib: Mapped[int | None] = mapped_column(Integer)
    # What a shared job's processes use of this GPU's memory, MiB, as its worker last measured it.
    used_mib: Mapped[int | None] = mapped_column(Integer)
    # The CPU cores its command (or allocation's shell) runs on, as 0-3,8 (`--cpus`, bound by its
    # worker: workers/core_binding.py), on its rank 0 row; None: bound to none.
    cores: Mapped[str | None] = mapped_column(String(4000))

    job: Mapped[Job] = relationship(back_populates="allocations")
    gpu: Mapped[Gpu] = relationship(back_populates="allocations")


class NextUp(Base):
    """The scheduler's word on what a busy GPU runs next if it frees before the next pass: pending
    one-GPU jobs in queue order (``rank``). The worker that ends a job takes the first of its list
    that is still pending in the same transaction, so a deep queue keeps its GPUs busy without a
    round trip through the scheduler. Only a hint: the take re-checks the job and the GPU."""

    __tablename__ = "next_up"

    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True, index=True)
    rank: Mapped[int] = mapped_column(Integer)


class JobOutput(Base):
    """A chunk of a job's stdout or stderr (``stream``), in the order written (seq)."""

    __tablename__ = "job_output"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    data: Mapped[str] = mapped_column(Text)
    written_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    stream: Mapped[int] = mapped_column(SmallInteger, default=c.STDOUT, server_default="0")


class JobMetric(Base):
    """One row of a running job's progress (an epoch's loss and accuracy), in order of seq."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


# 64-bit ids where a table grows by a row per GPU per second; SQLite's rowid is 64-bit already.
BigId = BigInteger().with_variant(Integer, "sqlite")


class DeviceSample(Base):
    """One reading of one GPU by its worker, tagged with the job that held it; None = not available.

    ``interval_s`` is the time the reading stands for (since the previous one), so sums weighted by
    it are exact whatever the sampling rate; ``energy_j`` is the energy used in that time (from the
    GPU's energy counter where it has one, else power times interval).
    """

    __tablename__ = "device_samples"
    __table_args__ = (Index("ix_device_samples_gpu_id_sampled_at", "gpu_id", "sampled_at"),
                      Index("ix_device_samples_job_id_sampled_at", "job_id", "sampled_at"),
                      Index("ix_device_samples_sampled_at", "sampled_at"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    sampled_at: Mapped[datetime] = mapped_column(UTCDateTime)
    interval_s: Mapped[float] = mapped_column(Float)
    utilization: Mapped[int | None] = mapped_column(Integer)
    memory_utilization: Mapped[int | None] = mapped_column(Integer)
    memory_used_mib: Mapped[int | None] = mapped_column(Integer)
    memory_total_mib: Mapped[int | None] = mapped_column(Integer)
    temperature_c: Mapped[int | None] = mapped_column(Integer)
    power_w: Mapped[float | None] = mapped_column(Float)
    sm_clock_mhz: Mapped[int | None] = mapped_column(Integer)
    energy_j: Mapped[float | None] = mapped_column(Float)
    # [{"pid", "name", "memory_mib", "gpuq"}]: the processes on the GPU, gpuq's and foreign ones.
    processes: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)


class DeviceMinute(Base):
    """One GPU's samples of one minute (and one job) rolled up: sums weighted by seconds, and maxima.

    Means are ``*_sum / *_seconds``; what the raw samples summed to, these rows sum to.
    """

    __tablename__ = "device_minutes"
    __table_args__ = (Index("ix_device_minutes_gpu_id_minute", "gpu_id", "minute"),
                      Index("ix_device_minutes_job_id", "job_id"),
                      Index("ix_device_minutes_minute", "minute"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    minute: Mapped[datetime] = mapped_column(UTCDateTime)
    samples: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    utilization_seconds: Mapped[float] = mapped_column(Float)  # seconds with a known utilisation
    utilization_sum: Mapped[float] = mapped_column(Float)  # utilisation (%) x seconds
    utilization_max: Mapped[int | None] = mapped_column(Integer)
    idle_seconds: Mapped[float] = mapped_column(Float)  # seconds below IDLE_UTILIZATION
    memory_seconds: Mapped[float] = mapped_column(Float)  # seconds with a known memory use
    memory_used_sum: Mapped[float] = mapped_column(Float)  # MiB x seconds
    memory_used_max: Mapped[int | None] = mapped_column(Integer)
    temperature_max: Mapped[int | None] = mapped_column(Integer)
    power_max: Mapped[float | None] = mapped_column(Float)
    energy_j: Mapped[float] = mapped_column(Float)


class JobUsage(Base):
    """A job's accounting summary, written when it ends."""

    __tablename__ = "job_usage"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    wall_s: Mapped[float] = mapped_column(Float)
    gpu_hours: Mapped[float] = mapped_column(Float)  # wall time x GPUs held
    memory_peak_mib: Mapped[int | None] = mapped_column(Integer)
    memory_mean_mib: Mapped[float | None] = mapped_column(Float)
    utilization_mean: Mapped[float | None] = mapped_column(Float)
    energy_j: Mapped[float | None] = mapped_column(Float)
    idle_s: Mapped[float] = mapped_column(Float)  # GPU-seconds below IDLE_UTILIZATION
    samples: Mapped[int] = mapped_column(Integer)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The GPUs it ran on (their indices on its node, rank order), as sacct keeps a job's: its
    # allocation rows go when it ends. None where its worker did not say (a summary summed later).
    gpu_indices: Mapped[list[int] | None] = mapped_column(JSON)
    # A command's CPU seconds, as its worker reaped it (sacct's TotalCPU): its processes that were
    # waited for, user and system time; None: not known (a workload, an allocation, a lost worker).
    cpu_s: Mapped[float | None] = mapped_column(Float)
    # The most host memory a command's processes were seen to hold (anonymous and shared, sampled:
    # workers/host_memory.py), MiB; None: not known (as cpu_s, or it ended before the first look).
    host_mem_peak_mib: Mapped[int | None] = mapped_column(Integer)


class EarlierAttempt(Base):
    """The GPU and CPU time an attempt of a job held before the job ran again (retried or requeued): the
    job's own ``started_at``/``ended_at`` are its last attempt's, so fair share and `gpuq stats`
    read these too (a job retried a hundred times after an hour each held the GPUs a hundred hours,
    and was charged one)."""

    __tablename__ = "earlier_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    user: Mapped[str] = mapped_column(String(64))
    node: Mapped[str | None] = mapped_column(String(255))
    charged: Mapped[float] = mapped_column(Float)  # its GPUs, each times its share of a shared GPU
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    # Why it ran again: "preempted", "requeued" (`gpuq requeue`), or the failure that retried or
    # requeued it (``constants.FAILURES``: exit, worker_lost, ...); None: kept before it was recorded.
    cause: Mapped[str | None] = mapped_column(String(32))
    # Its command's CPU seconds, as its worker reaped it (``JobUsage.cpu_s`` is the last attempt's):
    # None where not known (a workload, an allocation, an attempt the reaper ended).
    cpu_s: Mapped[float | None] = mapped_column(Float)


class JobMail(Base):
    """Mail a job's owner asked for (`gpuq submit --mail-type END`, service/mail.py): what about, to
    whom, and what is still to be sent. Beside the job's row, not in it: an ended job's row is final
    (service/lifecycle.py), and its end mail is sent after it ended."""

    __tablename__ = "job_mail"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    events: Mapped[str] = mapped_column(String(32))  # "BEGIN,END" (units.MAIL_EVENTS), as asked
    address: Mapped[str | None] = mapped_column(String(255))  # `--mail-user`; None: the job's owner
    # The events not yet mailed about, as ``events``; None once none is left (the index finds the
    # jobs the scheduler's mail thread still watches).
    due: Mapped[str | None] = mapped_column(String(32), index=True)
    # The job's earlier attempts mailed about (REQUEUE): one more each time it goes back to the queue.
    reruns_mailed: Mapped[int] = mapped_column(Integer, default=0)


class Submission(Base):
    """A submit's idempotency key and the jobs it made: a client that lost the answer (the server
    restarted mid-submit) asks again with the same key and gets these jobs, never a second copy."""

    __tablename__ = "submissions"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    user: Mapped[str] = mapped_column(String(64))
    job_ids: Mapped[list[int]] = mapped_column(JSON)
    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime)


def table(model: type[Base]) -> Table:
    """A model's table, for Core statements (``Model.__table__`` is typed as any FromClause)."""
    return cast(Table, model.__table__)
