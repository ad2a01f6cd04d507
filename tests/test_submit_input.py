"""Bad input gets one line that says what to change, a non-zero exit, and nothing written."""

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job
from gpuq.service.units import TIME_FORMS
from tests.conftest import (
    ThreadServer,
    cli_submit,
    run_cli,
    serving,
    settings_env,
    socket_path,
    venv_reachable_by_everyone,
)


def jobs_in(settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def invoke(args):
    return CliRunner().invoke(app, args, prog_name="gpuq")


@pytest.mark.parametrize("args,message", [
    (["submit", "--gpus", "0", "matmul"], "Invalid value for '--gpus': 0 is too small (1 or more)"),
    (["submit", "--gpus", "-2", "matmul"], "Invalid value for '--gpus': -2 is too small (1 or more)"),
    (["submit", "--gpus", "3", "--", "true"], "more than any node has (the largest, testnode, has 2)"),
    (["submit", "--gpus", "2", "matmul"], "matmul runs on one GPU"),
    # A word that is no workload, no file here and no program: named as none of them.
    (["submit", "matmull"], "matmull is none of gpuq's workloads (gpuq workloads), no file in "),
    # A script's path, as sbatch takes one, that is not there.
    (["submit", "./train.sh"], "no such job script: ./train.sh (in "),
    (["submit", "-G", "1", "train.sh", "--gpus", "2"], "train.sh is none of gpuq's workloads"),
    (["submit", "matmul", "--size", "big"], "--size must be a whole number; got 'big'"),
    (["submit", "matmul", "--size", "0"], "--size must be at least 1"),
    (["submit", "matmul", "--size", "9999999"], "--size must be at most 65536"),
    (["submit", "matmul", "--dtype", "fp64"], "--dtype must be one of fp32, tf32, fp16, bf16"),
    (["submit", "matmul", "--sise", "5"], "matmul has no parameter --sise"),
    (["submit", "matmul", "--size"], "--size needs a value"),
    (["submit", "matmul", "--size", "5", "--size", "6"], "--size is given twice"),
    (["submit", "matmul", "500"], "unexpected argument '500'"),
    (["submit", "sleep", "60"], "unexpected argument '60' after workload sleep: parameters are given as --name value "
                                "(the program sleep: gpuq submit -- sleep 60)"),
    (["submit"], "nothing to run"),
    (["submit", "--"], "no command given after --"),
    (["submit", "matmul", "--", "true"], "either a workload or a command"),
    (["submit", "--", "no-such-program-gpuq"], "command not found: no-such-program-gpuq"),
    (["submit", "--", "./not-here.sh"], "./not-here.sh is not an executable file"),
    (["submit", "--name", "", "--", "true"], "--name must not be empty"),
    (["submit", "--name", "a\nb", "--", "true"], "--name must be one line"),
    (["submit", "--name", "x" * 201, "--", "true"], "at most 200"),
    # Bytes of another encoding, as a shell passes them (surrogateescape): a server failure before.
    (["submit", "--name", "caf\udce9", "--", "true"], "--name is not valid UTF-8 text"),
    (["submit", "--env", "HOME=/tmp", "--", "true"], "--env HOME: this variable may not be set"),  # was ignored
    (["submit", "matmul", "--dtype", "fp\udce9"], "a workload parameter is not valid UTF-8 text"),
    (["submit", "--sweep", "lr=0.1,0.01,0.1", "--", "true"], "--sweep lr: 0.1 is given twice"),
])
def test_bad_submissions_are_refused_in_one_line_and_write_nothing(use_settings, args, message):
    result = invoke(args)
    assert result.exit_code == c.EXIT_USAGE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuq: ")
    assert message in lines[0]
    assert jobs_in(use_settings) == 0


def test_an_unreachable_broker_is_named_and_nothing_is_written(use_settings, monkeypatch):
    # The server is what reaches the broker: one whose broker is down says so, through the client.
    bad = use_settings.with_overrides(broker_url="redis://:hunter2@127.0.0.1:1/0",
                                      socket=socket_path())
    server = ThreadServer(bad)
    monkeypatch.setenv("GPUQ_SOCKET", bad.socket)
    try:
        result = invoke(["submit", "--", "true"])
    finally:
        server.stop()
    assert result.exit_code == c.EXIT_UNAVAILABLE
    assert "cannot reach the broker at redis://:***@127.0.0.1:1/0" in result.output
    assert "hunter2" not in result.output
    assert jobs_in(use_settings) == 0


def test_an_unreachable_database_is_named(use_settings, monkeypatch):
    bad = use_settings.with_overrides(database_url="postgresql+psycopg://gpuq:pw@127.0.0.1:1/gpuq",
                                      socket=socket_path())
    server = ThreadServer(bad)
    monkeypatch.setenv("GPUQ_SOCKET", bad.socket)
    try:
        result = invoke(["status"])
    finally:
        server.stop()
    assert result.exit_code == c.EXIT_UNAVAILABLE
    assert result.output.startswith("gpuq: cannot use the database at postgresql+psycopg://gpuq:***@127.0.0.1:1/gpuq")
    assert "pw@" not in result.output


def test_no_server_is_one_line_naming_where_the_client_looked(use_settings, monkeypatch):
    monkeypatch.setenv("GPUQ_SOCKET", "/tmp/gpuqt-nobody-here.sock")
    for args in (["status"], ["submit", "--", "true"]):
        result = invoke(args)
        assert result.exit_code == c.EXIT_UNAVAILABLE == 69
        assert result.output.startswith("gpuq: no gpuq server answers at /tmp/gpuqt-nobody-here.sock: no socket there")
        assert result.output.count("\n") == 1
    assert jobs_in(use_settings) == 0


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="needs root, unshare and setpriv: the client runs as nobody with a /run of its own")
def test_the_client_finds_the_server_by_gpuq_server_then_gpuq_socket_then_the_machines_socket_then_its_homes(
        use_settings, shared_dir):
    # The client runs as an ordinary user (nobody) with a /run of its own (a tmpfs in a private
    # mount namespace), so the machine's /run/gpuq/gpuq.sock is there only when the case puts it there.
    venv_reachable_by_everyone()
    real = str(use_settings.server_socket)  # where the test's server listens
    home = shared_dir / "home-of-the-user"
    home.mkdir(mode=0o755)
    base = {k: v for k, v in settings_env(use_settings).items() if k not in ("GPUQ_SOCKET", "GPUQ_SERVER")}
    base.update(GPUQ_HOME=str(home), HOME=str(shared_dir))
    nowhere = str(shared_dir / "nothing-listens-here.sock")

    def status(env: dict[str, str], machine_socket: bool = False) -> subprocess.CompletedProcess:
        setup = "mount -t tmpfs tmpfs /run"
        if machine_socket:
            setup += f" && mkdir -m 755 /run/gpuq && ln -s {shlex.quote(real)} /run/gpuq/gpuq.sock"
        argv = ["unshare", "-m", "sh", "-c", f'{setup} && exec setpriv --reuid 65534 --regid 65534 --clear-groups "$@"',
                "sh", sys.executable, "-m", "gpuq.cli", "status"]
        return subprocess.run(argv, env={**base, **env}, cwd=shared_dir, capture_output=True, text=True, timeout=60)

    def answered(done: subprocess.CompletedProcess) -> bool:
        assert done.returncode in (0, c.EXIT_UNAVAILABLE), done.stderr
        return done.returncode == 0

    # GPUQ_SERVER first, as a path or unix:PATH, whatever GPUQ_SOCKET says.
    assert answered(status({"GPUQ_SERVER": real, "GPUQ_SOCKET": nowhere}))
    assert answered(status({"GPUQ_SERVER": f"unix:{real}", "GPUQ_SOCKET": nowhere}))
    refused = status({"GPUQ_SERVER": f"unix:{nowhere}", "GPUQ_SOCKET": real})
    assert not answered(refused) and f"no gpuq server answers at unix:{nowhere}" in refused.stderr
    # Then GPUQ_SOCKET, then the machine's socket when it exists, ahead of the user's own.
    assert answered(status({"GPUQ_SOCKET": real}))
    (home / "gpuq.sock").symlink_to(nowhere)
    assert answered(status({}, machine_socket=True))
    # With no machine socket, the user's own stack's, in their gpuq home.
    alone = status({})
    assert not answered(alone) and f"no gpuq server answers at {home / 'gpuq.sock'}" in alone.stderr
    (home / "gpuq.sock").unlink()
    (home / "gpuq.sock").symlink_to(real)
    assert answered(status({}))


