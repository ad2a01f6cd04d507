"""One box, many people: root's `gpuq up` serves every user of the machine, and keeps them apart.

A real stack started by root with `gpuq up` (its own home, socket, password-protected Redis and
two simulated GPUs), and two real OS users made for the module, who run the real `gpuq` command
through `runuser` with nothing of gpuq in their environment but the socket's path. What they can
do is what the kernel says they are (SO_PEERCRED): nothing they send changes it.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import dispose_engines, write_scope
from gpuq.service.models import Job, Submission
from gpuq.service.settings import Settings, load_settings
from tests.conftest import free_port, venv_reachable_by_everyone, wait_for_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"),
                                reason="needs root, useradd and runuser: the stack serves real OS users")

GPUQ = str(Path(sys.executable).with_name("gpuq"))  # made reachable by the box fixture
RUNUSER = shutil.which("runuser") or "runuser"
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
MAX_PENDING = 3


@dataclass
class Box:
    """The machine's stack and its users."""

    settings: Settings
    env: dict[str, str]  # root's: what `gpuq up` / `gpuq down` ran with
    socket: str
    redis_port: int
    a: str
    b: str

    def home_of(self, user: str) -> str:
        return f"/home/{user}"

    def user_env(self, user: str) -> dict[str, str]:
        """A user's environment: a login's basics and the socket; no database, no broker, no config."""
        return {"PATH": PATH, "HOME": self.home_of(user), "LANG": "C.UTF-8", "GPUQ_SOCKET": self.socket}

    def as_user(self, user: str, *argv: str, cwd: str | None = None, timeout: float = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``argv`` run as ``user`` (runuser: their uid, gid and groups), in their home and with
        their ``user_env`` by default."""
        return subprocess.run([RUNUSER, "-u", user, "--", *argv], env=env or self.user_env(user),
                              cwd=cwd or self.home_of(user), capture_output=True, text=True, timeout=timeout)

    def gpuq(self, user: str, *args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
        return self.as_user(user, GPUQ, *args, cwd=cwd)


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 60), **kw)


@pytest.fixture(scope="module")
def box():
    venv_reachable_by_everyone()
    tag = uuid.uuid4().hex[:6]
    base = Path(tempfile.mkdtemp(prefix="gpuqmu-", dir="/tmp"))
    os.chmod(base, 0o711)  # users traverse to the home (0711 itself): never list it
    sock = f"/tmp/gpuqmu-{tag}.sock"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_") and k != "XDG_DATA_HOME"}
    env.update({"GPUQ_HOME": str(base / "home"), "GPUQ_SOCKET": sock, "GPUQ_REDIS_PORT": str(port),
                "GPUQ_FAKE_GPUS": "2", "GPUQ_WARM_START": "false", "GPUQ_MAX_PENDING_PER_USER": str(MAX_PENDING),
                "GPUQ_HEARTBEAT_INTERVAL": "0.5", "GPUQ_SCHEDULER_INTERVAL": "0.5", "GPUQ_KILL_GRACE": "1",
                "GPUQ_SAMPLE_INTERVAL": "0", "GPUQ_CONFIG": "/nonexistent/gpuq-test.toml", "PYTHONUNBUFFERED": "1"})
    users = [f"gpuqa_{tag}", f"gpuqb_{tag}"]
    made: list[str] = []
    try:
        for name in users:
            done = _run(["useradd", "-m", "-s", "/bin/sh", name])
            assert done.returncode == 0, done.stderr
            made.append(name)
        up = _run([GPUQ, "up", "--timeout", "150"], env=env, cwd=str(base), timeout=200)
        assert up.returncode == 0, f"gpuq up failed: {up.stdout}{up.stderr}\n{_logs(base / 'home' / 'logs')}"
        settings = load_settings(env)
        yield Box(settings, env, sock, port, *users)
    finally:
        down = _run([GPUQ, "down", "--grace", "5"], env=env, cwd=str(base), timeout=120)
        for name in made:
            _run(["userdel", "-r", "-f", name])
        dispose_engines()
        shutil.rmtree(base, ignore_errors=True)
        Path(sock).unlink(missing_ok=True)
        assert down.returncode == 0, down.stderr


def _logs(log_dir: Path) -> str:
    out = []
    for p in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _submitted(done: subprocess.CompletedProcess) -> int:
    assert done.returncode == 0, f"submit failed ({done.returncode}): {done.stderr}"
    m = re.search(r"submitted job (\d+)", done.stdout)
    assert m, done.stdout
    return int(m.group(1))


def _refused(done: subprocess.CompletedProcess, code: int = c.EXIT_NOT_ALLOWED) -> str:
    """The refusal's one line on stderr (and nothing on stdout), with gpuq's exit code."""
    assert done.returncode == code, f"exit {done.returncode}, not {code}: {done.stdout!r} {done.stderr!r}"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuq: "), done.stderr
    assert done.stdout == ""
    return lines[0]


def _sql_state(settings: Settings) -> tuple:
    """Every job's row as the moves would change it, and the submissions: to prove nothing changed.
    Not the reason a pending job waits: the scheduler writes that on its own time (a new held job's
    "held" may land after the snapshot)."""
    with write_scope(settings) as session:
        rows = session.execute(select(Job.id, Job.user, Job.state, Job.held, Job.priority, Job.time_limit_s,
                                      Job.name, Job.max_retries, Job.cancel_requested_at, Job.ended_at, Job.after)
                               .order_by(Job.id)).all()
        subs = session.scalar(select(func.count()).select_from(Submission))
    return tuple(tuple(r) for r in rows), subs


def _user_of(settings: Settings, job_id: int) -> str:
    with write_scope(settings) as session:
        return session.get(Job, job_id).user


def _pending_of(settings: Settings, user: str) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job).where(Job.user == user, Job.state == State.PENDING))


def _output(box: Box, user: str, job_id: int) -> str:
    done = box.gpuq(user, "logs", str(job_id))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(300)
def test_each_users_command_runs_as_that_user_and_status_shows_both(box):
    ids = {user: _submitted(box.gpuq(user, "submit", "--", "id", "-un")) for user in (box.a, box.b)}
    for user, job_id in ids.items():
        assert wait_for_state(box.settings, job_id, c.END_STATES) == State.SUCCEEDED
        assert _user_of(box.settings, job_id) == user
        assert _output(box, user, job_id).strip() == user  # the worker (root) ran it as its owner
    for viewer in (box.a, box.b):
        status = box.gpuq(viewer, "status")
        assert status.returncode == 0, status.stderr
        for user, job_id in ids.items():
            assert re.search(rf"^\s*{job_id}\s+{user}\s", status.stdout, re.M), status.stdout


@pytest.mark.timeout(300)
def test_a_users_command_makes_its_files_with_the_umask_it_was_submitted_with(box):
    # The root worker's 022 made a user's umask 077 outputs readable by everyone on shared storage;
    # SLURM carries the submitter's umask (SLURM_UMASK), and so does gpuq now.
    made = Path(box.home_of(box.a)) / f"from-job-{uuid.uuid4().hex[:6]}"
    submitted = box.as_user(box.a, "/bin/sh", "-c",
                            f"umask 077; exec {GPUQ} submit -- /bin/sh -c 'umask; touch {made}'")
    job_id = _submitted(submitted)
    assert wait_for_state(box.settings, job_id, c.END_STATES) == State.SUCCEEDED
    assert _output(box, box.a, job_id).strip() == "0077"
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and made.owner() == box.a


@pytest.mark.timeout(300)
def test_a_user_cannot_change_or_read_another_users_job(box):
    a, b = box.a, box.b
    secret, code_secret = f"TOPSECRET_{uuid.uuid4().hex}", f"DIFFSECRET_{uuid.uuid4().hex}"
    # A's work tree, a git repository with an uncommitted change (the diff the job records).
    work = f"{box.home_of(a)}/work"
    assert box.as_user(a, "mkdir", "-p", work).returncode == 0
    for argv in (["git", "init", "-q"], ["sh", "-c", "echo committed > train.py"], ["git", "add", "train.py"],
                 ["git", "-c", "user.name=a", "-c", "user.email=a@example.org", "commit", "-qm", "init"],
                 ["sh", "-c", f"echo {code_secret} >> train.py"],
                 ["sh", "-c", f"umask 077; echo {secret} > secret.txt"]):
        done = box.as_user(a, *argv, cwd=work)
        assert done.returncode == 0, done.stderr
    # The secret is in the job's output only (its command line, like squeue's, is everyone's).
    failed = _submitted(box.gpuq(a, "submit", "--", "sh", "-c", "cat secret.txt; exit 3", cwd=work))
    held = _submitted(box.gpuq(a, "submit", "--hold", "--", "true", cwd=work))
    waiting = _submitted(box.gpuq(a, "submit", "--after", str(held), "--", "true", cwd=work))  # pending, not held
    assert wait_for_state(box.settings, failed, c.END_STATES) == State.FAILED
    # What B would be refused, A (the owner) is given: the checks below can fail.
    assert secret in _output(box, a, failed)
    assert secret in box.gpuq(a, "show", str(failed)).stdout
    assert code_secret in box.gpuq(a, "show", "--diff", str(failed)).stdout

    before = _sql_state(box.settings)
    for args in (["cancel", str(held)], ["cancel", str(waiting)], ["hold", str(waiting)],
                 ["release", str(held)], ["resubmit", str(failed)], ["resubmit", str(held)],
                 ["update", str(waiting), "--priority", "5"], ["update", str(held), "--time", "1m", "--name", "x"],
                 ["update", str(waiting), "-d", "none"], ["logs", str(failed)], ["show", "--diff", str(failed)],
                 ["show", "--diff", "--json", str(failed)]):
        line = _refused(box.gpuq(b, *args))
        assert f"belongs to {a}" in line, line
        assert secret not in line and code_secret not in line
    # `show` is squeue's view, everyone's: B sees the job, never its output nor its code.
    shown = box.gpuq(b, "show", str(failed))
    assert shown.returncode == 0, shown.stderr
    assert "last output" not in shown.stdout and secret not in shown.stdout and code_secret not in shown.stdout
    as_json = box.gpuq(b, "show", "--json", str(failed))
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["user"] == a and data["last_output"] == []
    assert secret not in as_json.stdout and code_secret not in as_json.stdout
    # Nor all of A's at once, as scancel -u names them.
    for args in (["cancel", "-u", a], ["cancel", "--user", a, "-t", "pending"], ["cancel", "-u", a, "-s", "USR1"]):
        line = _refused(box.gpuq(b, *args))
        assert line == f"gpuq: only root or an admin (GPUQ_ADMINS) may act on another user's jobs (-u {a}); you are {b}"
    assert _sql_state(box.settings) == before

    # Root may: `scancel -u USER` as the machine's admin does it.
    done = _run([GPUQ, "cancel", "-u", a, "-t", "pending"], env=box.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"job {held} cancelled", f"job {waiting} cancelled"], done.stdout


@pytest.mark.timeout(300)
def test_a_user_cannot_signal_another_users_running_job_and_its_owner_can(box):
    a, b = box.a, box.b
    # Runs until cancelled; notes each SIGUSR1 on its output (its sleeps die of theirs: a loop goes on).
    job = _submitted(box.gpuq(a, "submit", "--", "sh", "-c",
                              "trap 'echo got-usr1' USR1; echo ready; while :; do sleep 0.1; done"))
    try:
        assert wait_for_state(box.settings, job, (State.RUNNING,)) == State.RUNNING
        deadline = time.monotonic() + 30
        while "ready" not in _output(box, a, job) and time.monotonic() < deadline:
            time.sleep(0.1)

        def asked() -> tuple:
            with write_scope(box.settings) as session:
                row = session.get(Job, job)
                return row.signal_asked, row.signal_asked_at

        before = _sql_state(box.settings)
        for args in (["cancel", "--signal", "USR1", str(job)], ["cancel", "-s", "KILL", str(job)]):
            assert f"belongs to {a}" in _refused(box.gpuq(b, *args))
        time.sleep(1)  # five looks of its worker's watch
        assert asked() == (None, None) and _sql_state(box.settings) == before
        assert "got-usr1" not in _output(box, a, job)
        sent = box.gpuq(a, "cancel", "--signal", "USR1", str(job))
        assert (sent.returncode, sent.stdout) == (0, f"job {job}: SIGUSR1 sent\n"), sent.stderr
        from tests.test_audit import logged

        log = box.settings.log_dir / "server.log"
        logged(log, f"signal by {a} (uid {pwd.getpwnam(a).pw_uid}): job {job} (SIGUSR1)")
        logged(log, f"refused signal by {b} (uid {pwd.getpwnam(b).pw_uid}): job {job} of {a} (job {job} belongs "
                    f"to {a}; only they or an admin may change it)", "WARNING")
        deadline = time.monotonic() + 30
        while "got-usr1" not in _output(box, a, job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "got-usr1" in _output(box, a, job)
    finally:  # a running job left behind would hold a GPU from the tests after it
        assert box.gpuq(a, "cancel", str(job)).returncode == 0


@pytest.mark.timeout(300)
def test_a_jobs_env_values_are_shown_to_its_owner_and_not_to_another_user(box):
    a, b = box.a, box.b
    secret = f"ENVSECRET_{uuid.uuid4().hex}"
    job_id = _submitted(box.gpuq(a, "submit", "--hold", "--env", f"MY_TOKEN={secret}", "--", "true"))
    mine = box.gpuq(a, "show", "--json", str(job_id))
    assert mine.returncode == 0, mine.stderr
    assert json.loads(mine.stdout)["env"]["MY_TOKEN"] == secret
    for args in (["show", "--json", str(job_id)], ["show", str(job_id)]):
        theirs = box.gpuq(b, *args)
        assert theirs.returncode == 0, theirs.stderr
        assert secret not in theirs.stdout and secret not in theirs.stderr
        assert "MY_TOKEN" not in theirs.stdout  # not even its name
    assert json.loads(box.gpuq(b, "show", "--json", str(job_id)).stdout)["env"] is None
    assert box.gpuq(a, "cancel", str(job_id)).returncode == 0


@pytest.mark.timeout(300)
def test_the_servers_log_names_who_changed_whose_job_and_who_was_refused(box):
    from tests.test_audit import logged

    a, b = box.a, box.b
    log = box.settings.log_dir / "server.log"
    who_a, who_b = (f"{u} (uid {pwd.getpwnam(u).pw_uid})" for u in (a, b))
    job_id = _submitted(box.gpuq(a, "submit", "--hold", "--", "true"))
    logged(log, f"submit by {who_a}: job {job_id}")
    refusal = f"job {job_id} belongs to {a}; only they or an admin may change it"
    for move in ("cancel", "release", "hold"):
        _refused(box.gpuq(b, move, str(job_id)))
        logged(log, f"refused {move} by {who_b}: job {job_id} of {a} ({refusal})", "WARNING")
    _refused(box.gpuq(b, "submit", "--user", a, "--", "true"))
    logged(log, f"refused submit by {who_b} on behalf of {a} via --user: no job "
                f"(only root may submit as another user (--user {a}); you are {b})", "WARNING")
    assert box.gpuq(a, "cancel", str(job_id)).returncode == 0
    logged(log, f"cancel by {who_a}: job {job_id}")


@pytest.mark.timeout(300)
def test_a_user_may_lower_their_running_jobs_time_limit_and_its_root_worker_stops_it_there(box):
    a = box.a
    job = _submitted(box.gpuq(a, "submit", "--time", "1h", "--", "sleep", "120"))
    assert wait_for_state(box.settings, job, [State.RUNNING]) == State.RUNNING
    line = _refused(box.gpuq(a, "update", str(job), "--time", "2h"), c.EXIT_CONFLICT)
    assert line == (f"gpuq: job {job} is running; only root or an admin may raise a started job's time limit "
                    "(you may lower it)")
    line = _refused(box.gpuq(a, "update", str(job), "--priority", "11"), c.EXIT_USAGE)
    assert "above the users' limit" in line
    lowered = box.gpuq(a, "update", str(job), "--time", "2s")
    assert lowered.returncode == 0 and "time limit 1:00:00 → 0:00:02" in lowered.stdout, lowered.stderr
    assert wait_for_state(box.settings, job, c.END_STATES, timeout=30) == State.TIMED_OUT


_FORGE = r"""
import http.client, json, socket, sys

class Conn(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=30)
        self.path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)

