"""`gpuq server` over TCP with MUNGE, for real: a munged with its own key per module, a `gpuq
server` subprocess listening on 127.0.0.1, and the real `gpuq` CLI as root and as an ordinary
user. A request is the uid munged vouches for, and nothing else: a missing, forged, replayed,
expired or borrowed credential is refused (77) before anything is written."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gpuq.service import constants as c
from gpuq.service import db, munge
from gpuq.service.db import write_scope
from gpuq.service.models import Job
from tests.conftest import IN_CI, Stack, free_port, make_settings, run_cli, settings_env, venv_reachable_by_everyone

pytestmark = pytest.mark.timeout(120)

IS_ROOT = os.geteuid() == 0
USER = "gpuqmunge"  # an ordinary user, made if absent (root only)
GPUQ = str(Path(sys.executable).with_name("gpuq"))


@pytest.fixture(scope="module")
def munged():
    """A munged with a freshly generated key on a socket of its own; its socket's path."""
    if shutil.which("munged") is None or shutil.which("munge") is None:
        if IN_CI:
            pytest.fail("munged is not installed, and CI must run these tests")
        pytest.skip("munged is not installed (Debian's munge package)")
    # munged wants every folder above its socket searchable by all, and refuses to run as root.
    top = Path(tempfile.mkdtemp(prefix="gpuq-munge-"))
    (top / "etc").mkdir()
    (top / "run").mkdir()
    as_munge = ["runuser", "-u", "munge", "--"] if IS_ROOT else []
    if IS_ROOT:
        shutil.chown(top / "etc", "munge", "munge")
        shutil.chown(top / "run", "munge", "munge")
    for path, mode in ((top, 0o755), (top / "run", 0o755), (top / "etc", 0o700)):
        os.chmod(path, mode)
    sock, pid_file = top / "run" / "munge.sock", top / "run" / "pid"
    subprocess.run([*as_munge, "mungekey", "-c", "-k", str(top / "etc/munge.key"), "-b", "1024"], check=True,
                   timeout=30)
    subprocess.run([*as_munge, "munged", "-S", str(sock), "--key-file", str(top / "etc/munge.key"),
                    "--log-file", str(top / "etc/log"), "--pid-file", str(pid_file),
                    "--seed-file", str(top / "etc/seed")], check=True, timeout=30)
    try:
        yield str(sock)
    finally:
        if pid_file.exists():
            pid = int(pid_file.read_text())
            os.kill(pid, 15)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.05)
        shutil.rmtree(top, ignore_errors=True)


def start_server(home: Path, redis_url: str, munge_socket: str, **overrides):
    """A `gpuq server` on its own SQLite database, listening on 127.0.0.1 with MUNGE; its stack and
    the GPUQ_SERVER address (https:// with ``tls_cert`` among ``overrides``). Two simulated GPUs on
    its node make submits possible without workers."""
    port = free_port()
    settings = make_settings(home / "home", f"sqlite:///{home / 'gpuq.db'}", redis_url)
    settings = settings.with_overrides(listen=f"127.0.0.1:{port}", munge_socket=munge_socket, **overrides)
    db.upgrade(settings)
    stack = Stack(settings, home / "logs")
    stack.start_server()
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                stack.stop()
                raise AssertionError(f"no TCP listener on {port}:\n{stack.log('server')}") from None
            time.sleep(0.05)
    return stack, f"{'https' if settings.tls_cert else 'http'}://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(munged, tmp_path_factory, redis_url):
    """(settings, GPUQ_SERVER address) of a server that decodes with the module's munged."""
    stack, address = start_server(tmp_path_factory.mktemp("munge-server"), redis_url, munged)
    yield stack.settings, address
    stack.stop()
    db.dispose_engines()


