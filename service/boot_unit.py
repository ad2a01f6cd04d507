"""The stack as a systemd service (`gpuq unit`): started at boot, restarted if its supervisor dies,
stopped at shutdown with its running jobs given their grace, as SLURM's own units do for its daemons.

The unit runs `gpuq up` and `gpuq down` themselves (``Type=forking``: `gpuq up` returns once the
workers have registered, and systemd then follows the supervisor through its pid file), so the
service is the stack an admin starts by hand, not a second way of running it. It carries no
setting but the config file's path: a unit file is readable by every user (`systemctl show` prints
its variables), so a password never goes in it, and settings kept in one file (root's, mode 0600
where it holds one) are the same for the service and for root's own `gpuq drain` or `gpuq resume`.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

from gpuq.service.settings import ENV_PREFIX, Settings
from gpuq.service.stack import pid_file, running_supervisor

# `gpuq up`'s wait for the workers inside the unit, and systemd's start timeout around it: a first
# start on a real GPU loads torch and CUDA in each warm worker.
START_TIMEOUT_S = 300
# What systemd adds to `gpuq down`'s grace before it kills what is left: the stop's own work.
STOP_MARGIN_S = 60


def gpuq_executable() -> str:
    """The absolute path of the `gpuq` command running now: the one the unit must run, whichever of
    several installations (a venv, /usr/local) this is."""
    here = Path(sys.argv[0])
    if here.name == "gpuq" and here.is_file():
        return str(here.resolve().parent / here.name) if not here.is_absolute() else str(here)
    beside = Path(sys.executable).parent / "gpuq"
    if beside.is_file():
        return str(beside)
    found = shutil.which("gpuq")
    return str(Path(found).absolute()) if found else str(beside)


def unit(settings: Settings, config: Path, gpuq: str, grace: float, system: bool) -> str:
    """The unit file's text: a system service (root's stack, every user's queue) or, for a user's
    own stack, a user service (`systemctl --user`)."""
    quoted = shlex.quote(gpuq)
    where = "/etc/systemd/system" if system else "~/.config/systemd/user"
    ctl = "systemctl" if system else "systemctl --user"
    lines = [
        f"# gpuq's stack as a systemd {'service' if system else 'user service'}: started at "
        f"{'boot' if system else 'login (or boot, with `loginctl enable-linger`)'}, restarted if its supervisor dies,",
        f"# stopped at shutdown with running jobs given {grace:g} s. Made by `gpuq unit` for {gpuq}.",
        f"# Install: gpuq unit > {where}/gpuq.service && {ctl} daemon-reload && {ctl} enable --now gpuq",
        "# Its settings are the config file's below (GPUQ_* variables of a shell do not reach it).",
        "",
        "[Unit]",
        "Description=gpuq: the job queue in front of this machine's GPUs",
        *(["After=network-online.target nvidia-persistenced.service", "Wants=network-online.target"]
          if system else []),
        "",
        "[Service]",
        "Type=forking",
        f"Environment={_quoted_assignment('GPUQ_CONFIG', str(config))}",
        f"ExecStart={quoted} up --timeout {START_TIMEOUT_S}",
        f"ExecStop={quoted} down --grace {grace:g}",
        f"PIDFile={pid_file(settings)}",
        f"TimeoutStartSec={START_TIMEOUT_S + 30}",
        f"TimeoutStopSec={int(grace) + STOP_MARGIN_S}",
        "Restart=on-failure",
        "RestartSec=5",
        # The cgroups below the service's are gpuq's to make (workers/cgroup.py makes a job's under
        # its worker's where the memory controller is enabled there), not systemd's to clean away.
        "Delegate=yes",
        # gpuq's own processes stop by `gpuq down`: systemd signals only what outlives it.
        "KillMode=mixed",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


def _quoted_assignment(name: str, value: str) -> str:
    """``NAME=value`` as systemd's Environment= takes it: quoted whole where the value has a space,
    a quote or a backslash (systemd's own rules: C-style escapes inside double quotes), and each
    % doubled (systemd expands %-specifiers in it)."""
    value = value.replace("%", "%%")
    if any(ch in value for ch in ' "\\\'\t'):
        return '"' + f"{name}={value}".replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"{name}={value}"


def before_install(settings: Settings, config: Path, sources: dict[str, str]) -> list[str]:
    """What would make the service's first start fail or differ from this shell's stack, each in a
    line: settings this shell sets by GPUQ_* variables (``sources``, as ``setting_sources`` gives
    them), a stack up now that systemd did not start, a Redis without a password on the port."""
    said = []
    unseen = sorted(name for name, source in sources.items() if source == "env")
    if unseen:
        names = ", ".join(ENV_PREFIX + name.upper() for name in unseen)
        said.append(f"{names} set in this shell will not reach the service: put them in {config} "
                    f"({', '.join(f'{name} = ...' for name in unseen)}) before you install it")
    supervisor = running_supervisor(settings)
    if supervisor is not None and not _under_systemd(supervisor.pid):
        said.append(f"this stack is up now, started by hand (supervisor pid {supervisor.pid}): `gpuq down` before "
                    "`systemctl enable --now gpuq`, or the service's start finds it up and fails")
    if settings.broker_is_managed:
        from gpuq.service import broker

        if broker.asks_no_password(settings):
            said.append(f"a Redis that asks no password answers on port {settings.redis_port}, so the service's "
                        f"`gpuq up` would refuse to start: set redis_port in {config} to a free port")
    return said


def _under_systemd(pid: int) -> bool:
    """Whether process ``pid`` runs as part of a systemd service (systemd gives each its INVOCATION_ID)."""
    try:
        variables = Path(f"/proc/{pid}/environ").read_text(errors="replace").split("\0")
    except OSError:
        return False
    return any(v.startswith("INVOCATION_ID=") for v in variables)
