"""Small things a user meets at the terminal: `gpuq run` of a job cancelled by someone else or by
its dependency exits as `gpuq wait` does (130 is only their own Ctrl-C), `gpuq cancel --array` is
one line however many tasks had ended, a usage error of `gpuq` itself is one line, exit 2, and
`gpuq status` as squeue's -i (again until Ctrl-C) and -j (those jobs)."""

from __future__ import annotations

import getpass
import json
import os
import pwd
import re
import subprocess
import sys

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.models import Job, utcnow
from tests.conftest import cli_submit, run_cli, settings_env, wait_for_state

pytestmark = pytest.mark.timeout(120)


def start_run(settings, args: list[str]) -> tuple[subprocess.Popen, int]:
    """`gpuq run ARGS` as a process of its own, once its job waits: the process and the job's id
    (from its first line, `gpuq: job 12 queued and waiting for ...`)."""
    proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "run", *args], env=settings_env(settings),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    found = re.match(r"gpuq: job (\d+) queued and waiting for ", first)
    assert found, first
    return proc, int(found[1])


def ended(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """The run's exit code and the lines it wrote on stderr after its first."""
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.splitlines()


# ---- gpuq run of a job it did not cancel ---------------------------------------------------------

def test_run_of_a_job_cancelled_because_its_dependency_failed_exits_as_wait_does_and_says_why(stack):
    first = cli_submit(stack.settings, ["--hold", "--", "false"])
    proc, job_id = start_run(stack.settings, ["--after", str(first), "--", "true"])
    assert run_cli(["release", str(first)], stack.settings).returncode == 0
    code, lines = ended(proc)
    # Not 130, the code of a Ctrl-C: the user interrupted nothing.
    assert code == c.EXIT_JOB_FAILED, lines
    assert lines[-1] == f"gpuq: job {job_id} cancelled: dependency never satisfied: job {first} failed", lines
    assert run_cli(["wait", str(job_id)], stack.settings).returncode == code


def test_run_of_a_job_cancelled_by_gpuq_cancel_elsewhere_exits_as_wait_does_and_says_so(stack):
    proc, job_id = start_run(stack.settings, ["--hold", "--", "true"])
    assert run_cli(["cancel", str(job_id)], stack.settings).returncode == 0
    code, lines = ended(proc)
    assert code == c.EXIT_JOB_FAILED, lines
    assert lines[-1] == f"gpuq: job {job_id} cancelled by {pwd.getpwuid(os.getuid()).pw_name}", lines  # who
    assert run_cli(["wait", str(job_id)], stack.settings).returncode == code


# ---- gpuq cancel --array -------------------------------------------------------------------------

def invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def end_jobs(settings, ids) -> None:
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id.in_(ids)).values(state=State.SUCCEEDED, ended_at=utcnow()))


def test_cancel_of_an_array_whose_tasks_mostly_ended_is_one_summary_line_and_named_jobs_a_line_each(use_settings):
    assert invoke(["submit", "--hold", "--array", "0-9", "--", "true"]).exit_code == 0  # jobs 1-10
    end_jobs(use_settings, range(1, 8))
    cancelled = invoke(["cancel", "--array", "1"])
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.output == "cancelled 3 jobs of array 1; 7 had already ended\n"
    again = invoke(["cancel", "--array", "1"])
    assert again.exit_code == c.EXIT_CONFLICT, again.output  # nothing changed: 4, as hold --array and the README say
    assert again.output == "nothing to cancel in array 1: all 10 of its jobs had already ended\n"
    # Jobs named by id keep their lines, and all of them ended is still exit 4.
    named = invoke(["cancel", "1", "9"])
    assert named.exit_code == c.EXIT_CONFLICT
    assert named.output == "job 1: already ended (succeeded)\njob 9: already ended (cancelled)\n"
    assert invoke(["submit", "--hold", "--", "true"]).exit_code == 0  # job 11
    both = invoke(["cancel", "11", "--array", "1"])
    assert both.exit_code == 0, both.output
    assert both.output == "job 11 cancelled\nnothing to cancel in array 1: all 10 of its jobs had already ended\n"


def test_cancel_of_an_array_with_running_tasks_waits_for_them_and_says_so_in_one_line(stack):
    submitted = run_cli(["submit", "--array", "0-3", "--", "sleep", "300"], stack.settings)
    array, first = map(int, re.match(r"submitted array (\d+): jobs (\d+)-", submitted.stdout).groups())
    wait_for_state(stack.settings, first, (State.RUNNING,))  # one stopped by its worker, the others at once
    cancelled = run_cli(["cancel", "--array", str(array)], stack.settings)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout == f"cancelled 4 jobs of array {array}\n"


def test_the_array_cancel_line_counts_running_tasks_still_stopping_and_those_that_ended_meanwhile():
    from gpuq.cli.ends import array_cancelled

    assert array_cancelled(7, [State.CANCELLED] * 2 + [c.CANCELLING] * 3 + ["ended"] * 9995) == \
        "cancelled 2 jobs of array 7; 3 running, being stopped; 9,995 had already ended"  # --no-wait
    assert array_cancelled(7, [State.CANCELLED, "stopping", State.SUCCEEDED, "ended"]) == \
        ("cancelled 1 job of array 7; 1 still stopping: their worker has not confirmed yet; 1 succeeded meanwhile; "
         "1 had already ended")


