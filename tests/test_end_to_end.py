"""The whole path, for real: `gpuq submit` -> SQL -> scheduler -> Redis/Celery -> a pinned worker
process -> SQL -> `gpuq status`, on SQLite and PostgreSQL, with simulated GPUs."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import time
from datetime import datetime

import psutil
import pytest

from gpuq.service import constants as c
from gpuq.service import job_output, jobs
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from tests.conftest import cli_submit as submit
from tests.conftest import free_port, output_of, run_cli, settings_env, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_matmul_goes_pending_running_succeeded_with_its_gflops_in_status_and_show(stack, tmp_path):
    s = stack.settings
    job_id = submit(s, ["matmul", "--size", "128", "--repeat", "20"])
    waited = run_cli(["wait", str(job_id), "--timeout", "120"], s, timeout=150)
    assert waited.returncode == 0, waited.stdout + waited.stderr + stack.logs()
    with write_scope(s) as session:
        job = jobs.get_job(session, job_id)
        assert job.state == State.SUCCEEDED and job.node == "testnode" and job.worker.startswith("gpu")
        assert job.submitted_at <= job.dispatched_at <= job.started_at <= job.ended_at
        result = job.result
    assert result["size"] == 128 and result["repeat"] == 20
    assert result["seconds"] > 0 and result["gflops"] == pytest.approx(2 * 128**3 * 20 / result["seconds"] / 1e9)
    assert result["device"] == "cpu" and result["fell_back_to_cpu"] is True
    status = run_cli(["status"], s)
    assert status.returncode == 0
    line = next(ln for ln in status.stdout.splitlines() if ln.strip().startswith(str(job_id)))
    assert "succeeded" in line and "GFLOP/s" in line and "matmul" in line
    assert "Simulated GPU" in status.stdout and "idle" in status.stdout
    show = run_cli(["show", str(job_id)], s)
    assert "gflops" in show.stdout and "succeeded" in show.stdout
    logs = run_cli(["logs", str(job_id)], s)
    assert "matmul: 20 products of 128x128" in logs.stdout


def test_a_command_runs_without_a_shell_in_its_directory_with_its_gpus_and_keeps_its_output(stack, tmp_path):
    s = stack.settings
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "print('visible', os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'])\n"
        "print('cwd', os.getcwd())\n"
        "print('args', sys.argv[1:])\n"
        "print('job', os.environ['GPUQ_JOB_ID'])\n"
        "print('secret', os.environ.get('GPUQ_DATABASE_URL'), os.environ.get('GPUQ_BROKER_URL'))\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    job_id = submit(s, ["--gpus", "2", "--", sys.executable, "train.py", "--lr", "0.1", "$HOME;", "a b"], cwd=tmp_path)
    assert wait_for_state(s, job_id, c.END_STATES) == State.SUCCEEDED, output_of(s, job_id) + stack.logs()
    out = run_cli(["logs", str(job_id)], s).stdout
    assert "visible 0,1 PCI_BUS_ID" in out
    assert f"cwd {tmp_path}" in out
    assert "args ['--lr', '0.1', '$HOME;', 'a b']" in out  # no shell: nothing expanded or split
    assert f"job {job_id}" in out and "to stderr" in out
    assert "secret None None" in out  # the worker's database and broker URLs stay with the worker
    # Its GPUs are told after its end too (its allocation went with it), as sacct keeps them.
    shown = json.loads(run_cli(["show", "--json", str(job_id)], s).stdout)
    assert shown["gpu_indices"] == [0, 1], shown
    assert f"2 on {shown['node']}: 0, 1" in run_cli(["show", str(job_id)], s).stdout
    # And in the lists' JSON (status, history), which gave null for every job.
    for args in (["status", "--json"], ["history", "--json"]):
        listed = json.loads(run_cli(args, s).stdout)
        rows = listed["jobs"] if isinstance(listed, dict) else listed
        assert next(j for j in rows if j["id"] == job_id)["gpu_indices"] == [0, 1], args


def script_ran(stack, where, name: str, text: str, args: tuple[str, ...] = (), timeout: float = 60) -> tuple[int, str]:
    """The job of script ``name`` (written in ``where`` with ``text``, submitted from there with
    ``args`` before it), once it succeeded, and its output."""
    (where / name).write_text(text)
    job_id = submit(stack.settings, [*args, name], cwd=where)
    state = wait_for_state(stack.settings, job_id, c.END_STATES, timeout=timeout)
    assert state == State.SUCCEEDED, output_of(stack.settings, job_id) + stack.logs()
    return job_id, run_cli(["logs", str(job_id)], stack.settings).stdout


def test_a_job_script_named_as_sbatch_takes_it_runs_with_its_arguments_and_its_gpuq_lines(stack, tmp_path):
    s = stack.settings
    # Not executable, as a script copied from a colleague often is: its #! line runs it.
    (tmp_path / "train.sh").write_text("#!/bin/sh\n#GPUQ --gpus 2\n#GPUQ --name scripted\n"
                                       "echo \"args $* on $CUDA_VISIBLE_DEVICES in $(pwd)\"\n")
    result = run_cli(["submit", "--parsable", "train.sh", "--lr", "0.1", "--gpus", "1"], s, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout)
    assert wait_for_state(s, job_id, c.END_STATES) == State.SUCCEEDED, output_of(s, job_id) + stack.logs()
    assert run_cli(["logs", str(job_id)], s).stdout == f"args --lr 0.1 --gpus 1 on 0,1 in {tmp_path}\n"
    assert json.loads(run_cli(["show", "--json", str(job_id)], s).stdout)["name"] == "scripted"
    # Given on stdin, as `sbatch <<EOF` takes one: the job carries the script's text.
    heredoc = subprocess.run([sys.executable, "-m", "gpuq.cli", "submit", "--parsable"], env=settings_env(s),
                             cwd=tmp_path, input="#!/bin/sh\n#SBATCH --job-name=heredoc\n"
                             "echo \"here $0 $SLURM_JOB_ID $SLURM_JOB_NAME $SLURM_SUBMIT_DIR\"\n"
                             "srun --ntasks=1 -c 1 -l sh -c 'echo step $0' \"$SLURM_JOB_ID\"\n",
                             capture_output=True, text=True, timeout=60)
    assert heredoc.returncode == 0, heredoc.stderr
    job_id = int(heredoc.stdout)
    assert wait_for_state(s, job_id, c.END_STATES) == State.SUCCEEDED, output_of(s, job_id) + stack.logs()
    # A SLURM script's body reads SLURM's names for its job's facts.
    # Its srun runs a step's command as the job's one task (gpuq.cli.srun).
    told = f"here /bin/sh {job_id} heredoc {tmp_path}\n0: step {job_id}\n"
    assert run_cli(["logs", str(job_id)], s).stdout == told
    # Its output in the file sbatch would write, as well as in gpuq.
    assert (tmp_path / f"slurm-{job_id}.out").read_text() == told
    # And an array's tasks their index, as an sbatch array script reads it.
    (tmp_path / "array.sh").write_text("#!/bin/sh\n#SBATCH --array=4-5\necho task $SLURM_ARRAY_TASK_ID of "
                                       "$SLURM_ARRAY_JOB_ID\n")
    made = json.loads(run_cli(["submit", "--json", "array.sh"], s, cwd=tmp_path).stdout)
    for task in made:
        assert wait_for_state(s, task["id"], c.END_STATES) == State.SUCCEEDED, output_of(s, task["id"])
        told = run_cli(["logs", str(task["id"])], s).stdout
        assert told == f"task {task['array_index']} of {task['array_id']}\n", told
        assert (tmp_path / f"slurm-{task['array_id']}_{task['array_index']}.out").read_text() == told
    assert sorted(t["array_index"] for t in made) == [4, 5]
    # A script of two tasks, as a DDP script asks SLURM for them: its srun starts one a task, each
    # told its rank, its cores shared among them.
    # Its first node as such a script finds it for MASTER_ADDR, with scontrol.
    _, told = script_ran(stack, tmp_path, "ddp.sh", (
        "#!/bin/sh\n#SBATCH --ntasks-per-node=2 -c 1\n"
        "echo tasks $SLURM_NTASKS at $(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
        "srun sh -c 'echo rank $SLURM_PROCID of $SLURM_NTASKS cpus $SLURM_CPUS_PER_TASK'\n"))
    told = told.splitlines()
    assert told[0] == f"tasks 2 at {s.node}", told
    assert sorted(told[1:]) == ["rank 0 of 2 cpus 1", "rank 1 of 2 cpus 1"], told
    # A script that requeues itself (as one does on the signal before its time limit) with
    # scontrol: the job runs again under its id, through gpuq's server.
    _, told = script_ran(stack, tmp_path, "again.sh", "#!/bin/sh\n#SBATCH -J again\nif [ -e ran-once ]; then echo "
                         "second run; exit 0; fi\ntouch ran-once\nscontrol requeue\nsleep 60\n", timeout=90)
    assert told.endswith("second run\n")


def test_a_slurm_script_queues_its_next_part_with_sbatch_as_under_slurm(stack, tmp_path):
    s = stack.settings
    # The first part queues the second after itself, as a chain of jobs under a time limit does;
    # sbatch's options (over the second's own lines) and its words as sbatch says them.
    # Its tasks are its own: none of the first part's (its SLURM_NTASKS is in sbatch's environment).
    (tmp_path / "second.sbatch").write_text("#!/bin/sh\n#SBATCH -J from-lines -c 1\necho second $SLURM_JOB_NAME "
                                            "after $1 tasks ${SLURM_NTASKS:-one}\n")
    first, told = script_ran(stack, tmp_path, "first.sbatch", (
        "#!/bin/sh\n#SBATCH -J first --ntasks-per-node=2\n"
        "sbatch --parsable -J second -p gpu -d afterok:$SLURM_JOB_ID second.sbatch $SLURM_JOB_ID > next.id\n"
        "sbatch --hold --wrap 'echo wrapped'\n"))
    second = int((tmp_path / "next.id").read_text())
    assert re.fullmatch(r"Submitted batch job (\d+)\n", told.splitlines()[-1] + "\n"), told
    assert "left out of second.sbatch, as meaning nothing to gpuq: -p gpu" in told, told
    assert wait_for_state(s, second, c.END_STATES) == State.SUCCEEDED, output_of(s, second) + stack.logs()
    assert run_cli(["logs", str(second)], s).stdout == f"second second after {first} tasks one\n"
    wrapped = int(told.splitlines()[-1].split()[-1])
    shown = json.loads(run_cli(["show", "--json", str(wrapped)], s).stdout)
    assert shown["state"] == State.PENDING and "echo wrapped" in shown["argv"][-1], shown
    assert run_cli(["cancel", str(wrapped)], s).returncode == 0
    # And from a user's shell, as `alias sbatch='gpuq sbatch'` runs their sbatch lines.
    done = run_cli(["sbatch", "-J", "typed", "--mem=1G", "-c", "2", "--hold", "second.sbatch", "x"], s, cwd=tmp_path)
    assert done.returncode == 0 and re.fullmatch(r"Submitted batch job \d+\n", done.stdout), done
    shown = json.loads(run_cli(["show", "--json", done.stdout.split()[-1]], s).stdout)
    assert (shown["name"], shown["cpus"], shown["host_mem_mib"], shown["held"]) == ("typed", 2, 1024, True), shown
    assert run_cli(["cancel", str(shown["id"])], s).returncode == 0
    done = run_cli(["sbatch", "--frobnicate", "second.sbatch"], s, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "") and done.stderr == (
        "gpuq sbatch: --frobnicate: not an option sbatch has (or none gpuq knows)\n"), done
    # A script that is no file is none (sbatch takes a script), and one that shares a workload's
    # name is the file all the same.
    done = run_cli(["sbatch", "missing.sbatch"], s, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("gpuq sbatch: missing.sbatch: no such file"), done
    (tmp_path / "train").write_text("#!/bin/sh\necho the train script\n")
    done = run_cli(["sbatch", "--parsable", "train"], s, cwd=tmp_path)
    assert done.returncode == 0, done
    assert wait_for_state(s, int(done.stdout), c.END_STATES) == State.SUCCEEDED
    assert run_cli(["logs", done.stdout.strip()], s).stdout == "the train script\n"


DDP = """
import os
import torch
import torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                        world_size=world)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank} of {world} local {os.environ['SLURM_LOCALID']} sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_a_slurm_ddp_script_runs_its_ranks_through_srun_and_torch_distributed_joins_them(stack, tmp_path):
    # The shape of a lab's DDP script for SLURM: tasks on one node, srun starting one a rank, each
    # finding its rank in SLURM's variables; torch.distributed (gloo, on the CPU) joins them.
    (tmp_path / "ddp.py").write_text(DDP)
    _, told = script_ran(stack, tmp_path, "ddp.sbatch", f"#!/bin/sh\n#SBATCH --ntasks-per-node=3 -t 5\nsrun "
                         f"{sys.executable} ddp.py\n", ("--env", f"MASTER_PORT={free_port()}"), timeout=120)
    told = sorted(line for line in told.splitlines() if line.startswith("rank"))
    assert told == [f"rank {r} of 3 local {r} sum 6" for r in range(3)], told


