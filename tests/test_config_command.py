"""`gpuq config` shows what the queue runs with: the server's settings (GET /v1/config), as far as
the caller may see them, and the client's own that find that server; with no server answering, the
client's own settings, said to be the local view. Secrets never leave the server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuq.service import constants as c
from gpuq.service.settings import config_file, mask_url
from tests import test_multiuser as multiuser
from tests.conftest import ThreadServer, make_settings, serving, settings_env
from tests.test_cli_speed import PROBE

pytestmark = pytest.mark.timeout(300)

box = multiuser.box  # root's `gpuq up` stack and two OS users (tests/test_multiuser.py)
needs_users = multiuser.pytestmark

DB_SECRET, BROKER_SECRET = "DbSecret-q7", "BrokerSecret-k9"


def gpuq(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def rows(text: str) -> dict[str, list[str]]:
    """A section of `gpuq config`'s lines, by variable: [source, value...]."""
    return {ln.split()[0]: ln.split()[1:] for ln in text.splitlines() if ln.startswith("GPUQ_")}


def sections(text: str) -> tuple[str, str, str]:
    """The server's header line, its rows, and the client's rows."""
    head, _, rest = text.partition("\n")
    served, _, client = rest.partition("\nthis client: ")
    return head, served, client


@pytest.fixture
def server(tmp_path):
    """A real server (a thread of this process) whose database and broker URLs carry passwords, and
    whose limits differ from the client's: `gpuq config` asks it only for its settings, never its
    database, so the URLs need not lead anywhere."""
    settings = make_settings(tmp_path / "home", f"postgresql+psycopg://ann:{DB_SECRET}@db.lab/gpuq",
                             f"redis://:{BROKER_SECRET}@broker.lab:6379/0", max_pending_per_user=3,
                             admins="carol,dave")
    running = ThreadServer(settings)
    yield settings
    running.stop()


@pytest.mark.timeout(120)
def test_with_no_server_answering_config_is_the_clients_local_view_and_says_so(tmp_path):
    env = {**settings_env(make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}",
                                        f"redis://:{BROKER_SECRET}@127.0.0.1:1/0")),
           "GPUQ_SOCKET": str(tmp_path / "none.sock"), "GPUQ_SERVER": "", "GPUQ_MAX_PENDING_PER_USER": "5"}
    text = gpuq(["config"], env)
    assert text.returncode == 0, text.stderr
    [note] = text.stderr.splitlines()
    assert note.startswith(f"gpuq: no gpuq server answers at {tmp_path / 'none.sock'}") and "local view" in note
    assert text.stdout.splitlines()[0] == "config file: /nonexistent/gpuq-test.toml (none there)"
    local = rows(text.stdout)
    assert local["GPUQ_MAX_PENDING_PER_USER"] == ["env", "5"] and local["GPUQ_HOME"] == ["env", str(tmp_path / "home")]
    assert local["GPUQ_BROKER_URL"] == ["env", "redis://:***@127.0.0.1:1/0"]
    as_json = gpuq(["config", "--json"], env)
    data = json.loads(as_json.stdout)
    assert data["view"] == "local" and "no gpuq server answers" in data["unreachable"]
    assert data["settings"]["max_pending_per_user"] == {"value": 5, "source": "env", "env": "GPUQ_MAX_PENDING_PER_USER"}
    assert BROKER_SECRET not in text.stdout + text.stderr + as_json.stdout + as_json.stderr


@pytest.mark.timeout(120)
def test_config_shows_the_servers_settings_not_the_clients_and_the_clients_own_server_and_socket(server, tmp_path):
    # The client's environment says otherwise: what the queue runs with is the server's to say.
    env = {**settings_env(server), "GPUQ_MAX_PENDING_PER_USER": "12345", "GPUQ_ADMINS": "mallory",
           "GPUQ_HOME": str(tmp_path / "clients-own-home")}
    text = gpuq(["config"], env)
    assert text.returncode == 0 and text.stderr == "", text.stderr
    head, served, client = sections(text.stdout)
    # The server's config file (this process's), not the client's.
    assert head.startswith(f"gpuq server at {server.socket}: the settings the queue runs with (config file: "
                           f"{config_file()}")
    shown = rows(served)
    # The server's values; "given" where its process's own environment does not give them (a
    # server started with settings of its own, as this one).
    assert shown["GPUQ_MAX_PENDING_PER_USER"] == ["given", "3"] and shown["GPUQ_ADMINS"] == ["given", "carol,dave"]
    assert shown["GPUQ_HOME"] == ["given", str(server.home)]
    # Root here is the server's admin (as its own user is, on a user's own stack): the URLs, masked.
    assert shown["GPUQ_DATABASE_URL"][1] == "postgresql+psycopg://ann:***@db.lab/gpuq"
    assert shown["GPUQ_BROKER_URL"][1] == "redis://:***@broker.lab:6379/0"
    assert rows(client) == {"GPUQ_SERVER": ["env"], "GPUQ_SOCKET": ["env", server.socket],
                            "GPUQ_TLS_CA": ["env"], "GPUQ_MUNGE_SOCKET": ["env", server.munge_socket]}
    as_json = gpuq(["config", "--json"], env)
    data = json.loads(as_json.stdout)
    assert (data["view"], data["server"], data["admin"]) == ("server", server.socket, True)
    assert data["settings"]["max_pending_per_user"]["value"] == 3
    assert data["client"]["settings"]["socket"] == {"value": server.socket, "source": "env", "env": "GPUQ_SOCKET"}
    for out in (text.stdout, as_json.stdout):
        assert DB_SECRET not in out and BROKER_SECRET not in out and "12345" not in out and "mallory" not in out


