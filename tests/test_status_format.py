"""`gpuq status -o/--format` and `gpuq history -o`: the job table's columns picked by name, as
squeue -o and sacct --format pick theirs, on a real stack; a wrong name is one line listing the fields."""

from __future__ import annotations

import json

import pytest

from gpuq.cli.job_fields import FIELDS
from gpuq.service.constants import State
from tests.conftest import cli_submit, run_cli, wait_for_state

pytestmark = pytest.mark.timeout(120)


def test_status_shows_the_fields_asked_for_in_their_order(stack, tmp_path):
    s = stack.settings
    running = cli_submit(s, ["--time", "1:00:00", "--cpus", "1.5", "--host-mem", "2G", "--", "sleep", "60"],
                         cwd=tmp_path)
    held = cli_submit(s, ["--hold", "--after", str(running), "--name", "later", "--", "true"], cwd=tmp_path)
    assert wait_for_state(s, running, (State.RUNNING,)) == State.RUNNING, stack.logs()
    try:
        out = run_cli(["status", "--me", "-o", "ID,state,cpus,host_mem,time_limit,time_left,after,command,workdir"],
                      s)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[:2] == ["jobs", lines[1]] and lines[1].split() == [
            "ID", "STATE", "CPUS", "HOST", "MEM", "TIME", "LIMIT", "TIME", "LEFT", "AFTER", "COMMAND", "WORKDIR"]
        rows = {int(cells[0]): cells for cells in map(str.split, lines[2:]) if cells and cells[0].isdigit()}
        run = rows[running]
        assert run[1:5] == ["running", "1.5", "2.0G", "1:00:00"] and run[5].startswith("0:59:"), run
        assert run[6:] == ["-", "sleep", "60", str(tmp_path)], run
        assert rows[held][1:7] == ["pending", "-", "-", "-", "-", str(running)], rows[held]
        # -h: the lines alone, in the same columns.
        bare = run_cli(["status", "--me", "-h", "-o", "id,name"], s).stdout.split()
        assert bare[bare.index(str(held)) + 1] == "later"
    finally:
        assert run_cli(["cancel", str(running), str(held)], s).returncode == 0


@pytest.mark.parametrize("args, line", [
    (["-o", "id,colour"], f"gpuq: --format: no field 'colour'; the fields are {', '.join(FIELDS)}"),
    (["-o", "id,,user"], "gpuq: --format takes field names separated by commas, e.g. id,user,state; got 'id,,user'"),
    (["-o", "id", "--json"], "gpuq: --format picks the job table's columns: not with --json (every field) or --start"),
])
def test_a_wrong_format_is_one_line_and_exit_2(stack, args, line):
    out = run_cli(["status", *args], stack.settings)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")


def test_history_shows_the_fields_asked_for_of_the_jobs_that_ended(stack, tmp_path):
    s = stack.settings
    failed = cli_submit(s, ["--cpus", "0.5", "--requeue", "--", "sh", "-c", "exit 3"], cwd=tmp_path)
    killed = cli_submit(s, ["--no-requeue", "--", "sh", "-c", "kill -9 $$"], cwd=tmp_path)
    oom = cli_submit(s, ["--", "sh", "-c", "echo 'CUDA error: out of memory'; exit 1"], cwd=tmp_path)
    for job_id in (failed, killed, oom):
        assert wait_for_state(s, job_id, (State.FAILED,)) == State.FAILED, stack.logs()
    out = run_cli(["history", "-o", "id,state,exit_code,cpus,waited,elapsed,failure,requeue"], s)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["ID", "STATE", "EXIT", "CPUS", "WAITED", "ELAPSED", "FAILURE", "REQUEUE"]
    table = lines[2:lines.index("")]  # then a blank line and the count of each end state
    rows = {int(cells[0]): cells for cells in map(str.split, table)}
    assert rows[failed][1:4] == ["failed", "3", "0.5"] and rows[failed][-2:] == ["exit", "yes"], rows[failed]
    assert rows[killed][1:5] == ["failed", "137", "(SIGKILL)", "-"], rows[killed]
    assert rows[killed][-2:] == ["exit", "no"] and rows[oom][-2:] == ["cuda_oom", "-"], (rows[killed], rows[oom])
    assert " ended from " in lines[-1]
    refused = run_cli(["history", "-o", "id", "--json"], s)
    assert (refused.returncode, refused.stderr) == (
        2, "gpuq: --format picks the table's columns: not with --json (every field)\n")


def test_history_gives_each_ended_jobs_usage_as_sacct_gives_totalcpu_and_maxrss(stack, tmp_path):
    s = stack.settings
    # A second of CPU in a process holding 200 MiB: its summary has both; a job that never started, none.
    busy = ("import time; x = bytearray(200 * 2**20); t = time.process_time()\n"
            "while time.process_time() - t < 1.0: x[0] = 1")
    ran = cli_submit(s, ["--", "python3", "-c", busy], cwd=tmp_path)
    never = cli_submit(s, ["--hold", "--", "true"], cwd=tmp_path)
    assert wait_for_state(s, ran, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()
    assert run_cli(["cancel", str(never)], s).returncode == 0
    out = run_cli(["history", "-P", "-h", "-o", "id,cpu_time,host_mem_peak,gpu_hours,gpu_mem_peak,gpu_util,"
                   "energy_kwh"], s)
    assert out.returncode == 0, out.stderr
    rows = {int(line.split("|")[0]): line.split("|")[1:] for line in out.stdout.splitlines()}
    cpu, host, gpu_hours = rows[ran][:3]
    assert cpu.startswith(("1.", "2.")) and cpu.endswith("s"), rows[ran]  # a duration: "1.0s"
    assert host.endswith("M") and 200 <= float(host[:-1]) < 1024, rows[ran]
    assert float(gpu_hours) >= 0, rows[ran]
    assert rows[never] == ["-"] * 6, rows[never]
    data = run_cli(["history", "--json"], s).stdout
    listed = {j["id"]: j for j in json.loads(data)["jobs"]}
    assert listed[ran]["usage"]["cpu_s"] >= 1.0 and listed[never]["usage"] is None
    # The GPUs each ran on, which its summary keeps once its allocation has gone.
    assert len(listed[ran]["gpu_indices"]) == 1 and listed[never]["gpu_indices"] is None
    # In the queue a job has no summary yet: status names where the field is.
    wrong = run_cli(["status", "-o", "id,cpu_time"], s)
    assert wrong.returncode == 2 and wrong.stderr.startswith(
        "gpuq: --format: no field 'cpu_time' (cpu_time is an ended job's: `gpuq history -o cpu_time`); "), wrong.stderr