def test_a_failing_command_fails_the_job_and_wait_says_so(stack, tmp_path):
    s = stack.settings
    job_id = submit(s, ["--", sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"], cwd=tmp_path)
    waited = run_cli(["wait", str(job_id)], s, timeout=90)
    assert waited.returncode == c.EXIT_JOB_FAILED and f"job {job_id} failed" in waited.stdout
    with write_scope(s) as session:
        job = jobs.get_job(session, job_id)
        assert job.exit_code == 3 and job.reason == "exited with status 3"
    assert output_of(s, job_id) == "bye\n"


def test_submit_wait_returns_once_every_task_ended_and_fails_if_one_failed(stack, tmp_path):
    s = stack.settings
    ran = run_cli(["submit", "--wait", "-D", str(tmp_path), "--", "sh", "-c", "pwd > where"], s, timeout=90)
    assert ran.returncode == 0, ran.stderr
    first, ended = ran.stdout.splitlines()
    job_id = int(first.removeprefix("submitted job "))
    assert ended == f"job {job_id} succeeded" and (tmp_path / "where").read_text() == f"{tmp_path}\n"
    # An array's tasks, one failing: every task waited for, exit 1; --parsable prints the id alone.
    tasks = run_cli(["submit", "-W", "--parsable", "-a", "0-1", "--", "sh", "-c", "exit $GPUQ_ARRAY_INDEX"], s,
                    cwd=tmp_path, timeout=90)
    assert tasks.returncode == c.EXIT_JOB_FAILED and tasks.stdout.strip().isdigit(), tasks.stderr
    array = int(tasks.stdout)
    with write_scope(s) as session:
        assert [jobs.get_job(session, array + i).state for i in (0, 1)] == [State.SUCCEEDED, State.FAILED]


def test_ctrl_c_stops_submit_wait_and_gpuq_wait_and_leaves_the_job_running(stack, tmp_path):
    import signal
    import subprocess

    from tests.conftest import settings_env

    s = stack.settings
    argv = [sys.executable, "-m", "gpuq.cli", "submit", "-W", "-t", "5m", "--", "sleep", "60"]
    proc = subprocess.Popen(argv, env=settings_env(s), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    job_id = int(proc.stdout.readline().removeprefix("submitted job "))
    assert wait_for_state(s, job_id, (State.RUNNING,)) == State.RUNNING
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == c.EXIT_RUN_CANCELLED
    assert err.strip() == f"gpuq: stopped waiting; job {job_id} goes on (gpuq wait {job_id})"
    with write_scope(s) as session:
        assert jobs.get_job(session, job_id).state == State.RUNNING
    # `gpuq wait` as well: one line of gpuq's, not click's "Aborted!".
    proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "wait", str(job_id)], env=settings_env(s),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err.strip()) == (c.EXIT_RUN_CANCELLED, "gpuq: stopped waiting; the jobs go on")
    assert run_cli(["cancel", str(job_id)], s).returncode == 0


def test_output_with_a_nul_character_is_kept_with_the_nul_shown_and_the_rest_after_it(stack, tmp_path):
    # PostgreSQL's text refuses NUL: the chunk, and at the job's end its usage summary, were lost.
    s = stack.settings
    code = "import sys; sys.stdout.buffer.write(b'ok\\x00end\\n'); sys.stdout.flush(); print('after')"
    job_id = submit(s, ["--", sys.executable, "-c", code], cwd=tmp_path)
    assert wait_for_state(s, job_id, c.END_STATES) == State.SUCCEEDED, stack.logs()
    assert output_of(s, job_id) == "ok\u2400end\nafter\n"


@pytest.mark.parametrize("make,code,why", [
    (lambda d: d.joinpath("plain.sh").write_text("echo hi\n"), 126,
     "./plain.sh: not a program this machine runs (a script needs a #! line)"),
    (lambda d: d.joinpath("plain.sh").write_text("#!/nonexistent/interp\necho hi\n"), 127,
     "./plain.sh: its interpreter /nonexistent/interp is not found"),
    (lambda d: None, 127, "./plain.sh: no such file or command (it was there at submit)"),
    # Saved on Windows: "its interpreter /bin/sh is not found" named the one program every machine has.
    (lambda d: d.joinpath("plain.sh").write_bytes(b"#!/bin/sh\r\necho hi\r\n"), 127,
     "./plain.sh: its #! line ends in a carriage return (Windows line endings), so the kernel looks for "
     "'/bin/sh\\r': convert it (dos2unix ./plain.sh)"),
])
def test_a_command_that_cannot_start_fails_with_one_line_and_the_exit_code_a_shell_gives(stack, tmp_path, make,
                                                                                          code, why):
    s = stack.settings
    script = tmp_path / "plain.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    held = submit(s, ["--hold", "--", "./plain.sh"], cwd=tmp_path)  # it passes the submit's checks
    script.unlink()
    make(tmp_path)
    if script.exists():
        script.chmod(0o755)
    assert run_cli(["release", str(held)], s).returncode == 0
    followed = run_cli(["attach", str(held)], s, timeout=90)
    assert followed.returncode == code, followed.stderr
    # Its first read may find the job not yet placed after its release (a loaded machine), which
    # a follower says on a line of its own; then the reason, and no traceback.
    said = [line for line in followed.stderr.splitlines(keepends=True)
            if not line.startswith(f"gpuq: job {held} queued and waiting for ")]
    assert said == [f"gpuq: cannot start the command: {why}\n"], followed.stderr
    with write_scope(s) as session:
        job = jobs.get_job(session, held)
        assert (job.state, job.failure, job.exit_code, job.reason) == (State.FAILED, c.FAILURE_EXIT, code,
                                                                       f"cannot start: {why}")


def test_cancel_kills_a_running_jobs_whole_process_tree_and_frees_the_gpu(stack, tmp_path):
    s = stack.settings
    pid_file = tmp_path / "pids"
    # A job that ignores SIGTERM and leaves a grandchild in its own new session.
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "escaped = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}} {{escaped.pid}}')\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    job_id = submit(s, ["--", sys.executable, str(script)], cwd=tmp_path)
    wait_for_state(s, job_id, [State.RUNNING])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().count(" ") == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert all(psutil.pid_exists(p) for p in pids)
    result = run_cli(["cancel", str(job_id)], s, timeout=60)
    assert result.returncode == 0 and f"job {job_id} cancelled" in result.stdout, result.stdout + result.stderr
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    with write_scope(s) as session:
        assert jobs.job_gpus(session, job_id) == []
        assert jobs.get_job(session, job_id).reason == f"cancelled by {pwd.getpwuid(os.getuid()).pw_name}"
    # The freed GPU takes the next job.
    nxt = submit(s, ["--", "true"])
    assert wait_for_state(s, nxt, c.END_STATES) == State.SUCCEEDED


def test_cancel_stops_a_running_builtin_workload_within_a_step(stack):
    s = stack.settings
    job_id = submit(s, ["matmul", "--size", "256", "--repeat", "1000000"])
    wait_for_state(s, job_id, [State.RUNNING])
    started = time.monotonic()
    result = run_cli(["cancel", str(job_id)], s, timeout=60)
    assert result.returncode == 0 and "cancelled" in result.stdout
    assert time.monotonic() - started < 20
    # The worker stays up and warm: the next job on it runs.
    nxt = submit(s, ["matmul", "--size", "64", "--repeat", "2"])
    assert wait_for_state(s, nxt, c.END_STATES) == State.SUCCEEDED


def test_jobs_queue_when_gpus_are_busy_and_a_gpu_is_never_given_to_two_jobs(stack, tmp_path):
    s = stack.settings
    marker = tmp_path / "running"
    marker.mkdir()
    # Each job records that it runs, on which GPU, while holding it for a moment.
    code = (f"import os, time; d={str(marker)!r}; me=os.path.join(d, os.environ['GPUQ_JOB_ID']);"
            "open(me, 'w').write(os.environ['CUDA_VISIBLE_DEVICES']);"
            "seen=[open(os.path.join(d, f)).read() for f in os.listdir(d)];"
            "time.sleep(0.7); os.remove(me); print(sorted(seen))")
    ids = [submit(s, ["--", sys.executable, "-c", code]) for _ in range(5)]
    states = {j: wait_for_state(s, j, c.END_STATES, timeout=90) for j in ids}
    assert set(states.values()) == {State.SUCCEEDED}, stack.logs()
    for j in ids:
        seen = eval(output_of(s, j))  # the GPUs busy while job j held its own
        assert len(seen) == len(set(seen)) and len(seen) <= 2
    with write_scope(s) as session:
        started = sorted(jobs.get_job(session, j).started_at for j in ids)
    assert started == sorted(started)


def test_status_json_lists_jobs_and_gpus(stack):
    s = stack.settings
    job_id = submit(s, ["--", "true"])
    wait_for_state(s, job_id, c.END_STATES)
    data = json.loads(run_cli(["status", "--json", "--ended", "1"], s).stdout)
    assert [j["id"] for j in data["jobs"]] == [job_id]
    assert data["jobs"][0]["state"] == State.SUCCEEDED and data["jobs"][0]["elapsed_s"] >= 0
    assert sorted((g["node"], g["index"], g["online"]) for g in data["gpus"]) == [
        ("testnode", 0, True), ("testnode", 1, True)]


def test_status_says_why_who_and_since_when_a_drained_node_is_drained_in_one_line_under_the_gpus(stack):
    s = stack.settings
    # Root's process run through sudo names the admin sudo let in (only root can open the database).
    me = "labadmin via sudo" if os.getuid() == 0 else pwd.getpwuid(os.getuid()).pw_name
    drained = run_cli(["drain", s.node, "--reason", "driver update at 18:00"], s, extra_env={"SUDO_USER": "labadmin"})
    assert drained.returncode == 0, drained.stderr
    try:
        out = run_cli(["status"], s).stdout
        assert out.count("(drained)") == 2  # both GPUs' lines
        assert re.fullmatch(rf"drained: node {s.node}: driver update at 18:00; by {me} since "
                            r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", out.rstrip().splitlines()[-1]), out
        assert out.count("drained: node") == 1
    finally:
        resumed = run_cli(["resume", "ALL"], s)  # SLURM's name for every node
        assert resumed.returncode == 0 and f"node {s.node} resumed" in resumed.stdout, resumed.stderr
    assert "drained" not in run_cli(["status"], s).stdout


def test_a_drain_planned_with_at_is_shown_under_the_gpus_starts_only_jobs_that_end_by_then_and_is_called_off(stack):
    s = stack.settings
    planned = run_cli(["drain", s.node, "--at", "2h", "--reason", "driver update"], s)
    assert planned.returncode == 0, planned.stderr
    assert re.fullmatch(rf"node {s.node} drains at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC: until then only jobs whose "
                        r"time limit ends by then start there; `gpuq resume` ends it\n", planned.stdout), planned.stdout
    waiting = None
    try:
        # Several nodes at once: all of them or none (here the second is no node of gpuq's).
        def window() -> dict:
            return json.loads(run_cli(["devices", "--json"], s).stdout)[0]["node_drain_ahead"]

        first = window()
        both = run_cli(["drain", s.node, "nosuch", "--at", "1h"], s)
        assert both.returncode == c.EXIT_USAGE and both.stderr == "gpuq: no node nosuch is known to gpuq\n", both
        assert window() == first  # not moved to 1h: nothing written
        for bad, says in ((["--at", "25:00"], "--at 25:00 is not a time of day"),
                          (["--at", "soon"], "--at takes a time of day"),
                          (["--at", "2027-99-01T09:00"], "--at takes a time of day")):
            refused = run_cli(["drain", s.node, *bad], s)
            assert refused.returncode == c.EXIT_USAGE and refused.stderr.count("\n") == 1, refused.stderr
            assert says in refused.stderr
        ends = run_cli(["drain", s.node, "--at", "2h", "--until", "30m"], s)  # an end, 30 minutes on
        assert ends.returncode == 0 and "it is in service again at its end" in ends.stdout, ends.stdout + ends.stderr
        span = window()
        assert (datetime.fromisoformat(span["until"]) - datetime.fromisoformat(span["at"])).total_seconds() == 1800
        assert " until " in run_cli(["status"], s).stdout
        for bad, says in ((["--until", "0s"], "--until"), (["--at", "2h", "--until", "now"], "is not after")):
            refused = run_cli(["drain", s.node, *bad], s)
            assert refused.returncode == c.EXIT_USAGE and says in refused.stderr, refused.stderr
        moved = run_cli(["drain", s.node, "--at", "3h"], s)  # no end now: until resumed
        assert moved.returncode == 0 and "(it was to drain at " in moved.stdout, moved.stdout + moved.stderr
        out = run_cli(["status"], s).stdout
        assert re.search(rf"^node {s.node} drains at [\d: -]+ UTC \(driver update; by \w+\): only jobs whose time "
                         r"limit ends by then start there$", out, re.M), out
        assert "(drained)" not in out
        assert "drains at" in run_cli(["devices"], s).stdout
        short = submit(s, ["--time", "5m", "--", "true"])
        assert wait_for_state(s, short, c.END_STATES) == State.SUCCEEDED
        waiting = submit(s, ["--", "true"])  # no time limit: it could not end before the drain
        time.sleep(1.5)
        shown = json.loads(run_cli(["status", "--json"], s).stdout)
        mine = [(j["state"], j["reason"]) for j in shown["jobs"] if j["id"] == waiting]
        assert mine == [("pending", "node draining")]
        said = run_cli(["why", str(waiting)], s).stdout
        assert "the nodes it fits are to drain before it could end there" in said and "no time limit" in said, said
        again = run_cli(["drain", s.node], s)  # now, not later: its planned reason goes with it
        assert again.returncode == 0, again.stderr
        assert "drained: node " + s.node + ": driver update; by " in run_cli(["status"], s).stdout
    finally:
        assert run_cli(["resume", s.node], s).returncode == 0
    assert wait_for_state(s, waiting, c.END_STATES) == State.SUCCEEDED
    out = run_cli(["status"], s).stdout
    assert "drain" not in out


def test_each_worker_is_pinned_to_its_gpu_with_pci_bus_order(stack):
    for name, proc in stack.procs.items():
        if not name.startswith("worker"):
            continue
        env = psutil.Process(proc.pid).environ()
        assert env["CUDA_VISIBLE_DEVICES"] == name.rsplit("-", 1)[1]
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        cmdline = " ".join(psutil.Process(proc.pid).cmdline())
        assert "gpuq.workers" in cmdline
        # solo pool: the worker runs jobs in its own process, no forked pool children (its one
        # other child, once it has run a command, is its lease guard: workers/guard.py)
        children = [" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children()]
        assert [c for c in children if "gpuq.workers.guard" not in c] == [], children
        assert len(children) <= 1


def test_a_training_job_records_each_epoch_in_sql_and_show_prints_them(stack):
    s = stack.settings
    job_id = submit(s, ["train", "--model", "lenet", "--epochs", "2", "--batch-size", "64",
                        "--train-size", "512", "--test-size", "128", "--lr", "0.5"])
    assert wait_for_state(s, job_id, c.END_STATES, timeout=150) == State.SUCCEEDED, output_of(s, job_id)
    with write_scope(s) as session:
        metrics = job_output.read_metrics(session, job_id)
        result = jobs.get_job(session, job_id).result
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert all({"train_loss", "train_acc", "test_acc", "examples_per_s", "seconds"} <= m.keys() for m in metrics)
    assert result["test_acc"] == metrics[-1]["test_acc"]
    show = run_cli(["show", str(job_id)], s).stdout
    assert "metrics" in show and "epoch=2" in show


def test_a_two_gpu_ddp_training_job_runs_one_rank_in_each_gpus_own_worker(stack):
    s = stack.settings
    job_id = submit(s, ["--gpus", "2", "train", "--strategy", "ddp", "--epochs", "1", "--batch-size", "64",
                        "--train-size", "256", "--test-size", "64"])
    assert wait_for_state(s, job_id, c.END_STATES, timeout=150) == State.SUCCEEDED, output_of(s, job_id)
    with write_scope(s) as session:
        job = jobs.get_job(session, job_id)
        assert job.result["world_size"] == 2 and job.result["strategy"] == "ddp"
        assert job.rendezvous.startswith("tcp://")
        assert len(job_output.read_metrics(session, job_id)) == 1  # rank 0 alone records
        rank0 = job.worker
    # Rank 1 ran in the other GPU's warm worker, not in a process rank 0 started.
    other = next(n for n in stack.procs if n.startswith("worker") and not rank0.startswith(f"gpu{n[-1]}@"))
    assert f"job {job_id} rank 1/2 started" in (stack.log_dir / f"{other}.log").read_text()


def test_a_submit_is_answered_once_its_job_is_written_and_its_message_is_published_after(stack, tmp_path):
    # The server answers a submit as soon as its job is in SQL, and publishes the placed job's
    # message after: a broker holding its writes back (Redis's CLIENT PAUSE WRITE) delays the
    # job's start, not the answer. Before, the answer waited for the publish.
    import redis

    s = stack.settings
    deadline = time.monotonic() + 60
    while True:  # placed at submit only when nothing else waits (jobs of this module's other tests)
        with write_scope(s) as session:
            if not jobs.list_jobs(session, ended_limit=0):
                break
        assert time.monotonic() < deadline, "the stack never went idle"
        time.sleep(0.1)
    r = redis.Redis.from_url(s.broker)
    pause_s = 4
    r.execute_command("CLIENT", "PAUSE", pause_s * 1000, "WRITE")
    paused_until = time.monotonic() + pause_s
    try:
        done = run_cli(["submit", "--", "true"], s, cwd=tmp_path)
        answered = time.monotonic()
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    assert done.returncode == 0, done.stdout + done.stderr + stack.logs()
    assert answered < paused_until, "the answer waited for the broker"
    job_id = int(done.stdout.split()[-1])
    assert wait_for_state(s, job_id, (State.SUCCEEDED, State.FAILED)) == State.SUCCEEDED, stack.logs()


def test_a_job_killed_by_a_signal_shows_its_exit_as_a_shell_does_not_as_a_negative_number(stack, tmp_path):
    # `gpuq show` and `gpuq history` printed -9, where `gpuq run` exits 137 and a shell says 137.
    s = stack.settings
    job_id = submit(s, ["--", "/bin/sh", "-c", "kill -KILL $$"], cwd=tmp_path)
    assert wait_for_state(s, job_id, c.END_STATES) == State.FAILED
    assert "exit code  137 (SIGKILL)" in run_cli(["show", str(job_id)], s).stdout
    listed = run_cli(["history", "--since", "1h"], s).stdout
    assert any(line.split()[0] == str(job_id) and "137 (SIGKILL)" in line for line in listed.splitlines()), listed
