"""Issue 6's security guarantees, for real: a job's environment is what its submitter chose plus
gpuq's own, a root worker runs it as its owner with that user's groups only, broker and database
passwords (plain and TLS Redis) never show, and hostile text is stored exactly, run as literal
argv and shown one line per job."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import redis
from sqlalchemy import create_engine, inspect, text

from gpuq.service import constants as c
from gpuq.service import db, jobs, spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from tests.conftest import cli_submit as submit
from tests.conftest import (
    free_port,
    make_settings,
    new_postgres_database,
    output_of,
    run_cli,
    serving,
    settings_env,
    stack_on_database,
    start_stack,
    system_redis_server,
    wait_for_state,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

IS_ROOT = os.geteuid() == 0
# A Python another user may run: this venv's may live under root's home (pyenv), closed to others.
SYSTEM_PYTHON = "/usr/bin/python3"


def _system_python_matches() -> bool:
    try:
        out = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except OSError:
        return False
    return out == str(sys.version_info[:2])


needs_root = pytest.mark.skipif(not (IS_ROOT and _system_python_matches()),
                                reason="needs a root worker and a system Python of this version for user nobody")


def run_to_end(stack, args, cwd=None, extra_env=None) -> tuple[int, str, str]:
    job_id = submit(stack.settings, args, cwd=cwd, extra_env=extra_env)
    state = wait_for_state(stack.settings, job_id, c.END_STATES)
    return job_id, state, output_of(stack.settings, job_id)


@pytest.fixture(scope="module", params=["postgres"])
def stack(request, tmp_path_factory, redis_url):
    """One stack on PostgreSQL for the module (what runs as whom does not depend on the database)."""
    yield from stack_on_database(request, tmp_path_factory, redis_url)


PRINT_IDENTITY = ("import os, json; print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), "
                  "'groups': sorted(os.getgroups()), 'env': dict(os.environ), 'cwd': os.getcwd()}))")


def test_a_command_gets_the_submitters_chosen_variables_and_gpuqs_and_none_of_the_workers(stack, tmp_path):
    s = stack.settings
    worker_env = psutil.Process(stack.procs["worker-testnode-0"].pid).environ()
    assert worker_env["GPUQ_DATABASE_URL"] == s.database_url  # the worker has it: the job must not
    job_id, state, out = run_to_end(
        stack, ["--env", "FROM_HERE", "--env", "SET=a b;$(c)", "--", sys.executable, "-c", PRINT_IDENTITY],
        cwd=tmp_path, extra_env={"FROM_HERE": "yes", "NOT_ASKED_FOR": "no", "LANG": "C.UTF-8", "LC_TIME": "C"})
    assert state == State.SUCCEEDED, out
    env = json.loads(out)["env"]
    assert env["FROM_HERE"] == "yes" and env["SET"] == "a b;$(c)"
    assert env["LANG"] == "C.UTF-8" and env["LC_TIME"] == "C" and env["PATH"] == os.environ["PATH"]
    assert env["GPUQ_JOB_ID"] == str(job_id) and env["GPUQ_NODE"] == "testnode" and env["GPUQ_GPUS"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1") and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "NOT_ASKED_FOR" not in env
    # Nothing but the default set, what --env named, and gpuq's own.
    assert set(env) - env_default_names(env) - {"FROM_HERE", "SET"} == {
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUQ_JOB_ID", "GPUQ_JOB_NAME", "GPUQ_GPUS", "GPUQ_NODE",
        "GPUQ_WORKER", "GPUQ_RUN_ID", "GPUQ_UMASK",  # the submitter's umask, which the job is given
        "GPUQ_SOCKET",  # its own stack's server, for a `gpuq` it runs (not another stack's on the machine)
        "GPUQ_SIMULATED_MEMORY_DIR"}  # simulated GPUs only: where a job declares simulated GPU memory
    assert env["GPUQ_SOCKET"] == str(s.server_socket)
    assert not any(s.broker_url in v or s.database_url in v for v in env.values())
    with write_scope(s) as session:
        stored = jobs.get_job(session, job_id).env
    assert stored["FROM_HERE"] == "yes" and "GPUQ_JOB_ID" not in stored  # gpuq's own are set at run time


def env_default_names(env: dict) -> set[str]:
    from gpuq.service.job_variables import DEFAULT_ENV, DEFAULT_ENV_PREFIXES

    return {k for k in env if k in DEFAULT_ENV or k.startswith(DEFAULT_ENV_PREFIXES)}


@needs_root
def test_a_root_worker_runs_a_job_for_nobody_as_nobody_with_only_nobodys_groups(stack, shared_dir):
    job_id, state, out = run_to_end(stack, ["--user", "nobody", "--", SYSTEM_PYTHON, "-c", PRINT_IDENTITY],
                                    cwd=shared_dir)
    assert state == State.SUCCEEDED, out + stack.logs()
    seen = json.loads(out)
    assert seen["uid"] == 65534 and seen["cwd"] == str(shared_dir)
    assert seen["groups"] == sorted(set(os.getgrouplist("nobody", seen["gid"])))
    assert 0 not in seen["groups"] and seen["gid"] != 0
    env = seen["env"]
    assert env["USER"] == env["LOGNAME"] == "nobody" and env["HOME"] == "/nonexistent"
    assert not {"GPUQ_DATABASE_URL", "GPUQ_BROKER_URL", "GPUQ_CONFIG"} & env.keys()
    with write_scope(stack.settings) as session:
        assert jobs.get_job(session, job_id).user == "nobody"
    _, state, out = run_to_end(stack, ["--user", "nobody", "--", "id"], cwd=shared_dir)
    assert state == State.SUCCEEDED and out.split()[0] == "uid=65534(nobody)", out


@needs_root
def test_roots_resubmit_of_a_users_job_runs_it_as_that_user_not_as_root(stack, shared_dir):
    job_id, state, out = run_to_end(stack, ["--user", "nobody", "--", "id", "-un"], cwd=shared_dir)
    assert state == State.SUCCEEDED and out.strip() == "nobody"
    again = run_cli(["resubmit", "--json", str(job_id)], stack.settings, cwd=shared_dir)
    assert again.returncode == 0, again.stderr
    copy = json.loads(again.stdout)["id"]
    assert wait_for_state(stack.settings, copy, c.END_STATES) == State.SUCCEEDED
    assert output_of(stack.settings, copy).strip() == "nobody"


@needs_root
def test_a_command_enters_its_directory_as_its_owner_not_as_the_root_worker(stack, shared_dir):
    # Popen enters the directory before the child becomes the owner: a user could run (and read)
    # in a directory only root may enter.
    closed = shared_dir / "roots-only"
    closed.mkdir(mode=0o700)
    (closed / "secret.txt").write_text("root's")
    # The server refuses such a directory (below); one closed after the submit is what a worker meets.
    job_id = submitting.submit(stack.settings, spec.command_spec(["cat", "secret.txt"], cwd=str(closed),
                                                                 user="nobody")).id
    state = wait_for_state(stack.settings, job_id, c.END_STATES)
    out = output_of(stack.settings, job_id)
    with write_scope(stack.settings) as session:
        job = jobs.get_job(session, job_id)
    assert state == State.FAILED and job.exit_code == 126, out
    assert "root's" not in out
    assert out.strip() == f"gpuq: cannot start the command: cannot enter its directory {closed} as nobody: " \
                          "Permission denied"


@needs_root
def test_a_submits_paths_are_checked_with_its_owners_rights_so_they_reveal_nothing_of_roots(stack, shared_dir):
    # The server is root: its checks told a user what existed where they may not look.
    closed = shared_dir / "roots-only"
    closed.mkdir(mode=0o700)
    (closed / "tool.sh").write_text("#!/bin/sh\ntrue\n")
    (closed / "tool.sh").chmod(0o755)
    (closed / "data").mkdir()
    for args, cwd, line in [
        (["--", "true"], closed, f"working directory {closed} does not exist or is closed to nobody"),
        (["--", str(closed / "tool.sh")], shared_dir, f"{closed}/tool.sh is not an executable file (from "
                                                      f"{shared_dir}) or is closed to nobody"),
        (["--", str(closed / "gone.sh")], shared_dir, f"{closed}/gone.sh is not an executable file (from "
                                                      f"{shared_dir}) or is closed to nobody"),
        (["train", "--data-dir", str(closed / "data")], shared_dir,
         f"--data-dir {closed}/data is not a directory or is closed to nobody"),
        (["train", "--checkpoint", str(closed / "ck.pt")], shared_dir,
         f"--checkpoint {closed}/ck.pt: directory {closed} does not exist or is closed to nobody"),
    ]:
        refused = run_cli(["submit", "--user", "nobody", *args], stack.settings, cwd=cwd)
        assert refused.returncode == 2 and refused.stderr.strip() == f"gpuq: {line}", (args, refused.stderr)
    # Root's own submit of the same is root's to make.
    assert run_cli(["submit", "--hold", "--", str(closed / "tool.sh")], stack.settings, cwd=closed).returncode == 0


TINY_TRAIN = ["train", "--epochs", "1", "--train-size", "64", "--test-size", "16", "--batch-size", "16"]


@needs_root
def test_a_train_jobs_checkpoint_is_written_and_read_with_its_owners_rights(stack, shared_dir):
    # The workload runs inside the root worker: a checkpoint path was opened as root (a file
    # written into /root, another user's weights read and replaced).
    closed = shared_dir / "roots-only"
    closed.mkdir(mode=0o700)
    # Past the server's check of the path (as the owner, above): a directory closed after the submit.
    job_id = submitting.submit(stack.settings, spec.workload_spec(
        "train", [*TINY_TRAIN[1:], "--checkpoint", str(closed / "ck.pt")], cwd=str(shared_dir), user="nobody")).id
    state = wait_for_state(stack.settings, job_id, c.END_STATES)
    out = output_of(stack.settings, job_id)
    with write_scope(stack.settings) as session:
        job = jobs.get_job(session, job_id)
    assert state == State.FAILED and f"{closed / 'ck.pt'}: Permission denied (as nobody)" in job.reason, out
    assert list(closed.iterdir()) == []
    open_dir = shared_dir / "everyones"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    ck = open_dir / "ck.pt"
    _, state, out = run_to_end(stack, ["--user", "nobody", *TINY_TRAIN, "--checkpoint", str(ck)], cwd=shared_dir)
    assert state == State.SUCCEEDED, out + stack.logs()
    assert ck.stat().st_uid == 65534 and sorted(p.name for p in open_dir.iterdir()) == ["ck.pt"]
    # Root's own checkpoint beside it, unreadable to nobody: nobody's job cannot resume from it.
    ck.unlink()
    _, state, _ = run_to_end(stack, [*TINY_TRAIN, "--checkpoint", str(ck)], cwd=shared_dir)
    assert state == State.SUCCEEDED and ck.stat().st_uid == 0
    ck.chmod(0o600)  # the server cannot see a file's rights it was not asked about: the worker's open is the check
    job_id, state, out = run_to_end(stack, ["--user", "nobody", *TINY_TRAIN, "--checkpoint", str(ck)], cwd=shared_dir)
    with write_scope(stack.settings) as session:
        job = jobs.get_job(session, job_id)
    assert state == State.FAILED and "Permission denied (as nobody)" in job.reason
    assert ck.stat().st_uid == 0  # not replaced


@needs_root
def test_a_train_jobs_checkpoint_is_made_with_the_submitters_umask(stack, shared_dir):
    # The worker wrote every checkpoint 0644 (its own 022), whatever the submitter's umask, as a
    # command job's files are not. The client sends its umask; the job's environment keeps it.
    open_dir = shared_dir / "umasked"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    for user, ck in (("nobody", open_dir / "theirs.pt"), ("root", open_dir / "mine.pt")):
        old = os.umask(0o077)  # the client's, which the submit carries
        try:
            _, state, out = run_to_end(stack, ["--user", user, *TINY_TRAIN, "--checkpoint", ck.name], cwd=open_dir)
        finally:
            os.umask(old)
        assert state == State.SUCCEEDED, out + stack.logs()
        assert stat.S_IMODE(ck.stat().st_mode) == 0o600, (user, oct(ck.stat().st_mode))


@needs_root
def test_a_job_running_as_another_user_is_still_cancelled_whole(stack, shared_dir):
    s = stack.settings
    job_id = submit(s, ["--user", "nobody", "--", SYSTEM_PYTHON, "-c",
                        "import subprocess, time; subprocess.Popen(['sleep', '300']); print('up', flush=True); "
                        "time.sleep(300)"], cwd=shared_dir)
    wait_for_state(s, job_id, {State.RUNNING})
    deadline = time.monotonic() + 30
    while "up" not in output_of(s, job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    theirs = [p for p in psutil.process_iter(["uids", "cmdline"])
              if p.info["uids"] and p.info["uids"].real == 65534 and "300" in " ".join(p.info["cmdline"] or [])]
    assert len(theirs) == 2
    assert run_cli(["cancel", str(job_id)], s).returncode == 0  # root may, as SLURM's scancel lets root
    assert wait_for_state(s, job_id, c.END_STATES) == State.CANCELLED
    gone, alive = psutil.wait_procs(theirs, timeout=10)
    assert alive == []


@needs_root
def test_a_job_whose_owner_has_no_account_on_the_node_fails_with_that_reason(stack, shared_dir):
    # The server refuses such a --user (below); a node whose accounts differ from the server's is
    # what leaves a worker with an owner it does not know: the row is written as the server would.
    job_id = submitting.submit(stack.settings, spec.command_spec(["true"], cwd=str(shared_dir),
                                                                 user="gpuq-no-such-user")).id
    state = wait_for_state(stack.settings, job_id, c.END_STATES)
    with write_scope(stack.settings) as session:
        job = jobs.get_job(session, job_id)
    assert state == State.FAILED and "user gpuq-no-such-user is not known on node testnode" in job.reason


@needs_root
def test_roots_submit_as_a_user_unknown_here_is_refused_with_nothing_queued(stack, shared_dir):
    def all_jobs() -> int:
        with write_scope(stack.settings) as session:
            return session.scalar(text("SELECT count(*) FROM jobs"))

    before = all_jobs()
    result = run_cli(["submit", "--user", "gpuq-no-such-user", "--", "true"], stack.settings, cwd=shared_dir)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "gpuq: --user gpuq-no-such-user: no such user on this node"
    assert all_jobs() == before


def run_as_nobody(args, settings, cwd, extra_env=None) -> subprocess.CompletedProcess:
    """The real `gpuq` command run by an ordinary user (nobody) instead of root."""
    env = settings_env(settings)
    env.update({"HOME": str(cwd), "USER": "nobody", "LOGNAME": "nobody"}, **(extra_env or {}))
    import sysconfig

    # redis-py wants the async_timeout package below Python 3.11.3 (Debian 12 has 3.11.2); asyncio's is the same.
    boot = (f"import asyncio, runpy, site, sys, types; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "
            "sys.modules.setdefault('async_timeout', types.SimpleNamespace(timeout=asyncio.timeout)); "
            "sys.argv[0] = 'gpuq'; runpy.run_module('gpuq.cli', run_name='__main__')")
    return subprocess.run([SYSTEM_PYTHON, "-c", boot, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60, user=65534, group=65534, extra_groups=[])


@needs_root
def test_the_owner_is_the_os_user_not_what_user_or_logname_say(stack, shared_dir):
    result = run_as_nobody(["submit", "--hold", "--json", "--", "true"], stack.settings, shared_dir,
                           extra_env={"USER": "root", "LOGNAME": "root", "USERNAME": "root"})
    assert result.returncode == 0, result.stderr
    job_id = json.loads(result.stdout)["id"]
    with write_scope(stack.settings) as session:
        assert jobs.get_job(session, job_id).user == "nobody"
    assert run_cli(["cancel", str(job_id)], stack.settings, extra_env={"GPUQ_ADMINS": "root"}).returncode == 0


@needs_root
def test_logs_of_another_users_job_are_readable_when_logs_are_shared(stack, shared_dir):
    job_id, state, out = run_to_end(stack, ["--", "echo", "root's output"], cwd=shared_dir)
    refused = run_as_nobody(["logs", str(job_id)], stack.settings, shared_dir)
    assert refused.returncode == c.EXIT_NOT_ALLOWED and refused.stdout == ""
    # What the server is told decides, not the client's environment.
    told = run_as_nobody(["logs", str(job_id)], stack.settings, shared_dir, {"GPUQ_SHARED_LOGS": "true",
                                                                            "GPUQ_ADMINS": "nobody"})
    assert told.returncode == c.EXIT_NOT_ALLOWED and told.stdout == ""
    with serving(stack.settings, shared_logs=True) as shared_settings:
        shared = run_as_nobody(["logs", str(job_id)], shared_settings, shared_dir)
    assert shared.returncode == 0 and shared.stdout == "root's output\n"
    with serving(stack.settings, admins="nobody") as admin_settings:
        admin = run_as_nobody(["logs", str(job_id)], admin_settings, shared_dir)
    assert admin.returncode == 0 and admin.stdout == "root's output\n"


@needs_root
def test_an_admin_named_in_the_servers_settings_may_hold_release_resubmit_and_cancel_anyones_job(stack, shared_dir):
    # Root's job, held, and after a held job: released, it still waits, so no worker takes it.
    first = submit(stack.settings, ["--hold", "--", "true"], cwd=shared_dir)
    job_id = submit(stack.settings, ["--hold", "--after", str(first), "--", "true"], cwd=shared_dir)

    def state() -> tuple[str, bool]:
        with write_scope(stack.settings) as session:
            j = jobs.get_job(session, job_id)
            return j.state, j.held

    # An ordinary user may not; telling the client they are an admin changes nothing.
    for extra in (None, {"GPUQ_ADMINS": "nobody"}):
        for action in ("release", "hold", "resubmit", "cancel"):
            refused = run_as_nobody([action, str(job_id)], stack.settings, shared_dir, extra)
            assert refused.returncode == c.EXIT_NOT_ALLOWED and refused.stdout == "", (action, refused.stderr)
            assert len(refused.stderr.splitlines()) == 1
    assert state() == (State.PENDING, True)
    # Named an admin by the server's own settings, the same user may.
    with serving(stack.settings, admins="nobody") as admin_settings:
        assert run_as_nobody(["release", str(job_id)], admin_settings, shared_dir).returncode == 0
        assert state() == (State.PENDING, False)
        assert run_as_nobody(["hold", str(job_id)], admin_settings, shared_dir).returncode == 0
        assert state() == (State.PENDING, True)
        again = run_as_nobody(["resubmit", "--json", str(job_id)], admin_settings, shared_dir)
        assert again.returncode == 0, again.stderr
        assert run_as_nobody(["cancel", str(job_id)], admin_settings, shared_dir).returncode == 0
    assert state()[0] == State.CANCELLED
    with write_scope(stack.settings) as session:  # the copy is root's, as a requeue: never the asker's
        copy = jobs.get_job(session, json.loads(again.stdout)["id"])
        assert copy.user == "root" and copy.argv == ["true"]
    for done in (copy.id, first):
        jobs.cancel(stack.settings, done)


HOSTILE = ["; touch {m}", "$(touch {m})", "`touch {m}`", "| touch {m}", "&& touch {m}", "> {m}",
           "it's \"quoted\" \\ back", "two\nlines\r\n", "ünïcödé ✓ 日本語 🚀", "\x1b[31mred\x1b[0m \x07",
           "*", "~", "$HOME"]


def test_hostile_arguments_are_stored_exactly_run_as_literal_argv_and_shown_one_line_each(stack, tmp_path):
    s = stack.settings
    marker = tmp_path / "marker"
    args = [a.format(m=marker) for a in HOSTILE]
    job_id, state, out = run_to_end(stack, ["--name", "[/] naïve ✓ 'q' \"d\" $(x) `y` ; | & [red]", "--",
                                            sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))",
                                            *args], cwd=tmp_path)
    second, _, _ = run_to_end(stack, ["--", sys.executable, "-c", "pass", *args], cwd=tmp_path)
    assert state == State.SUCCEEDED and json.loads(out) == args
    assert not marker.exists()  # no shell ever saw them
    shown = json.loads(run_cli(["show", "--json", str(job_id)], s).stdout)
    assert shown["argv"][3:] == args and shown["name"] == "[/] naïve ✓ 'q' \"d\" $(x) `y` ; | & [red]"
    status = run_cli(["status", "--ended", "50"], s)
    assert status.returncode == 0, status.stderr
    assert "\x1b" not in status.stdout and "\x07" not in status.stdout and "\r" not in status.stdout
    rows = [ln for ln in status.stdout.splitlines() if ln.strip().split(" ")[0] in (str(job_id), str(second))]
    assert len(rows) == 2 and "[/] naïve ✓" in rows[0]
    show = run_cli(["show", str(job_id)], s).stdout
    assert "\x1b" not in show and "\\x1b[31mred" in show and "two\\nlines" in show


def test_a_100_kb_argument_is_passed_whole(stack, tmp_path):
    big = "x" * 100_000
    job_id, state, out = run_to_end(stack, ["--", sys.executable, "-c", "import sys; print(len(sys.argv[1]))", big],
                                    cwd=tmp_path)
    assert state == State.SUCCEEDED and out.strip() == "100000"


# --- passwords and TLS -------------------------------------------------------------------------

@contextmanager
def own_redis(workdir: Path, *args: str):
    """A redis-server of this test's own, on a free port, with ``args`` (password, TLS)."""
    server = system_redis_server()
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    plain = [] if "--tls-port" in args else ["--port", str(port)]
    argv = [server, *plain, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir),
            *[a.replace("{port}", str(port)) for a in args]]
    log = open(workdir / "redis.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket_to(port) as ok:
                if ok:
                    break
            assert proc.poll() is None, (workdir / "redis.log").read_text()
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@contextmanager
def socket_to(port: int):
    import socket

    s = socket.socket()
    s.settimeout(0.2)
    try:
        s.connect(("127.0.0.1", port))
        yield True
    except OSError:
        yield False
    finally:
        s.close()


def everything_shown_and_stored(stack, job_id: int) -> str:
    """All gpuq printed, logged and stored that a password could hide in."""
    s = stack.settings
    texts = [path.read_text(errors="replace") for path in stack.log_dir.glob("*.log")]
    for args in (["status"], ["status", "--json"], ["show", str(job_id)], ["show", "--json", str(job_id)],
                 ["logs", str(job_id)], ["devices", "--json"], ["stats", "--json"], ["why", str(job_id)]):
        result = run_cli(args, s)
        assert result.returncode == 0, (args, result.stderr)
        texts += [result.stdout, result.stderr]
    engine = create_engine(s.database)
    with engine.connect() as conn:
        for table in inspect(engine).get_table_names():
            texts += [str(row) for row in conn.execute(text(f'SELECT * FROM "{table}"'))]
    engine.dispose()
    return "\n".join(texts)


def test_passwords_in_the_broker_and_database_urls_work_and_show_nowhere(tmp_path, postgres_server):
    pw, pgpw = "Br0kerSecret-x1", "PgSecret-y2"
    url, drop = new_postgres_database(postgres_server)
    database = url.replace("postgres@", f"postgres:{pgpw}@")  # trust auth accepts it; it must still be hidden
    with own_redis(tmp_path, "--requirepass", pw) as port:
        settings = make_settings(tmp_path / "home", database, f"redis://:{pw}@127.0.0.1:{port}/0")
        db.upgrade(settings)
        st = start_stack(settings, tmp_path / "logs")
        try:
            job_id, state, out = run_to_end(st, ["--", sys.executable, "-c", "print('ran')"], cwd=tmp_path)
            assert state == State.SUCCEEDED and out == "ran\n", st.logs()
            seen = everything_shown_and_stored(st, job_id)
            assert pw not in seen and pgpw not in seen
            with serving(settings, broker_url=f"redis://:{pw}-wrong@127.0.0.1:{port}/0") as wrong:
                result = run_cli(["submit", "--", "true"], wrong)
            assert result.returncode == c.EXIT_UNAVAILABLE
            assert result.stderr.startswith(f"gpuq: cannot reach the broker at redis://:***@127.0.0.1:{port}/0: ")
            assert pw not in result.stderr and len(result.stderr.splitlines()) == 1
        finally:
            st.stop()
            db.dispose_engines()
            drop()


@pytest.mark.parametrize("args", [["status"], ["submit", "--", "true"], ["show", "1"], ["logs", "1"],
                                  ["db", "upgrade"], ["worker", "--gpu", "0"]])
def test_an_unreachable_database_or_broker_is_named_with_its_password_masked(tmp_path, args, redis_url):
    for database, broker in (("postgresql+psycopg://u:DbSecret@127.0.0.1:1/x", redis_url),
                             (f"sqlite:///{tmp_path / 'db'}", "redis://:RedisSecret@127.0.0.1:1/0")):
        settings = make_settings(tmp_path / "home", database, broker)
        if database.startswith("sqlite"):
            db.upgrade(settings)
            db.dispose_engines()
        if broker.endswith(":1/0") and args[0] in ("status", "show", "logs", "db"):
            continue  # these never talk to the broker
        if args[0] in ("db", "worker"):  # gpuq's own services: they use the database themselves
            result = run_cli(args, settings)
        else:  # users' commands: the server is what cannot reach them, and says so through the client
            with serving(settings) as served:
                result = run_cli(args, served)
        assert result.returncode == c.EXIT_UNAVAILABLE, (args, result.stdout, result.stderr)
        assert "Secret" not in result.stdout + result.stderr
        assert "u:***@127.0.0.1:1/x" in result.stderr or "redis://:***@127.0.0.1:1/0" in result.stderr


def make_tls_files(workdir: Path) -> Path:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it; returns the CA file."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=gpuq test CA")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (workdir / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.crt", "-days", "2", "-extfile", "san.cnf")
    return workdir / "ca.crt"


def test_a_job_runs_through_a_tls_redis_with_a_password_and_a_wrong_ca_is_refused(tmp_path, postgres_server):
    ca = make_tls_files(tmp_path)
    pw = "TlsSecret-z3"
    url, drop = new_postgres_database(postgres_server)
    with own_redis(tmp_path, "--port", "0", "--tls-port", "{port}", "--tls-cert-file", str(tmp_path / "server.crt"),
                   "--tls-key-file", str(tmp_path / "server.key"), "--tls-ca-cert-file", str(ca),
                   "--tls-auth-clients", "no", "--requirepass", pw) as port:
        broker = f"rediss://:{pw}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
        with pytest.raises(redis.ConnectionError):  # the server speaks TLS only
            redis.Redis(host="127.0.0.1", port=port, password=pw, socket_connect_timeout=2).ping()
        settings = make_settings(tmp_path / "home", url, broker)
        db.upgrade(settings)
        st = start_stack(settings, tmp_path / "logs")
        try:
            job_id, state, out = run_to_end(st, ["--", sys.executable, "-c", "print('over tls')"], cwd=tmp_path)
            assert state == State.SUCCEEDED and out == "over tls\n", st.logs()
            assert pw not in everything_shown_and_stored(st, job_id)
            other = make_tls_files(Path(tempfile.mkdtemp(dir=tmp_path)))
            with serving(settings, broker_url=broker.replace(str(ca), str(other))) as untrusted:
                result = run_cli(["submit", "--", "true"], untrusted)
            assert result.returncode == c.EXIT_UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in result.stderr
            assert pw not in result.stderr and "rediss://:***@127.0.0.1" in result.stderr
        finally:
            st.stop()
            db.dispose_engines()
            drop()


def test_a_uid_with_no_account_here_gets_a_name_no_account_can_have():
    # As "uidN" it was the name of any local account called that: a caller of that uid from
    # another node (MUNGE) owned that account's jobs, and theirs became its.
    import pwd

    from gpuq.service.rights import Caller

    unknown = next(u for u in range(4_242_424, 4_242_524) if not _has_account(u))
    caller = Caller.of_uid(unknown)
    assert caller.user == f"uid:{unknown}" and ":" in caller.user  # passwd's field separator
    assert Caller.of_uid(0).user == pwd.getpwuid(0).pw_name


def _has_account(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False