path, cwd, other, victim = sys.argv[1:5]
forged = {"X-User": "root", "X-Remote-User": "root", "X-Forwarded-User": other, "Remote-User": "root",
          "Authorization": "Basic cm9vdDpyb290", "Content-Type": "application/json"}
results = []
for method, target, body in [("POST", "/v1/jobs", {"command": ["true"], "cwd": cwd}),
                             ("POST", "/v1/jobs", {"command": ["true"], "cwd": cwd, "user": "root"}),
                             ("POST", "/v1/jobs", {"command": ["true"], "cwd": cwd, "user": other}),
                             ("POST", "/v1/jobs/" + victim + "/cancel", {"user": other}),
                             ("GET", "/v1/jobs/" + victim + "/output", None)]:
    conn = Conn(path)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, target, body=data, headers=forged)
    r = conn.getresponse()
    results.append([r.status, json.loads(r.read())])
    conn.close()
print(json.dumps(results))
"""


@pytest.mark.timeout(300)
def test_only_a_jobs_owner_may_send_it_the_stdin_gpuq_run_forwards(box):
    a, b = box.a, box.b

    def post(user: str, target: str, body: dict) -> tuple[int, dict]:
        out = box.as_user(user, "curl", "-sS", "--unix-socket", box.socket, "-X", "POST", "-w", "\n%{http_code}",
                          "-H", "Content-Type: application/json", "--data-binary", json.dumps(body),
                          f"http://localhost{target}")
        assert out.returncode == 0, out.stderr
        text, _, code = out.stdout.rpartition("\n")
        return int(code), json.loads(text)

    # As `gpuq run` submits with a pipe for its stdin: A's job reads what A sends it.
    status, answer = post(a, "/v1/jobs", {"command": ["sh", "-c", "cat; id -un"], "cwd": box.home_of(a),
                                          "stdin": True})
    assert status == 200, answer
    job_id = answer["jobs"][0]["id"]
    forged = base64.b64encode(b"rm -rf ~\n").decode()
    status, answer = post(b, f"/v1/jobs/{job_id}/stdin", {"data": forged, "end": True})
    assert (status, answer["exit_code"]) == (403, c.EXIT_NOT_ALLOWED), answer
    assert "only they may send it input" in answer["error"]
    status, answer = post(a, f"/v1/jobs/{job_id}/stdin", {"data": base64.b64encode(b"from a\n").decode(),
                                                           "end": True})
    assert (status, answer["taken"]) == (200, True)
    assert wait_for_state(box.settings, job_id, c.END_STATES) == State.SUCCEEDED
    assert _output(box, a, job_id).split() == ["from", "a", a]  # B's chunk never reached it
    status, answer = post(a, f"/v1/jobs/{job_id}/stdin", {"data": "", "end": True})
    assert (status, answer["exit_code"]) == (409, c.EXIT_CONFLICT)  # ended: it reads no more


@pytest.mark.timeout(300)
def test_forged_identity_in_fields_or_headers_changes_nothing(box):
    a, b = box.a, box.b
    victim = _submitted(box.gpuq(a, "submit", "--hold", "--", "true"))
    before = _sql_state(box.settings)

    # Python's http.client on the socket, as B, with every field and header that could claim a name.
    done = box.as_user(b, sys.executable, "-c", _FORGE, box.socket, box.home_of(b), a, str(victim))
    assert done.returncode == 0, done.stderr
    (ok_status, ok), (root_status, as_root), (other_status, as_other), (cancel_status, cancel), \
        (logs_status, logs) = json.loads(done.stdout)
    assert ok_status == 200 and [j["user"] for j in ok["jobs"]] == [b]
    assert _user_of(box.settings, ok["jobs"][0]["id"]) == b
    for status, answer in ((root_status, as_root), (other_status, as_other), (cancel_status, cancel),
                           (logs_status, logs)):
        assert status == 403 and answer["exit_code"] == c.EXIT_NOT_ALLOWED, answer

    # curl on the socket, as B: the same.
    def curl(method: str, target: str, body: dict | None) -> tuple[int, dict]:
        argv = ["curl", "-sS", "--unix-socket", box.socket, "-X", method, "-w", "\n%{http_code}",
                "-H", "X-User: root", "-H", f"X-Remote-User: {a}", "-H", "Authorization: Bearer root",
                "-H", "Content-Type: application/json"]
        if body is not None:
            argv += ["--data-binary", json.dumps(body)]
        out = box.as_user(b, *argv, f"http://localhost{target}")
        assert out.returncode == 0, out.stderr
        text, _, code = out.stdout.rpartition("\n")
        return int(code), json.loads(text)

    status, answer = curl("POST", "/v1/jobs", {"command": ["id", "-un"], "cwd": box.home_of(b)})
    assert status == 200 and answer["jobs"][0]["user"] == b
    made = answer["jobs"][0]["id"]
    status, answer = curl("POST", "/v1/jobs", {"command": ["id", "-un"], "cwd": box.home_of(b), "user": "root"})
    assert (status, answer["exit_code"]) == (403, c.EXIT_NOT_ALLOWED)
    status, answer = curl("POST", f"/v1/jobs/{victim}/hold", None)
    assert (status, answer["exit_code"]) == (403, c.EXIT_NOT_ALLOWED)

    assert wait_for_state(box.settings, made, c.END_STATES) == State.SUCCEEDED
    assert _output(box, b, made).strip() == b  # it ran as B, whatever the headers said
    # Nothing else changed: the two jobs B made are B's, A's job is as it was, nothing is root's.
    after = _sql_state(box.settings)
    new = [r for r in after[0] if r[0] not in {row[0] for row in before[0]}]
    assert sorted(r[0] for r in new) == sorted([ok["jobs"][0]["id"], made]) and {r[1] for r in new} == {b}
    assert [r for r in after[0] if r[0] in {row[0] for row in before[0]} and r[2] in c.ACTIVE_STATES] == \
        [r for r in before[0] if r[2] in c.ACTIVE_STATES]
    assert after[1] == before[1]  # no key sent, so no submission recorded
    assert box.gpuq(a, "cancel", str(victim)).returncode == 0


@pytest.mark.timeout(300)
def test_submit_as_another_user_is_refused_to_non_root(box):
    before = _sql_state(box.settings)
    for user, other in ((box.a, box.b), (box.b, box.a), (box.b, "root")):
        for test_only in ([], ["--test-only"]):  # an estimate is checked as the submit it tries
            line = _refused(box.gpuq(user, "submit", *test_only, "--user", other, "--", "id", "-un"))
            assert "only root may submit as another user" in line
    tried = box.gpuq(box.b, "submit", "--test-only", "--", "id", "-un")
    assert tried.returncode == 0 and tried.stdout.strip().endswith("nothing was queued"), tried.stderr
    assert _sql_state(box.settings) == before


@pytest.mark.timeout(300)
def test_users_cannot_read_the_stacks_state_nor_reach_its_redis(box):
    s = box.settings
    home = s.home
    db_file = home / "gpuq.db"
    assert _mode(home) == 0o711
    for d in (s.log_dir, s.run_dir, home / "redis"):
        assert _mode(d) == 0o700, d
    for f in (db_file, s.redis_secret, home / "redis" / "redis.conf"):
        assert _mode(f) == 0o600, f
    for suffix in ("-wal", "-shm"):
        f = db_file.with_name(db_file.name + suffix)
        if f.exists():
            assert _mode(f) == 0o600, f
    assert _mode(box.socket) == 0o666

    password = s.redis_secret.read_text().strip()
    assert len(password) >= 32
    for user in (box.a, box.b):
        for f in (db_file, s.redis_secret, home / "redis" / "redis.conf", s.log_dir / "server.log",
                  s.run_dir / "supervisor.pid"):
            done = box.as_user(user, "cat", str(f))
            assert done.returncode != 0 and password not in done.stdout, f
            assert "Permission denied" in done.stderr, done.stderr
        listing = box.as_user(user, "ls", str(home))
        assert listing.returncode != 0 and "Permission denied" in listing.stderr
        # No password, no broker: Redis asks for one (NOAUTH), and knows no user's guess.
        ping = box.as_user(user, "redis-cli", "-p", str(box.redis_port), "ping")
        assert "PONG" not in ping.stdout and ("NOAUTH" in ping.stdout + ping.stderr or ping.returncode != 0), ping
        guess = box.as_user(user, "redis-cli", "--no-auth-warning", "-p", str(box.redis_port), "-a", "gpuq", "ping")
        assert "PONG" not in guess.stdout
    # The password works (so the refusals above are for want of it), and no process shows it:
    # every user can read every /proc/PID/cmdline.
    ok = _run(["redis-cli", "--no-auth-warning", "-p", str(box.redis_port), "-a", password, "ping"])
    assert ok.stdout.strip() == "PONG"
    for proc in psutil.process_iter(["cmdline"]):
        assert password not in " ".join(proc.info["cmdline"] or []), proc


@pytest.mark.timeout(300)
def test_a_users_pending_jobs_are_capped_and_the_one_past_the_cap_writes_nothing(box):
    user = box.b
    for _ in range(MAX_PENDING - _pending_of(box.settings, user)):
        _submitted(box.gpuq(user, "submit", "--hold", "--", "true"))
    assert _pending_of(box.settings, user) == MAX_PENDING
    before = _sql_state(box.settings)
    line = _refused(box.gpuq(user, "submit", "--hold", "--", "true"), c.EXIT_OVER_LIMIT)
    assert f"{user} has {MAX_PENDING} jobs pending" in line, line
    _refused(box.gpuq(user, "submit", "--hold", "--array", "0-1", "--", "true"), c.EXIT_OVER_LIMIT)
    assert _sql_state(box.settings) == before
    # The cap is per user: the other user still submits.
    other = _submitted(box.gpuq(box.a, "submit", "--hold", "--", "true"))
    assert box.gpuq(box.a, "cancel", str(other)).returncode == 0
    cancelled = box.gpuq(user, "cancel", "--me")
    assert cancelled.returncode == 0, cancelled.stderr
    assert _pending_of(box.settings, user) == 0
    # Below the cap again: a submit is taken (the limit counts pending jobs, not jobs ever made).
    again = _submitted(box.gpuq(user, "submit", "--hold", "--", "true"))
    assert box.gpuq(user, "cancel", str(again)).returncode == 0


@pytest.mark.timeout(300)
def test_a_snapshot_runs_as_its_owner_from_roots_home_and_only_they_read_the_copy(box):
    a, b = box.a, box.b
    secret = f"SNAPSECRET_{uuid.uuid4().hex}"
    work = f"{box.home_of(a)}/snapwork"
    for argv in (["mkdir", "-p", work], ["git", "init", "-q", work],
                 ["sh", "-c", f"cd {work} && umask 077 && echo {secret} > data.txt"]):
        done = box.as_user(a, *argv)
        assert done.returncode == 0, done.stderr
    job_id = _submitted(box.gpuq(a, "submit", "--snapshot", "--", "sh", "-c", "id -un; cat data.txt; pwd", cwd=work))
    assert wait_for_state(box.settings, job_id, c.END_STATES) == State.SUCCEEDED, _output(box, a, job_id)
    user, text, where = _output(box, a, job_id).split()
    copy = box.settings.snapshots / str(job_id)
    assert (user, text, where) == (a, secret, str(copy))  # run as A, in the copy under root's home
    assert os.stat(copy).st_uid == pwd.getpwnam(a).pw_uid  # made by a child running as A
    assert _mode(box.settings.snapshots) == 0o711
    # B can neither list the snapshots nor read A's copy, even knowing its path.
    for argv in (["ls", str(box.settings.snapshots)], ["cat", str(copy / "data.txt")], ["ls", str(copy)]):
        done = box.as_user(b, *argv)
        assert done.returncode != 0 and secret not in done.stdout, argv


def test_two_users_allocations_never_share_a_gpu_and_each_shell_runs_as_its_user(box):
    """Alice holds both GPUs with `gpuq alloc`; Bob's allocation waits until her command exits,
    then his runs as him; what hers left in the background is stopped by the root worker."""
    marker = f"{400 + uuid.uuid4().int % 100_000 / 1000:.3f}"
    alice = subprocess.Popen([RUNUSER, "-u", box.a, "--", GPUQ, "alloc", "--gpus", "2", "--", "sh", "-c",
                              f"id -un; sleep {marker} & sleep 3"], env=box.user_env(box.a), cwd=box.home_of(box.a),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        held = _newest_allocation_of(box.settings, box.a)
        assert wait_for_state(box.settings, held, (State.RUNNING,)) == State.RUNNING
        # Bob cannot keep Alice's allocation alive or end it through the API, and is told why.
        for method, call in (("POST", "keepalive"), ("POST", "end"), ("DELETE", "keepalive"), ("PUT", "keepalive")):
            out = box.as_user(box.b, "curl", "-sS", "--unix-socket", box.socket, "-X", method, "-H",
                              "Content-Type: application/json", "--data-binary", '{"exit_code": 0}',
                              f"http://localhost/v1/jobs/{held}/{call}")
            assert json.loads(out.stdout)["error"] == (f"job {held} is {box.a}'s; only they or an admin "
                                                       "may keep it alive or end it"), out.stdout
        bob = box.gpuq(box.b, "alloc", "--", "sh", "-c", "id -un; echo CVD=$CUDA_VISIBLE_DEVICES")
        assert alice.wait(60) == 0, alice.stderr.read()
    finally:
        if alice.poll() is None:
            alice.kill()
    assert alice.stdout.read().strip() == box.a
    assert bob.returncode == 0, bob.stderr
    assert bob.stdout.splitlines()[0] == box.b and "CVD=" in bob.stdout
    with write_scope(box.settings) as session:
        first = session.get(Job, held)
        second = session.scalar(select(Job).where(Job.user == box.b, Job.kind == c.KIND_INTERACTIVE)
                                .order_by(Job.id.desc()).limit(1))
        assert first.user == box.a and second.started_at >= first.ended_at  # never on the GPUs at once
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]


def _newest_allocation_of(settings: Settings, user: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with write_scope(settings) as session:
            found = session.scalar(select(func.max(Job.id)).where(Job.user == user, Job.kind == c.KIND_INTERACTIVE))
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no allocation of {user} after {timeout} s")


@pytest.mark.timeout(300)
def test_a_users_own_stack_serves_only_them_and_keeps_its_state_and_redis_from_others(box):
    # `gpuq up` run by a user is theirs alone: its workers cannot switch users and run every job
    # as that user, so a server that took another user's request would run it as its owner.
    owner, other = box.a, box.b
    home = Path(box.home_of(owner)) / f"gpuq-own-{uuid.uuid4().hex[:6]}"
    sock, port = f"/tmp/gpuqown-{uuid.uuid4().hex[:6]}.sock", free_port()  # a socket the other user can reach
    env = {"PATH": PATH, "HOME": box.home_of(owner), "LANG": "C.UTF-8", "GPUQ_HOME": str(home), "GPUQ_SOCKET": sock,
           "GPUQ_REDIS_PORT": str(port), "GPUQ_FAKE_GPUS": "1", "GPUQ_WARM_START": "false",
           "GPUQ_HEARTBEAT_INTERVAL": "0.5", "GPUQ_SCHEDULER_INTERVAL": "0.5", "GPUQ_SAMPLE_INTERVAL": "0",
           "GPUQ_CONFIG": "/nonexistent/gpuq-test.toml", "PYTHONUNBUFFERED": "1"}

    def as_(user: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return box.as_user(user, GPUQ, *args, timeout=timeout,
                           env=env if user == owner else {**box.user_env(user), "GPUQ_SOCKET": sock})

    up = as_(owner, "up", "--timeout", "150", timeout=200)
    try:
        assert up.returncode == 0, f"gpuq up failed: {up.stdout}{up.stderr}\n{_logs(home / 'logs')}"
        job_id = _submitted(as_(owner, "submit", "--", "id", "-un"))
        assert as_(owner, "wait", str(job_id)).returncode == 0
        assert as_(owner, "logs", str(job_id)).stdout.strip() == owner
        # No memory cgroup for a user's workers: they hold a command to --host-mem by polling its size.
        hog = _submitted(as_(owner, "submit", "--host-mem", "64M", "--", "python3", "-c",
                             "import time; x = bytearray(512 * 2**20); time.sleep(30)"))
        assert as_(owner, "wait", str(hog)).returncode != 0
        shown = as_(owner, "show", str(hog)).stdout
        assert "host_oom" in shown and "stopped by gpuq" in shown and "past its limit of 64 MiB" in shown, shown
        # Nor a CPU cgroup: an allocation's --cpus of whole cores is held by the cores its worker
        # binds it to (its own user's process: a worker may), not by a quota; a fraction of a core is
        # not held, and its terminal is told before the command runs (the worker lets the gate
        # through with the "not held" signal).
        alloc = as_(owner, "alloc", "--cpus", "1", "--", "sh", "-c", "echo cpus=$GPUQ_CPUS nproc=$(nproc)")
        assert alloc.returncode == 0 and alloc.stdout.strip() == "cpus=1 nproc=1", alloc
        assert "not held" not in alloc.stderr, alloc.stderr
        alloc = as_(owner, "alloc", "--cpus", "0.5", "--", "sh", "-c", "echo cpus=$GPUQ_CPUS nproc=$(nproc)")
        assert alloc.returncode == 0 and alloc.stdout.strip() == "cpus=0.5 nproc=1", alloc
        unheld = [line for line in alloc.stderr.splitlines() if "not held" in line]
        assert len(unheld) == 1 and unheld[0].startswith("gpuq: --cpus 0.5 is not held to on ") and unheld[0].endswith(
            ": its worker may make no CPU cgroup"), alloc.stderr
        # A command's too: on its core, with no line that it is not held.
        pinned = _submitted(as_(owner, "submit", "--cpus", "1", "--", "sh", "-c", "echo nproc=$(nproc) $GPUQ_CORES"))
        assert as_(owner, "wait", str(pinned)).returncode == 0
        ran = as_(owner, "logs", str(pinned)).stdout
        assert re.fullmatch(r"nproc=1 \d+\n", ran), ran
        # The stack's owner is its admin, as root is the machine's: past the users' priority cap,
        # and `gpuq config` says so beside GPUQ_ADMINS (it read as no admin at all).
        assert as_(owner, "submit", "--hold", "--priority", "50", "--", "true").returncode == 0
        assert json.loads(as_(owner, "config", "--json").stdout)["settings"]["admins"]["also"] == owner
        admins = next(line for line in as_(owner, "config").stdout.splitlines() if line.startswith("GPUQ_ADMINS "))
        assert admins.endswith(f"(and {owner}, whose stack this is)"), admins
        settings = load_settings(env)
        with write_scope(settings) as session:
            jobs_before = session.scalar(select(func.count()).select_from(Job))
        for args in (("status",), ("submit", "--", "id", "-un"), ("show", str(job_id)), ("cancel", str(job_id))):
            line = _refused(as_(other, *args))
            assert f"{owner}'s own stack" in line and f"serves only {owner}" in line, line
        with write_scope(settings) as session:
            assert session.scalar(select(func.count()).select_from(Job)) == jobs_before
        # Its state is its owner's alone, and the Redis it started asks for the password it keeps there.
        assert _mode(home) == 0o700 and _mode(home / "gpuq.db") == 0o600 and _mode(settings.redis_secret) == 0o600
        assert pwd.getpwuid(os.stat(home / "gpuq.db").st_uid).pw_name == owner
        listing = box.as_user(other, "ls", str(home))
        assert listing.returncode != 0 and "Permission denied" in listing.stderr
        # A stack whose socket is in its owner's home (the default) is closed to others: 77 and
        # whose it is, not 69 and "start one with `gpuq up`".
        inside = home / "gpuq.sock"
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(inside))
            listener.listen()
            closed = box.as_user(other, GPUQ, "status", env={**box.user_env(other), "GPUQ_SERVER": str(inside)})
        line = _refused(closed)
        assert line == (f"gpuq: the gpuq server at {inside} is closed to you (permission denied on its socket or a "
                        "folder above it): it is another user's; use the machine's queue or one of your own "
                        "(`gpuq up`)"), line
        ping = box.as_user(other, "redis-cli", "-p", str(port), "ping")
        assert "PONG" not in ping.stdout and "NOAUTH" in ping.stdout + ping.stderr, ping
    finally:
        down = as_(owner, "down", "--grace", "5", timeout=120)
        dispose_engines()
        Path(sock).unlink(missing_ok=True)
        shutil.rmtree(home, ignore_errors=True)
    assert down.returncode == 0, down.stderr


_HOLD_CONNECTIONS = """
import socket, sys
conns = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    conns.append(s)
print("holding", flush=True)
sys.stdin.read()  # until the test is done
"""


@pytest.mark.timeout(120)
def test_one_user_holding_connections_open_cannot_starve_the_server_for_others(box):
    # Thousands of idle connections of one user took every descriptor the server had, and every
    # other user's `gpuq status` hung (the security audit).
    from gpuq.server.connections import MAX_PER_USER

    hog = subprocess.Popen([RUNUSER, "-u", box.a, "--", sys.executable, "-c", _HOLD_CONNECTIONS, box.socket,
                            str(MAX_PER_USER)], env=box.user_env(box.a), cwd=box.home_of(box.a),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "holding"
        started = time.monotonic()
        assert box.gpuq(box.b, "status").returncode == 0  # another user is served
        assert time.monotonic() - started < 20
        # The hog's next connection is closed before it is read: its own requests fail, in one line.
        refused = box.gpuq(box.a, "status")
        assert refused.returncode == c.EXIT_UNAVAILABLE, refused
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        log = box.settings.log_dir / "server.log"
        assert f"holds {MAX_PER_USER} connections open, the most one user may" in log.read_text(), log
    finally:
        hog.stdin.close()
        hog.wait(30)
    deadline = time.monotonic() + 20
    while box.gpuq(box.a, "status").returncode != 0:  # its own connections closed: served again
        assert time.monotonic() < deadline, "the user was not served again"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_a_users_output_file_is_written_as_them_and_a_link_to_a_file_they_may_not_write_fails_the_job(box):
    # The worker is root: had it opened --output itself, a link in the user's home would have let
    # them write any file of the machine. The job's own process opens it, as the user.
    a = box.a
    home = Path(box.home_of(a))
    job_id = _submitted(box.gpuq(a, "submit", "-o", "run-%j.log", "--", "/bin/sh", "-c",
                                 "id -un; sleep 1; echo err >&2"))
    # The sleep: stdout and stderr come through two pipes, each copied by its own thread, so two lines
    # written within an instant of each other may land in either order (README, --output).
    assert wait_for_state(box.settings, job_id, c.END_STATES) == State.SUCCEEDED
    written = home / f"run-{job_id}.log"
    assert written.read_text() == f"{a}\nerr\n" and written.owner() == a
    assert _output(box, a, job_id) == f"{a}\nerr\n"  # gpuq's own copy as well
    guarded = Path(tempfile.mkdtemp(prefix="gpuqmu-root-", dir="/tmp"))
    target = guarded / "root-only"
    target.write_text("root's\n")
    os.chmod(target, 0o644)  # readable by all, writable by root alone
    link = home / f"link-{uuid.uuid4().hex[:6]}"
    assert box.as_user(a, "ln", "-s", str(target), str(link)).returncode == 0
    try:
        job_id = _submitted(box.gpuq(a, "submit", "-o", str(link), "--", "echo", "overwritten"))
        assert wait_for_state(box.settings, job_id, c.END_STATES) == State.FAILED
        assert target.read_text() == "root's\n"
        why = box.gpuq(a, "why", str(job_id)).stdout
        assert f"cannot start: cannot open {link} as {a}: Permission denied" in why, why
        # Another user's directory, which they may not write in: refused at submit, as them.
        refused = box.gpuq(a, "submit", "-o", f"{box.home_of(box.b)}/x.log", "--", "true")
        assert _refused(refused, c.EXIT_USAGE) == (f"gpuq: --output: {box.home_of(box.b)} is not a directory you "
                                                   "may write in")
    finally:
        shutil.rmtree(guarded, ignore_errors=True)
