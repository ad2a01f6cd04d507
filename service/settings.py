"""The one settings object: typed, read once from the environment and an optional TOML file.

Precedence: environment (``GPUQ_*``) over the file (``GPUQ_CONFIG``, else
``$XDG_CONFIG_HOME/gpuq/config.toml``) over the defaults below. Nothing else in gpuq reads
``os.environ`` for its configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from gpuq.service.errors import ConfigError
from gpuq.service.setting_checks import (  # noqa: F401 - OTHER_ENV and the rest: settings' names too
    ADMIN_MAX_PRIORITY,
    ENV_PREFIX,
    OTHER_ENV,
    OTHER_ENV_PREFIXES,
    check_env_names,
    check_urls,
    check_values,
    coerce,
    file_key_hint,
    origin,
)


def _data_home() -> Path:
    # Root's gpuq is the machine's: its state is a system service's (`sudo gpuq up` serves everyone).
    if os.geteuid() == 0 and not os.environ.get("XDG_DATA_HOME"):
        return Path(SYSTEM_HOME)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gpuq"


# Where root's gpuq keeps its state, and where its server's socket is: every user's client looks there.
SYSTEM_HOME = "/var/lib/gpuq"
SYSTEM_SOCKET = "/run/gpuq/gpuq.sock"


def config_file(environ: Mapping[str, str] | None = None) -> Path:
    """The config file gpuq reads (it need not exist): ``GPUQ_CONFIG``, else the user's config directory."""
    env = os.environ if environ is None else environ
    explicit = env.get("GPUQ_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpuq" / "config.toml"


@dataclass(frozen=True)
class Settings:
    """Everything gpuq can be configured with. Field ``x`` is set by ``GPUQ_X`` or ``x =`` in the file."""

    # Where the embedded defaults keep their state: the SQLite file, logs, pid files, a local Redis.
    home: Path = field(default_factory=_data_home)
    # SQLAlchemy URL; empty means SQLite (WAL) at ``home/gpuq.db``.
    database_url: str = ""
    # Celery broker; must be redis:// or rediss://. Empty means the local Redis that `gpuq up` manages.
    broker_url: str = ""
    # Port of that local Redis: `gpuq up` uses a Redis already answering there, or starts one.
    redis_port: int = 6379
    # Prefix of every queue and key gpuq puts in Redis, so two gpuq installations can share one Redis.
    key_prefix: str = "gpuq"
    # The name this machine's workers report; jobs are placed on the GPUs of one node.
    node: str = field(default_factory=socket.gethostname)
    # Number of simulated GPUs; 0 means use NVML (real GPUs).
    fake_gpus: int = 0
    # Memory each simulated GPU reports, MiB.
    fake_gpu_memory_mib: int = 16384
    # The simulated GPUs' model names by index, comma-separated, the last naming the rest (a node
    # of several models, for --gpu-type: "NVIDIA A100-SXM4-80GB,NVIDIA GeForce RTX 3090"); empty:
    # each is a "Simulated GPU".
    fake_gpu_names: str = ""
    # The CPU cores near each simulated GPU by index, lists separated by spaces ("0-15 16-31", as
    # NVML's CPU affinity gives a real GPU's): a job bound to cores takes its GPUs' first; empty: none known.
    fake_gpu_cores: str = ""
    # Seconds between worker heartbeats (liveness, and the GPU's state in `gpuq status`).
    heartbeat_interval: float = 2.0
    # Seconds between device samples each worker keeps in SQL (utilisation, memory, power, ...); 0: none.
    sample_interval: float = 1.0
    # Days raw device samples are kept before they are rolled into 1-minute aggregates (kept forever).
    sample_retention_days: float = 7.0
    # Seconds a running job must have held its GPUs mostly idle before `gpuq status` flags it.
    idle_window: float = 600.0
    # How long a running job may hold its GPUs mostly idle before the scheduler cancels it, in
    # --time's forms ("2h"): an allocation or a notebook left open overnight gives its GPUs back.
    # Empty: never (the flag above only shows it).
    idle_limit: str = ""
    # Users (comma-separated) whose jobs the idle limit leaves running: a lab's exceptions, such as
    # a demo account or a user whose work is mostly on the CPU for hours (the flag still shows it).
    idle_limit_exempt: str = ""
    # A worker silent this many seconds is lost: its GPU is not given out, its running job fails.
    worker_timeout: float = 20.0
    # Seconds the scheduler sleeps when nobody wakes it (it is woken on submit and on job end).
    scheduler_interval: float = 1.0
    # Place a submission at once, in its own transaction, when no other job waits (as SLURM tries
    # each job at submit unless told to `defer`); false: only the scheduler's passes place jobs.
    place_at_submit: bool = True
    # Seconds between SIGTERM and SIGKILL when a running job is cancelled.
    kill_grace: float = 10.0
    # The same when a preemptible job is preempted (SLURM's GraceTime of a scavenger QOS): a job may
    # need longer to save a checkpoint than a cancelled one, and the job that preempts it waits.
    preempt_grace: float = 10.0
    # CPU cores a command job (or an allocation) may use for each of its GPUs when it gives no
    # --cpus (SLURM's DefCpuPerGPU, held to as docker's --cpus is: a cgroup's CPU quota); 0: no limit.
    # On a box whose GPUs' jobs starve each other's data loaders, its cores over its GPUs.
    cpus_per_gpu: float = 0.0
    # The same for host memory, MiB (SLURM's DefMemPerGPU): a command that gives no --host-mem is held to
    # this for each of its GPUs, and reserves it on its node; 0: no limit. On a node whose jobs together
    # outgrow its memory, its memory (less the system's) over its GPUs.
    host_mem_per_gpu_mib: int = 0
    # The CPU cores this node offers its jobs, which a job's --cpus reserves (as SLURM's CPUs= of a
    # node): read by its workers, which report it; 0: the cores the worker may run on. More than the
    # node has lets jobs together ask for more than it has; fewer keeps some for the system.
    node_cpus: int = 0
    # "cores": a command with --cpus N runs on N cores of its own, near its GPUs where the node says
    # which are (SLURM's task/affinity, --cpu-bind=cores); "none": on every core the worker may use,
    # held only by its cgroup's quota.
    cpu_bind: str = "cores"
    # The host memory this node offers its jobs, MiB, which a job's --host-mem reserves (SLURM's
    # RealMemory): read by its workers, which report it; 0: the machine's memory. Fewer keeps some for
    # the system and the workers themselves.
    node_host_mem_mib: int = 0
    # Output of one job kept in SQL, bytes; past it the rest is dropped with a note.
    max_output_bytes: int = 16 * 1024 * 1024
    # `gpuq up`'s logs (home/logs: the supervisor's and each process's it runs) are rotated when one
    # passes this many MiB: copied to NAME.log.1 (the older ones to .2, .3, ...) and emptied; 0: never.
    log_rotate_mib: int = 64
    # Rotated copies kept of each log (NAME.log.1 the newest); the oldest beyond them is removed.
    # 0: a log past log_rotate_mib is emptied without a copy.
    log_rotate_keep: int = 4
    # Address other nodes reach this one at, for the ranks of a multi-GPU job to meet; empty: the
    # address this host's name resolves to.
    advertise_addr: str = ""
    # Fair share: a GPU-hour used this many hours ago counts half as much as one used now.
    fairshare_half_life_h: float = 168.0
    # What a preemptible job's GPU-hour counts in fair share, 0 to 1 (SLURM's UsageFactor of a
    # scavenger QOS): 1, as any job's; 0, free, since it yields its GPUs to anyone who waits.
    preemptible_charge: float = 1.0
    # How long a preemptible job runs before it may be preempted (SLURM's PreemptExemptTime), in
    # --time's forms: a job that spends its first minutes loading data is not stopped just after.
    # Empty: from its start.
    preempt_exempt: str = ""
    # GPUs one user's jobs may hold at once; 0: no limit.
    user_gpu_limit: int = 0
    # Some users' own limits in place of it, "USER=GPUS,..." (SLURM's MaxTRESPerUser on a user's
    # association): "alice=1,pi=0" holds alice to 1 and the pi to none. Empty: everyone's is the one above.
    user_gpu_limits: str = ""
    # The queue's time limits, in --time's forms (SLURM's DefaultTime and MaxTime): a job submitted
    # without --time gets default_time (else max_time); one asking for more than max_time is refused
    # at submit. Empty: none (a job without --time runs until it ends).
    default_time: str = ""
    max_time: str = ""
    # Highest --priority a user may give (admins: up to 1000); anyone may go down to -1000.
    max_priority: int = 10
    # Users (comma-separated) who may act on anyone's jobs and use higher priorities.
    admins: str = ""
    # The program job mail is handed to (`gpuq submit --mail-type`): `PROG -s SUBJECT ADDRESS`, the
    # body on its stdin (mailx's, SLURM's MailProg); and the domain added to an address that is a
    # bare user name (SLURM's MailDomain; empty: none, the machine's own mail delivers it).
    mail_prog: str = "/usr/bin/mail"
    mail_domain: str = ""
    # Simulated foreign use: "GPU:MIB:PID:USER[,...]", processes gpuq did not start on simulated GPUs.
    fake_gpu_foreign: str = ""
    # Where the processes of jobs on simulated GPUs say how much simulated GPU memory they hold (a
    # file per GPU and process; service/simulated_memory.py); empty: a directory under /tmp named by
    # the stack's uid, key prefix and node. Made world-writable and sticky like /tmp: on a root stack
    # jobs run as many users, and gpuq's home is closed to them.
    fake_gpu_memory_dir: str = ""
    # Warm the worker at start (import torch, touch the GPU) so the first job does not pay for it.
    warm_start: bool = True
    # Seconds a running job's lease lasts; its worker renews it every heartbeat. A job whose lease
    # ran out (worker SIGKILLed, node gone) is reaped within this plus one scheduler interval.
    lease_timeout: float = 30.0
    # Times a job that asked for retries may be put back after an infrastructure failure (worker
    # lost, worker shut down, GPU lost); these do not use up its own --retries, but are capped so a
    # job that kills its worker cannot loop for hours.
    max_requeues: int = 3
    # Whether a job that says neither --requeue nor --no-requeue is put back after such a failure
    # (SLURM's JobRequeue): "retries" (if it asked for --retries), "yes" (always), "no" (never).
    # Read at submit: a job keeps the word it was submitted with.
    requeue: str = "retries"
    # A dispatched job not claimed after this many seconds is sent again (Redis may have lost it).
    resend_after: float = 15.0
    # Seconds a worker told to stop (first SIGTERM) lets its running job go on; 0: until it ends.
    shutdown_grace: float = 0.0
    # Redis redelivers an unacknowledged message after this many seconds; SQL makes a redelivery
    # harmless, so this only bounds how long a lost worker's message waits.
    visibility_timeout: float = 7 * 24 * 3600.0
    # Where `gpuq submit --snapshot` keeps each job's copy of the work tree; empty: ``home/snapshots``.
    # With workers on several nodes it must be storage they all see at the same path (NFS and such).
    snapshot_dir: str = ""
    # Days a job's snapshot is kept after the last job that runs from it ended (a resubmit reuses
    # it); then the scheduler removes it, with whatever the job wrote inside. 0: kept for ever.
    snapshot_retention_days: float = 0.0
    # A work tree bigger than this (the files git would list, bytes) is not snapshotted.
    snapshot_max_bytes: int = 256 * 1024 * 1024
    # The uncommitted diff kept with a command job, bytes; past it the diff is cut, and marked so.
    git_diff_max_bytes: int = 1024 * 1024
    # Whether anyone may read any job's output (`gpuq logs`); false: only its owner and the admins.
    shared_logs: bool = False
    # The server's Unix socket (`gpuq server`); empty: /run/gpuq/gpuq.sock for root, else home/gpuq.sock.
    socket: str = ""
    # Where the client finds the server: a socket path, unix:PATH, or http://host:port (MUNGE over
    # TCP); empty: the socket setting if given, else /run/gpuq/gpuq.sock if it exists, else home/gpuq.sock.
    server: str = ""
    # host:port the server also listens on for other nodes, each request carrying a MUNGE
    # credential; empty: no TCP.
    listen: str = ""
    # The TCP listener's certificate chain and private key (PEM files): with them it speaks HTTPS,
    # so outputs, diffs and credentials cross the network encrypted; empty: plain HTTP.
    tls_cert: str = ""
    tls_key: str = ""
    # The client's CA bundle for an https:// GPUQ_SERVER (a lab's own CA); empty: the system's.
    tls_ca: str = ""
    # munged's socket, for the client's credentials and the server's decoding (Debian's default).
    munge_socket: str = "/run/munge/munge.socket.2"
    # Jobs one user may have pending at once; past it a submit is refused whole.
    max_pending_per_user: int = 10_000
    # An allocation (`gpuq alloc`) or a `gpuq run`'s job whose client has not been heard from for
    # this many seconds (ssh dropped, client killed) is ended as client_lost and everything it
    # started is stopped (service/kept_jobs.py); the client says it is alive every third of this.
    alloc_keepalive: float = 30.0
    # GPU memory held back for each shared job's CUDA context, MiB, on top of its share (--mem): the
    # shares plus these never exceed a GPU's memory beside what other programs use.
    shared_context_mib: int = 512
    # Seconds a shared job may use more GPU memory than its share (a transient peak) before its
    # worker stops it as gpu_mem_exceeded.
    shared_mem_grace: float = 3.0

    @functools.cached_property
    def time_limits(self) -> tuple[int | None, int | None]:
        """default_time and max_time in seconds (None where not set); a job without --time gets the
        first, else the second."""
        from gpuq.service.units import parse_duration

        most = parse_duration(self.max_time) if self.max_time else None
        return (parse_duration(self.default_time) if self.default_time else most), most

    @functools.cached_property
    def preempt_exempt_s(self) -> int:
        """preempt_exempt in seconds (0: none)."""
        from gpuq.service.units import parse_duration

        return parse_duration(self.preempt_exempt) if self.preempt_exempt else 0

    @functools.cached_property
    def idle_limit_s(self) -> int:
        """idle_limit in seconds (0: none)."""
        from gpuq.service.units import parse_duration

        return parse_duration(self.idle_limit) if self.idle_limit else 0

    @functools.cached_property  # asked on every transaction; replace() makes a new object, nothing stale
    def database(self) -> str:
        """The effective database URL."""
        return self.database_url or f"sqlite:///{self.home / 'gpuq.db'}"

    @functools.cached_property
    def broker(self) -> str:
        """The effective broker URL: the configured one, else the local Redis that `gpuq up` runs,
        with the password it generated for it when there is one (root's stack always has one)."""
        if self.broker_url:
            return self.broker_url
        try:
            password = self.redis_secret.read_text().strip()
        except OSError:
            password = ""
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.redis_port}/0"

    @property
    def redis_secret(self) -> Path:
        """The password of the Redis that `gpuq up` runs as root (mode 0600: gpuq's own processes only)."""
        return self.home / "redis.secret"

    @property
    def server_socket(self) -> Path:
        """The Unix socket `gpuq server` listens on."""
        if self.socket:
            return Path(self.socket).expanduser()
        return Path(SYSTEM_SOCKET) if os.geteuid() == 0 else self.home / "gpuq.sock"

    @property
    def broker_is_managed(self) -> bool:
        """True when no broker was configured, so `gpuq up` may start one itself."""
        return not self.broker_url

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    @property
    def snapshots(self) -> Path:
        """The directory job snapshots go to."""
        return Path(self.snapshot_dir).expanduser() if self.snapshot_dir else self.home / "snapshots"

    @property
    def admin_users(self) -> frozenset[str]:
        return frozenset(u.strip() for u in self.admins.split(",") if u.strip())

    @property
    def idle_exempt_users(self) -> frozenset[str]:
        """``idle_limit_exempt`` as names."""
        return frozenset(u.strip() for u in self.idle_limit_exempt.split(",") if u.strip())

    @functools.cached_property
    def gpu_limits(self) -> dict[str, int]:
        """``user_gpu_limits`` by user (checked at load: ``gpu_limits.parse``); read once."""
        from gpuq.service.gpu_limits import parse

        return parse(self.user_gpu_limits)

    def gpu_limit_of(self, user: str) -> int:
        """The GPUs ``user``'s jobs may hold at once; 0: no limit."""
        from gpuq.service.gpu_limits import limit_of

        return limit_of(user, self.user_gpu_limit, self.gpu_limits)

    @property
    def gpu_limited(self) -> bool:
        """Whether any user is held to a GPU limit."""
        from gpuq.service.gpu_limits import any_limit

        return any_limit(self.user_gpu_limit, self.gpu_limits)

    def with_overrides(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


_TYPES = {"Path": Path, "str": str, "int": int, "float": float, "bool": bool}


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the settings from ``environ`` (default: the process environment) and the config file."""
    return _load(environ)[0]


def setting_sources(environ: Mapping[str, str] | None = None) -> tuple[Settings, Path, dict[str, str]]:
    """The settings, the config file looked at, and where each field came from: "env", "file" or
    "default" (for `gpuq config`)."""
    return _load(environ)


def _load(environ: Mapping[str, str] | None) -> tuple[Settings, Path, dict[str, str]]:
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = config_file(env)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory" + (" (GPUQ_CONFIG)" if env.get("GPUQ_CONFIG") else ""))
    # A GPUQ_CONFIG naming no file is no file, like the default path: the tests, benchmarks and
    # scripts say "no file" that way (GPUQ_CONFIG=/nonexistent/...); `gpuq config` says "(none there)".
    if path.is_file():
        import tomllib  # only with a file: every `gpuq` command reads the settings

        try:
            values.update(tomllib.loads(path.read_text()))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {' '.join(str(exc).split())}") from None
    known = {f.name: f for f in dataclasses.fields(Settings)}
    for key in list(values):
        if key not in known:
            raise ConfigError(f"unknown setting {key!r} in {path}{file_key_hint(key, known)}")
    check_env_names(env, known)
    sources = {name: "file" if name in values else "default" for name in known}
    for name in known:
        env_name = ENV_PREFIX + name.upper()
        if env_name in env:
            values[name] = env[env_name]
            sources[name] = "env"
    typed = {}
    for name, raw in values.items():
        try:
            typed[name] = coerce(name, raw, _TYPES[str(known[name].type)])
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({origin(name, sources, path)})") from None
    settings = Settings(**typed)
    check_values(settings, sources, path)
    check_urls(settings)
    return settings, path, sources


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``, fit for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read once."""
    return load_settings()


def secret_env_names() -> tuple[str, ...]:
    """Environment variables a job must never inherit from its worker."""
    return ("GPUQ_DATABASE_URL", "GPUQ_BROKER_URL", "GPUQ_CONFIG")


_SECRET_WORDS = ("password", "secret", "token")


def masked(name: str, value: Any) -> Any:
    """A setting's value fit to print: URLs with their password masked, secret-named settings hidden."""
    if any(word in name.lower() for word in _SECRET_WORDS):
        return "***" if value not in ("", None) else value
    if isinstance(value, str) and "://" in value:
        return mask_url(value)
    return value


# Fields whose empty default means "derived": shown as the value gpuq really uses.
_EFFECTIVE = {"database_url": "database", "broker_url": "broker", "snapshot_dir": "snapshots"}


def shown_settings(settings: Settings, sources: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every setting fit to print (`gpuq config`, ``GET /v1/config``), by field name: ``value``, the
    one gpuq really uses (a derived default resolved) masked as ``masked`` masks it; ``source``,
    where it came from (``sources``); ``env``, the variable that sets it."""
    shown = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, _EFFECTIVE.get(f.name, f.name))
        value = str(value) if isinstance(value, Path) else value
        shown[f.name] = {"value": masked(f.name, value), "source": sources[f.name], "env": ENV_PREFIX + f.name.upper()}
    return shown