@pytest.fixture(scope="module")
def ordinary_user() -> Iterator[str]:
    """An ordinary user of the machine's, made for the module if absent and removed after it."""
    if not IS_ROOT:
        pytest.skip("making and becoming another user needs root")
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", USER], check=True, timeout=30)
        made = True
    venv_reachable_by_everyone()
    yield USER
    if made:
        subprocess.run(["userdel", "-f", USER], capture_output=True, timeout=30)


def gpuq(server, args, user: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real `gpuq` over TCP (GPUQ_SERVER), as root or, with ``user``, as that user."""
    settings, address = server
    extra = {"GPUQ_SERVER": address, **(env or {})}
    if user is None:
        return run_cli(args, settings, cwd="/tmp", extra_env=extra)
    env = {**settings_env(settings), **extra}
    return subprocess.run(["runuser", "-u", user, "--", GPUQ, *args], env=env, cwd="/tmp", capture_output=True,
                          text=True, timeout=60)


def send(server, method: str, target: str, body: bytes = b"", credential: str | None = None):
    """One raw HTTP request to the server's TCP listener: (status, JSON answer)."""
    host, port = server[1].removeprefix("http://").split(":")
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if credential is not None:
        headers["Authorization"] = f"MUNGE {credential}"
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, target, body=body or None, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def credential(munged: str, text: str, ttl: int | None = None) -> str:
    ttl_args = [] if ttl is None else ["-t", str(ttl)]
    return subprocess.run(["munge", "-S", munged, *ttl_args, "-s", text], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def job_count(settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def owner_of(settings, job_id: int) -> str:
    with write_scope(settings) as session:
        return session.get(Job, job_id).user


SUBMIT = c.API_PREFIX + "/jobs"
BODY = json.dumps({"command": ["true"], "cwd": "/tmp", "hold": True}).encode()


def test_root_status_submit_and_whoami_over_tcp_are_the_uid_munged_vouches_for(server, munged):
    status = gpuq(server, ["status"])
    assert status.returncode == 0, status.stderr
    made = gpuq(server, ["submit", "--json", "--hold", "--", "true"])
    assert made.returncode == 0, made.stderr
    assert owner_of(server[0], json.loads(made.stdout)["id"]) == "root"
    target = c.API_PREFIX + "/whoami"
    answer = send(server, "GET", target, credential=credential(munged, munge.payload("GET", target, b"")))
    assert answer == (200, {"user": "root", "uid": 0, "admin": True})
    # A query string is part of what the credential names, exactly as the client sent it.
    target = c.API_PREFIX + "/jobs?ended=5&user=root&x=a%20b"
    assert send(server, "GET", target, credential=credential(munged, munge.payload("GET", target, b"")))[0] == 200


def test_ordinary_user_submits_and_is_known_over_tcp_as_themself(server, ordinary_user):
    made = gpuq(server, ["submit", "--json", "--hold", "--", "true"], user=ordinary_user)
    assert made.returncode == 0, made.stderr
    assert owner_of(server[0], json.loads(made.stdout)["id"]) == ordinary_user
    who = gpuq(server, ["status"], user=ordinary_user)
    assert who.returncode == 0, who.stderr
    script = "import json; from gpuq.cli.client import Client; print(json.dumps(Client().get('/whoami')))"
    settings, address = server
    whoami = subprocess.run(["runuser", "-u", ordinary_user, "--", sys.executable, "-c", script],
                            env={**settings_env(settings), "GPUQ_SERVER": address}, cwd="/tmp",
                            capture_output=True, text=True, timeout=60)
    assert whoami.returncode == 0, whoami.stderr
    assert json.loads(whoami.stdout) == {"user": ordinary_user, "uid": pwd.getpwnam(ordinary_user).pw_uid,
                                         "admin": False}


def test_ordinary_user_may_not_submit_as_another_over_tcp(server, ordinary_user):
    before = job_count(server[0])
    refused = gpuq(server, ["submit", "--user", "root", "--", "true"], user=ordinary_user)
    assert refused.returncode == c.EXIT_NOT_ALLOWED, refused.stderr
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("gpuq: only root may submit")
    assert job_count(server[0]) == before


def _for_submit(munged: str, ttl: int | None = None) -> str:
    return credential(munged, munge.payload("POST", SUBMIT, BODY), ttl)


def _replayed(munged: str, server) -> str:
    cred = _for_submit(munged)
    assert send(server, "POST", SUBMIT, BODY, cred)[0] == 200  # its first use is good
    return cred


def _forged(munged: str, server) -> str:
    """A real credential with one character of its MAC'd middle changed: what one without the key makes."""
    cred = _for_submit(munged)
    return cred[:30] + ("A" if cred[30] != "A" else "B") + cred[31:]


def _expired(munged: str, server) -> str:
    cred = _for_submit(munged, ttl=1)
    time.sleep(2.2)
    return cred


REFUSED = {
    "none": lambda munged, server: None,
    "empty": lambda munged, server: "",
    "garbage": lambda munged, server: "not-a-credential",
    "forged": _forged,
    "replayed": _replayed,
    "expired": _expired,
    "other path": lambda munged, server: credential(munged, munge.payload("POST", SUBMIT + "/1/cancel", BODY)),
    "other body": lambda munged, server: credential(munged, munge.payload("POST", SUBMIT, BODY + b" ")),
    "other method": lambda munged, server: credential(munged, munge.payload("GET", SUBMIT, BODY)),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_bad_credential_is_refused_with_77_and_nothing_written(server, munged, kind):
    cred = REFUSED[kind](munged, server)
    before = job_count(server[0])
    status, answer = send(server, "POST", SUBMIT, BODY, cred)
    assert (status, answer["exit_code"]) == (403, c.EXIT_NOT_ALLOWED), answer
    assert "\n" not in answer["error"] and answer["error"], answer
    assert job_count(server[0]) == before


def test_a_tcp_peer_sending_half_requests_holds_a_bounded_share_and_unix_users_are_served(server):
    # Anyone who reaches the port could open connections by the thousand, each a request whose body
    # never came, before any credential was checked: the server ran out of descriptors, and every
    # user's `gpuq status` on the Unix socket hung.
    from gpuq.server.connections import MAX_PER_ADDRESS
    from gpuq.server.identity import BODY_SECONDS

    settings, address = server
    host, port = address.removeprefix("http://").split(":")
    half = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: MUNGE abc\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_PER_ADDRESS):
            conn = socket.create_connection((host, int(port)), timeout=10)
            conn.sendall(half)
            held.append(conn)
        sent = time.monotonic()
        extra = socket.create_connection((host, int(port)), timeout=10)
        try:
            extra.sendall(b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(4096) == b"", "one past the address's share is closed before it is read"
        except ConnectionResetError:
            pass
        finally:
            extra.close()
        served = run_cli(["status"], settings, timeout=30)  # over the Unix socket meanwhile
        assert served.returncode == 0, served.stderr
        held[0].settimeout(BODY_SECONDS + 20)
        answer = held[0].recv(65536).decode()
        assert f"the request's body did not arrive within {BODY_SECONDS:g} s" in answer, answer
        assert answer.startswith("HTTP/1.1 403") and time.monotonic() - sent < BODY_SECONDS + 15
    finally:
        for conn in held:
            conn.close()


def test_the_cli_prints_a_refused_credential_in_one_line_and_exits_77(server, tmp_path):
    # A `munge` on PATH that makes forged credentials: the CLI's request is refused by the server.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "munge").write_text("#!/bin/sh\necho MUNGE:AwQFAAAforgedforgedforged:\n")
    (fake / "munge").chmod(0o755)
    before = job_count(server[0])
    refused = gpuq(server, ["submit", "--", "true"], env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert refused.returncode == c.EXIT_NOT_ALLOWED, refused.stderr
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("gpuq: the MUNGE credential was refused")
    assert job_count(server[0]) == before


def test_a_client_whose_munged_is_down_exits_69_in_one_line(server, munged):
    down = str(Path(munged).with_name("gone.sock"))
    result = gpuq(server, ["status"], env={"GPUQ_MUNGE_SOCKET": down})
    assert result.returncode == c.EXIT_UNAVAILABLE, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("gpuq: munged at"), result.stderr


def test_a_server_whose_munged_is_down_answers_69_not_77(munged, tmp_path_factory, redis_url):
    stack, address = start_server(tmp_path_factory.mktemp("munge-down"), redis_url,
                                  str(Path(munged).with_name("gone.sock")))
    try:
        before = job_count(stack.settings)
        result = gpuq((stack.settings, address), ["submit", "--hold", "--", "true"], env={"GPUQ_MUNGE_SOCKET": munged})
        assert result.returncode == c.EXIT_UNAVAILABLE, result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("gpuq: munged at"), result.stderr
        assert job_count(stack.settings) == before
    finally:
        stack.stop()
        db.dispose_engines()


# --- TLS on the TCP listener --------------------------------------------------------------------

@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, made with openssl."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=gpuq-test", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def tls_server(munged, certificate, tmp_path_factory, redis_url):
    cert, key = certificate
    stack, address = start_server(tmp_path_factory.mktemp("tls-server"), redis_url, munged, tls_cert=str(cert),
                                  tls_key=str(key))
    yield stack.settings, address
    stack.stop()
    db.dispose_engines()


def test_over_tls_the_cli_submits_and_reads_with_the_labs_ca_and_the_credential_still_names_the_caller(
        tls_server, certificate):
    assert tls_server[1].startswith("https://")
    ca = {"GPUQ_TLS_CA": str(certificate[0])}
    made = gpuq(tls_server, ["submit", "--json", "--hold", "--", "true"], env=ca)
    assert made.returncode == 0, made.stderr
    assert owner_of(tls_server[0], json.loads(made.stdout)["id"]) == "root"
    status = gpuq(tls_server, ["status", "--json"], env=ca)
    assert status.returncode == 0 and json.loads(status.stdout)["jobs"], status.stderr


def test_over_tls_a_server_the_client_cannot_verify_or_plain_http_is_one_line_and_nothing_written(
        tls_server, certificate, tmp_path):
    before = job_count(tls_server[0])
    other_ca = tmp_path / "other.pem"  # a CA that did not sign the server's certificate
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k.pem"),
                    "-out", str(other_ca), "-days", "2", "-subj", "/CN=other"], check=True, capture_output=True,
                   timeout=60)
    refused = gpuq(tls_server, ["submit", "--", "true"], env={"GPUQ_TLS_CA": str(other_ca)})
    assert refused.returncode == c.EXIT_UNAVAILABLE and refused.stderr.count("\n") == 1, refused.stderr
    assert "failed TLS" in refused.stderr and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
    plain = gpuq(tls_server, ["submit", "--", "true"], env={"GPUQ_SERVER": tls_server[1].replace("https", "http")})
    assert plain.returncode != 0 and plain.stderr.count("\n") == 1, plain.stderr
    assert job_count(tls_server[0]) == before


def test_a_server_whose_certificate_cannot_be_loaded_says_so_in_one_line_and_listens_nowhere(munged, tmp_path,
                                                                                              redis_url):
    settings = make_settings(tmp_path / "home", f"sqlite:///{tmp_path / 'gpuq.db'}", redis_url).with_overrides(
        listen=f"127.0.0.1:{free_port()}", munge_socket=munged, tls_cert=str(tmp_path / "missing.pem"))
    db.upgrade(settings)
    done = subprocess.run([sys.executable, "-m", "gpuq.cli", "server"], env=settings_env(settings),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == c.EXIT_CONFIG and done.stderr.count("\n") == 1, done.stderr
    assert "GPUQ_TLS_CERT" in done.stderr and not settings.server_socket.exists()