# ---- usage errors --------------------------------------------------------------------------------

def gpuq(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUQ_HOME": str(tmp_path), "GPUQ_CONFIG": "/nonexistent/gpuq.toml"}
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args,line", [
    (["nosuchcommand"], "gpuq: No such command 'nosuchcommand' (gpuq --help)"),
    (["--bogus"], "gpuq: No such option '--bogus' (gpuq --help)"),
    (["--versoin"], "gpuq: No such option '--versoin'. Did you mean '--version'? (gpuq --help)"),
    (["status", "--quux"], "gpuq: No such option '--quux' (gpuq status --help)"),
    # Near one of its options (-o's --format): click's suggestion stays on the line.
    (["status", "--frobnicate"], "gpuq: No such option '--frobnicate'. Did you mean '--format'? (gpuq status --help)"),
    (["status", "--useer"], "gpuq: No such option '--useer'. Did you mean '--user'? (gpuq status --help)"),
    (["db", "upgrade", "--bogus"], "gpuq: No such option '--bogus' (gpuq db upgrade --help)"),
])
def test_a_usage_error_is_one_line_on_stderr_naming_the_help_and_exit_2(tmp_path, args, line):
    out = gpuq(args, tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (c.EXIT_USAGE, "", line + "\n")


def test_gpuq_alone_still_prints_its_help(tmp_path):
    out = gpuq([], tmp_path)  # click writes it on stderr, exit 2, as for a missing argument
    assert out.returncode == c.EXIT_USAGE
    assert out.stderr.startswith("Usage: gpuq") and "Commands:" in out.stderr, (out.stdout, out.stderr)


def test_logs_of_a_job_that_has_not_started_says_so_on_stderr_and_cancel_of_nothing_names_user(use_settings):
    # `gpuq logs` of a pending job printed nothing and exited 0, as a job that printed nothing.
    assert invoke(["submit", "--hold", "--", "true"]).exit_code == 0  # job 1
    shown = invoke(["logs", "1"])
    assert shown.exit_code == 0 and shown.stdout == "", shown.output
    assert shown.stderr == "gpuq: job 1 has not started: pending (held); no output yet\n", shown.stderr
    assert invoke(["logs", "--json", "1"]).stderr == ""  # a document, as it was: state and empty output
    nothing = invoke(["cancel"])
    assert nothing.exit_code == c.EXIT_USAGE and "--me for all of yours" in nothing.output, nothing.output


def test_why_and_devices_escape_what_a_user_or_a_process_wrote_before_a_terminal_sees_it(use_settings):
    # A job's reason quotes a user's file (a script's #! line), and a process names itself (prctl):
    # both reached root's terminal raw, escape sequences and all.
    from gpuq.cli.devices import _processes

    assert invoke(["submit", "--hold", "--", "true"]).exit_code == 0  # job 1
    with write_scope(use_settings) as session:
        session.execute(update(Job).where(Job.id == 1).values(state=State.FAILED, ended_at=utcnow(),
                                                             reason="cannot start: its interpreter /x\x1b]0;PWN\x07"))
    said = invoke(["why", "1"])
    assert said.exit_code == 0 and "\x1b" not in said.output and "\\x1b]0;PWN\\x07" in said.output, said.output
    listed = _processes([{"name": "\x1b]0;PWN\x07\x1b[2J", "pid": 4242, "memory_mib": 10}])
    assert "\x1b" not in listed and listed.startswith("\\x1b]0;PWN\\x07\\x1b[2J[4242]"), listed


def test_status_iterate_lists_the_queue_again_each_time_under_its_time_until_ctrl_c(use_settings, tmp_path):
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "status", "-i", "0.2", "-n", "0"],
                            env=settings_env(use_settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def next_listing() -> list[str]:
        """The lines of the next listing, after its time line, to the blank line that ends it."""
        head = proc.stdout.readline()
        assert re.match(r"every 0\.2s: gpuq status    \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(Ctrl-C stops\)$",
                        head.rstrip()), head
        assert proc.stdout.readline() == "\n"
        lines = []
        while (line := proc.stdout.readline()) and "GPUs registered" not in line:
            lines.append(line.rstrip())
        assert proc.stdout.readline() == "\n"
        return lines

    assert "no jobs" in next_listing()
    job_id = cli_submit(use_settings, ["--hold", "--", "true"], cwd=tmp_path)
    # Asked of the server again each time: the job submitted meanwhile is in a later listing.
    for _ in range(20):
        if any(line.split()[:1] == [str(job_id)] for line in next_listing()):
            break
    else:
        pytest.fail("the job submitted meanwhile never appeared")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (0, "")


def test_status_iterate_takes_a_tenth_of_a_second_at_least_in_one_line(use_settings):
    out = run_cli(["status", "-i", "0"], use_settings)
    assert out.returncode == c.EXIT_USAGE and len(out.stderr.strip().splitlines()) == 1
    assert "'--iterate': 0.0 is not in the range 0.1<=x<=86400" in out.stderr


def test_status_jobs_lists_just_those_jobs_and_their_arrays_tasks_ended_ones_included(use_settings, tmp_path):
    def parsable(*args: str) -> int:
        out = run_cli(["submit", "--parsable", "--hold", *args, "--", "true"], use_settings, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    done, array, other = parsable(), parsable("-a", "0-2"), parsable()
    with write_scope(use_settings) as s:  # an ended job is listed too, however long ago it ended
        s.execute(update(Job).where(Job.id == done).values(state=State.SUCCEEDED, started_at=utcnow(),
                                                            ended_at=utcnow(), exit_code=0))
    out = run_cli(["status", "-j", f"{done},{array}", "--json", "-n", "0"], use_settings)
    assert out.returncode == 0, out.stderr
    assert [j["id"] for j in json.loads(out.stdout)["jobs"]] == [done, array, array + 1, array + 2]
    table = run_cli(["status", "-j", str(array)], use_settings).stdout
    rows = [line.split()[0] for line in table.splitlines()[2:] if line.strip() and line.split()[0][0].isdigit()]
    assert rows[0] == f"{array}-{array + 2}" and str(other) not in rows and str(done) not in rows
    # A task's own id is that task alone.
    one = json.loads(run_cli(["status", "-j", str(array + 1), "--json"], use_settings).stdout)["jobs"]
    assert [j["id"] for j in one] == [array + 1]


def test_status_noheader_prints_the_job_lines_alone_for_a_script_to_count(use_settings, tmp_path):
    """`gpuq status -h` (squeue -h): no title, header, note or GPU table; nothing at all where no job is."""
    assert run_cli(["status", "-h", "--me"], use_settings).stdout == ""
    assert run_cli(["status", "--start", "-h"], use_settings).stdout == ""
    ids = [run_cli(["submit", "--parsable", "--hold", "--", "true"], use_settings, cwd=tmp_path).stdout.strip()
           for _ in range(3)]
    out = run_cli(["status", "-h", "--me"], use_settings)
    assert out.returncode == 0, out.stderr
    # In queue order, as the table lists them: the first submitted first.
    assert [line.split()[:4] for line in out.stdout.splitlines()] == [
        [i, getpass.getuser(), "true", "pending"] for i in ids], out.stdout
    assert "ID" not in out.stdout and "gpus" not in out.stdout
    starts = run_cli(["status", "--start", "-h"], use_settings).stdout
    assert sorted(line.split()[0] for line in starts.splitlines()) == sorted(ids), starts
    both = run_cli(["status", "-h", "--json"], use_settings)
    assert (both.returncode, both.stdout) == (c.EXIT_USAGE, "")
    assert both.stderr == "gpuq: --noheader and --parsable are the table's; --json has neither: give one of them\n"


def test_status_parsable_splits_each_job_line_on_bars_with_the_whole_name(use_settings, tmp_path):
    assert run_cli(["status", "-P", "-h", "--me"], use_settings).stdout == ""
    assert run_cli(["status", "-P", "--me", "-o", "id,name"], use_settings).stdout == "ID|NAME\n"
    name = "sweep|lr " + "x" * 40  # past the table's 30 columns, with a bar in it
    first = run_cli(["submit", "--parsable", "--hold", "-J", name, "--", "true"], use_settings, cwd=tmp_path)
    second = run_cli(["submit", "--parsable", "--hold", "--", "true"], use_settings, cwd=tmp_path)
    ids = [first.stdout.strip(), second.stdout.strip()]
    out = run_cli(["status", "-P", "--me", "-o", "id,name,state"], use_settings)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ID|NAME|STATE", f"{ids[0]}|sweep/lr {'x' * 40}|pending",
                                       f"{ids[1]}|true|pending"], out.stdout
    default = run_cli(["status", "-P", "-h", "--me"], use_settings).stdout.splitlines()
    assert [line.split("|")[0] for line in default] == ids and {len(line.split("|")) for line in default} == {8}
    starts = run_cli(["status", "--start", "-P"], use_settings).stdout.splitlines()
    assert starts[0] == "ID|USER|NAME|GPUS|START|NODE|REASON" and starts[1].startswith(f"{ids[0]}|"), starts
    refused = run_cli(["status", "-P", "--json"], use_settings)
    assert refused.returncode == c.EXIT_USAGE and "--json has neither" in refused.stderr


@pytest.mark.parametrize("args,code,words", [
    (["status", "-j", "999999"], c.EXIT_NOT_FOUND, "gpuq: no job 999999"),
    (["status", "-j", "1,x"], c.EXIT_USAGE, "gpuq: --jobs takes job ids like 12 or 12,13; got '1,x'"),
    (["status", "-j", "1", "--start"], c.EXIT_USAGE, "--start lists every pending job"),
])
def test_status_jobs_of_nothing_or_of_no_id_is_one_line_and_its_exit_code(use_settings, args, code, words):
    out = run_cli(args, use_settings)
    assert out.returncode == code and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
