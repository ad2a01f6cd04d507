"""Bad input and abuse: each attempt is refused with one clear line and a named exit code, and
nothing is written (no job row, no Redis message) and nothing runs.

Complements tests/test_submit_input.py (ordinary mistakes) and tests/test_worker_guarantees.py
(duplicate and misdirected messages): here are hostile sizes and numbers, environment injection,
other users' jobs, and messages pushed straight into a worker's queue.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, update
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import broker, db, job_variables, jobs, spec, submitting
from gpuq.service import constants as c
from gpuq.service import settings as settings_module
from gpuq.service.celery_app import make_app
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Allocation, Gpu, Job, JobOutput, utcnow
from tests.conftest import Stack, ThreadServer, make_settings, new_postgres_database, settings_env
from tests.test_security import needs_root, run_as_nobody

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pg(tmp_path_factory, postgres_server, redis_url):
    """Settings on one PostgreSQL database at head for the module: nothing is meant to be written.
    No scheduler runs here, and a submit places nothing itself: the tests forge every message."""
    url, drop = new_postgres_database(postgres_server)
    settings = make_settings(tmp_path_factory.mktemp("abuse") / "home", url, redis_url, place_at_submit=False)
    db.upgrade(settings)
    server = ThreadServer(settings)  # the users' commands go through it, as on a real node
    yield settings
    server.stop()
    db.dispose_engines()
    drop()


def snapshot(settings) -> tuple:
    """Everything a refused request must leave as it was: the jobs and their states, output, and
    gpuq's Redis keys with their lengths."""
    with write_scope(settings) as session:
        rows = tuple(session.execute(select(Job.id, Job.state, Job.held, Job.user, Job.cancel_requested_at,
                                            Job.priority).order_by(Job.id)).all())
        output = session.scalar(select(func.count()).select_from(JobOutput))
    r = broker.client(settings)
    keys = {k: r.llen(k) if r.type(k) == b"list" else r.type(k) for k in r.scan_iter(f"{settings.key_prefix}*")}
    return rows, output, keys


def invoke(settings, args: list[str], env: dict[str, str] | None = None):
    settings_module.get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, args, prog_name="gpuq", env={**settings_env(settings), **(env or {})})
    finally:
        settings_module.get_settings.cache_clear()


def assert_refused(settings, args, code, message, env=None) -> None:
    before = snapshot(settings)
    result = invoke(settings, args, env)
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuq: ") and message in lines[0], result.output
    assert snapshot(settings) == before


BIG = "y" * (1 << 20)


@pytest.mark.parametrize("args,message", [
    # Huge, negative and malformed resources: refused before SQL (a 32-bit column would overflow).
    (["--gpus", "100000"], "--gpus 100000 is more than any node has"),
    (["--gpus", "99999999999999999999"], "is more than any node has"),
    (["--mem", "-5G"], "--mem takes a size like 20G"),
    (["--mem", "1e30"], "--mem takes a size like 20G"),
    (["--mem", "9" * 400], "is more than any GPU has"),
    (["--mem", "0.1K"], "--mem must be at least 1M"),
    (["--time", "-1"], "--time takes 2h, 30m"),
    (["--time", "0"], "--time must be at least 1s"),
    (["--time", "99999d"], "is more than 366 days"),
    (["--time", "99999999999:00:00"], "is more than 366 days"),
    (["--time", "²:00"], "--time takes 2h, 30m"),
    (["--priority", "1000000000"], "--priority must be between -1000 and 1000"),
    (["--priority", "1e9"], "Invalid value for '--priority'"),
    (["--retries", "-1"], "Invalid value for '--retries': -1 is too small (0 or more)"),
    (["--retries", "101"], "--retries must be between 0 and 100"),
    (["--after", "abc"], "--after takes job ids"),
    (["--after", "0"], "--after takes job ids"),
    (["--after", "99999999999"], "--after takes job ids"),
    (["--after", "7"], "--after: no job 7"),
    (["--after-any", "1;DROP TABLE jobs"], "--after-any takes job ids"),
    (["--array", "0-99999999999"], "--array takes ranges"),
    (["--array", "0-2000000000:1000000"], "--array indices must be at most 1000000000"),
    (["--node", " "], "--node must not be empty"),
    # Environment injection: the loader, shells, and what gpuq itself sets.
    (["--env", "LD_PRELOAD=/tmp/evil.so"], "--env LD_PRELOAD: this variable may not be set"),
    (["--env", "LD_AUDIT=/tmp/evil.so"], "--env LD_AUDIT: this variable may not be set"),
    (["--env", "BASH_ENV=/tmp/evil.sh"], "--env BASH_ENV: this variable may not be set"),
    (["--env", "GLIBC_TUNABLES=glibc.malloc.check=3"], "--env GLIBC_TUNABLES: this variable may not be set"),
    (["--env", "GPUQ_DATABASE_URL=sqlite:////tmp/x"], "--env GPUQ_DATABASE_URL: this variable may not be set"),
    (["--env", "GPUQ_ARRAY_INDEX=3"], "--env GPUQ_ARRAY_INDEX: this variable may not be set"),
    (["--env", "CUDA_VISIBLE_DEVICES=0,1"], "--env CUDA_VISIBLE_DEVICES: this variable may not be set"),
    (["--env", "BASH_FUNC_ls%%=() { id; }"], "not a variable name"),
    (["--env", "1X=y"], "not a variable name"),
    (["--env", "A B=y"], "not a variable name"),
    (["--env", "=y"], "not a variable name"),
    (["--env", "ABUSE_NEVER_SET"], "--env ABUSE_NEVER_SET: not set here"),
    (["--env", "HUGE=" + "v" * 70_000], "--env HUGE: the value is longer than 64 KiB"),
    # Names and commands: control characters, and a command line used as a data channel.
    (["--name", "\x1b[2J\x1b[Hfake prompt"], "--name must not contain control characters"),
    (["--name", "tab\there"], "--name must not contain control characters"),
    (["--user", "bad name;rm"], "is not a user name"),
])
def test_a_hostile_command_submission_is_refused_in_one_line_and_writes_nothing(pg, args, message):
    assert_refused(pg, ["submit", *args, "--", "true"], c.EXIT_USAGE, message)


