"""One settings object, from the environment and a file; secrets never shown."""

import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from gpuq.service import constants as c
from gpuq.service import spec
from gpuq.service.errors import ConfigError
from gpuq.service.settings import ADMIN_MAX_PRIORITY, OTHER_ENV, OTHER_ENV_PREFIXES, Settings, load_settings, mask_url
from tests.conftest import make_settings, settings_env

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[1]


def gpuq(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`gpuq ARGS` as a user runs it, with ``env`` and none of this process's GPUQ_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


def refused_in_one_line(out: subprocess.CompletedProcess, says: str) -> None:
    assert out.returncode == c.EXIT_CONFIG == 78, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and says in out.stderr and out.stdout == "", out.stderr


def test_defaults_are_sqlite_in_the_data_dir_and_the_local_redis(tmp_path):
    s = load_settings({"XDG_DATA_HOME": str(tmp_path), "GPUQ_CONFIG": str(tmp_path / "none.toml")})
    assert s.database == f"sqlite:///{Path(s.home) / 'gpuq.db'}"
    # The local Redis; with the password of the Redis a stack of this home made, if one did (root's
    # home is the machine's /var/lib/gpuq, whatever XDG_DATA_HOME says).
    secret = s.redis_secret.read_text().strip() if s.redis_secret.exists() else None
    assert s.broker == (f"redis://:{quote(secret, safe='')}@127.0.0.1:6379/0" if secret else "redis://127.0.0.1:6379/0")
    assert s.broker_is_managed


def test_environment_overrides_the_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('database_url = "postgresql+psycopg://db/gpuq"\nfake_gpus = 4\nkill_grace = 3\n')
    s = load_settings({"GPUQ_CONFIG": str(cfg), "GPUQ_FAKE_GPUS": "8"})
    assert s.database == "postgresql+psycopg://db/gpuq"
    assert s.fake_gpus == 8 and s.kill_grace == 3.0


@pytest.mark.parametrize("env,match", [
    ({"GPUQ_FAKE_GPUS": "two"}, "fake_gpus must be int"),
    ({"GPUQ_KILL_GRACE": "-1"}, "must not be negative"),
    ({"GPUQ_HEARTBEAT_INTERVAL": "nan"}, "heartbeat_interval must be a finite number"),
    ({"GPUQ_BROKER_URL": "amqp://guest@localhost//"}, "redis:// or rediss://"),
    ({"GPUQ_DATABASE_URL": "gpuq.db"}, "not a database URL"),
    ({"GPUQ_WARM_START": "maybe"}, "warm_start must be bool"),
])
def test_malformed_settings_are_refused_with_the_setting_named(env, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        load_settings({"GPUQ_CONFIG": str(tmp_path / "none.toml"), **env})


def test_unknown_key_in_the_file_is_refused(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('databse_url = "x"\n')
    with pytest.raises(ConfigError, match="unknown setting 'databse_url'"):
        load_settings({"GPUQ_CONFIG": str(cfg)})


def test_passwords_are_masked_in_urls():
    assert mask_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert mask_url("postgresql+psycopg://bob:pw@db/gpuq") == "postgresql+psycopg://bob:***@db/gpuq"
    assert mask_url("sqlite:///x.db") == "sqlite:///x.db"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_root_keeps_its_state_in_var_lib_gpuq_and_serves_on_run_gpuq_and_a_user_in_their_own_home(tmp_path):
    # What `sudo gpuq up` and a user's `gpuq up` use with no settings at all.
    from tests.conftest import venv_reachable_by_everyone

    venv_reachable_by_everyone()
    probe = ("from gpuq.service.settings import load_settings; s = load_settings(); "
             "print(s.home, s.server_socket, s.database)")
    user_home = tmp_path / "nobodys-home"
    user_home.mkdir()
    tmp_path.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "GPUQ_CONFIG": "/nonexistent/gpuq-test.toml"}

    def settings_of(*prefix: str, home: str) -> list[str]:
        done = subprocess.run([*prefix, sys.executable, "-c", probe], env={**env, "HOME": home}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert settings_of(home="/root") == ["/var/lib/gpuq", "/run/gpuq/gpuq.sock", "sqlite:////var/lib/gpuq/gpuq.db"]
    own = user_home / ".local" / "share" / "gpuq"
    assert settings_of("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", home=str(user_home)) == [
        str(own), str(own / "gpuq.sock"), f"sqlite:///{own / 'gpuq.db'}"]


def _env(tmp_path: Path, **variables: str) -> dict[str, str]:
    return {"GPUQ_CONFIG": str(tmp_path / "none.toml"), "XDG_DATA_HOME": str(tmp_path), **variables}


@pytest.mark.parametrize("variables,match", [
    # Text for an int is a whole number: "2.7" used to be refused only as "two" was.
    ({"GPUQ_FAKE_GPUS": "2.7"}, r"setting fake_gpus must be int \(a whole number\), got '2.7' \(GPUQ_FAKE_GPUS\)"),
    ({"GPUQ_FAKE_GPUS": "true"}, "fake_gpus must be int"),
    ({"GPUQ_MAX_OUTPUT_BYTES": "inf"}, "max_output_bytes must be int"),
    ({"GPUQ_KILL_GRACE": "inf"}, "setting kill_grace must be a finite number, got 'inf'"),
    ({"GPUQ_VISIBILITY_TIMEOUT": "-inf"}, "visibility_timeout must be a finite number"),
    ({"GPUQ_HEARTBEAT_INTERVAL": "0"},
     r"setting heartbeat_interval must be above 0, got 0 \(GPUQ_HEARTBEAT_INTERVAL\)"),
    ({"GPUQ_SCHEDULER_INTERVAL": "0"}, "scheduler_interval must be above 0"),
    ({"GPUQ_ALLOC_KEEPALIVE": "0"}, "alloc_keepalive must be above 0"),
    ({"GPUQ_RESEND_AFTER": "0"}, "resend_after must be above 0"),
    ({"GPUQ_VISIBILITY_TIMEOUT": "0"}, "visibility_timeout must be above 0"),
    ({"GPUQ_FAIRSHARE_HALF_LIFE_H": "0"}, "fairshare_half_life_h must be above 0"),
    ({"GPUQ_IDLE_WINDOW": "0"}, "idle_window must be above 0"),
    ({"GPUQ_FAKE_GPU_MEMORY_MIB": "0"}, "fake_gpu_memory_mib must be above 0"),
    ({"GPUQ_FAKE_GPU_NAMES": "A100,\x1b[2J"}, r"setting fake_gpu_names takes model names separated by commas .*"
                                              r"got '\\x1b\[2J' \(GPUQ_FAKE_GPU_NAMES\)"),
    ({"GPUQ_FAKE_GPU_NAMES": "A100,,H100"}, "setting fake_gpu_names takes model names"),
    ({"GPUQ_REDIS_PORT": "70000"}, "setting redis_port must be a TCP port, 1 to 65535, got 70000"),
    ({"GPUQ_REDIS_PORT": "0"}, "redis_port must be a TCP port"),
    ({"GPUQ_MAX_PRIORITY": "1001"}, "setting max_priority must be at most 1000, the admins' highest --priority"),
    ({"GPUQ_USER_GPU_LIMITS": "alice:1"}, r"setting user_gpu_limits takes USER=GPUS pairs separated by commas, e\.g\. "
                                         r"alice=1,pi=0 \(0: no limit\), got 'alice:1' \(GPUQ_USER_GPU_LIMITS\)"),
    ({"GPUQ_USER_GPU_LIMITS": "alice=1,bob=-2"}, "USER=GPUS pairs .* got 'bob=-2'"),
    ({"GPUQ_USER_GPU_LIMITS": "alice=two"}, "USER=GPUS pairs .* got 'alice=two'"),
    ({"GPUQ_USER_GPU_LIMITS": "al ice=2"}, "USER=GPUS pairs .* got 'al ice=2'"),
    ({"GPUQ_USER_GPU_LIMITS": "alice=1,alice=2"},
     r"setting user_gpu_limits gives alice twice \(GPUQ_USER_GPU_LIMITS\)"),
    ({"GPUQ_DATABASE_URL": "foo://bar"}, "GPUQ_DATABASE_URL must be a SQLite or PostgreSQL URL"),
    ({"GPUQ_DATABASE_URL": "postgres://db/gpuq"}, "GPUQ_DATABASE_URL must be a SQLite or PostgreSQL URL"),
    ({"GPUQ_DATABASE_URL": "mysql+pymysql://u:pw@db/gpuq"}, r"SQLite or PostgreSQL URL .*, got mysql\+pymysql://u:\*\*\*@"),
    ({"GPUQ_BROKER_URL": "redis://broker:99999/0"}, r"GPUQ_BROKER_URL is not a URL \(Port out of range"),
    ({"GPUQ_BROKER_URL": "unix:///run/redis.sock"}, "redis:// or rediss://"),
    ({"GPUQ_MAX_TIME": "a week"}, r"setting max_time is not a time as --time reads one \(--time takes .*"
                                  r"got 'a week'; GPUQ_MAX_TIME\)"),
    ({"GPUQ_DEFAULT_TIME": "0"}, r"setting default_time is not a time .*at least 1s"),
    ({"GPUQ_PREEMPT_EXEMPT": "soon"}, r"setting preempt_exempt is not a time as --time reads one .*PREEMPT_EXEMPT\)"),
    ({"GPUQ_IDLE_LIMIT": "overnight"}, r"setting idle_limit is not a time as --time reads one .*GPUQ_IDLE_LIMIT\)"),
    ({"GPUQ_DEFAULT_TIME": "2-00:00:00", "GPUQ_MAX_TIME": "1d"},
     r"setting default_time \(2-00:00:00, GPUQ_DEFAULT_TIME\) is longer than max_time \(1d, GPUQ_MAX_TIME\)"),
    # Refused by the server only as it started (`gpuq up`: exit 69 after seconds), `gpuq config` said 0.
    ({"GPUQ_LISTEN": "nonsense"}, r"GPUQ_LISTEN must be host:port \(a TCP port, 1 to 65535\), got 'nonsense'"),
    ({"GPUQ_LISTEN": ":99999"}, "GPUQ_LISTEN must be host:port"),
    ({"GPUQ_LISTEN": "http://localhost:8000"}, "GPUQ_LISTEN must be host:port"),  # a URL: the server crashed
    # A client told where no server can be said 69, "no server answers".
    ({"GPUQ_SERVER": "ftp://x"}, "GPUQ_SERVER 'ftp://x': ftp:// is not a way to reach a gpuq server"),
    ({"GPUQ_SERVER": "http://"}, "GPUQ_SERVER 'http://': it names no host"),
    ({"GPUQ_SERVER": "http://localhost:99999"}, "its port is not a TCP port"),
    ({"GPUQ_SERVER": "unix:"}, "GPUQ_SERVER 'unix:': it names no socket"),
    ({"GPUQ_SERVER": "node1:8642"}, r"GPUQ_SERVER 'node1:8642': a socket path must be absolute \(a host is http://"),
    ({"GPUQ_SERVER": "unix:run/gpuq.sock"}, "a socket path must be absolute"),
    ({"GPUQ_REQUEUE": "always"}, r"setting requeue must be retries, yes or no \(a job without --requeue or "
                                 r"--no-requeue .*\), got 'always' \(GPUQ_REQUEUE\)"),
])
def test_values_that_would_break_the_stack_are_refused_naming_the_setting(variables, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        load_settings(_env(tmp_path, **variables))


@pytest.mark.parametrize("variables,check", [
    ({"GPUQ_SAMPLE_INTERVAL": "0"}, lambda s: s.sample_interval == 0),  # documented: no sampling
    ({"GPUQ_SHUTDOWN_GRACE": "0", "GPUQ_SNAPSHOT_RETENTION_DAYS": "0", "GPUQ_KILL_GRACE": "0"},
     lambda s: (s.shutdown_grace, s.snapshot_retention_days, s.kill_grace) == (0, 0, 0)),
    ({"GPUQ_MAX_OUTPUT_BYTES": "1e3", "GPUQ_FAKE_GPUS": "2.0"},
     lambda s: (s.max_output_bytes, s.fake_gpus) == (1000, 2)),
    ({"GPUQ_MAX_PRIORITY": "1000", "GPUQ_REDIS_PORT": "65535"},
     lambda s: (s.max_priority, s.redis_port) == (1000, 65535)),
    ({"GPUQ_HEARTBEAT_INTERVAL": "5", "GPUQ_LEASE_TIMEOUT": "10", "GPUQ_WORKER_TIMEOUT": "10"},
     lambda s: (s.lease_timeout, s.worker_timeout) == (10, 10)),
    ({"GPUQ_DATABASE_URL": "sqlite+pysqlite:////tmp/x.db"}, lambda s: s.database.startswith("sqlite+pysqlite")),
    # SQLAlchemy takes a password urlsplit would stumble on: only the scheme is checked.
    ({"GPUQ_DATABASE_URL": "postgresql+psycopg://ann:p#[w@db/gpuq"}, lambda s: s.database.endswith("@db/gpuq")),
    ({"GPUQ_BROKER_URL": "rediss://:pw@broker:6380/2"}, lambda s: s.broker.startswith("rediss://")),
    # SLURM's forms and gpuq's; without a default, a job without --time gets the maximum.
    ({"GPUQ_DEFAULT_TIME": "1:00:00", "GPUQ_MAX_TIME": "7-00:00:00"}, lambda s: s.time_limits == (3600, 7 * 86400)),
    ({"GPUQ_MAX_TIME": "12h"}, lambda s: s.time_limits == (12 * 3600, 12 * 3600)),
    ({}, lambda s: s.time_limits == (None, None)),
    ({"GPUQ_REQUEUE": "yes"}, lambda s: s.requeue == "yes"),
])
def test_values_that_mean_something_are_still_accepted(variables, check, tmp_path):
    assert check(load_settings(_env(tmp_path, **variables)))


@pytest.mark.parametrize("variables,first,second", [
    ({"GPUQ_HEARTBEAT_INTERVAL": "20"}, r"lease_timeout \(30 s, the default\)",
     r"heartbeat_interval \(20 s, GPUQ_HEARTBEAT_INTERVAL\)"),
    ({"GPUQ_LEASE_TIMEOUT": "3"}, r"lease_timeout \(3 s, GPUQ_LEASE_TIMEOUT\)",
     r"heartbeat_interval \(2 s, the default\)"),
    ({"GPUQ_WORKER_TIMEOUT": "0.75", "GPUQ_HEARTBEAT_INTERVAL": "0.5"},
     r"worker_timeout \(0.75 s, GPUQ_WORKER_TIMEOUT\)",
     r"heartbeat_interval \(0.5 s, GPUQ_HEARTBEAT_INTERVAL\)"),
])
def test_a_lease_or_worker_timeout_under_two_heartbeats_names_both_settings(variables, first, second, tmp_path):
    # A lease renewed every heartbeat that lasts less than two of them ran out on every job ("worker lost").
    with pytest.raises(ConfigError, match=f"setting {first} must be at least twice {second}"):
        load_settings(_env(tmp_path, **variables))


@pytest.mark.parametrize("content,says", [
    ('admins = 7\n', "setting admins must be text or a list of names, got 7"),
    ('admins = ["cal", 7]\n', "setting admins must be text or a list of names, got ['cal', 7]"),
    ('idle_limit_exempt = 7\n', "setting idle_limit_exempt must be text or a list of names, got 7"),
    ('node = ["a", "b"]\n', "setting node must be text, got ['a', 'b']"),
    ('fake_gpus = 2.7\n', "setting fake_gpus must be int (a whole number), got 2.7"),
    ('fake_gpus = true\n', "setting fake_gpus must be int (a whole number), got true"),
    ('kill_grace = false\n', "setting kill_grace must be float (a number), got false"),
    ('kill_grace = inf\n', "setting kill_grace must be a finite number, got inf"),
    ('warm_start = 0.5\n', "setting warm_start must be bool (true or false), got 0.5"),
    ('home = 3\n', "setting home must be a path (text), got 3"),
    ('user_gpu_limits = {alice = "two"}\n', "setting user_gpu_limits must be text or a table of users' GPUs, got "
                                              "{'alice': 'two'}"),
])
def test_a_toml_value_of_the_wrong_type_is_refused_naming_the_setting_and_the_file(content, says, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(content)
    with pytest.raises(ConfigError) as caught:
        load_settings({"GPUQ_CONFIG": str(cfg)})
    assert str(caught.value) == f"{says} (in {cfg})"


def test_some_users_own_gpu_limits_stand_in_for_everyones_from_the_environment_or_a_toml_table(tmp_path):
    s = load_settings(_env(tmp_path, GPUQ_USER_GPU_LIMIT="2", GPUQ_USER_GPU_LIMITS=" alice=1, pi=0,"))
    assert s.gpu_limits == {"alice": 1, "pi": 0}
    assert [s.gpu_limit_of(u) for u in ("alice", "pi", "bob")] == [1, 0, 2] and s.gpu_limited
    assert not load_settings(_env(tmp_path, GPUQ_USER_GPU_LIMITS="pi=0")).gpu_limited  # nobody is held to one
    assert load_settings(_env(tmp_path, GPUQ_USER_GPU_LIMITS="bob=3")).gpu_limit_of("bob") == 3
    cfg = tmp_path / "c.toml"
    cfg.write_text('user_gpu_limit = 4\n[user_gpu_limits]\nalice = 1\n"svc.bot" = 0\n')
    s = load_settings({"GPUQ_CONFIG": str(cfg), "XDG_DATA_HOME": str(tmp_path)})
    assert (s.user_gpu_limits, s.gpu_limit_of("alice"), s.gpu_limit_of("svc.bot"), s.gpu_limit_of("x")) == (
        "alice=1,svc.bot=0", 1, 0, 4)


def test_a_toml_list_of_admins_and_integral_floats_are_taken_as_meant(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('admins = ["cal", "dee"]\nmax_output_bytes = 1e3\nfake_gpu_memory_mib = 8192.0\nkill_grace = 3\n'
                   'idle_limit_exempt = ["demo"]\n')
    s = load_settings({"GPUQ_CONFIG": str(cfg), "XDG_DATA_HOME": str(tmp_path)})
    assert s.admin_users == {"cal", "dee"} and s.admins == "cal,dee" and s.idle_exempt_users == {"demo"}
    assert (s.max_output_bytes, s.fake_gpu_memory_mib, s.kill_grace) == (1000, 8192, 3.0)
    assert type(s.max_output_bytes) is int and type(s.kill_grace) is float


def test_the_users_priority_limit_is_held_to_the_admins_highest_priority():
    assert ADMIN_MAX_PRIORITY == spec.ADMIN_MAX_PRIORITY


def test_a_mistyped_gpuq_variable_stops_every_command_with_one_line_naming_the_setting_meant(tmp_path):
    # GPUQ_ADMIN=cal was ignored: the queue ran with no admins at all.
    env = {"GPUQ_CONFIG": str(tmp_path / "none.toml"), "GPUQ_HOME": str(tmp_path / "home"), "GPUQ_ADMIN": "cal"}
    for command in (["config"], ["status"]):
        refused_in_one_line(gpuq(command, env),
                            "unknown setting GPUQ_ADMIN in the environment (did you mean GPUQ_ADMINS?)")
    with pytest.raises(ConfigError, match="unknown setting GPUQ_FROBNICATE in the environment: unset it"):
        load_settings(_env(tmp_path, GPUQ_FROBNICATE="1"))


def test_a_bad_value_in_the_environment_stops_every_command_with_one_line(tmp_path):
    env = {"GPUQ_CONFIG": str(tmp_path / "none.toml"), "GPUQ_HOME": str(tmp_path / "home"),
           "GPUQ_HEARTBEAT_INTERVAL": "0"}
    for command in (["config"], ["status"]):
        refused_in_one_line(gpuq(command, env), "setting heartbeat_interval must be above 0")


def test_gpuq_runs_inside_a_job_whose_environment_carries_gpuqs_own_variables(tmp_path):
    # What a worker, `gpuq alloc` and a sweep set in a job's environment, and the client's own: a
    # job may run `gpuq` itself. Each is known by name (no GPUQ_JOB_ID here, which lets any pass).
    env = {"GPUQ_CONFIG": str(tmp_path / "none.toml"), "GPUQ_HOME": str(tmp_path / "home"),
           "GPUQ_SOCKET": str(tmp_path / "no.sock"), "GPUQ_RIDE_OUT": "0",
           **{name: "1" for name in OTHER_ENV - {"GPUQ_CONFIG", "GPUQ_JOB_ID"}},
           "GPUQ_SWEEP_LR": "0.1", "GPUQ_SWEEP_BATCH_SIZE": "32", "GPUQ_NODE": "n1", "GPUQ_TEST_REDIS": "redis://x"}
    out = gpuq(["config", "--json"], env)
    assert out.returncode == 0, out.stderr
    assert '"view": "local"' in out.stdout


def test_inside_a_job_a_gpuq_variable_this_version_does_not_know_is_let_pass(tmp_path):
    # A worker of a newer gpuq may set one in the job's environment; the job's own `gpuq` runs on.
    env = {"GPUQ_CONFIG": str(tmp_path / "none.toml"), "GPUQ_HOME": str(tmp_path / "home"),
           "GPUQ_SOCKET": str(tmp_path / "no.sock"), "GPUQ_RIDE_OUT": "0", "GPUQ_JOB_ID": "7",
           "GPUQ_FROM_A_NEWER_WORKER": "1"}
    out = gpuq(["config", "--json"], env)
    assert out.returncode == 0, out.stderr
    # Not a job: the same variable is refused.
    del env["GPUQ_JOB_ID"]
    refused_in_one_line(gpuq(["config"], env), "unknown setting GPUQ_FROM_A_NEWER_WORKER in the environment")


# Python names that hold no variable: cli/follow.py's GPUQ_ENDS (failures), tests/test_compose.py's
# GPUQ_SERVICES (compose services), the settings docstring's GPUQ_X (any setting); and the README's
# example of a mistyped one, GPUQ_ADMIN.
_NOT_VARIABLES = {"GPUQ_ENDS", "GPUQ_SERVICES", "GPUQ_X", "GPUQ_ADMIN"}
_SCANNED = ("cli", "service", "workers", "server", "web", "migrations", "benchmarks", "scripts", "tests", ".ci",
            "README.md", "docker-compose.yml", "Dockerfile", "pyproject.toml")


def test_every_gpuq_variable_the_code_reads_or_sets_is_a_setting_or_known_so_none_is_refused(tmp_path):
    # Found by reading the code and the docs, so a variable added later without a place in
    # OTHER_ENV fails here, not in every job that runs `gpuq`.
    files = [p for top in _SCANNED for p in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".db")
             and p.name not in ("settings.py", "test_settings.py")]
    names = {m for p in files for m in re.findall(r"(?<![A-Za-z0-9_])GPUQ_[A-Z0-9_]+",
                                                  p.read_text(errors="replace"))}
    assert {"GPUQ_JOB_ID", "GPUQ_RUN_ID", "GPUQ_SERVER", "GPUQ_SWEEP_LR", "GPUQ_TEST_REDIS"} <= names, names
    settings = {"GPUQ_" + f.name.upper() for f in dataclasses.fields(Settings)}
    unknown = sorted(n for n in names - _NOT_VARIABLES - settings - OTHER_ENV if not n.startswith(OTHER_ENV_PREFIXES))
    assert unknown == []
    # Outside a job too (inside one, with GPUQ_JOB_ID, none is refused).
    load_settings(_env(tmp_path, **dict.fromkeys(names - _NOT_VARIABLES - settings - {"GPUQ_JOB_ID"}, "1")))


def test_every_value_the_test_stacks_give_their_processes_is_accepted(tmp_path):
    for overrides in ({}, {"lease_timeout": 4.0, "heartbeat_interval": 0.5, "worker_timeout": 4.0,
                           "scheduler_interval": 0.3, "resend_after": 3.0, "kill_grace": 1.0, "visibility_timeout": 1.0,
                           "sample_interval": 0.0, "alloc_keepalive": 2.0, "admins": "carol,dave"}):
        env = settings_env(make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}",
                                         "redis://127.0.0.1:6379/13", **overrides), base={})
        load_settings(env)


def test_a_config_path_that_is_a_directory_is_one_line_and_exit_78_and_a_missing_one_is_no_file(tmp_path):
    env = {"GPUQ_CONFIG": str(tmp_path), "GPUQ_HOME": str(tmp_path / "home")}
    refused_in_one_line(gpuq(["config"], env), f"config file {tmp_path} is a directory (GPUQ_CONFIG)")
    # The default place as a directory is as wrong.
    (tmp_path / "xdg" / "gpuq" / "config.toml").mkdir(parents=True)
    with pytest.raises(ConfigError, match="config.toml is a directory$"):
        load_settings({"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    # A GPUQ_CONFIG naming no file stays "no file": the tests, benchmarks and scripts say it so.
    assert load_settings({"GPUQ_CONFIG": str(tmp_path / "none.toml")}).fake_gpus == 0


def test_the_log_rotation_settings_are_read_from_the_environment_and_the_file_and_a_bad_one_is_one_line(tmp_path):
    s = load_settings(_env(tmp_path))
    assert (s.log_rotate_mib, s.log_rotate_keep) == (64, 4)
    cfg = tmp_path / "c.toml"
    cfg.write_text("log_rotate_mib = 16\nlog_rotate_keep = 2\n")
    s = load_settings({"GPUQ_CONFIG": str(cfg), "XDG_DATA_HOME": str(tmp_path)})
    assert (s.log_rotate_mib, s.log_rotate_keep) == (16, 2)
    s = load_settings({"GPUQ_CONFIG": str(cfg), "XDG_DATA_HOME": str(tmp_path), "GPUQ_LOG_ROTATE_MIB": "0",
                       "GPUQ_LOG_ROTATE_KEEP": "10"})
    assert (s.log_rotate_mib, s.log_rotate_keep) == (0, 10)  # 0: no rotation
    for variables, says in (({"GPUQ_LOG_ROTATE_MIB": "-1"}, "setting log_rotate_mib must not be negative, got '-1'"),
                            ({"GPUQ_LOG_ROTATE_MIB": "0.5"},
                             "setting log_rotate_mib must be int (a whole number), got '0.5' (GPUQ_LOG_ROTATE_MIB)"),
                            ({"GPUQ_LOG_ROTATE_KEEP": "-2"}, "setting log_rotate_keep must not be negative")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_settings(_env(tmp_path, **variables))
    cfg.write_text("log_rotate_keep = 1.5\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({"GPUQ_CONFIG": str(cfg)})
    assert str(caught.value) == f"setting log_rotate_keep must be int (a whole number), got 1.5 (in {cfg})"
    refused_in_one_line(gpuq(["config"], {"GPUQ_CONFIG": str(tmp_path / "none.toml"), "GPUQ_HOME": str(tmp_path / "h"),
                                          "GPUQ_LOG_ROTATE_MIB": "2.5"}), "setting log_rotate_mib must be int")


def test_folders_made_for_the_servers_socket_are_0755_whatever_the_umask(tmp_path):
    # Under a root shell's umask 000 they were 0777: anyone could replace the socket.
    from gpuq.service.system_home import socket_folder

    old = os.umask(0)
    try:
        socket_folder(tmp_path / "run" / "gpuq" / "gpuq.sock")
    finally:
        os.umask(old)
    for folder in (tmp_path / "run", tmp_path / "run" / "gpuq"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder


def test_a_socket_folder_every_user_may_write_is_refused_but_a_sticky_one_is_not(tmp_path):
    from gpuq.service.errors import StackError
    from gpuq.service.system_home import socket_folder

    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(StackError, match=r"which every user may write \(mode 0777\): anyone could replace the socket"):
        socket_folder(open_to_all / "gpuq.sock")
    # A folder above it that every user may write: they could rename the socket's folder away.
    (open_to_all / "sub").mkdir(mode=0o755)
    with pytest.raises(StackError, match=f"is under {open_to_all}, which every user may write"):
        socket_folder(open_to_all / "sub" / "gpuq.sock")
    open_to_all.chmod(0o1777)  # as /tmp: only the socket's owner may remove it
    socket_folder(open_to_all / "gpuq.sock")
    socket_folder(open_to_all / "sub" / "gpuq.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="hands a folder to another user")
def test_a_socket_folder_another_user_owns_is_refused(tmp_path):
    from gpuq.service.errors import StackError
    from gpuq.service.system_home import socket_folder

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(StackError, match=f"is under {theirs}, which nobody owns: they could replace the socket"):
        socket_folder(theirs / "gpuq.sock")
