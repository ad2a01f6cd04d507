"""`gpuq unit`: the stack as a systemd service, started at boot and stopped at shutdown.

No systemd runs here as PID 1, so the unit is checked twice without it: by systemd's own
`systemd-analyze verify`, and by doing what systemd does with a ``Type=forking`` unit: run its
ExecStart in a bare environment with its Environment= alone, wait for that process to exit, find
the service's main process through its PIDFile, then run its ExecStop and see everything gone.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpuq.service import boot_unit
from gpuq.service.settings import Settings
from tests.conftest import free_port, socket_path
from tests.faults import PrivateRedis

pytestmark = pytest.mark.timeout(240)

# What systemd gives a system service: its own PATH, no HOME (no User=), nothing of a shell's.
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def gpuq_unit(config: Path, *args: str, **variables: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
           "GPUQ_CONFIG": str(config), **variables}
    return subprocess.run([sys.executable, "-m", "gpuq.cli", "unit", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def keys(text: str) -> dict[str, list[str]]:
    """A unit file's keys and their values, in order (a key may come more than once)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def private_config(tmp_path: Path, redis_port: int | None = None) -> Path:
    home = tmp_path / "home"
    config = tmp_path / "gpuq.toml"
    port = redis_port or free_port()
    config.write_text(f'home = "{home}"\nsocket = "{socket_path()}"\nredis_port = {port}\nfake_gpus = 2\n'
                      f'node = "unitnode"\nwarm_start = false\nfake_gpu_memory_dir = "{home / "sim"}"\n')
    return config


def test_the_unit_runs_this_gpuqs_up_and_down_with_the_config_file_alone_and_systemd_accepts_it(tmp_path):
    config = private_config(tmp_path)
    made = gpuq_unit(config, "--grace", "45")
    assert made.returncode == 0 and made.stderr == "", made.stderr
    found = keys(made.stdout)
    gpuq = str(Path(sys.executable).parent / "gpuq")  # the console script of this installation
    assert found["ExecStart"] == [f"{gpuq} up --timeout {boot_unit.START_TIMEOUT_S}"]
    assert found["ExecStop"] == [f"{gpuq} down --grace 45"]
    assert found["TimeoutStopSec"] == [str(45 + boot_unit.STOP_MARGIN_S)]
    # Its one variable is where its settings are: no password in a file every user can read.
    assert found["Environment"] == [f"GPUQ_CONFIG={config}"]
    assert found["PIDFile"] == [str(tmp_path / "home" / "run" / "supervisor.pid")]
    assert found["Type"] == ["forking"] and found["Restart"] == ["on-failure"]
    system = os.geteuid() == 0
    assert found["WantedBy"] == ["multi-user.target" if system else "default.target"]
    assert f"gpuq unit > {'/etc/systemd/system' if system else '~/.config/systemd/user'}/gpuq.service" in made.stdout
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here to verify the unit with")
    unit_file = tmp_path / "gpuq.service"
    unit_file.write_text(made.stdout)
    verified = subprocess.run(["systemd-analyze", "verify", str(unit_file)], capture_output=True, text=True,
                              timeout=60)
    # Unknown keys, bad values and a command that is not executable are all said on stderr.
    assert verified.returncode == 0 and verified.stderr == "", verified.stderr


def test_gpuq_unit_names_the_shells_variables_the_service_will_not_see(tmp_path):
    config = private_config(tmp_path)
    made = gpuq_unit(config, GPUQ_KILL_GRACE="7", GPUQ_MAX_TIME="2h")
    assert made.returncode == 0 and "ExecStart=" in made.stdout
    assert made.stderr == (f"gpuq: GPUQ_KILL_GRACE, GPUQ_MAX_TIME set in this shell will not reach the service: put "
                           f"them in {config} (kill_grace = ..., max_time = ...) before you install it\n")


