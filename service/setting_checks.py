"""How a setting's value is read and checked: its type from the file's TOML or the environment's
text (``coerce``), the GPUQ_* variables that are not settings, and the values of the right type that
would break the stack (``check_values``, ``check_urls``). Each refusal is one ConfigError line naming
the setting and where it came from; `service/settings.py` holds the settings themselves."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gpuq.service.constants import MAX_CPUS
from gpuq.service.errors import ConfigError

if TYPE_CHECKING:
    from gpuq.service.settings import Settings

ENV_PREFIX = "GPUQ_"


# The environment carries GPUQ_* variables that are not settings: the client's own, those gpuq sets
# in every job's environment (and a job may run `gpuq` itself), and the test harness's. Any other
# GPUQ_* variable is refused, as an unknown key in the file is: a typo (GPUQ_ADMIN=cal) silently
# ignored left a queue without its admins. tests/test_settings.py checks that every GPUQ_ name in
# the code is a setting or listed here. Inside a job (GPUQ_JOB_ID set) none is refused: a job's
# environment is the worker's making (job_variables.check_env_name refuses --env GPUQ_*), and a worker of
# another gpuq version than the `gpuq` a job runs may set a variable this one does not know.
_JOB_MARK = "GPUQ_JOB_ID"
OTHER_ENV = frozenset({
    "GPUQ_CONFIG",  # the config file (config_file)
    "GPUQ_RIDE_OUT",  # the client: how long it rides out a server restart (cli/client.py)
    # Set in a job's environment (workers/execute.py, cli/alloc.py, service/spec.py,
    # service/allocations.py, service/job_cpus.py, service/constants.py's *_VARIABLE).
    _JOB_MARK, "GPUQ_JOB_NAME", "GPUQ_GPUS", "GPUQ_RUN_ID", "GPUQ_WORKER", "GPUQ_ALLOC", "GPUQ_ARRAY_INDEX",
    "GPUQ_MEMORY_FRACTION", "GPUQ_SIMULATED_MEMORY_DIR", "GPUQ_UMASK", "GPUQ_CPUS", "GPUQ_CORES",
})
# Families of them: a sweep's values (GPUQ_SWEEP_<NAME>, service/spec.py), the tests' own services.
OTHER_ENV_PREFIXES = ("GPUQ_SWEEP_", "GPUQ_TEST_")

# Settings a 0 breaks: a loop that never sleeps (heartbeat, scheduler, `gpuq alloc`'s keepalive),
# every worker, lease or allocation given up at once, every dispatch resent or redelivered on each
# pass, a division by zero (fair share's half-life), an idle flag on every job, a GPU of no memory.
# A 0 is a choice for the others, most of them documented ("0: none", "0: until it ends").
_POSITIVE = ("heartbeat_interval", "scheduler_interval", "worker_timeout", "lease_timeout", "resend_after",
             "visibility_timeout", "alloc_keepalive", "fairshare_half_life_h", "idle_window", "fake_gpu_memory_mib")
# Settings renewed or refreshed every heartbeat: one late heartbeat must not end them.
_HEARTBEATS = 2
_PER_HEARTBEAT = ("lease_timeout", "worker_timeout")
# The highest --priority an admin may give (service/spec.py's ADMIN_MAX_PRIORITY; importing it
# here would be circular): the users' limit cannot exceed it.
ADMIN_MAX_PRIORITY = 1000
# The most host memory a node may offer, MiB: what a row's integer holds (2 PiB).
MAX_NODE_MEM_MIB = 2**31 - 1
# Database URL schemes gpuq runs on (service/dialect.py): SQLite and PostgreSQL, with any driver.
_DATABASES = ("sqlite", "postgresql")


def _shown(raw: Any) -> str:
    """A value as its writer wrote it, short enough for one line."""
    text = ("true" if raw else "false") if isinstance(raw, bool) else repr(raw)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: float) -> str:
    """A number as a person writes it: 0.5, 30, 70000 (not 3e+01 or 7e+04)."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def _whole(raw: Any) -> int | None:
    """An integer from a TOML integer, an integral float (1e3, 1000.0) or the text of either; None
    for anything else (2.7, true, inf, a list, "two")."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
        try:
            raw = float(raw)
        except ValueError:
            return None
    if isinstance(raw, float) and math.isfinite(raw) and raw.is_integer() and abs(raw) < 2**53:
        return int(raw)
    return None


def coerce(name: str, raw: Any, kind: type) -> Any:
    """``raw`` (text from the environment, any TOML value from the file) as a ``kind``, or ConfigError."""
    value: Any
    if kind is bool:
        value = raw if isinstance(raw, bool) else None
        if isinstance(raw, (str, int)) and not isinstance(raw, bool):
            value = {"1": True, "true": True, "yes": True, "on": True,
                     "0": False, "false": False, "no": False, "off": False, "": False}.get(str(raw).strip().lower())
    elif kind is int:
        value = _whole(raw)
    elif kind is float:
        value = None
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw)
            except ValueError:
                pass
        if value is not None and not math.isfinite(value):  # inf, and NaN (no comparison holds for it)
            raise ConfigError(f"setting {name} must be a finite number, got {_shown(raw)}")
    elif name in ("admins", "idle_limit_exempt") and isinstance(raw, list) and all(isinstance(u, str) for u in raw):
        value = ",".join(u.strip() for u in raw)  # admins = ["ann", "bob"]: what a TOML user writes
    elif name == "user_gpu_limits" and isinstance(raw, dict) and all(
            isinstance(n, int) and not isinstance(n, bool) for n in raw.values()):
        value = ",".join(f"{u}={n}" for u, n in raw.items())  # user_gpu_limits = {alice = 1}: a TOML table
    else:  # str, Path: text only; a TOML list or number here is a mistake, not a name
        value = (Path(raw).expanduser() if kind is Path else raw) if isinstance(raw, str) else None
    if value is None:
        text = {"admins": "text or a list of names", "idle_limit_exempt": "text or a list of names",
                "user_gpu_limits": "text or a table of users' GPUs"}
        what = {int: "int (a whole number)", float: "float (a number)", bool: "bool (true or false)",
                Path: "a path (text)"}.get(kind, text.get(name, "text"))
        raise ConfigError(f"setting {name} must be {what}, got {_shown(raw)}")
    if kind in (int, float) and value < 0:
        raise ConfigError(f"setting {name} must not be negative, got {_shown(raw)}")
    return value


def origin(name: str, sources: Mapping[str, str], path: Path) -> str:
    """Where setting ``name`` came from, for a message: its variable, the file, or the default."""
    return {"env": ENV_PREFIX + name.upper(), "file": f"in {path}"}.get(sources[name], "the default")


def check_env_names(env: Mapping[str, str], known: Mapping[str, Any]) -> None:
    """ConfigError for a GPUQ_* variable that is neither a setting nor one of OTHER_ENV, outside a job."""
    if _JOB_MARK in env:
        return
    names = {ENV_PREFIX + name.upper() for name in known}
    for var in env:
        if var.startswith(ENV_PREFIX) and var not in names and var not in OTHER_ENV \
                and not var.startswith(OTHER_ENV_PREFIXES):
            import difflib  # only for the message

            near = difflib.get_close_matches(var, sorted(names), n=1, cutoff=0.75)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown setting {var} in the environment{hint}: unset it, or see `gpuq config` "
                              "for the settings")


def file_key_hint(key: str, known: Mapping[str, Any]) -> str:
    """" (did you mean ...?)" for a config file's unknown key: the setting a variable's name
    (GPUQ_MAX_TIME) or a near spelling (max_pending_per_usr) means; "" for none."""
    name = key.lower().removeprefix(ENV_PREFIX.lower())
    if name in known:
        return f" (did you mean {name}? the file takes the settings' names, without {ENV_PREFIX})"
    import difflib  # only for the message

    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {near[0]}?)" if near else ""


# GPUQ_REQUEUE's words, and the word a job submitted without --requeue or --no-requeue gets for each.
REQUEUE_DEFAULT: dict[str, bool | None] = {"retries": None, "yes": True, "no": False}
REQUEUE_WORDS = tuple(REQUEUE_DEFAULT)
# GPUQ_CPU_BIND's words (SLURM's --cpu-bind): bound to cores of its own, or to none.
CPU_BIND_WORDS = ("cores", "none")


def check_values(settings: Settings, sources: Mapping[str, str], path: Path) -> None:
    """ConfigError for a value of the right type that would break the stack, naming the setting(s)."""
    def fail(name: str, why: str) -> None:
        raise ConfigError(f"setting {name} {why}, got {_number(getattr(settings, name))} "
                          f"({origin(name, sources, path)})")

    for name in _POSITIVE:
        if not getattr(settings, name) > 0:
            fail(name, "must be above 0")
    if not 1 <= settings.redis_port <= 65535:
        fail("redis_port", "must be a TCP port, 1 to 65535")
    if not 0 <= settings.cpus_per_gpu <= MAX_CPUS:
        fail("cpus_per_gpu", f"must be between 0 (no limit) and {MAX_CPUS} (CPU cores a job may use for each GPU)")
    if not 0 <= settings.node_cpus <= MAX_CPUS:
        fail("node_cpus", f"must be between 0 (the cores the worker may run on) and {MAX_CPUS} (CPU cores this node "
                          "offers jobs)")
    if not 0 <= settings.host_mem_per_gpu_mib <= MAX_NODE_MEM_MIB:
        fail("host_mem_per_gpu_mib", f"must be between 0 (no limit) and {MAX_NODE_MEM_MIB} (MiB of host memory a "
                                     "command may use for each GPU)")
    if not 0 <= settings.node_host_mem_mib <= MAX_NODE_MEM_MIB:
        fail("node_host_mem_mib", f"must be between 0 (the machine's memory) and {MAX_NODE_MEM_MIB} (MiB of host "
                                  "memory this node offers jobs)")
    if not 0 <= settings.preemptible_charge <= 1:
        fail("preemptible_charge", "must be between 0 and 1 (what a preemptible job's GPU-hour counts in fair share)")
    if settings.requeue not in REQUEUE_WORDS:
        raise ConfigError(f"setting requeue must be {', '.join(REQUEUE_WORDS[:-1])} or {REQUEUE_WORDS[-1]} (a job "
                          f"without --requeue or --no-requeue is put back after a failure of the machinery: if it "
                          f"asked for --retries, always, never), got {settings.requeue[:60]!r} "
                          f"({origin('requeue', sources, path)})")
    if settings.cpu_bind not in CPU_BIND_WORDS:
        raise ConfigError(f"setting cpu_bind must be {' or '.join(CPU_BIND_WORDS)} (whether a command with --cpus "
                          f"runs on cores of its own), got {settings.cpu_bind[:60]!r} "
                          f"({origin('cpu_bind', sources, path)})")
    if settings.max_priority > ADMIN_MAX_PRIORITY:
        fail("max_priority", f"must be at most {ADMIN_MAX_PRIORITY}, the admins' highest --priority")
    _check_time_limits(settings, sources, path)
    if settings.user_gpu_limits:
        from gpuq.service.gpu_limits import parse

        try:
            parse(settings.user_gpu_limits)
        except ConfigError as exc:
            raise ConfigError(f"setting {exc} ({origin('user_gpu_limits', sources, path)})") from None
    _check_addresses(settings, sources, path)
    if settings.fake_gpu_names:
        from gpuq.service.devices import parse_names  # only where it is set: the client's path stays light

        try:
            parse_names(settings.fake_gpu_names, 1)
        except ConfigError as exc:
            raise ConfigError(f"setting {exc} ({origin('fake_gpu_names', sources, path)})") from None
    if settings.fake_gpu_cores:
        from gpuq.service.devices import parse_cores

        try:
            parse_cores(settings.fake_gpu_cores, 1)
        except ConfigError as exc:
            raise ConfigError(f"setting {exc} ({origin('fake_gpu_cores', sources, path)})") from None
    beat = settings.heartbeat_interval
    for name in _PER_HEARTBEAT:
        if getattr(settings, name) < _HEARTBEATS * beat:
            raise ConfigError(
                f"setting {name} ({_number(getattr(settings, name))} s, {origin(name, sources, path)}) must be at "
                f"least twice heartbeat_interval ({_number(beat)} s, {origin('heartbeat_interval', sources, path)}): "
                "it is renewed every heartbeat, and one late heartbeat must not end it")


def listen_address(listen: str) -> tuple[str, int]:
    """GPUQ_LISTEN as the server binds it: (host, port); ``:PORT`` or ``0.0.0.0:PORT`` is every
    address, ``[::1]:PORT`` an IPv6 one. ConfigError for anything else."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or "/" in host:  # http://h:1: a URL
        raise ConfigError(f"GPUQ_LISTEN must be host:port (a TCP port, 1 to 65535), got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def server_problem(address: str) -> str | None:
    """Why GPUQ_SERVER's value names no server a client could reach (None: it may): a socket path,
    unix:PATH, or http(s)://host:port."""
    if "://" in address:
        try:  # urlsplit and .port raise ValueError on a bracket left open or a port past 65535
            parts = urlsplit(address)
            port = parts.port
        except ValueError:
            return "its port is not a TCP port (1 to 65535)"
        if parts.scheme not in ("http", "https"):
            return f"{parts.scheme}:// is not a way to reach a gpuq server"
        if not parts.hostname:
            return "it names no host"
        if port == 0:
            return "its port is not a TCP port (1 to 65535)"
        return None
    socket = address.removeprefix("unix:")
    if not socket.strip():
        return "it names no socket"
    if not socket.startswith("/"):
        # Read from wherever the command runs: a host name or host:port without http:// lands here.
        return "a socket path must be absolute (a host is http://host:port)"
    return None


def _check_addresses(settings: Settings, sources: Mapping[str, str], path: Path) -> None:
    if settings.listen:
        try:
            listen_address(settings.listen)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({origin('listen', sources, path)})") from None
    why = server_problem(settings.server) if settings.server else None
    if why is not None:
        raise ConfigError(f"GPUQ_SERVER {settings.server[:200]!r}: {why}; use a socket path, unix:PATH or "
                          f"http(s)://host:port ({origin('server', sources, path)})")


def _check_time_limits(settings: Settings, sources: Mapping[str, str], path: Path) -> None:
    """default_time, max_time, preempt_exempt and idle_limit read as --time does, the default no longer than
    the maximum."""
    from gpuq.service.errors import InvalidSpec
    from gpuq.service.units import parse_duration

    seconds = {}
    for name in ("default_time", "max_time", "preempt_exempt", "idle_limit"):
        text = getattr(settings, name)
        if text:
            try:
                seconds[name] = parse_duration(text)
            except InvalidSpec as exc:
                raise ConfigError(f"setting {name} is not a time as --time reads one ({exc}; "
                                  f"{origin(name, sources, path)})") from None
    if "default_time" in seconds and "max_time" in seconds and seconds["default_time"] > seconds["max_time"]:
        raise ConfigError(f"setting default_time ({settings.default_time}, {origin('default_time', sources, path)}) "
                          f"is longer than max_time ({settings.max_time}, {origin('max_time', sources, path)})")


def check_urls(settings: Settings) -> None:
    from gpuq.service.settings import mask_url

    try:  # as kombu reads it (urlparse, then the port): a port past 65535 or not a number is a traceback there
        broker = urlsplit(settings.broker)
        broker.port  # noqa: B018 - read for its check
    except ValueError as exc:
        raise ConfigError(f"GPUQ_BROKER_URL is not a URL ({exc}): {mask_url(settings.broker)}") from None
    if broker.scheme not in ("redis", "rediss"):
        raise ConfigError(f"GPUQ_BROKER_URL must be a redis:// or rediss:// URL, got {mask_url(settings.broker)}")
    if "://" not in settings.database:
        raise ConfigError(f"GPUQ_DATABASE_URL is not a database URL: {mask_url(settings.database)}")
    # The scheme as SQLAlchemy reads it, which takes a password urlsplit would not ('#', '[').
    if settings.database.split("://", 1)[0].split("+", 1)[0] not in _DATABASES:  # postgresql+psycopg: a driver
        raise ConfigError(f"GPUQ_DATABASE_URL must be a SQLite or PostgreSQL URL (sqlite:///PATH, "
                          f"postgresql+psycopg://...), got {mask_url(settings.database)}")