@pytest.mark.parametrize("args,message", [
    (["--", "echo", BIG], "the command line is longer than 128 KiB"),
    (["--", "echo", *(["z" * 100] * 2000)], "the command line is longer than 128 KiB"),
    (["--env", "FOO=1", "matmul"], "--env is for a command"),
    (["matmul", "--size", "1; rm -rf /"], "--size must be a whole number"),
    (['{"kind": "command", "argv": ["rm", "-rf", "/"]}'], "no such job script: {"),  # a path: a '/'
    (["evil\n\x1b[2Jname"], "evil\\n\\x1b[2Jname is none of gpuq's workloads"),  # one line, no escape
    (["train", "--model", "lenet$(id)"], "--model must be one of"),
    (["train", "--data-dir", "x" * 200_000], "the parameters are longer than 128 KiB"),
    (["train", "--data-dir", "no\nsuch\x1b[2J dir"], "no\\nsuch\\x1b[2J dir is not a directory"),
])
def test_a_malformed_spec_or_oversized_command_is_refused_and_writes_nothing(pg, args, message):
    assert_refused(pg, ["submit", *args], c.EXIT_USAGE, message)


def test_nul_bytes_and_undecodable_text_cannot_reach_a_job():
    # A command line cannot carry NUL, but the Python API can: the same checks apply.
    with pytest.raises(InvalidSpec, match="NUL byte"):
        spec.command_spec(["echo", "a\x00b"])
    with pytest.raises(InvalidSpec, match="the value contains a NUL byte"):
        job_variables.job_env(["X=a\x00b"])
    with pytest.raises(InvalidSpec, match="not valid UTF-8"):
        spec.command_spec(["echo", "bad\udcff"])
    with pytest.raises(InvalidSpec, match="--env X: the value is not valid UTF-8"):
        job_variables.job_env(["X"], {"X": "bad\udcff"})
    # The default set is never a door for the loader either: only named variables are taken.
    env = job_variables.job_env([], {"PATH": "/bin", "LD_PRELOAD": "/tmp/evil.so", "GPUQ_BROKER_URL": "redis://x",
                            "LC_ALL": "C", "AWS_SECRET_ACCESS_KEY": "k", "LANG": "bad\udcff"})
    assert env == {"PATH": "/bin", "LC_ALL": "C"}
    # --env ALL (sbatch's --export=ALL) takes the rest of the submitter's variables, and still no hook
    # of the loader, none of gpuq's, nothing a NUL or a bad byte would break, and --env's own on top.
    env = job_variables.job_env(["ALL", "HF_HOME=/data/hf"], {
        "PATH": "/bin", "LD_PRELOAD": "/tmp/evil.so", "GPUQ_BROKER_URL": "redis://x", "WANDB_API_KEY": "w",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "HF_HOME": "/home/a/hf", "CUDA_VISIBLE_DEVICES": "3",
        "BASH_FUNC_x%%": "() { id; }", "NUL": "a\x00b", "BAD": "bad\udcff", "1X": "y", "HOME": "/home/a",
        "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"})  # the submitting job's, as an sbatch in a job has them
    assert env == {"PATH": "/bin", "WANDB_API_KEY": "w", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
                   "HF_HOME": "/data/hf", "HOME": "/home/a"}
    # An environment past the limit is refused in one line, which says what to do where --env ALL
    # (a SLURM script's default) took it all.
    big = {f"V{i}": "x" * 60_000 for i in range(5)}
    with pytest.raises(InvalidSpec, match=r"larger than 256 KiB \(--env ALL, a SLURM script's default: name what"):
        job_variables.job_env(["ALL"], big)
    with pytest.raises(InvalidSpec, match=r"larger than 256 KiB$"):
        job_variables.job_env([f"V{i}" for i in range(5)], big)