def test_gpuq_unit_warns_of_a_redis_without_a_password_on_the_port_the_services_up_would_refuse(tmp_path):
    open_redis = PrivateRedis(tmp_path)
    try:
        config = private_config(tmp_path, redis_port=open_redis.port)
        made = gpuq_unit(config)
    finally:
        open_redis.stop()
    assert made.returncode == 0 and "ExecStart=" in made.stdout
    assert made.stderr == (f"gpuq: a Redis that asks no password answers on port {open_redis.port}, so the service's "
                           f"`gpuq up` would refuse to start: set redis_port in {config} to a free port\n")


def test_a_config_path_with_spaces_and_percents_is_quoted_as_systemd_reads_it(tmp_path):
    assert boot_unit._quoted_assignment("GPUQ_CONFIG", "/etc/gpuq/config.toml") == "GPUQ_CONFIG=/etc/gpuq/config.toml"
    assert boot_unit._quoted_assignment("GPUQ_CONFIG", '/srv/lab "a"/100%.toml') == \
        '"GPUQ_CONFIG=/srv/lab \\"a\\"/100%%.toml"'
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here")
    odd = tmp_path / "lab config" / "100%.toml"
    odd.parent.mkdir()
    text = boot_unit.unit(Settings(home=tmp_path / "home"), odd, "/usr/local/bin/gpuq", 30, system=True)
    (tmp_path / "gpuq.service").write_text(text.replace("/usr/local/bin/gpuq", shutil.which("true")))
    verified = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "gpuq.service")], capture_output=True,
                              text=True, timeout=60)
    assert verified.returncode == 0 and verified.stderr == "", verified.stderr


def test_a_users_own_stack_gets_a_user_service_wanted_by_their_session(tmp_path):
    text = boot_unit.unit(Settings(home=tmp_path / "home"), tmp_path / "c.toml", "/opt/gpuq/bin/gpuq", 30, system=False)
    found = keys(text)
    assert found["WantedBy"] == ["default.target"] and "After" not in found
    assert "systemctl --user enable --now gpuq" in text and "loginctl enable-linger" in text


@pytest.mark.slow
def test_the_units_start_and_stop_keep_the_contract_of_a_forking_service(tmp_path):
    config = private_config(tmp_path)
    found = keys(gpuq_unit(config).stdout)
    name, _, value = found["Environment"][0].partition("=")
    env = {"PATH": SYSTEMD_PATH, name: value}
    pid_file = Path(found["PIDFile"][0])
    start = subprocess.run(shlex.split(found["ExecStart"][0]), env=env, capture_output=True, text=True,
                           timeout=int(found["TimeoutStartSec"][0]))
    try:
        # systemd takes the service as started when ExecStart's process exits 0, and follows the
        # main process the PIDFile names from then on: the supervisor, up, with its workers.
        assert start.returncode == 0, start.stdout + start.stderr
        assert "gpuq is up: 2 worker(s)" in start.stdout
        main = psutil.Process(int(pid_file.read_text()))
        assert "gpuq.service.supervisor" in " ".join(main.cmdline())
        family = [main, *main.children(recursive=True)]
        assert sum("gpuq.workers" in " ".join(p.cmdline()) for p in family) == 2
        status = subprocess.run([sys.executable, "-m", "gpuq.cli", "status"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and "unitnode" in status.stdout, status.stderr
        # Up by hand as far as systemd knows (no INVOCATION_ID): enabling the unit now would fail its start.
        again = gpuq_unit(config)
        assert (f"gpuq: this stack is up now, started by hand (supervisor pid {main.pid}): `gpuq down` before "
                "`systemctl enable --now gpuq`") in again.stderr, again.stderr
    finally:
        stop = subprocess.run(shlex.split(found["ExecStop"][0]), env=env, capture_output=True, text=True,
                              timeout=int(found["TimeoutStopSec"][0]))
    assert stop.returncode == 0 and "gpuq is down" in stop.stdout, stop.stdout + stop.stderr
    # Nothing left for systemd's final kill, and no pid file to mislead its next start.
    assert not pid_file.exists()
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