def test_a_mistyped_option_is_named_as_an_unknown_option(use_settings):
    for args in (["submit", "--shaerd", "--", "true"], ["submit", "--shaerd", "matmul"]):
        result = invoke(args)
        assert result.exit_code == c.EXIT_USAGE
        assert result.output == "gpuq: no such option: --shaerd (gpuq submit --help)\n"
    assert jobs_in(use_settings) == 0


def test_a_good_submission_prints_the_job_id_and_stores_the_spec(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["submit", "--name", "bench", "matmul", "--size", "500", "--repeat", "100"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "submitted job 1"
    result = invoke(["submit", "--gpus", "2", "--json", "--", "python", "train.py", "--lr", "0.1"])
    assert result.exit_code == 0, result.output
    import json

    job = json.loads(result.output)
    assert job["id"] == 2 and job["argv"] == ["python", "train.py", "--lr", "0.1"]
    assert job["cwd"] == str(tmp_path) and job["gpus"] == 2 and job["state"] == "pending"
    with write_scope(use_settings) as session:
        first = session.get(Job, 1)
        assert first.name == "bench" and first.workload == "matmul"
        assert first.params == {"size": 500, "repeat": 100, "warmup": 3, "dtype": "fp32", "cpu_baseline": False}


def test_without_gpus_a_job_gets_one_gpu_or_the_least_its_workload_takes(use_settings):
    import json

    def gpus(*args):
        result = invoke(["submit", "--json", "--hold", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["gpus"]

    # multi-matmul needs two: without --gpus it was refused ("needs at least 2 GPUs; got --gpus 1").
    assert (gpus("multi-matmul"), gpus("matmul"), gpus("--", "true"), gpus("--gpus", "2", "--", "true")) == (2, 1, 1, 2)
    refused = invoke(["submit", "--gpus", "1", "multi-matmul"])
    assert refused.exit_code == c.EXIT_USAGE and "multi-matmul needs at least 2 GPUs; got --gpus 1" in refused.output


def test_status_show_and_cancel_name_a_missing_job(use_settings):
    for args in (["show", "42"], ["logs", "42"], ["wait", "42"], ["cancel", "42"]):
        result = invoke(args)
        assert result.exit_code == c.EXIT_NOT_FOUND, (args, result.output)
        assert result.output.strip() == "gpuq: no job 42"


def test_cancelling_a_pending_job_ends_it_at_once_and_twice_is_a_conflict(use_settings):
    assert invoke(["submit", "--", "true"]).exit_code == 0
    result = invoke(["cancel", "1"])
    assert result.exit_code == 0 and "job 1 cancelled" in result.output
    again = invoke(["cancel", "1"])
    assert again.exit_code == c.EXIT_CONFLICT and "already ended (cancelled)" in again.output
    assert invoke(["wait", "1"]).exit_code == c.EXIT_JOB_FAILED


def test_cancelling_several_named_jobs_that_all_ended_is_a_conflict_and_some_ended_is_not(use_settings):
    for _ in range(3):
        assert invoke(["submit", "--", "true"]).exit_code == 0
    assert invoke(["cancel", "1", "2"]).exit_code == 0
    both = invoke(["cancel", "1", "2"])
    assert both.exit_code == c.EXIT_CONFLICT, both.output
    assert "job 1: already ended (cancelled)" in both.output and "job 2: already ended (cancelled)" in both.output
    some = invoke(["cancel", "2", "3"])
    assert some.exit_code == 0 and "job 2: already ended" in some.output and "job 3 cancelled" in some.output


def test_relative_paths_in_workload_parameters_are_stored_from_the_submit_directory(tmp_path, monkeypatch):
    from gpuq.service.spec import workload_spec

    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    job = workload_spec("train", ["--checkpoint", "ckpt/run1.pt"])
    assert job.params["checkpoint"] == str(tmp_path / "ckpt" / "run1.pt")


def test_an_array_is_cancelled_by_its_id_and_cancel_user_takes_all_of_mine(use_settings):
    result = invoke(["submit", "--array", "0-2", "--hold", "--", "true"])
    assert result.exit_code == 0 and result.output.strip() == "submitted array 1: jobs 1-3 (3)"
    assert invoke(["submit", "--", "true"]).exit_code == 0
    shown = invoke(["show", "--array", "1"]).output.splitlines()
    assert len(shown) == 3 and all("pending" in ln and "held" in ln for ln in shown)
    result = invoke(["cancel", "--array", "1"])
    assert result.exit_code == 0 and result.output == "cancelled 3 jobs of array 1\n"
    assert invoke(["cancel", "--array", "9"]).output.strip() == "gpuq: no array 9"
    result = invoke(["cancel", "--me"])
    assert result.exit_code == 0 and result.output.strip() == "job 4 cancelled"
    assert invoke(["cancel", "--me"]).output.strip() == "no active jobs to cancel"
    # As scancel -u names the caller, and as gpuq's --user flag was: bare, it is --me.
    for args in (["cancel", "-u", pwd.getpwuid(os.getuid()).pw_name], ["cancel", "--user"]):
        assert invoke(args).output.strip() == "no active jobs to cancel", args
    assert invoke(["wait", "--array", "1"]).exit_code == c.EXIT_JOB_FAILED


def test_cancel_user_with_job_ids_or_an_array_is_refused_and_cancels_nothing(use_settings):
    # It took the union: `gpuq cancel --user 5` cancelled every job of the caller's, not job 5.
    assert invoke(["submit", "--array", "0-1", "--hold", "--", "true"]).exit_code == 0  # jobs 1-2
    assert invoke(["submit", "--hold", "--", "true"]).exit_code == 0  # job 3
    for args in (["cancel", "--user", "1"], ["cancel", "--me", "--array", "1"]):
        result = invoke(args)
        assert result.exit_code == c.EXIT_USAGE
        assert result.output.strip() == "gpuq: --me cancels all your jobs: give it alone, without job ids or --array"
    result = invoke(["cancel", "-u", "someone", "2"])
    assert result.output.strip() == ("gpuq: -u someone cancels all of someone's jobs: give it alone, without job "
                                     "ids or --array")
    with write_scope(use_settings) as session:
        assert set(session.scalars(select(Job.state))) == {State.PENDING}


@pytest.mark.parametrize("args,message", [
    (["show", str(2**63)], f"no job {2**63}"),  # past SQLite's integers (and PostgreSQL's from 2**31)
    (["show", str(2**31)], f"no job {2**31}"),
    (["logs", str(10**30)], f"no job {10**30}"),
    (["stats", str(2**40)], f"no job {2**40}"),
    (["cancel", "1", str(2**63)], f"no job {2**63}"),
    (["show", "--array", str(2**63)], f"no array {2**63}"),
    (["history", "--array", str(2**40)], f"no array {2**40}"),
    (["show", "--array", "-1"], "'-1' is not a job id (a whole number from 1)"),
    (["stats", "--since", "x" * 9000], "the server refused the request (400"),  # past aiohttp's request line
    (["wait", "1", "--timeout", "nan"], "nan is not a number"),
])
def test_ids_and_values_past_any_a_job_can_have_are_one_line_not_a_server_failure(use_settings, args, message):
    # They reached the database as numbers it cannot take: the server failed (exit 70, "see its log").
    assert invoke(["submit", "--hold", "--", "true"]).exit_code == 0
    result = invoke(args)
    assert result.exit_code in (c.EXIT_NOT_FOUND, c.EXIT_USAGE), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


@pytest.mark.parametrize("args,message", [
    # Python's int() took digit groups: `gpuq cancel 7_0` (SLURM's task 0 of array 7) cancelled job 70.
    (["show", "7_0"], "'7_0' is not a job id: an array's tasks have job ids of their own (gpuq show --array 7"),
    (["cancel", "1_0"], "'1_0' is not a job id"),
    (["cancel", "1-3"], "'1-3' is not a job id: give each id (12 13 14), or --array ID"),
    (["hold", "1,2"], "'1,2' is not a job id: give each id"),
    (["wait", "\u0661"], "is not a job id (a whole number from 1)"),  # an Arabic-Indic one
    (["submit", "--gpus", "1_0", "--", "true"], "Invalid value for '--gpus': '1_0' is not a whole number"),
    (["submit", "--retries", " 2", "--", "true"], "Invalid value for '--retries': ' 2' is not a whole number"),
    (["submit", "--priority", "1_0", "--", "true"], "Invalid value for '--priority': '1_0' is not a whole number"),
    (["submit", "--after", "1_0", "--", "true"], "--after takes job ids like 12 or 12,13; got '1_0'"),
    (["history", "-n", "0"], "Invalid value for '--limit': 0 is too small (1 or more)"),
])
def test_numbers_are_ascii_digits_only_and_a_slurm_task_id_is_not_read_as_another_job(use_settings, args, message):
    first = invoke(["submit", "--hold", "--", "true"])
    assert first.exit_code == 0, first.output
    result = invoke(args)
    assert result.exit_code == c.EXIT_USAGE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    with write_scope(use_settings) as session:
        assert [j.held for j in session.scalars(select(Job))] == [True]  # nothing written, nothing changed


@pytest.mark.parametrize("since", ["99999999d", "0001-01-01", str(10**30) + "d"])
def test_a_period_from_before_any_job_is_from_the_start_not_a_server_failure(use_settings, since):
    result = invoke(["stats", "--since", since, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["since"].startswith("1970-01-01")


@pytest.mark.parametrize("args,message", [
    (["submit", "--mem", "lots", "--", "true"], "--mem takes a size like 20G"),
    (["submit", "--mem", "\u0663G", "--", "true"], "--mem takes a size like 20G"),  # an Arabic-Indic 3: was 3 GiB
    (["submit", "--time", "\u0663h", "--", "true"], "--time takes " + TIME_FORMS),
    (["submit", "--array", "0-\u0663", "--", "true"], "--array"),
    (["submit", "--time", "forever", "--", "true"], "--time takes " + TIME_FORMS),
    (["submit", "--time", "1:99:99", "--", "true"], "--time takes " + TIME_FORMS),
    (["submit", "--array", "5-1", "--", "true"], "--array range '5-1' is empty"),
    (["submit", "--array", "0-20000", "--", "true"], "more than 10000 tasks"),
    (["submit", "--sweep", "lr", "--", "true"], "--sweep takes name=value,value"),
    (["submit", "--sweep", "lr=1,,2", "--", "true"], "--sweep takes name=value,value"),  # was: 2 jobs
    (["submit", "--sweep", "lr=a\x01b", "--", "true"], "--sweep lr: a value holds a control character"),
    # Counted before the jobs are made: the server built 10^10 of them in memory before refusing.
    (["submit", *[a for n in "abcdefghij" for a in ("--sweep", f"{n}=" + ",".join(map(str, range(10))))], "--", "true"],
     "this submission makes 10,000,000,000 jobs; at most 10,000"),
    (["submit", "--array", "0-9999", "--sweep", "lr=1,2", "--", "true"], "makes 20,000 jobs; at most 10,000"),
    (["submit", "--name", "evil\u202egnp.sh", "--", "true"], "bidirectional formatting characters"),
    (["submit", "--after", "1", "--after-any", "2", "--", "true"], "give --after or --after-any, not both"),
    (["submit", "--after", "", "--", "true"], "--after takes job ids like 12 or 12,13"),  # was: no dependency
    (["submit", "--after", "1,,2", "--", "true"], "--after takes job ids like 12 or 12,13"),
    (["submit", "--after-any", "99", "--", "true"], "--after-any: no job 99"),
    # sbatch's -d: the two kinds gpuq has, and a line for each of the others.
    (["submit", "-d", "afterok:99", "--", "true"], "--after: no job 99"),
    (["submit", "-d", "afterok:1,afterany:2", "--", "true"], "one way (afterany, afterok: give one of them)"),
    (["submit", "-d", "after:99", "--", "true"], "-d after: no job 99"),
    (["submit", "-d", "afternotok:99", "--", "true"], "-d afternotok: no job 99"),
    (["submit", "-d", "aftercorr:1", "--", "true"], "--dependency aftercorr is for an array's tasks"),
    (["submit", "-d", "afterburstbuffer:1", "--", "true"], "--dependency afterburstbuffer (after a burst buffer's "
                                                           "stage-out) is not one gpuq has"),
    (["submit", "-d", "singleton:5", "--", "true"], "--dependency takes afterok:, afterany:, afternotok:, after: or "
                                                    "aftercorr:ID[:ID...] and singleton"),
    (["submit", "-d", "singleton", "--array", "0-3", "--", "true"], "--dependency singleton is for one job of a "
                                                                    "name; an array's tasks run one at a time"),
    (["submit", "-d", "afterok:1?afterok:2", "--", "true"], "? (any one of them) is not one gpuq has"),
    (["submit", "-d", "afterany:1+10", "--", "true"], "a delay (+MINUTES) is not one gpuq has"),
    (["submit", "-d", "12", "--", "true"], "--dependency takes afterok:, afterany:, afternotok:, after: or "
                                           "aftercorr:ID"),
    (["submit", "-d", "afterok:", "--", "true"], "--dependency takes afterok:, afterany:"),
    (["submit", "-d", "afterok:1_0", "--", "true"], "--dependency takes afterok:, afterany:"),
    (["submit", "-d", "afterok:1", "--after", "1", "--", "true"], "give --dependency or --after / --after-any"),
    (["submit", "--host-mem", "99999999999G", "--", "true"], "is more than any machine has"),
    (["submit", "--mem", "64G", "--", "true"], "more than any GPU has (8192 MiB)"),
    (["submit", "--node", "elsewhere", "--", "true"], "--node elsewhere: no such node"),
    (["submit", "-x", "elsewhere", "--", "true"], "--exclude elsewhere: no such node is known to gpuq"),
    (["submit", "--exclude", "testnode", "--", "true"], "--exclude testnode leaves no node with 1 GPU"),
    (["hold", "5"], "no job 5"),
    (["show", "5", "--array", "1"], "give a job id or --array ID, not both"),  # the id was dropped
    (["show", "--diff", "--array", "1"], "--diff is one job's"),
    (["stats", "5", "--rollup"], "--rollup does only the roll-up: give it alone"),
    (["stats", "--rollup", "--json"], "--rollup does only the roll-up: give it alone"),
    (["drain", "elsewhere"], "no node elsewhere is known to gpuq"),
])
def test_bad_scheduling_requests_are_refused_in_one_line_and_write_nothing(use_settings, args, message):
    result = invoke(args)
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert jobs_in(use_settings) == 0


def test_sbatchs_dependency_afterok_and_afterany_are_after_and_after_any_on_the_line_and_in_a_script(use_settings,
                                                                                                       tmp_path):
    first, second = (json.loads(invoke(["submit", "--json", "--hold", "--", "true"]).output)["id"] for _ in "12")
    script = tmp_path / "then.sh"
    script.write_text(f"#!/bin/sh\n#GPUQ -d afterany:{first}\ntrue\n")
    script.chmod(0o755)
    for args, expected in ((["-d", f"afterok:{first}:{second}"], ([first, second], "afterok", False)),
                           (["--dependency", f"afterok:{first},afterok:{second}"], ([first, second], "afterok", False)),
                           (["-d", f"AFTERANY:{second}"], ([second], "afterany", False)),
                           (["-d", f"afterok:{first},singleton"], ([first], "afterok", True)),
                           (["-d", f"afternotok:{first}"], ([first], "afternotok", False)),
                           (["-d", f"after:{first}:{second}"], ([first, second], "after", False)),
                           ([str(script)], ([first], "afterany", False))):
        made = invoke(["submit", "--json", *args, "--", "true"] if args[0].startswith("-") else
                      ["submit", "--json", "--", *args])
        assert made.exit_code == 0, made.output
        with write_scope(use_settings) as session:
            job = session.get(Job, json.loads(made.output)["id"])
            assert (job.after, job.after_kind, job.singleton, job.state, job.reason) == (
                *expected, State.PENDING, "dependency")
    # An allocation takes none.
    with pytest.raises(InvalidSpec, match="an allocation \\(gpuq alloc\\) takes no --dependency"):
        from gpuq.server.submission import _allocation, _fields

        _allocation(_fields({"dependency": f"afterok:{first}", "node": "n", "interactive": True}), "ann", None)


def test_a_command_with_bidirectional_text_is_queued_under_a_name_that_escapes_it(use_settings):
    # Its derived name was refused as if the user had given `--name`: Hebrew or Arabic text holds
    # right-to-left marks. The command runs as given; only the name shows the marks as escapes.
    result = invoke(["submit", "--hold", "--", "echo", "\u202eRTL", "\u200fx"])
    assert result.exit_code == 0, result.output
    with write_scope(use_settings) as session:
        job = session.scalars(select(Job)).one()
        assert job.argv == ["echo", "\u202eRTL", "\u200fx"]
        assert job.name == "echo \\u202eRTL \\u200fx"


def test_two_submissions_racing_near_the_pending_cap_never_take_the_user_past_it(settings, monkeypatch):
    # Each submission checks the cap in a read before it writes: two of one user's, both read
    # before either wrote, each saw room. Near the cap the write counts again, one at a time.
    import threading

    from gpuq.service import spec, submitting
    from gpuq.service.errors import OverLimit

    s = settings.with_overrides(max_pending_per_user=4, place_at_submit=False)
    make = lambda n: [spec.command_spec(["true"], user="ann", cwd="/") for _ in range(n)]  # noqa: E731
    submitting.submit_all(s, make(2))
    both_read = threading.Barrier(2, timeout=20)
    real = submitting._code_at_submit

    def after_the_read(*args, **kwargs):
        both_read.wait()  # each submission has passed its read's check; neither has written
        return real(*args, **kwargs)

    monkeypatch.setattr(submitting, "_code_at_submit", after_the_read)
    outcomes: list[str] = []

    def submit_two() -> None:
        try:
            submitting.submit_all(s, make(2))
            outcomes.append("queued")
        except OverLimit as refused:
            outcomes.append(str(refused))

    racers = [threading.Thread(target=submit_two) for _ in range(2)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(60)
    assert sorted(outcomes)[1] == "queued" and "ann has 4 jobs pending and the limit is 4" in sorted(outcomes)[0]
    with write_scope(s) as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.state == "pending")) == 4


def test_a_time_past_the_queues_maximum_is_one_line_exit_2_and_a_job_without_time_gets_the_default(settings):
    with serving(settings, default_time="30m", max_time="2h") as limited:
        refused = run_cli(["submit", "--time", "3h", "--", "true"], limited)
        assert refused.returncode == c.EXIT_USAGE
        assert refused.stderr.strip().splitlines() == [
            "gpuq: --time 3:00:00 is more than this queue's maximum, 2:00:00 (GPUQ_MAX_TIME)"]
        assert jobs_in(settings) == 0
        job = cli_submit(limited, ["--hold", "--", "true"])
        shown = json.loads(run_cli(["show", str(job), "--json"], limited).stdout)
        assert shown["time_limit_s"] == 1800


@pytest.mark.parametrize("given,seconds", [
    ("90", 90 * 60), ("1:00", 60), ("0:30", 30), ("90:00", 90 * 60), ("1:30:00", 5400), ("100:00:00", 360000),
    ("2-00:00:00", 2 * 86400), ("2-3", 2 * 86400 + 3 * 3600), ("1-2:30", 86400 + 2 * 3600 + 1800), ("2h", 7200),
    ("30m", 1800), ("90s", 90), ("1d", 86400)])
def test_time_limits_take_slurms_forms_as_slurm_reads_them(given, seconds):
    # `--time 1:00` was an hour here and a minute in SLURM; `2-00:00:00` was refused.
    from gpuq.service.units import parse_duration

    assert parse_duration(given) == seconds


def test_an_unknown_api_path_or_method_gets_aiohttps_own_status_with_the_json_error(use_settings):
    # Every refusal of the HTTP layer was a 400: a script calling the API could not tell a path that
    # does not exist (404) or a wrong method (405) from bad input.
    from gpuq.cli.client import unix_connection

    for method, path, status in (("GET", "/v1/nope", 404), ("DELETE", "/v1/jobs", 405)):
        conn = unix_connection(str(use_settings.server_socket), 30)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            answer = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == status and answer["exit_code"] == c.EXIT_USAGE, (method, path, answer)
        assert answer["error"].startswith(f"{method} {path}: "), answer