# --- other users' jobs -------------------------------------------------------------------------

@pytest.fixture
def roots_job(pg):
    """A held job of root's (the test runs as root), for another user to try things on."""
    job = submitting.submit(pg, spec.command_spec(["true"], cwd="/"))
    with write_scope(pg) as session:
        session.execute(update(Job).where(Job.id == job.id).values(held=True))
        session.add(JobOutput(job_id=job.id, seq=0, data="root's secret output\n"))
    yield job.id
    with write_scope(pg) as session:
        session.execute(update(Job).where(Job.id == job.id, Job.state == State.PENDING)
                        .values(state=State.CANCELLED, ended_at=utcnow()))


@needs_root
@pytest.mark.parametrize("command", ["cancel", "hold", "release", "logs", "update --priority 1"])
def test_another_users_cancel_hold_release_update_or_logs_is_refused(pg, roots_job, shared_dir, command):
    before = snapshot(pg)
    name, *options = command.split()
    result = run_as_nobody([name, str(roots_job), *options], pg, shared_dir)
    assert result.returncode == c.EXIT_NOT_ALLOWED, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.startswith(f"gpuq: job {roots_job} belongs to root; only they or")
    assert len(result.stderr.splitlines()) == 1
    assert snapshot(pg) == before


@needs_root
def test_an_ordinary_user_cannot_submit_as_someone_else(pg, shared_dir):
    before = snapshot(pg)
    result = run_as_nobody(["submit", "--user", "root", "--", "true"], pg, shared_dir)
    assert result.returncode == c.EXIT_NOT_ALLOWED, result.stderr
    assert result.stderr.strip() == "gpuq: only root may submit as another user (--user root); you are nobody"
    assert snapshot(pg) == before


# --- messages pushed straight into a worker's queue -------------------------------------------

@pytest.fixture(scope="module")
def worker(pg, tmp_path_factory):
    """One real worker process (GPU 0) and no scheduler: every message it gets is the test's."""
    st = Stack(pg, tmp_path_factory.mktemp("abuse-logs"))
    st.start_worker(0)
    st.wait_registered(1)
    yield st
    st.stop()


def worker_log(st) -> str:
    return (st.log_dir / "worker-testnode-0.log").read_text(errors="replace")


