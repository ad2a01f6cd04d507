"""CLI habits: shell completion, `gpuq config`, the config file, --json on every read command, and
progress bars on a terminal only."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from gpuq.cli.app import app
from gpuq.service import constants as c
from gpuq.service import jobs, spec, submitting
from gpuq.service.constants import State
from gpuq.service.errors import ConfigError
from gpuq.service.settings import load_settings, setting_sources
from tests.conftest import run_cli, settings_env
from tests.test_end_to_end import output_of, submit, wait_for_state

pytestmark = pytest.mark.timeout(180)

# Commands that change things or run services; every other command reads, and must take --json.
NOT_READ = {"cancel", "hold", "release", "requeue", "update", "drain", "resume", "retire", "up", "down", "reconfigure",
            "unit",  # a systemd unit file, not a document of the queue
            "worker", "scheduler", "db",
            "server", "dashboard",  # a server, like worker and scheduler: it prints no document
            "run", "attach", "alloc",  # the job's own output, or a shell: in the terminal, as it comes
            "sbatch"}  # sbatch's words, "Submitted batch job N", as sbatch says them (gpuq submit --json)


def gpuq(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_show_completion_prints_a_bash_script_and_the_protocol_completes_commands_and_options():
    env = {**os.environ, "GPUQ_CONFIG": "/nonexistent/gpuq.toml"}
    # The shell is told from the command's parents: run from bash, whatever started the tests.
    script = subprocess.run(["bash", "-c", '"$@"; exit $?', "bash", sys.executable, "-m", "gpuq.cli",
                             "--show-completion"], env=env, capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "_GPUQ_COMPLETE=complete_bash" in script.stdout, script.stderr
    words = gpuq([], {**env, "_GPUQ_COMPLETE": "complete_bash", "COMP_WORDS": "gpuq res", "COMP_CWORD": "1"})
    assert words.stdout.split() == ["resubmit", "resume"]
    options = gpuq([], {**env, "_GPUQ_COMPLETE": "complete_bash", "COMP_WORDS": "gpuq submit --snap",
                        "COMP_CWORD": "2"})
    assert options.stdout.split() == ["--snapshot"]


@pytest.mark.parametrize("args,option", [(["wait", "--timeout", "-1", "1"], "--timeout"),
                                         (["up", "--timeout", "0"], "--timeout"),
                                         (["down", "--grace", "-1"], "--grace")])
def test_a_negative_wait_or_grace_is_refused_as_bad_input_before_anything_runs(tmp_path, args, option):
    # Refused by the option itself: `wait --timeout -1` used to wait once and report a timeout
    # (exit 5), and no stack is started or stopped with a limit that makes no sense.
    env = {**os.environ, "GPUQ_HOME": str(tmp_path), "GPUQ_CONFIG": "/nonexistent/gpuq.toml",
           "GPUQ_SOCKET": str(tmp_path / "none.sock")}
    done = gpuq(args, env)
    assert done.returncode == c.EXIT_USAGE, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing started, nothing written


_ORPHAN = """
import os, subprocess, sys, time
if os.fork():
    os._exit(0)  # the parent leaves: the child is init's (or a subreaper's) now
time.sleep(0.5)
done = subprocess.run([sys.executable, "-m", "gpuq.cli", "--show-completion"], capture_output=True, text=True)
out = sys.argv[1]
with open(out + ".tmp", "w") as f:
    f.write(f"{done.returncode}\\n{done.stderr}")
