"""docker-compose.yml, checked without a Docker engine: `docker compose config` where the compose
plugin exists, a structural check of services, images, volumes, GPU reservations, healthchecks and
grace periods always; and every service's command line run here for real, against the test Redis
and a fresh PostgreSQL database, so no command in the file is one that does not exist."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from sqlalchemy import select

from gpuq.migrations.versions import HEAD
from gpuq.service import db
from gpuq.service.db import write_scope
from gpuq.service.models import Gpu
from tests.conftest import free_port, make_settings, new_postgres_database, run_cli, settings_env, wait_for_socket
from tests.test_end_to_end import submit, wait_for_state

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
# What a lab admin puts in .env; the passwords have no default on purpose.
ADMIN_ENV = {"POSTGRES_PASSWORD": "pg-secret-1", "REDIS_PASSWORD": "redis-secret-1", "GPUQ_NODE": "composenode"}
GPUQ_SERVICES = ("migrate", "server", "scheduler", "worker-gpu0", "worker-gpu1", "dashboard", "flower")
# Where the server listens in its container: the host's /run/gpuq, bind-mounted.
SERVER_SOCKET = "/run/gpuq/gpuq.sock"
BIN = Path(sys.executable).parent


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $$, ${N}, ${N:-default}, ${N-default}, ${N:?error}, nested."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                if text.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                depth -= text[j] == "}"
                j += 1
            body = text[i + 2:j - 1]
            name, op, rest = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(:-|:\?|-|\?)?(.*)$", body, re.S).groups()
            value = env.get(name)
            if op in (":-", "-") and (value is None or (op == ":-" and value == "")):
                value = interpolate(rest, env)
            elif op in (":?", "?") and (value is None or (op == ":?" and value == "")):
                raise ValueError(f"{name}: {interpolate(rest, env)}")
            out.append(value or "")
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def resolved(value, env):
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [resolved(v, env) for v in value]
    if isinstance(value, dict):
        return {k: resolved(v, env) for k, v in value.items()}
    return value


def load(env: dict[str, str] | None = None) -> dict:
    """The compose file with its anchors merged and its variables substituted."""
    return resolved(yaml.safe_load(COMPOSE.read_text()), ADMIN_ENV if env is None else env)


def seconds(text: str) -> float:
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", text))


def test_docker_compose_config_accepts_the_file_where_the_compose_plugin_exists():
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` plugin here; the structural tests below check the file")
    env = {**os.environ, **ADMIN_ENV}
    out = subprocess.run([docker, "compose", "-f", str(COMPOSE), "--profile", "flower", "config", "-q"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_services_images_volumes_commands_healthchecks_and_grace_periods():
    doc = load()
    services = doc["services"]
    assert set(services) == {"redis", "postgres", *GPUQ_SERVICES}
    assert services["redis"]["image"].startswith("redis:") and services["postgres"]["image"].startswith("postgres:")
    for name in GPUQ_SERVICES:
        s = services[name]
        assert s["image"] == "gpuq:latest" and s["build"]["target"] == "cuda", name
        assert isinstance(s["command"], list) and s["command"], name
        if name == "dashboard":  # a client of the server (checked below), with no credentials
            continue
        if name != "migrate":  # the migration needs only PostgreSQL
            assert s["depends_on"]["redis"]["condition"] == "service_healthy", name
        env = s["environment"]
        assert env["GPUQ_DATABASE_URL"].startswith("postgresql+psycopg://") and env["GPUQ_BROKER_URL"].startswith("redis://")
        assert env["GPUQ_NODE"] == "composenode"
    for name in ("server", "scheduler", "worker-gpu0", "worker-gpu1", "flower"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["restart"] == "no" and services["migrate"]["command"] == ["gpuq", "db", "upgrade"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("redis", "postgres", "server", "dashboard"):
        assert services[name]["healthcheck"]["test"], name
    # Named volumes; the server's bind mounts of host paths are checked below.
    used = {v.split(":", 1)[0] for s in services.values() for v in s.get("volumes", []) if not v.startswith("/")}
    assert used == set(doc["volumes"]) == {"redis-data", "postgres-data", "snapshots", "cores"}
    assert services["postgres"]["volumes"] == ["postgres-data:/var/lib/postgresql/data"]
    assert services["redis"]["volumes"] == ["redis-data:/data"]
    # Warm shutdown: a worker's running job gets minutes to finish, and is interrupted cleanly
    # (its end written) before Docker's SIGKILL.
    for name in ("worker-gpu0", "worker-gpu1"):
        grace = seconds(services[name]["stop_grace_period"])
        assert grace >= 300 and 0 < float(services[name]["environment"]["GPUQ_SHUTDOWN_GRACE"]) <= grace - 30
    assert all(seconds(services[n]["stop_grace_period"]) >= 10
               for n in ("server", "scheduler", "dashboard", "redis", "postgres"))
    assert services["flower"]["profiles"] == ["flower"]
    assert all("profiles" not in s for n, s in services.items() if n != "flower")
    # The database URL the gpuq services use is the one the postgres service creates.
    url = urlsplit(services["scheduler"]["environment"]["GPUQ_DATABASE_URL"])
    pg = services["postgres"]["environment"]
    assert (url.username, url.password, url.hostname, url.path) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
                                                                     "postgres", "/" + pg["POSTGRES_DB"])
    broker = urlsplit(services["scheduler"]["environment"]["GPUQ_BROKER_URL"])
    assert (broker.password, broker.hostname) == (ADMIN_ENV["REDIS_PASSWORD"], "redis")
    # Published on the host's localhost only: a read-only page is still nobody else's business.
    assert services["dashboard"]["ports"] == ["127.0.0.1:8642:8642"]
    assert services["flower"]["ports"] == ["127.0.0.1:5555:5555"]


def test_the_server_runs_as_root_on_the_hosts_run_gpuq_socket_and_names_uids_as_the_host_does():
    services = load()["services"]
    server = services["server"]
    assert server["command"] == ["gpuq", "server"]
    # Root: the caller is the socket peer's uid (SO_PEERCRED), the host's uid without a user namespace.
    assert server["user"] == "root"
    # (and the workers, which run each command as its owner: the next test)
    # (and the scheduler, which removes snapshots past their retention, each its submitter's: below)
    assert all("user" not in s for n, s in services.items()
               if n not in ("server", "scheduler") and not n.startswith("worker-gpu"))
    assert server["environment"]["GPUQ_SOCKET"] == SERVER_SOCKET
    assert "GPUQ_LISTEN" not in server["environment"]  # TCP with MUNGE is the admin's choice (commented out)
    assert "ports" not in server
    assert "/run/gpuq:/run/gpuq" in server["volumes"]
    assert {"/etc/passwd:/etc/passwd:ro", "/etc/group:/etc/group:ro"} <= set(server["volumes"])
    # The other services use the database directly; only the server takes users' requests, and
    # the dashboard is a client of it (the socket read-only, no database or broker password).
    assert all(not any(str(v).startswith("/run/gpuq") for v in s.get("volumes", []))
               for n, s in services.items() if n not in ("server", "dashboard"))
    dashboard = services["dashboard"]
    assert dashboard["volumes"] == ["/run/gpuq:/run/gpuq:ro"]
    assert dashboard["environment"] == {"GPUQ_SOCKET": SERVER_SOCKET}
    assert dashboard["depends_on"] == {"server": {"condition": "service_healthy"}}
    kind, *check = server["healthcheck"]["test"]
    assert kind == "CMD" and check[:2] == ["python", "-c"] and SERVER_SOCKET in check[2]
    text = COMPOSE.read_text()
    assert "# GPUQ_LISTEN:" in text and "/run/munge:/run/munge" in text


def test_workers_run_commands_as_their_owner_where_they_were_submitted_and_share_snapshots_with_the_server():
    # As the image's `gpuq` user, without the host's homes, every user's command ran as one uid, and
    # a command submitted from a home directory was refused at submit (the server saw no such directory).
    services = load()["services"]
    server = services["server"]
    assert "/home:/home:ro" in server["volumes"]
    snapshots = server["environment"]["GPUQ_SNAPSHOT_DIR"]
    assert f"snapshots:{snapshots}" in server["volumes"] and "snapshots" in load()["volumes"]
    for name, worker in services.items():
        if not name.startswith("worker-gpu"):
            continue
        assert worker["user"] == "root"
        assert {"/etc/passwd:/etc/passwd:ro", "/etc/group:/etc/group:ro", "/home:/home",
                f"snapshots:{snapshots}"} <= set(worker["volumes"])
        assert worker["environment"]["GPUQ_SNAPSHOT_DIR"] == snapshots
        assert worker["environment"]["GPUQ_DATABASE_URL"] == server["environment"]["GPUQ_DATABASE_URL"]


def test_a_nodes_worker_containers_keep_one_record_of_the_cores_their_commands_are_bound_to():
    # Each container has a file system of its own: without one volume where the record lives, each
    # worker would see only its own job's cores, and two jobs of the node could take the same ones.
    from gpuq.service.settings import SYSTEM_HOME
    from gpuq.workers.core_binding import record_path

    services = load()["services"]
    workers = [s for name, s in services.items() if name.startswith("worker-gpu")]
    assert len(workers) >= 2 and all(w["user"] == "root" and "GPUQ_HOME" not in w["environment"] for w in workers)
    # Root's home (SYSTEM_HOME) holds the record; every worker mounts the one volume there.
    where = record_path(make_settings(Path(SYSTEM_HOME), "sqlite://", "redis://"), "composenode").parent
    assert all(f"cores:{where}" in w["volumes"] for w in workers)
    assert not any(f"cores:{where}" in s.get("volumes", []) for name, s in services.items()
                   if not name.startswith("worker-gpu"))


def test_without_passwords_the_file_refuses_to_resolve():
    for missing in ("POSTGRES_PASSWORD", "REDIS_PASSWORD"):
        with pytest.raises(ValueError, match=missing):
            load({k: v for k, v in ADMIN_ENV.items() if k != missing})


def test_each_worker_reserves_the_nodes_gpus_by_id_and_is_pinned_to_its_own():
    services = load()["services"]
    workers = {n: s for n, s in services.items() if n.startswith("worker-gpu")}
    ids = None
    for name, s in workers.items():
        index = name.removeprefix("worker-gpu")
        assert s["command"] == ["gpuq", "worker", "--gpu", index]
        assert s["environment"]["CUDA_VISIBLE_DEVICES"] == index
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and "count" not in device
        assert "utility" in device["capabilities"]  # NVML, for the device samples
        assert index in device["device_ids"]
        # Every worker sees the same GPUs, so a multi-GPU job's process sees all of its GPUs and the
        # containers' NVML indices agree; ascending, so those indices are the list's positions.
        assert ids is None or device["device_ids"] == ids
        ids = device["device_ids"]
        assert s["pid"] == "host" and seconds(s["stop_grace_period"]) >= 300
    assert ids == sorted(ids, key=int) and ids == [str(i) for i in range(len(workers))]


def test_redis_command_line_runs_with_an_append_only_file_noeviction_and_a_password(tmp_path):
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.skip("no redis-server here")
    argv = load()["services"]["redis"]["command"]
    assert argv[0] == "redis-server"
    port = free_port()
    # The file's command line, plus where this test's copy listens and keeps its files.
    proc = subprocess.Popen([redis_server, *argv[1:], "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, password=ADMIN_ENV["REDIS_PASSWORD"], socket_connect_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis did not start"
                time.sleep(0.1)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 2 * 1024 ** 3
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_connect_timeout=2).ping()
        client.set("k", "v")
        assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
        # Its healthcheck, as Docker runs it in the container (with the container's environment).
        kind, script = load()["services"]["redis"]["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        env = {**os.environ, **load()["services"]["redis"]["environment"]}
        check = subprocess.run(["sh", "-c", script.replace("redis-cli", f"redis-cli -p {port}", 1)], env=env,
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
    finally:
        proc.terminate()
        proc.wait(10)


def _service_env(service: dict, settings) -> dict[str, str]:
    """The service's environment from the file, with the test's database and Redis for the hosts
    `postgres` and `redis` (as another node overrides them), over the test settings; the server's
    socket is the test's (/run/gpuq is root's, and not this test's to take), and only a service
    whose environment names it has it."""
    env = {k: v for k, v in settings_env(settings).items() if k not in ("GPUQ_SOCKET", "GPUQ_SERVER")}
    env.update({k: str(v) for k, v in service["environment"].items()})
    if env.get("GPUQ_SOCKET") == SERVER_SOCKET:
        env["GPUQ_SOCKET"] = str(settings.server_socket)
    if "GPUQ_SNAPSHOT_DIR" in env:  # the volume's path in the containers; the test's own here
        env["GPUQ_SNAPSHOT_DIR"] = str(settings.home / "snapshots")
    return env


def _argv(service: dict, **replace: str) -> list[str]:
    """The service's command line with this venv's executables, and options replaced."""
    argv = list(service["command"])
    argv[0] = str(BIN / argv[0])
    for i, arg in enumerate(argv):
        for option, value in replace.items():
            if arg == option:
                argv[i + 1] = value
            elif arg.startswith(option + "="):
                argv[i] = f"{option}={value}"
    return argv


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: server exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return resp.read().decode()
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"{proc.args} did not stop on SIGTERM within {timeout} s") from None


@pytest.fixture
def compose_db(tmp_path, redis_url, postgres_server):
    """Settings of a fresh, empty PostgreSQL database (the compose file's database kind) and the
    test Redis, and the interpolation values that point the file's services at them."""
    url, drop = new_postgres_database(postgres_server)
    settings = make_settings(tmp_path / "home", url, redis_url, node="composenode", warm_start=False)
    try:
        yield settings, {**ADMIN_ENV, "GPUQ_DATABASE_URL": url, "GPUQ_BROKER_URL": redis_url}
    finally:
        drop()


@pytest.mark.slow
def test_migrate_server_scheduler_worker_and_dashboard_command_lines_run_a_job_and_stop_on_sigterm(compose_db,
                                                                                                     tmp_path):
    settings, values = compose_db
    services = load(values)["services"]
    assert db.current_revision(settings) is None
    migrate = subprocess.run(_argv(services["migrate"]), env=_service_env(services["migrate"], settings),
                             capture_output=True, text=True, timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    assert db.current_revision(settings) == HEAD

    procs: dict[str, subprocess.Popen] = {}
    port = free_port()
    plan = {"server": _argv(services["server"]),
            "scheduler": _argv(services["scheduler"]), "worker-gpu0": _argv(services["worker-gpu0"]),
            "dashboard": _argv(services["dashboard"], **{"--host": "127.0.0.1", "--port": str(port)})}
    try:
        for name, argv in plan.items():
            env = _service_env(services[name], settings)
            if name.startswith("worker"):
                env["GPUQ_FAKE_GPUS"] = "2"  # no NVIDIA GPU here: the simulated ones stand in for NVML
            with open(tmp_path / f"{name}.log", "wb") as out:
                procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)
        # The server, as the file starts it, on its socket (the test's path for /run/gpuq/gpuq.sock).
        sock = settings.server_socket
        wait_for_socket(sock, procs["server"], lambda: (tmp_path / "server.log").read_text()[-3000:], timeout=60)
        kind, *check = services["server"]["healthcheck"]["test"]
        assert kind == "CMD" and check[0] == "python"
        check = [sys.executable, *(a.replace(SERVER_SOCKET, str(sock)) for a in check[1:])]
        health = subprocess.run(check, capture_output=True, text=True, timeout=30)
        assert health.returncode == 0, health.stderr + (tmp_path / "server.log").read_text()[-3000:]
        deadline = time.monotonic() + 60
        while True:
            with write_scope(settings) as session:
                gpu = session.scalar(select(Gpu).where(Gpu.node == "composenode", Gpu.index == 0))
            if gpu is not None and gpu.heartbeat_at is not None:
                break
            assert time.monotonic() < deadline and procs["worker-gpu0"].poll() is None, \
                (tmp_path / "worker-gpu0.log").read_text()[-3000:]
            time.sleep(0.2)
        job = submit(settings, ["--", "true"], cwd=tmp_path)
        assert wait_for_state(settings, job, ("succeeded", "failed"), timeout=60) == "succeeded"
        metrics = _wait_http(f"http://127.0.0.1:{port}/metrics", procs["dashboard"], tmp_path / "dashboard.log")
        assert 'Hostname="composenode"' in metrics and "gpuq_jobs{" in metrics
        kind, *check = services["dashboard"]["healthcheck"]["test"]
        assert kind == "CMD" and check[0] == "python"
        check = [sys.executable, *(a.replace(":8642/", f":{port}/") for a in check[1:])]
        assert subprocess.run(check, capture_output=True, timeout=30).returncode == 0
        # `gpuq status` through the server's socket (a user's client finds it by GPUQ_SOCKET).
        status = run_cli(["status"], settings, extra_env={"GPUQ_SOCKET": str(sock)})
        assert status.returncode == 0, status.stderr
        assert "succeeded" in status.stdout and "composenode" in status.stdout
        for name in ("dashboard", "server", "scheduler", "worker-gpu0"):
            assert _stop(procs[name]) == 0, f"{name}:\n" + (tmp_path / f"{name}.log").read_text()[-3000:]
        assert "scheduler stopped" in (tmp_path / "scheduler.log").read_text()
        assert not sock.exists()  # the server removes its socket when it stops
        failed = run_cli(["status"], settings, extra_env={"GPUQ_SOCKET": str(sock)})
        assert failed.returncode != 0 and "no gpuq server answers" in failed.stderr
        with write_scope(settings) as session:
            assert session.scalar(select(Gpu).where(Gpu.node == "composenode", Gpu.index == 0)).heartbeat_at is None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
        db.dispose_engines()


@pytest.mark.slow
def test_flower_profile_command_line_serves_flower_on_the_broker(compose_db, tmp_path):
    settings, values = compose_db
    service = load(values)["services"]["flower"]
    assert service["command"][:3] == ["celery", "--broker", values["GPUQ_BROKER_URL"]]
    port = free_port()
    argv = _argv(service, **{"--address": "127.0.0.1", "--port": str(port)})
    log = tmp_path / "flower.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=_service_env(service, settings), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        page = _wait_http(f"http://127.0.0.1:{port}/", proc, log)
        assert "Flower" in page
    finally:
        if proc.poll() is None:
            _stop(proc)


def test_the_scheduler_sees_the_snapshots_as_root_so_a_retention_removes_them():
    # As the image's user, without the volume, GPUQ_SNAPSHOT_RETENTION_DAYS removed nothing: each
    # copy is its submitter's, 0700, and the scheduler did not see the directory at all.
    services = load()["services"]
    scheduler, server = services["scheduler"], services["server"]
    assert scheduler["user"] == "root"
    where = server["environment"]["GPUQ_SNAPSHOT_DIR"]
    assert scheduler["environment"]["GPUQ_SNAPSHOT_DIR"] == where
    assert f"snapshots:{where}" in scheduler["volumes"] and f"snapshots:{where}" in server["volumes"]
    assert "GPUQ_DATABASE_URL" in scheduler["environment"]  # the shared environment kept beside its own