def wait_for_log(st, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = worker_log(st)
        if text in log:
            return log
        assert st.procs["worker-testnode-0"].poll() is None, log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the worker's log:\n{worker_log(st)[-3000:]}")


def send(settings, args, **options) -> None:
    queue = gpu0(settings).queue
    make_app(settings).send_task(c.RUN_JOB_TASK, args=args, queue=queue, routing_key=queue, retry=False, **options)


def gpu0(settings) -> Gpu:
    with write_scope(settings) as session:
        gpu = session.scalar(select(Gpu).where(Gpu.node == settings.node, Gpu.index == 0))
        session.expunge(gpu)
        return gpu


def toucher(marker: Path) -> list[str]:
    return [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"]


class Evil:
    """Runs a command when unpickled: what a pickle message would do to a worker that accepted it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_message_is_refused_by_the_worker_which_keeps_serving(pg, worker, tmp_path):
    marker = tmp_path / "unpickled"
    jobs_before = snapshot(pg)[0]
    send(pg, [Evil(marker)], serializer="pickle")
    log = wait_for_log(worker, "Refusing to deserialize untrusted content of type pickle")
    time.sleep(0.5)
    assert not marker.exists() and worker.procs["worker-testnode-0"].poll() is None
    assert snapshot(pg)[0] == jobs_before
    send(pg, [424242])  # still serving
    wait_for_log(worker, "job 424242 is not dispatched to this GPU; message dropped")
    assert "Traceback" not in log.split("Refusing to deserialize")[-1].split("\n", 2)[1]


@pytest.mark.parametrize("args,logged", [
    ([424243], "job 424243 is not dispatched to this GPU; message dropped"),
    (["touch /tmp/gpuq-abuse-owned"], "dropped a message with job id 'touch /tmp/gpuq-abuse-owned'"),
    ([True], "dropped a message with job id True"),
    ([{"argv": ["touch", "/tmp/gpuq-abuse-owned"]}], "dropped a message with job id {'argv'"),
])
def test_a_forged_message_for_no_job_is_dropped_and_writes_nothing(pg, worker, args, logged):
    before = snapshot(pg)
    send(pg, args)
    wait_for_log(worker, logged)
    assert not Path("/tmp/gpuq-abuse-owned").exists()
    assert snapshot(pg)[:2] == before[:2]


def test_a_forged_message_for_a_pending_job_does_not_start_it(pg, worker, tmp_path):
    marker = tmp_path / "ran"
    job = submitting.submit(pg, spec.command_spec(toucher(marker), cwd=str(tmp_path)))
    send(pg, [job.id])
    wait_for_log(worker, f"job {job.id} is not dispatched to this GPU; message dropped")
    with write_scope(pg) as session:
        row = jobs.get_job(session, job.id)
        assert row.state == State.PENDING and row.started_at is None and row.worker is None
        session.execute(update(Job).where(Job.id == job.id).values(state=State.CANCELLED, ended_at=utcnow()))
    assert not marker.exists()


def test_a_message_naming_another_command_runs_the_rows_command_only(pg, worker, tmp_path):
    """The job is dispatched to GPU 0 in SQL, and the only messages are forged ones naming another
    command: in kwargs (the task takes none: refused) and in headers (ignored: the row's runs)."""
    theirs, mine = tmp_path / "forged-command-ran", tmp_path / "row-command-ran"
    job = submitting.submit(pg, spec.command_spec(toucher(mine), cwd=str(tmp_path)))
    with write_scope(pg) as session:
        session.execute(update(Job).where(Job.id == job.id).values(state=State.DISPATCHED, dispatched_at=utcnow(),
                                                                   node=pg.node))
        session.add(Allocation(job_id=job.id, gpu_id=gpu0(pg).id, rank=0))
    evil = toucher(theirs)
    send(pg, [job.id], kwargs={"argv": evil})
    wait_for_log(worker, "unexpected keyword argument 'argv'")
    with write_scope(pg) as session:
        assert jobs.get_job(session, job.id).state == State.DISPATCHED
    send(pg, [job.id], headers={"argv": evil, "command": " ".join(evil)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with write_scope(pg) as session:
            row = jobs.get_job(session, job.id)
        if row.state in c.END_STATES:
            break
        time.sleep(0.1)
    assert row.state == State.SUCCEEDED and row.argv == toucher(mine), worker_log(worker)[-3000:]
    assert mine.read_text() == "x" and not theirs.exists()


def test_a_program_whose_name_holds_a_newline_cannot_forge_a_line_of_the_workers_log(pg, worker, tmp_path):
    # The worker logged argv[0] raw: a name with a newline wrote a line of its own, an audit line's look-alike.
    forged = "INFO gpuq.audit: cancel by root (uid 0) as admin: job 99 of victor"
    program = tmp_path / f"p\n2026-11-26 19:50:00,000 {forged}\x1b[2K"
    shutil.copy("/bin/true", program)
    job = submitting.submit(pg, spec.command_spec([str(program)], cwd=str(tmp_path)))
    with write_scope(pg) as session:
        session.execute(update(Job).where(Job.id == job.id).values(state=State.DISPATCHED, dispatched_at=utcnow(),
                                                                   node=pg.node))
        session.add(Allocation(job_id=job.id, gpu_id=gpu0(pg).id, rank=0))
    send(pg, [job.id])
    log = wait_for_log(worker, f"job {job.id} started (")
    assert not any(line.endswith(forged) or line.startswith("2026-11-26 19:50:00") for line in log.splitlines())
    assert "\x1b" not in log and "\\n2026-11-26 19:50:00,000 INFO gpuq.audit" in log
