"""A job script's ``#GPUQ`` lines (cli/script.py): `gpuq submit` options read from the script, as
sbatch reads ``#SBATCH``, below the command line's, and refused in one line naming the script's line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.cli.script import directive_lines
from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import Job
from gpuq.service.units import TIME_FORMS

pytestmark = pytest.mark.timeout(60)

SCRIPT = """#!/bin/bash
# Train the small model.
#GPUQ --gpus 2 --time 30m
#GPUQ --name from-script   # a comment after the options
#GPUQ --env A=1
#GPUQ --env B=2
#GPUQ --hold

#SBATCH --gres=gpu:8
echo training
#GPUQ --priority 9
"""


def invoke(args):
    return CliRunner().invoke(app, args, prog_name="gpuq")


def script(tmp_path, text: str, name: str = "job.sh"):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def jobs_in(settings) -> int:
    with write_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def submitted(args) -> dict:
    result = invoke(["submit", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_only_the_leading_comment_blocks_gpuq_lines_are_read(tmp_path):
    lines = directive_lines(str(script(tmp_path, SCRIPT)))
    assert [n for n, _ in lines] == [3, 4, 5, 6, 7]
    assert lines[1] == (4, "--name from-script   # a comment after the options")
    assert directive_lines(str(tmp_path / "missing.sh")) == []
    (tmp_path / "program").write_bytes(b"\x7fELF\0\0#GPUQ --gpus 2\n")
    assert directive_lines(str(tmp_path / "program")) == []


def test_a_scripts_options_apply_and_the_command_lines_win(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, SCRIPT)
    job = submitted(["--name", "from-cli", "--", "./job.sh"])
    assert job["argv"] == ["./job.sh"] and job["gpus"] == 2 and job["time_limit_s"] == 1800
    assert job["name"] == "from-cli" and job["priority"] == 0  # the line after the first command is not read
    with write_scope(use_settings) as session:
        row = session.get(Job, job["id"])
        assert row.held and row.env["A"] == "1" and row.env["B"] == "2"
    # Run by an interpreter, the script named second is read the same; --env on the command line
    # replaces the script's (as sbatch's command line replaces its #SBATCH lines).
    job = submitted(["--env", "C=3", "--", "bash", "job.sh"])
    assert job["gpus"] == 2 and job["name"] == "from-script"
    with write_scope(use_settings) as session:
        env = session.get(Job, job["id"]).env
        assert env["C"] == "3" and "A" not in env


@pytest.mark.parametrize("line,message", [
    ("#GPUQ --gpus many", "job.sh line 2: Invalid value for '--gpus': 'many' is not a whole number (digits only)"),
    ("#GPUQ --gpsu 2", "job.sh line 2: '--gpsu': a #GPUQ line takes gpuq submit's options only"),
    ("#GPUQ matmul", "job.sh line 2: 'matmul': a #GPUQ line takes gpuq submit's options only"),
    ("#GPUQ -- true", "job.sh line 2: '--': a #GPUQ line takes gpuq submit's options only"),
    ("#GPUQ --user root", "job.sh line 2: --user is given on the command line, not in a script"),
    ("#GPUQ --gpus a100:1\n#GPUQ --gpu-type rtx", "--gpus a100:1 and --gpu-type rtx name two GPU types: give one "
                                                 "(--gpus from job.sh line 2) (--gpu-type from job.sh line 3)"),
    ("#GPUQ --json", "job.sh line 2: --json is given on the command line, not in a script"),
    ("#GPUQ --name 'unclosed", "job.sh line 2: #GPUQ --name 'unclosed: No closing quotation"),
    # Refused by the server, which knows options, not lines: the client names the line.
    ("#GPUQ --time 1:99:99", "--time takes " + TIME_FORMS + "; got '1:99:99' (job.sh line 2)"),
    ("#GPUQ --gpus 99", "--gpus 99 is more than any node has (the largest, testnode, has 2) (job.sh line 2)"),
])
def test_a_bad_gpuq_line_is_refused_in_one_line_naming_it_and_nothing_is_written(use_settings, tmp_path,
                                                                                monkeypatch, line, message):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, f"#!/bin/sh\n{line}\ntrue\n")
    result = invoke(["submit", "--", "./job.sh"])
    assert result.exit_code == c.EXIT_USAGE, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("gpuq: ")
    assert message in result.output
    assert jobs_in(use_settings) == 0


def test_a_scripts_gpus_type_count_asks_for_that_many_of_that_model(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, "#!/bin/sh\n#GPUQ --gpus simulated:1 --hold\ntrue\n")  # sbatch's --gpus TYPE:COUNT
    job = submitted(["--", "./job.sh"])
    assert (job["gpus"], job["gpu_type"]) == (1, "simulated")
    job = submitted(["--gpus", "1", "--", "./job.sh"])  # the command line's --gpus replaces the line's, type and all
    assert (job["gpus"], job["gpu_type"]) == (1, None)


def test_a_scripts_gres_asks_for_gpus_as_sbatchs_and_the_command_lines_gpus_or_gres_win(use_settings, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, "#!/bin/sh\n#GPUQ --gres gpu:simulated:2 --hold\ntrue\n")
    job = submitted(["--", "./job.sh"])
    assert (job["gpus"], job["gpu_type"]) == (2, "simulated")
    job = submitted(["--gpus", "1", "--", "./job.sh"])  # the command line's --gpus over the line's --gres
    assert (job["gpus"], job["gpu_type"]) == (1, None)
    script(tmp_path, "#!/bin/sh\n#GPUQ --gpus 2 --hold\ntrue\n")
    job = submitted(["--gres", "gpu", "--", "./job.sh"])  # and the command line's --gres over its --gpus
    assert (job["gpus"], job["gpu_type"]) == (1, None)


def test_a_scripts_requeue_word_is_kept_and_the_command_lines_wins(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, "#!/bin/sh\n#GPUQ --no-requeue --retries 2 --hold\ntrue\n")
    assert (submitted(["--", "./job.sh"])["requeue"], submitted(["--", "./job.sh"])["max_retries"]) == (False, 2)
    assert submitted(["--requeue", "--", "./job.sh"])["requeue"] is True
    script(tmp_path, "#!/bin/sh\n#GPUQ --hold\ntrue\n")
    assert submitted(["--", "./job.sh"])["requeue"] is None  # no word: as its retries say


@pytest.mark.parametrize("line,message", [
    ("#GPUQ --gpus 1 --gres gpu:2", "give --gpus or --gres, not both (job.sh line 2)"),
    ("#GPUQ --gres gpu:99", "--gpus 99 is more than any node has (the largest, testnode, has 2) (job.sh line 2)"),
    ("#GPUQ --gres mps:50", "job.sh line 2: Invalid value for '--gres': 'mps:50': GPUs are the one resource gpuq "
                            "gives: gpu, gpu:COUNT or gpu:TYPE:COUNT"),
    ("#GPUQ --wrap 'echo hi'", "job.sh line 2: --wrap is given on the command line, not in a script"),
])
def test_a_bad_gres_or_wrap_line_is_refused_naming_it_and_nothing_is_written(use_settings, tmp_path, monkeypatch,
                                                                            line, message):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, f"#!/bin/sh\n{line}\ntrue\n")
    result = invoke(["submit", "--", "./job.sh"])
    assert (result.exit_code, result.output.count("\n")) == (c.EXIT_USAGE, 1), result.output
    assert message in result.output
    assert jobs_in(use_settings) == 0


def test_run_of_a_script_whose_lines_make_an_array_says_which_line(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, "#!/bin/sh\n#GPUQ --array 0-1\ntrue\n")
    result = invoke(["run", "--", "./job.sh"])
    assert result.exit_code == c.EXIT_USAGE and result.output == (
        "gpuq: gpuq run follows one job; queue an array or a sweep with gpuq submit (--array from job.sh line 2)\n")
    assert jobs_in(use_settings) == 0


def test_a_command_that_is_no_script_here_reads_nothing(use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = submitted(["--", "true"])
    assert job["gpus"] == 1 and job["name"] == "true"


def submit_command():
    import typer.main

    from gpuq.cli.submit import app as submit_app

    return typer.main.get_command(submit_app).commands["submit"]


@pytest.mark.parametrize("args,at", [
    (["train.sh", "--lr", "0.1"], 0),
    (["-G", "2", "--name", "a.b", "-H", "./train.sh", "--gpus", "3"], 5),  # an option's value is no word of its own
    (["--name=a.b", "-G2", "sub/run", "x"], 2),
    (["-Hc", "1", "train.py"], 2),  # flags, then one whose value is the next word
    (["-HG", "--time", "1h", "x.sh"], 2),  # -G's value is '--time'
    (["matmul", "--size", "5"], 0),
    (["--gpus", "2"], None),
    ([], None),
])
def test_the_first_word_is_past_the_options_and_their_values(args, at):
    from gpuq.cli.script import first_word

    assert first_word(submit_command().params, args) == at


def test_a_scripts_shebang_is_split_as_the_kernel_splits_it():
    from gpuq.service.launchable import kernel_argv

    assert kernel_argv(b"#!/bin/bash\necho\n") == ["/bin/bash"]
    assert kernel_argv(b"#! /usr/bin/env -S python3 -u  \nprint()\n") == ["/usr/bin/env", "-S python3 -u"]
    assert kernel_argv(b"#!/usr/bin/python3\t-u\n") == ["/usr/bin/python3", "-u"]
    # The argument whole, as the kernel passes it: its own tabs kept, the blanks before it not.
    assert kernel_argv(b"#!/usr/bin/env \t -S awk\t-f\n") == ["/usr/bin/env", "-S awk\t-f"]
    assert kernel_argv(b"echo\n") is None and kernel_argv(b"#!\n") is None and kernel_argv(b"#!  \n") is None


def test_a_script_named_as_sbatch_takes_it_is_the_command_with_every_word_after_it(use_settings, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, SCRIPT, "run.sh")
    # Executable: run where it is (a bare name would be looked up in PATH); the words after it are
    # the script's, --gpus too, and its #GPUQ lines are read as for `-- ./run.sh`.
    job = submitted(["--priority", "3", "run.sh", "--gpus", "3", "a b"])
    assert job["argv"] == ["./run.sh", "--gpus", "3", "a b"], job
    assert job["gpus"] == 2 and job["name"] == "from-script" and job["priority"] == 3
    # Not executable: its #! line's interpreter runs it, as sbatch needs no chmod +x; its lines are
    # read past an interpreter given as a path.
    (tmp_path / "run.sh").chmod(0o644)
    job = submitted(["run.sh", "--lr", "0.1"])
    assert job["argv"] == ["/bin/bash", "./run.sh", "--lr", "0.1"] and job["gpus"] == 2, job
    assert job["name"] == "from-script"
    # Found from --chdir's directory, as the job runs there.
    (tmp_path / "sub").mkdir()
    script(tmp_path / "sub", "#!/bin/sh\n#GPUQ --name in-sub\necho\n", "go.sh")
    job = submitted(["-D", "sub", "go.sh"])
    assert job["argv"] == ["./go.sh"] and job["name"] == "in-sub" and job["cwd"] == str(tmp_path / "sub")
    # What follows -- after the script is its own, as any word after it.
    assert submitted(["sub/go.sh", "--", "x"])["argv"] == ["sub/go.sh", "--", "x"]


def test_a_program_named_in_a_workloads_place_runs_from_path_and_a_workloads_name_is_the_workload(
        use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = submitted(["-G", "1", "--name", "py", "python3", "-c", "print(1)", "--gpus", "2"])
    assert job["argv"] == ["python3", "-c", "print(1)", "--gpus", "2"] and job["gpus"] == 1 and job["name"] == "py"
    # A file named as a workload is not taken for it: ./sleep is the file.
    script(tmp_path, "#!/bin/sh\necho\n", "sleep")
    job = submitted(["sleep", "--seconds", "1"])
    assert job["workload"] == "sleep" and job["argv"] is None
    assert submitted(["./sleep"])["argv"] == ["./sleep"]


def test_a_script_nothing_would_run_is_refused_in_one_line_and_nothing_is_written(use_settings, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('no #! line')\n")
    result = invoke(["submit", "train.py", "--lr", "0.1"])
    assert result.exit_code == c.EXIT_USAGE and result.output == (
        "gpuq: train.py is not executable and has no #! line to say what runs it: chmod +x it, or name its "
        "interpreter: gpuq submit -- python3 train.py\n")
    result = invoke(["run", "nothere.sh"])
    assert result.exit_code == c.EXIT_USAGE and result.output == (
        f"gpuq: nothere.sh is none of gpuq's workloads (gpuq workloads), no file in {tmp_path} and no command "
        "on PATH\n")
    result = invoke(["submit", "-G", "1", "sub/missing.sh"])
    missing = f"gpuq: no such job script: sub/missing.sh (in {tmp_path})\n"
    assert (result.exit_code, result.output) == (c.EXIT_USAGE, missing)
    assert jobs_in(use_settings) == 0


@pytest.mark.parametrize("words,gpuq,left_out", [
    (["--job-name=train", "-t", "1:00:00"], ["--name", "train", "--time", "1:00:00"], []),
    (["--gres=gpu:a100:2", "-c", "8", "--mem=32G"], ["--gres", "gpu:a100:2", "--cpus", "8", "--host-mem", "32G"], []),
    (["--mem", "4000"], ["--host-mem", "4000M"], []),  # sbatch's unit: megabytes
    (["-Jname", "-o", "logs/%x-%j.out", "-e", "err.log"], ["--name", "name", "--output", "logs/%x-%j.out", "--error",
                                                          "err.log"], []),
    (["--export=ALL"], ["--env", "ALL"], []),
    (["--export=NONE"], [], []),
    (["--export", "WANDB_MODE=offline,HF_HOME"], ["--env", "WANDB_MODE=offline", "--env", "HF_HOME"], []),
    (["-H", "--requeue", "--array=0-9%2", "-d", "afterok:12"], ["--hold", "--requeue", "--array", "0-9%2",
                                                               "--dependency", "afterok:12"], []),
    (["-p", "gpu", "--account=lab", "-N", "1", "--ntasks=1", "--nice=5", "-q", "normal"], [],
     ["-p gpu", "--account lab", "--nice 5", "-q normal"]),
    (["--gpus-per-node=2", "--mail-type=END,FAIL", "-x", "n3"], ["--gpus", "2", "--mail-type", "END,FAIL",
                                                                "--exclude", "n3"], []),
    # SLURM's mail events gpuq sends none for are left out, said as the rest are.
    (["--mail-type=END,TIME_LIMIT_80,ARRAY_TASKS"], ["--mail-type", "END"],
     ["--mail-type TIME_LIMIT_80", "--mail-type ARRAY_TASKS"]),
    (["--mail-type=TIME_LIMIT"], [], ["--mail-type TIME_LIMIT"]),
    (["--time=UNLIMITED", "-t", "infinite"], [], ["--time UNLIMITED", "-t infinite"]),
])
def test_an_sbatch_line_becomes_gpuq_submits_options_and_what_means_nothing_here_is_left_out(words, gpuq, left_out):
    from gpuq.cli.sbatch_lines import translate

    assert translate(words) == (gpuq, left_out)


@pytest.mark.parametrize("words,message", [
    (["-N", "2"], "#SBATCH -N 2: a gpuq job runs on one node (its GPUs, cores and tasks all there)"),
    (["--ntasks=0"], "#SBATCH --ntasks 0: a count of tasks on the job's one node, 1 to 1024"),
    (["--ntasks-per-node", "many"], "#SBATCH --ntasks-per-node many: a count of tasks on the job's one node"),
    (["--exclusive"], "#SBATCH --exclusive: gpuq does not hold a whole node"),
    (["--constraint=a100"], "#SBATCH --constraint a100: ask for a GPU model with --gres gpu:MODEL:N"),
    (["--mem-per-cpu=4G"], "give the job's host memory as --mem"),
    (["-D", "/tmp"], "give -D on the command line"),
    (["--frobnicate=1"], "#SBATCH --frobnicate: not an option gpuq takes (gpuq submit --help)"),
    (["train.py"], "'train.py': an #SBATCH line takes sbatch's options only"),
    (["-t"], "-t needs a value"),
])
def test_an_sbatch_option_gpuq_cannot_honour_or_does_not_know_is_refused_naming_it(words, message):
    from gpuq.cli.sbatch_lines import translate

    with pytest.raises(InvalidSpec) as refused:
        translate(words)
    assert message in str(refused.value)


SLURM_SCRIPT = """#!/bin/bash
#SBATCH --job-name=resnet
#SBATCH -p gpu --account=lab
#SBATCH --gres=gpu:2 -c 4 --mem=4000
#SBATCH --time=1:00:00
#GPUQ --name from-gpuq
srun python train.py
"""


def test_a_slurm_script_runs_as_it_is_its_gpuq_lines_over_its_sbatch_lines_and_what_is_left_out_said(
        use_settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, SLURM_SCRIPT, "train.sbatch")
    result = invoke(["submit", "--json", "train.sbatch"])
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert job["argv"] == ["./train.sbatch"] and job["name"] == "from-gpuq" and job["gpus"] == 2, job
    assert job["time_limit_s"] == 3600 and job["host_mem_mib"] == 4000 and job["cpus"] == 4, job
    assert result.stderr == ("gpuq: left out of train.sbatch, as meaning nothing to gpuq: -p gpu (line 3), --account "
                             "lab (line 3)\n")  # its srun is the job's own (gpuq.cli.srun): nothing to say of it
    # Marked as a SLURM script's, as sbatch sets it: its worker gives it SLURM's names for its facts;
    # and its output goes where sbatch writes it.
    with write_scope(use_settings) as session:
        assert session.get(Job, job["id"]).env["SLURM_SUBMIT_DIR"] == str(tmp_path)
    assert job["output_file"] == str(tmp_path / "slurm-%j.out"), job
    script(tmp_path, "#!/bin/sh\n#SBATCH -a 1-2\ntrue\n", "array.sbatch")
    tasks = json.loads(invoke(["submit", "--json", "array.sbatch"]).stdout)
    assert {t["output_file"] for t in tasks} == {str(tmp_path / "slurm-%A_%a.out")}, tasks  # filled as each runs
    script(tmp_path, "#!/bin/sh\n#SBATCH -o mine.log\ntrue\n", "own.sbatch")
    assert json.loads(invoke(["submit", "--json", "own.sbatch"]).stdout)["output_file"] == str(tmp_path / "mine.log")
    # The command line over both.
    result = invoke(["submit", "--json", "-G", "1", "-t", "5m", "train.sbatch"])
    assert result.exit_code == 0 and json.loads(result.stdout)["gpus"] == 1, result.output


def test_a_slurm_script_takes_the_submitters_whole_environment_unless_it_or_the_command_line_says_otherwise(
        use_settings, tmp_path, monkeypatch):
    # sbatch's --export default is ALL: a script relying on what its shell exported (a W&B project,
    # a cache directory) runs as under SLURM. gpuq's own variables and the refused ones stay out.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_PROJECT", "resnet")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/hook.so")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")

    def env_of(text: str, *args: str) -> dict:
        script(tmp_path, text, "run.sbatch")
        job = submitted([*args, "run.sbatch"])
        with write_scope(use_settings) as session:
            return session.get(Job, job["id"]).env

    env = env_of("#!/bin/sh\n#SBATCH -J all\ntrue\n")
    assert env["WANDB_PROJECT"] == "resnet" and "LD_PRELOAD" not in env and "CUDA_VISIBLE_DEVICES" not in env, env
    env = env_of("#!/bin/sh\n#SBATCH -J all\n#GPUQ --env A=1\ntrue\n")
    assert env["WANDB_PROJECT"] == "resnet" and env["A"] == "1", env
    # --export=NONE: gpuq's default set alone (PATH, HOME...); --export=NAME: that one beside it.
    env = env_of("#!/bin/sh\n#SBATCH --export=NONE\ntrue\n")
    assert "WANDB_PROJECT" not in env and env["PATH"] == os.environ["PATH"], env
    env = env_of("#!/bin/sh\n#SBATCH --export=HF_HOME=/data/hf\ntrue\n")
    assert "WANDB_PROJECT" not in env and env["HF_HOME"] == "/data/hf", env
    # The command line's --env replaces the script's, sbatch's default among them.
    env = env_of("#!/bin/sh\n#SBATCH -J all\ntrue\n", "--env", "B=2")
    assert "WANDB_PROJECT" not in env and env["B"] == "2", env
    # A script of #GPUQ lines alone is gpuq's: its default set.
    env = env_of("#!/bin/sh\n#GPUQ -J mine\ntrue\n")
    assert "WANDB_PROJECT" not in env, env


@pytest.mark.parametrize("line,message", [
    ("#SBATCH --nodes=2", "job.sh line 2: #SBATCH --nodes 2: a gpuq job runs on one node (its GPUs, cores and "
                          "tasks all there)"),
    ("#SBATCH --gres=gpu:9", "--gpus 9 is more than any node has (the largest, testnode, has 2) (job.sh line 2)"),
    ("#SBATCH --partition", "job.sh line 2: --partition needs a value"),
    ("#GPUQ --gpus 2 train", "job.sh line 2: 'train': a #GPUQ line takes gpuq submit's options only"),
])
def test_a_bad_sbatch_line_is_refused_in_one_line_naming_it_and_nothing_is_written(use_settings, tmp_path, monkeypatch,
                                                                                   line, message):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, f"#!/bin/sh\n{line}\ntrue\n")
    result = invoke(["submit", "job.sh"])
    assert result.exit_code == c.EXIT_USAGE, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("gpuq: ") and message in result.output
    assert jobs_in(use_settings) == 0


def test_a_script_given_on_stdin_is_carried_by_the_job_with_its_lines_read_as_sbatch_reads_one(use_settings, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = "#!/bin/bash\n#SBATCH -J heredoc -p gpu\n#GPUQ --gpus 2\necho $GPUQ_JOB_ID\n"
    result = CliRunner().invoke(app, ["submit", "--json"], input=text, prog_name="gpuq")
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert job["argv"] == ["/bin/bash", "-c", text] and job["name"] == "heredoc" and job["gpus"] == 2, job
    assert result.stderr == "gpuq: left out of stdin, as meaning nothing to gpuq: -p gpu (line 2)\n"
    # Without a #! line, sh runs it; without a name, the job is called after where it came from.
    plain = CliRunner().invoke(app, ["submit", "--json", "-t", "5m"], input="echo hi\n", prog_name="gpuq")
    assert json.loads(plain.stdout)["argv"] == ["/bin/sh", "-c", "echo hi\n"]
    assert json.loads(plain.stdout)["name"] == "stdin"


@pytest.mark.parametrize("given,message", [
    ("", "nothing to run: name a workload (gpuq workloads), a job script or a command, or give a script on stdin"),
    ("  \n", "nothing to run"),
    ("echo \0", "the script given on stdin is not text (a NUL byte)"),
    ("#" * (200 * 1024), "the script given on stdin is longer than 128 KiB"),
    ("#!/bin/sh\n#SBATCH --nodes=2\ntrue\n", "stdin line 2: #SBATCH --nodes 2: a gpuq job runs on one node"),
])
def test_a_script_on_stdin_that_nothing_would_run_is_refused_in_one_line_and_nothing_is_written(use_settings, given,
                                                                                                message):
    result = CliRunner().invoke(app, ["submit"], input=given, prog_name="gpuq")
    assert result.exit_code == c.EXIT_USAGE and result.output.count("\n") == 1, result.output
    assert result.output.startswith("gpuq: ") and message in result.output
    assert jobs_in(use_settings) == 0


def test_a_slurm_scripts_job_has_slurms_names_for_its_own_facts_and_none_of_sruns_task_variables():
    from gpuq.service.slurm_names import tasks_of, variables

    names = variables(12, "train[3]", "n1", 2, cpus=2.5, array_id=9, array_index=3)
    assert names == {"SLURM_JOB_ID": "12", "SLURM_JOBID": "12", "SLURM_JOB_NAME": "train[3]",
                     "SLURM_JOB_NODELIST": "n1", "SLURM_NODELIST": "n1", "SLURMD_NODENAME": "n1",
                     "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2",
                     "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "3", "SLURM_CPUS_PER_TASK": "3"}
    assert "SLURM_ARRAY_TASK_ID" not in variables(12, "t", "n1", 1) and "SLURM_NTASKS" not in names
    # A job of four tasks: its count, and its cores shared among them, as sbatch gives a batch script.
    four = variables(12, "ddp", "n1", 4, cpus=8, tasks=4)
    assert (four["SLURM_NTASKS"], four["SLURM_NTASKS_PER_NODE"], four["SLURM_CPUS_PER_TASK"]) == ("4", "4", "2")
    assert "SLURM_PROCID" not in four  # each task's, which its srun sets in the tasks it starts
    # The count as a job's environment gives it, which its user may have set to anything.
    assert [tasks_of(env) for env in ({}, {"SLURM_NTASKS": "4"}, {"SLURM_NTASKS": "x"}, {"SLURM_NTASKS": "0"},
                                      {"SLURM_NTASKS": "99999"})] == [4 - 3, 4, 1, 1, 1]


def test_a_script_without_sbatch_lines_is_not_marked_as_slurms_and_its_srun_is_said_at_submit(use_settings, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, "#!/bin/sh\n#GPUQ --name plain\nsrun true\n")
    result = invoke(["submit", "--json", "job.sh"])
    with write_scope(use_settings) as session:
        assert "SLURM_SUBMIT_DIR" not in session.get(Job, json.loads(result.stdout)["id"]).env
    assert result.stderr == ("gpuq: note: job.sh runs srun (line 3), SLURM's task launcher, which a gpuq job finds "
                             "only where its script has #SBATCH lines (it runs the command as the job's one task)\n")


def test_the_lines_of_a_script_that_run_srun_are_found():
    from gpuq.cli.script import srun_lines

    text = "#!/bin/sh\n# srun in a comment\nsrun python a.py\n  exec srun -n1 b\nsrunner x\necho srun\nsrun\n"
    assert srun_lines(text) == [3, 4, 7]


@pytest.mark.parametrize("argv,command,chdir,said", [
    (["python", "train.py", "-n", "4"], ["python", "train.py", "-n", "4"], None, []),  # its words are its own
    (["-n1", "--cpus-per-task=4", "--gres", "gpu:2", "-l", "--mpi=pmix", "-u", "python", "x.py"], ["python", "x.py"],
     None, []),
    (["--ntasks", "1", "-N", "1-1", "-D", "/tmp", "--", "-weird"], ["-weird"], "/tmp", []),
    (["-o", "step.log", "--error=e.log", "true"], ["true"], None, ["--output step.log", "--error e.log"]),
])
def test_srun_in_a_job_runs_its_command_as_the_jobs_one_task(argv, command, chdir, said):
    from gpuq.cli.srun import command_of

    step = command_of(argv)
    assert (step.command, step.chdir, step.said) == (command, chdir, said)


@pytest.mark.parametrize("argv,message", [
    (["-n", "0", "python", "x.py"], "--ntasks 0: a count of tasks, 1 or more"),
    (["--nodes=2", "x"], "--nodes 2: a gpuq job runs on one node, its tasks all there"),
    (["--frob", "x"], "--frob: not an option srun has"),
    (["-c"], "-c needs a value"),
    (["-l"], "no command to run"),
])
def test_srun_in_a_job_refuses_what_it_would_not_run(argv, message):
    from gpuq.cli.srun import Refused, command_of

    with pytest.raises(Refused, match=re.escape(message)):
        command_of(argv)


def _srun(args: list[str], tasks: int | None, tmp_path, timeout: float = 60,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **(env or {})}
    if tasks is not None:
        env["SLURM_NTASKS"] = str(tasks)
    return subprocess.run([sys.executable, "-m", "gpuq.cli.srun", *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


def test_srun_in_a_job_of_several_tasks_starts_one_a_task_each_told_its_rank_as_srun_does(tmp_path):
    # A job whose script asked for four tasks (#SBATCH --ntasks-per-node=4): its srun starts the
    # command four times, each told its place as SLURM tells a task, for Lightning or a DDP script.
    show = "echo rank $SLURM_PROCID local $SLURM_LOCALID of $SLURM_NTASKS node $SLURM_NODEID; echo e$SLURM_PROCID >&2"
    ran = _srun(["-l", "sh", "-c", show], 4, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == [f"{r}: rank {r} local {r} of 4 node 0" for r in range(4)]
    assert sorted(ran.stderr.splitlines()) == [f"{r}: e{r}" for r in range(4)]  # labelled, as srun -l
    # GPUs asked per task (SLURM_GPUS_PER_TASK, or the step's --gpus-per-task): each task its own
    # of the job's, as SLURM binds them, so a script's `cuda:0` is each rank's own GPU; --gpu-bind=none
    # lets each see them all.
    gpus = {"CUDA_VISIBLE_DEVICES": "3,5,6,7"}
    ran = _srun(["-l", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], 4, tmp_path, env={**gpus, "SLURM_GPUS_PER_TASK": "1"})
    assert sorted(ran.stdout.splitlines()) == ["0: 3", "1: 5", "2: 6", "3: 7"], ran.stderr
    ran = _srun(["-l", "--gpu-bind=none", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], 2, tmp_path,
                env={**gpus, "SLURM_GPUS_PER_TASK": "1"})
    assert sorted(ran.stdout.splitlines()) == ["0: 3,5,6,7", "1: 3,5,6,7"], ran.stderr
    ran = _srun(["-l", "--gpus-per-task", "2", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], 2, tmp_path, env=gpus)
    assert sorted(ran.stdout.splitlines()) == ["0: 3,5", "1: 6,7"], ran.stderr
    ran = _srun(["-l", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], 2, tmp_path, env=gpus)  # none asked per task
    assert sorted(ran.stdout.splitlines()) == ["0: 3,5,6,7", "1: 3,5,6,7"], ran.stderr
    # -n picks fewer of them; the highest status is srun's; more than the job has is refused.
    ran = _srun(["-n", "2", "sh", "-c", "echo $SLURM_NTASKS; exit $((SLURM_PROCID + 3))"], 4, tmp_path)
    assert (ran.returncode, ran.stdout) == (4, "2\n2\n"), ran.stderr
    ran = _srun(["-n", "5", "true"], 4, tmp_path)
    assert ran.returncode == 2 and ran.stderr.startswith("gpuq srun: --ntasks 5: the job has 4 tasks"), ran.stderr
    # -K: one task's failure stops the others, and its status is srun's.
    ran = _srun(["-K", "sh", "-c", "[ $SLURM_PROCID = 1 ] && exit 5; exec sleep 60"], 3, tmp_path, timeout=30)
    assert ran.returncode == 5, ran.stderr
    # A task a signal ended: 128 + N; a command that is not there: 127, no task left behind.
    assert _srun(["sh", "-c", "kill -9 $$"], 2, tmp_path).returncode == 137
    ran = _srun(["no-such-command-here"], 2, tmp_path)
    assert ran.returncode == 127 and "no-such-command-here: command not found" in ran.stderr
    # The signals srun is sent reach its tasks.
    (tmp_path / "trap.sh").write_text('trap "echo got TERM $SLURM_PROCID; exit 0" TERM\necho up\nwhile :; do '
                                      'sleep 0.1; done\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_NTASKS": "2"}
    srun = subprocess.Popen([sys.executable, "-m", "gpuq.cli.srun", "sh", "trap.sh"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    assert srun.stdout is not None
    assert [srun.stdout.readline(), srun.stdout.readline()] == ["up\n", "up\n"]
    srun.terminate()
    out, _ = srun.communicate(timeout=30)
    assert srun.returncode == 0 and sorted(out.splitlines()) == ["got TERM 0", "got TERM 1"], out
    # A signal from gpuq's worker, which sends it every process of the job, reached each task
    # already: not passed on again, so a checkpoint handler runs once; one from anyone else is.
    (tmp_path / "count.sh").write_text('n=0\ntrap "n=\\$((n+1)); echo usr1 \\$n" USR1\ntrap "exit 0" TERM\n'
                                       'echo up\nwhile :; do sleep 0.05; done\n')
    srun = subprocess.Popen([sys.executable, "-m", "gpuq.cli.srun", "sh", "count.sh"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    assert srun.stdout is not None
    assert [srun.stdout.readline(), srun.stdout.readline()] == ["up\n", "up\n"]
    # As a worker's process names itself (python -m gpuq.workers), alive while srun looks.
    as_worker = f"import os, time; os.kill({srun.pid}, {int(signal.SIGUSR1)}); time.sleep(1)"
    subprocess.run([sys.executable, "-c", as_worker, "gpuq.workers", "--gpu", "0"], timeout=30)
    srun.send_signal(signal.SIGUSR1)  # from this test's process: passed on
    assert sorted([srun.stdout.readline(), srun.stdout.readline()]) == ["usr1 1\n", "usr1 1\n"]
    srun.terminate()
    out, _ = srun.communicate(timeout=30)
    assert srun.returncode == 0 and out == "", out
    # In a job of one task, the command is that task, with none of a task's variables.
    ran = _srun(["-l", "sh", "-c", "echo one ${SLURM_PROCID:-none}"], None, tmp_path)
    assert (ran.returncode, ran.stdout) == (0, "0: one none\n"), ran.stderr
    # A directory that is not there is named, one task or several (it was "command not found").
    for tasks in (None, 2):
        ran = _srun(["-D", str(tmp_path / "gone"), "true"], tasks, tmp_path)
        assert (ran.returncode, ran.stderr) == (126, f"gpuq srun: {tmp_path / 'gone'}: No such file or directory\n")


def test_a_slurm_scripts_tasks_reach_its_job_and_what_it_asks_per_task_is_times_its_tasks(use_settings, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    script(tmp_path, "#!/bin/sh\n#SBATCH --ntasks-per-node=2 -c 3\n#SBATCH --gpus-per-task=1\nsrun python x.py\n",
           "ddp.sbatch")
    job = submitted(["ddp.sbatch"])
    assert (job["cpus"], job["gpus"]) == (6, 2), job
    with write_scope(use_settings) as session:
        env = session.get(Job, job["id"]).env
        assert (env["SLURM_NTASKS"], env["SLURM_NTASKS_PER_NODE"]) == ("2", "2"), env
        assert env["SLURM_GPUS_PER_TASK"] == "1", env  # its srun binds each task to its own GPU
    # The job's own where a #GPUQ line or the command line gives them; the tasks stay.
    script(tmp_path, "#!/bin/sh\n#SBATCH -n 2 -c 3 --gres=gpu:1\n#GPUQ --cpus 4\ntrue\n", "own.sbatch")
    job = submitted(["own.sbatch"])
    assert (job["cpus"], job["gpus"]) == (4, 1), job
    job = submitted(["--cpus", "1", "--env", "A=1", "ddp.sbatch"])
    assert (job["cpus"], job["gpus"]) == (1, 2), job
    with write_scope(use_settings) as session:
        assert session.get(Job, job["id"]).env["SLURM_NTASKS"] == "2"
    job = submitted(["--gpus", "2", "ddp.sbatch"])  # the command line's GPUs are the job's: no task's own
    with write_scope(use_settings) as session:
        assert job["gpus"] == 2 and "SLURM_GPUS_PER_TASK" not in session.get(Job, job["id"]).env
    # One task (none asked): no SLURM_NTASKS, which libraries read as srun's ranks.
    script(tmp_path, "#!/bin/sh\n#SBATCH -c 2\ntrue\n", "one.sbatch")
    job = submitted(["one.sbatch"])
    with write_scope(use_settings) as session:
        assert job["cpus"] == 2 and "SLURM_NTASKS" not in session.get(Job, job["id"]).env


def test_sbatchs_command_line_is_read_up_to_its_script_its_own_options_gpuq_submits():
    from gpuq.cli.sbatch_lines import CommandLine, command_line

    read = command_line(["-J", "next", "--parsable", "-D", "/w", "-p", "gpu", "--dependency=afterok:4", "--hold",
                         "--export=NONE", "next.sh", "-J", "its own"])
    assert read == CommandLine(submit=["--parsable", "--chdir", "/w"], wrap=None,
                               options=["-J", "next", "-p", "gpu", "--dependency", "afterok:4", "--hold",
                                        "--export", "NONE"], script=["next.sh", "-J", "its own"])
    assert command_line(["--wrap", "echo hi", "-W"]) == CommandLine(submit=["--wait"], wrap="echo hi")
    for argv, message in ((["--frob", "x"], "--frob: not an option sbatch has"), (["-J"], "-J needs a value")):
        with pytest.raises(InvalidSpec, match=message):
            command_line(argv)


def test_scontrol_in_a_job_expands_host_lists_as_a_ddp_script_asks_and_refuses_the_rest_naming_gpuqs_command():
    from gpuq.cli.scontrol import Refused, expand

    assert expand("vm") == ["vm"]
    assert expand("n[01-03,7]-ib,gpu") == ["n01-ib", "n02-ib", "n03-ib", "n7-ib", "gpu"]
    assert expand("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    for bad in ("n[1-", "n[3-1]", "n[a]", "n]1["):
        with pytest.raises(Refused):
            expand(bad)
    env = {**os.environ, "SLURM_JOB_NODELIST": "n[1-2]"}

    def scontrol(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpuq.cli.scontrol", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    # MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1), and the job's own list.
    assert scontrol("show", "hostnames", "n[1-2]").stdout == "n1\nn2\n"
    assert scontrol("show", "hostnames").stdout == "n1\nn2\n"
    assert scontrol("show", "hostlist", "a,b").stdout == "a,b\n"
    refused = scontrol("update", "JobId=5", "TimeLimit=10")
    assert refused.returncode == 2 and refused.stderr == ("gpuq scontrol: update JobId=5 TimeLimit=10: only `show "
                                                          "hostnames` and `show hostlist` run here, in a gpuq job; for "
                                                          "this, gpuq update\n"), refused.stderr
    # A requeue names a job, the job's own where none is given.
    refused = scontrol("requeue")
    assert refused.returncode == 2 and refused.stderr == "gpuq scontrol: requeue: name a job (no SLURM_JOB_ID here)\n"


def test_the_srun_shim_is_written_once_runnable_by_everyone_and_again_when_it_differs(tmp_path):
    from gpuq.service.slurm_bin import directory

    where = directory(tmp_path)
    shim = tmp_path / "slurm-bin" / "srun"
    assert where == str(shim.parent) and (shim.stat().st_mode & 0o777) == 0o755
    assert (shim.parent.stat().st_mode & 0o777) == 0o755 and "-m gpuq.cli.srun" in shim.read_text()
    before = shim.stat().st_ino
    directory(tmp_path)
    assert shim.stat().st_ino == before  # the same text: left as it is
    shim.write_text("#!/bin/sh\nexit 9\n")
    directory(tmp_path)
    assert "-m gpuq.cli.srun" in shim.read_text() and sorted(os.listdir(shim.parent)) == ["sbatch", "scontrol", "srun"]
    assert (shim.parent / "scontrol").stat().st_mode & 0o777 == 0o755
    ran = subprocess.run([str(shim), "-n", "1", "sh", "-c", "echo ran $0", "here"], capture_output=True, text=True,
                         timeout=60)
    assert (ran.returncode, ran.stdout) == (0, "ran here\n"), ran.stderr
    # A home it cannot write in (here a file, which even root cannot make a directory in): none, and
    # the job runs without it.
    (tmp_path / "a-file").write_text("")
    assert directory(tmp_path / "a-file") is None