os.rename(out + ".tmp", out)
"""


def test_show_completion_with_no_shell_among_its_parents_says_so_in_one_line(tmp_path):
    if Path("/proc/1/comm").read_text().strip() in ("sh", "bash", "dash", "zsh", "fish"):
        pytest.skip("a shell is this machine's init: an orphan's parent is a shell here")
    out = tmp_path / "out"
    env = {**os.environ, "GPUQ_CONFIG": "/nonexistent/gpuq.toml"}
    subprocess.run([sys.executable, "-c", _ORPHAN, str(out)], env=env, check=True, timeout=30)
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    returncode, _, stderr = out.read_text().partition("\n")
    if returncode == "0":
        pytest.skip("a shell was found among the orphan's parents (a subreaper that is a shell)")
    assert returncode == "2", stderr
    assert stderr.startswith("gpuq: cannot tell which shell this is") and stderr.count("\n") == 1, stderr


def test_install_completion_writes_the_script_and_sources_it_from_bashrc(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash", "GPUQ_CONFIG": "/nonexistent/gpuq.toml"}
    out = gpuq(["--install-completion", "bash"], env)
    assert out.returncode == 0, out.stderr
    script = tmp_path / ".bash_completions" / "gpuq.sh"
    assert "_GPUQ_COMPLETE=complete_bash" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()


def test_the_config_file_lives_in_xdg_config_home_and_env_beats_file_beats_default(tmp_path):
    cfg = tmp_path / "xdg" / "gpuq" / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('fake_gpus = 3\nkill_grace = 4\n')
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "GPUQ_KILL_GRACE": "7"}
    settings, path, sources = setting_sources(env)
    assert path == cfg
    assert (settings.fake_gpus, sources["fake_gpus"]) == (3, "file")
    assert (settings.kill_grace, sources["kill_grace"]) == (7.0, "env")
    assert (settings.redis_port, sources["redis_port"]) == (6379, "default")
    assert load_settings({**env, "GPUQ_CONFIG": str(tmp_path / "other.toml")}).fake_gpus == 0


def test_gpuq_config_names_the_file_the_source_of_each_setting_and_masks_secrets(tmp_path):
    cfg = tmp_path / "gpuq.toml"
    cfg.write_text('broker_url = "redis://:hunter2@127.0.0.1:6379/13"\nfake_gpus = 2\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    # A socket no server listens on: the local view. (Left to look where it likes, the client finds
    # a root stack's /run/gpuq/gpuq.sock where one is up, and shows that server's settings.)
    env.update(GPUQ_CONFIG=str(cfg), GPUQ_DATABASE_URL="postgresql+psycopg://ann:s3cret@db.lab/gpuq",
               GPUQ_HOME=str(tmp_path / "home"), GPUQ_SOCKET=str(tmp_path / "no-server.sock"))
    text = gpuq(["config"], env)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == f"config file: {cfg}"
    lines = {ln.split()[0]: ln.split()[1:] for ln in text.stdout.splitlines()[1:]}
    assert lines["GPUQ_DATABASE_URL"] == ["env", "postgresql+psycopg://ann:***@db.lab/gpuq"]
    assert lines["GPUQ_BROKER_URL"] == ["file", "redis://:***@127.0.0.1:6379/13"]
    assert lines["GPUQ_FAKE_GPUS"] == ["file", "2"] and lines["GPUQ_REDIS_PORT"] == ["default", "6379"]
    assert lines["GPUQ_SNAPSHOT_DIR"] == ["default", str(tmp_path / "home" / "snapshots")]
    as_json = gpuq(["config", "--json"], env)
    data = json.loads(as_json.stdout)
    assert data["config_file"] == str(cfg) and data["config_file_exists"] is True
    assert data["settings"]["home"] == {"value": str(tmp_path / "home"), "source": "env", "env": "GPUQ_HOME"}
    for out in (text.stdout, as_json.stdout):
        assert "hunter2" not in out and "s3cret" not in out


@pytest.mark.parametrize("content,says", [('kill_grace = "x\n', "cannot read config file"),
                                          ("colour = 1\n", "unknown setting 'colour' in"),
                                          ("max_pending_per_usr = 5\n", "(did you mean max_pending_per_user?)"),
                                          ('GPUQ_MAX_TIME = "2h"\n', "(did you mean max_time? the file takes the "
                                                                     "settings' names, without GPUQ_)"),
                                          ("fake_gpus = -2\n", "must not be negative")])
def test_a_bad_config_file_is_one_line_and_exit_78_for_any_command(tmp_path, content, says):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(content)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}, "GPUQ_CONFIG": str(cfg)}
    for command in (["config"], ["status"]):
        out = gpuq(command, env)
        assert out.returncode == c.EXIT_CONFIG == 78
        assert out.stderr.count("\n") == 1 and says in out.stderr and out.stdout == ""
    with pytest.raises(ConfigError):
        load_settings({"GPUQ_CONFIG": str(cfg)})


def test_every_read_command_takes_json_and_prints_parseable_json(use_settings, tmp_path):
    settings = use_settings
    job = submitting.submit(settings, spec.command_spec(["echo", "hi"], cwd=str(tmp_path)))
    jobs.cancel(settings, job.id, user=job.user)
    group = get_command(app)
    ctx = click.Context(group)
    commands = {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}
    read_commands = sorted(name for name in commands if name not in NOT_READ)
    assert {"status", "show", "logs", "why", "devices", "stats", "workloads", "config", "wait"} <= set(read_commands)
    args = {"show": [str(job.id)], "logs": [str(job.id)], "why": [str(job.id)], "wait": [str(job.id)],
            "resubmit": [str(job.id)], "submit": ["--", "true"]}
    runner = CliRunner()
    for name in read_commands:
        params = {opt for p in commands[name].params for opt in getattr(p, "opts", [])}
        assert "--json" in params, f"gpuq {name} has no --json"
        result = runner.invoke(app, [name, "--json", *args.get(name, [])])
        assert result.exit_code in (0, c.EXIT_JOB_FAILED), (name, result.output)
        json.loads(result.stdout)  # raises on anything but one JSON document


# ---- progress bars, against a stack running a real training job ------------------------------------

def in_pty(args: list[str], settings, timeout: float = 120) -> tuple[int, str]:
    """Run `gpuq ARGS` with its stdin, stdout and stderr on a pseudo-terminal; its exit code and all
    it wrote there."""
    master, slave = os.openpty()
    env = {**settings_env(settings), "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=env)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(10), b"".join(chunks).decode(errors="replace")


TRAIN = ["train", "--model", "lenet", "--epochs", "3", "--batch-size", "64", "--train-size", "256",
         "--test-size", "64", "--lr", "0.5"]


def test_logs_follow_of_a_training_job_shows_an_epoch_bar_on_a_terminal_only(stack):
    s = stack.settings
    job_id = submit(s, TRAIN)
    code, screen = in_pty(["logs", "-f", str(job_id)], s)
    assert code == 0, screen
    assert wait_for_state(s, job_id, c.END_STATES) == State.SUCCEEDED, stack.logs()
    assert "epoch 3/3" in screen and "3/3" in screen.split("epoch 3/3")[-1]  # the bar: text, then M/N
    assert "━" in screen and "\x1b[" in screen
    assert "epoch 1/3: loss" in screen  # the job's own output, above the bar
    piped = run_cli(["logs", "-f", str(job_id)], s)
    assert piped.stdout == output_of(s, job_id) and "━" not in piped.stderr + piped.stdout
    forced = run_cli(["logs", "-f", "--progress", str(job_id)], s)
    assert "epoch 3/3" in forced.stdout.replace(output_of(s, job_id), "")


def test_wait_shows_a_bar_of_jobs_ended_on_a_terminal_and_plain_lines_in_a_pipe(stack):
    s = stack.settings
    ids = [submit(s, ["--", sys.executable, "-c", f"import time; time.sleep({t})"]) for t in (0.5, 1.5)]
    code, screen = in_pty(["wait", *map(str, ids)], s)
    assert code == 0, screen
    assert "2 of 2 jobs ended" in screen and "━" in screen
    assert f"job {ids[0]} succeeded" in screen
    piped = run_cli(["wait", *map(str, ids)], s)
    assert piped.returncode == 0
    assert piped.stdout == "".join(f"job {i} succeeded\n" for i in ids) and piped.stderr == ""
    forced = run_cli(["wait", "--progress", *map(str, ids)], s)
    assert "2 of 2 jobs ended" in forced.stderr


def test_show_writes_a_workloads_empty_or_spaced_parameters_as_a_shell_would_take_them(use_settings, tmp_path):
    (tmp_path / "my runs").mkdir()
    runner = CliRunner()
    made = runner.invoke(app, ["submit", "--hold", "--gpus", "2", "train", "--strategy", "ddp",
                               "--checkpoint", str(tmp_path / "my runs" / "a.pt")], prog_name="gpuq")
    assert made.exit_code == 0, made.output
    runs = next(line for line in runner.invoke(app, ["show", "1"]).output.splitlines() if "runs" in line)
    assert "--data-dir ''" in runs and "  --" not in runs
    assert f"--checkpoint '{tmp_path}/my runs/a.pt'" in runs


def test_version_prints_gpuqs_version_and_exits_0():
    from gpuq import __version__

    done = subprocess.run([sys.executable, "-m", "gpuq.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"gpuq {__version__}\n", "")


def test_run_does_not_offer_the_options_it_refuses_and_refuses_them_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    offered = CliRunner().invoke(app, ["run", "--help"]).output
    assert "--detach" in offered and not any(o in offered for o in ("--array", "--sweep", "--json")), offered
    assert all(o in CliRunner().invoke(app, ["submit", "--help"]).output for o in ("--array", "--sweep", "--json"))
    for args in (["--array", "0-1"], ["--sweep", "lr=1,2"]):
        refused = CliRunner().invoke(app, ["run", *args, "--", "true"])
        assert refused.exit_code == c.EXIT_USAGE and refused.output == (
            "gpuq: gpuq run follows one job; queue an array or a sweep with gpuq submit\n"), refused.output


def test_a_reader_that_goes_away_ends_gpuq_as_sigpipe_would_with_141_and_nothing_said(use_settings):
    # `gpuq status | head -1` whose head has gone: click exited 1, gpuq's own failure to a
    # `set -o pipefail` script, where a shell reports a program SIGPIPE ended (and `gpuq run`) 141.
    for args in (["--help"], ["status"], ["workloads"]):
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run([sys.executable, "-m", "gpuq.cli", *args], stdout=write, stderr=subprocess.PIPE,
                                  text=True, timeout=60)
        finally:
            os.close(write)
        assert (done.returncode, done.stderr) == (141, ""), args


def test_sbatchs_short_options_mean_in_submit_and_alloc_what_they_mean_to_slurm_users(use_settings):
    from tests.test_scheduling import register

    s = use_settings
    register(s, s.node, 2)
    out = run_cli(["submit", "--json", "-G", "2", "-J", "train", "-t", "1:30:00", "-H", "-w", s.node, "-a", "0-3%2",
                   "--", "true"], s)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert [(j["gpus"], j["name"], j["time_limit_s"], j["held"], j["on_node"], j["array_limit"]) for j in made] == [
        (2, f"train[{i}]", 5400, True, s.node, 2) for i in range(4)]
    for command in ("submit", "run", "alloc"):
        shown = run_cli([command, "--help"], s).stdout
        assert "-G, --gpus" in shown and "-t, --time" in shown and "-J, --name" in shown, command


def test_sbatchs_gres_and_wrap_ask_for_gpus_and_run_a_shell_line_and_misuse_is_one_line(use_settings, tmp_path):
    from tests.test_scheduling import register

    s = use_settings
    register(s, s.node, 2)
    out = run_cli(["submit", "--json", "--hold", "--gres", "gpu:simulated:2", "--wrap", "echo a && echo $B"], s,
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert (job["argv"], job["gpus"], job["gpu_type"]) == (["sh", "-c", "echo a && echo $B"], 2, "simulated")
    for args, says in [(["--gres", "gpu:2", "--gpus", "1", "--", "true"], "give --gpus or --gres, not both"),
                       (["--gres", "shard:1", "--", "true"], "Invalid value for '--gres': 'shard:1': GPUs are the one"),
                       (["--gres", "gpu:a100:x", "--", "true"], "Invalid value for '--gres': 'a100:x' is not a GPU"),
                       (["--wrap", "true", "--", "true"], "give --wrap or a command after --, not both"),
                       (["--wrap", "true", "matmul"], "give --wrap or a workload, not both"),
                       (["--wrap", "true", "python3", "x.py"], "give --wrap or a command, not both"),
                       (["--wrap", " "], "--wrap: the command line is empty")]:
        refused = run_cli(["submit", *args], s, cwd=tmp_path)
        assert refused.returncode == c.EXIT_USAGE and refused.stderr.startswith(f"gpuq: {says}"), (args,
                                                                                                  refused.stderr)
        assert refused.stderr.count("\n") == 1
    refused = run_cli(["alloc", "--gres", "gpu:1", "--gpus", "2"], s, cwd=tmp_path)
    assert (refused.returncode, refused.stderr) == (c.EXIT_USAGE, "gpuq: give --gpus or --gres, not both\n")
    from sqlalchemy import select

    from gpuq.service.db import write_scope
    from gpuq.service.models import Job

    with write_scope(s) as session:
        assert session.scalars(select(Job.id)).all() == [job["id"]]  # nothing written by a refusal


def test_a_wrapped_shell_line_runs_as_its_job_through_gpuq_run(stack):
    done = run_cli(["run", "--gres", "gpu", "--wrap", "echo one && echo two >&2; exit 3"], stack.settings)
    assert (done.returncode, done.stdout, done.stderr) == (3, "one\n", "two\n")


def test_cancel_by_name_and_state_takes_only_my_jobs_that_match_as_scancel_n_and_t(use_settings, tmp_path):
    from tests.test_scheduling import register

    s = use_settings
    register(s, s.node, 1)

    def made(*args: str) -> list[int]:
        out = run_cli(["submit", "--json", "--hold", *args, "--", "true"], s, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        return [j["id"] for j in (got if isinstance(got, list) else [got])]

    sweep, other = made("-J", "sweep", "-a", "0-2"), made("-J", "other")
    swept = run_cli(["cancel", "-n", "sweep"], s)
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout.splitlines() == [f"job {j} cancelled" for j in sweep]
    running = run_cli(["cancel", "--name", "oth*", "--state", "running"], s)
    assert (running.returncode, running.stdout) == (0, "no active jobs to cancel\n")
    pending = run_cli(["cancel", "-n", "oth*", "-t", "pending"], s)
    assert pending.stdout.splitlines() == [f"job {other[0]} cancelled"]
    for args, says in [(["-t", "held"], "--state takes pending or running; got 'held'"),
                       (["-n", " "], "--name needs a name or a pattern"),
                       ([str(other[0]), "-n", "x"], "--name and --state choose among all your jobs")]:
        refused = run_cli(["cancel", *args], s)
        assert refused.returncode == c.EXIT_USAGE and refused.stderr.startswith(f"gpuq: {says}"), refused.stderr