@pytest.mark.timeout(120)
def test_the_public_view_of_the_config_endpoint_withholds_where_the_database_and_broker_are(server):
    out = subprocess.run(["curl", "-sS", "--unix-socket", server.socket, "-H", f"{c.VIEW_HEADER}: {c.PUBLIC_VIEW}",
                          "http://gpuq/v1/config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["admin"] is False
    for name in ("database_url", "broker_url", "redis_port", "key_prefix", "tls_key"):
        assert data["settings"][name] == {"value": None, "source": None, "env": f"GPUQ_{name.upper()}",
                                          "withheld": True}
    assert data["settings"]["max_pending_per_user"]["value"] == 3
    assert data["settings"]["admins"]["value"] == "carol,dave"
    assert "db.lab" not in out.stdout and "broker.lab" not in out.stdout and DB_SECRET not in out.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("answering", [True, False], ids=["server", "local"])
def test_config_imports_no_sqlalchemy_celery_redis_or_server_code(server, tmp_path, answering):
    env = settings_env(server)
    if not answering:
        env["GPUQ_SOCKET"] = str(tmp_path / "none.sock")
    out = subprocess.run([sys.executable, "-c", PROBE, "config"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY \n" in out.stdout, out.stdout


@needs_users
def test_a_user_of_roots_stack_sees_its_settings_not_their_own_defaults_and_not_where_its_database_is(box):
    password = box.settings.redis_secret.read_text().strip()
    text = box.gpuq(box.a, "config")
    assert text.returncode == 0 and text.stderr == "", text.stderr
    head, served, client = sections(text.stdout)
    assert head.startswith(f"gpuq server at {box.socket}: the settings the queue runs with")
    shown = rows(served)
    assert shown["GPUQ_HOME"] == ["env", str(box.settings.home)]  # root's stack's, not ~/.local/share/gpuq
    assert shown["GPUQ_MAX_PENDING_PER_USER"] == ["env", str(multiuser.MAX_PENDING)]
    assert shown["GPUQ_FAKE_GPUS"] == ["env", "2"] and shown["GPUQ_KILL_GRACE"] == ["env", "1.0"]
    for name in ("GPUQ_DATABASE_URL", "GPUQ_BROKER_URL", "GPUQ_REDIS_PORT", "GPUQ_KEY_PREFIX", "GPUQ_TLS_KEY"):
        assert shown[name] == ["-", "(root", "and", "admins", "only)"], name
    assert rows(client)["GPUQ_SOCKET"] == ["env", box.socket]
    assert ".local/share" not in text.stdout and "sqlite:" not in text.stdout and password not in text.stdout
    assert f":{box.redis_port}/" not in text.stdout
    data = json.loads(box.gpuq(box.a, "config", "--json").stdout)
    assert data["admin"] is False and data["settings"]["database_url"]["withheld"] is True


@needs_users
def test_an_admin_named_by_the_server_sees_where_the_database_and_broker_are_with_their_passwords_masked(box):
    password = box.settings.redis_secret.read_text().strip()
    # The stack's settings with user A named an admin, served on a socket of its own.
    with serving(box.settings, admins=box.a) as admin_settings:
        def config_of(user: str) -> dict:
            done = box.as_user(user, multiuser.GPUQ, "config", "--json",
                               env={**box.user_env(user), "GPUQ_SOCKET": admin_settings.socket})
            assert done.returncode == 0, done.stderr
            assert password not in done.stdout
            return json.loads(done.stdout)

        admin, other = config_of(box.a), config_of(box.b)
    assert admin["admin"] is True and other["admin"] is False
    assert admin["settings"]["database_url"]["value"] == f"sqlite:///{box.settings.home / 'gpuq.db'}"
    assert admin["settings"]["broker_url"]["value"] == mask_url(box.settings.broker) == \
        f"redis://:***@127.0.0.1:{box.redis_port}/0"
    assert admin["settings"]["redis_port"]["value"] == box.redis_port
    assert other["settings"]["database_url"] == {"value": None, "source": None, "env": "GPUQ_DATABASE_URL",
                                                 "withheld": True}
    # Root, through the stack's own server: every setting, the broker's password masked still.
    done = subprocess.run([multiuser.GPUQ, "config"], env=box.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"redis://:***@127.0.0.1:{box.redis_port}/0" in done.stdout and password not in done.stdout

