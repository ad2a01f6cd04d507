"""One settings object, from the environment and a file; secrets never shown."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from gpuq.service.errors import ConfigError
from gpuq.service.settings import load_settings, mask_url


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
    ({"GPUQ_HEARTBEAT_INTERVAL": "nan"}, "heartbeat_interval must be a number"),
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
