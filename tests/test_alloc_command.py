"""`gpuq alloc` checks the command it will run (or the shell) before it asks the server for
anything, as `gpuq submit` checks a job's command: a program that could not start is one line on
stderr, exit 2, and nothing queued, not an allocation granted and then failed with 127. And the
gate the shell starts behind (cli/gate.py) waits for its worker's word."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from sqlalchemy import func, select

from gpuq.service import constants as c
from gpuq.service.db import read_scope
from gpuq.service.models import Job
from gpuq.workers.core_binding import held_to_cpus
from tests.conftest import run_cli, stack_on_database

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["sqlite"])
def one_gpu(request, tmp_path_factory, redis_url):
    """A stack with a free GPU: an allocation asked for would be granted at once."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1)


def _jobs(settings) -> int:
    with read_scope(settings) as session:
        return session.scalar(select(func.count()).select_from(Job))


def test_alloc_of_a_command_that_cannot_start_is_refused_as_submit_refuses_it_and_queues_nothing(one_gpu, tmp_path):
    s = one_gpu.settings
    before = _jobs(s)
    (tmp_path / "notes.txt").write_text("not a program\n")
    for command in (["gpuq-no-such-command", "--flag"], ["./no-such-script.sh"], ["./notes.txt"]):
        submitted = run_cli(["submit", "--", *command], s, cwd=tmp_path)
        allocated = run_cli(["alloc", "--", *command], s, cwd=tmp_path)
        assert allocated.returncode == submitted.returncode == c.EXIT_USAGE, allocated.stderr
        assert allocated.stderr == submitted.stderr, (allocated.stderr, submitted.stderr)
        assert allocated.stderr.count("\n") == 1 and allocated.stdout == ""
    for named in (["alloc", "--", "gpuq-no-such-command"], ["alloc", "-G", "1", "gpuq-no-such-command", "-G", "2"]):
        assert run_cli(named, s).stderr == "gpuq: command not found: gpuq-no-such-command (not on PATH)\n", named
    assert _jobs(s) == before


def test_alloc_of_a_shell_that_cannot_start_says_to_set_shell_and_queues_nothing(one_gpu, tmp_path):
    s = one_gpu.settings
    before = _jobs(s)
    out = run_cli(["alloc"], s, cwd=tmp_path, extra_env={"SHELL": "/nonexistent/bin/zsh"})
    assert out.returncode == c.EXIT_USAGE and out.stdout == ""
    assert out.stderr == (f"gpuq: cannot run your shell: /nonexistent/bin/zsh is not an executable file (from "
                          f"{tmp_path}); set SHELL, or give a command after --\n")
    assert _jobs(s) == before
    # A shell that can start still gets its allocation.
    ran = run_cli(["alloc"], s, cwd=tmp_path, extra_env={"SHELL": "true"})
    assert ran.returncode == 0, ran.stderr
    assert _jobs(s) == before + 1


def test_alloc_takes_a_command_named_without_dashes_as_salloc_does_every_word_after_it_its_own(one_gpu, tmp_path):
    ran = run_cli(["alloc", "--time", "5m", "sh", "-c", "echo held $1; exit 3", "sh", "--time"], one_gpu.settings,
                  cwd=tmp_path)
    assert (ran.returncode, ran.stdout) == (3, "held --time\n"), ran.stderr
    assert "until" in ran.stderr  # its time limit, 5 minutes from now, was gpuq's


def test_the_shell_takes_from_the_servers_answer_only_simulated_memory_and_its_cores_as_numbers():
    # An answer forged over plain HTTP (or from a wrong GPUQ_SERVER) set LD_PRELOAD and BASH_ENV in
    # the user's shell: code of the forger's, run as them.
    from gpuq.cli.alloc import FROM_SERVER, shell_env
    from gpuq.service import simulated_memory

    assert FROM_SERVER == (simulated_memory.ENV_VARIABLE, "GPUQ_CPUS", "OMP_NUM_THREADS")
    held = {"id": 7, "gpu_indices": [0, 2], "run_id": "r1", "node": "n1",
            "env": {"LD_PRELOAD": "/tmp/evil.so", "BASH_ENV": "/tmp/evil.sh", "PATH": "/tmp/evil",
                    simulated_memory.ENV_VARIABLE: "/var/lib/gpuq/simulated-gpu-memory", "OTHER_DIR": 3,
                    "GPUQ_CPUS": "2.5", "OMP_NUM_THREADS": "2"}}
    env = shell_env(held, {"PATH": "/usr/bin", "HOME": "/home/ann"})
    assert env == {"PATH": "/usr/bin", "HOME": "/home/ann",
                   simulated_memory.ENV_VARIABLE: "/var/lib/gpuq/simulated-gpu-memory",
                   "GPUQ_CPUS": "2.5", "OMP_NUM_THREADS": "2",
                   "CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                   "CUDA_MPS_PIPE_DIRECTORY": "/nonexistent/gpuq-outside-mps", "GPUQ_JOB_ID": "7",
                   "GPUQ_RUN_ID": "r1", "GPUQ_ALLOC": "7", "GPUQ_GPUS": "2", "GPUQ_NODE": "n1"}
    # The terminal's own OpenMP threads win; a value that is not a number never reaches the shell.
    assert shell_env(held, {"OMP_NUM_THREADS": "16"})["OMP_NUM_THREADS"] == "16"
    forged = dict(held, env={"GPUQ_CPUS": "2; rm -rf ~", "OMP_NUM_THREADS": "$(evil)"})
    assert not {"GPUQ_CPUS", "OMP_NUM_THREADS"} & set(shell_env(forged, {}))


def _gate(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The gate as `gpuq alloc` starts it: its signals blocked from the fork on."""
    return subprocess.Popen([sys.executable, *c.ALLOC_GATE_ARGS, "--", *argv], text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, c.ALLOC_GATE_SIGNALS))


def test_the_gate_starts_the_shell_in_its_own_process_only_once_the_worker_signals():
    # Signalled at once, before its Python is up (the worker may find it that soon): it still
    # waits, then runs the command in the same process (the pid the worker placed).
    gate = _gate("sh", "-c", "echo ran as $$")
    try:
        gate.send_signal(c.ALLOC_GATE_SIGNAL)
        out, err = gate.communicate(timeout=20)
    finally:
        gate.kill()
    assert (gate.returncode, out.strip(), err) == (0, f"ran as {gate.pid}", "")
    held = _gate("sh", "-c", "echo ran")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            held.communicate(timeout=1.5)  # no signal yet: the shell has not started
        held.send_signal(c.ALLOC_GATE_SIGNAL)
        assert held.communicate(timeout=20)[0] == "ran\n"
    finally:
        held.kill()


def test_the_gate_says_on_the_terminal_when_its_worker_could_not_hold_the_shell_to_its_cpus():
    env = dict(os.environ, GPUQ_CPUS="2.5", GPUQ_NODE="n1")
    unheld = _gate("sh", "-c", "echo ran", env=env)
    unheld.send_signal(c.ALLOC_GATE_UNHELD_SIGNAL)
    out, err = unheld.communicate(timeout=20)
    assert (unheld.returncode, out) == (0, "ran\n")
    assert err == "gpuq: --cpus 2.5 is not held to on n1: its worker may make no CPU cgroup\n"
    held = _gate("sh", "-c", "echo ran", env=env)  # held: not a word
    held.send_signal(c.ALLOC_GATE_SIGNAL)
    assert held.communicate(timeout=20) == ("ran\n", "")


@pytest.mark.parametrize("answer, told", [("0-1,4", "0-1,4"), ("0,1,2,4", "0-2,4"), ("0-1; rm -rf ~", ""), ("3-1", ""),
                                          ("", ""), (None, ""), (7, "")])
def test_the_gate_tells_the_shell_its_cores_as_the_server_says_them_and_nothing_else(tmp_path, answer, told):
    """Once let through, an allocation with --cpus asks the server for its cores; what is not a list
    of cores (a forged answer, none: not bound) is not put in the shell's environment."""
    import http.server
    import json
    import socketserver
    import threading

    asked: list[str] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = json.dumps({"id": 7, "cores": answer}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class UnixHTTP(socketserver.UnixStreamServer):
        def get_request(self):  # BaseHTTPRequestHandler wants an address pair
            conn, _ = super().get_request()
            return conn, ("local", 0)

    path = str(tmp_path / "s.sock")
    with UnixHTTP(path, Answer) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env = dict(os.environ, GPUQ_CPUS="2", GPUQ_JOB_ID="7", GPUQ_SERVER=f"unix:{path}")
        gate = _gate("sh", "-c", "echo \"cores=$GPUQ_CORES\"", env=env)
        gate.send_signal(c.ALLOC_GATE_SIGNAL)
        out, err = gate.communicate(timeout=20)
        server.shutdown()
    assert (gate.returncode, out, err) == (0, f"cores={told}\n", "")
    assert asked == ["/v1/jobs/7"]


def test_the_worker_lets_the_gate_through_as_unheld_only_where_cpus_were_asked_and_no_quota_holds_them():
    quota = SimpleNamespace(cpus=2.5)
    assert held_to_cpus(None, None) and held_to_cpus(2.5, quota)
    assert not held_to_cpus(2.5, None) and not held_to_cpus(2.5, SimpleNamespace(cpus=None))


def test_the_gate_says_in_one_line_what_it_cannot_run():
    gate = _gate("/nonexistent/gpuq-shell")
    gate.send_signal(c.ALLOC_GATE_SIGNAL)
    out, err = gate.communicate(timeout=20)
    assert (gate.returncode, out) == (127, "")
    assert err == "gpuq: cannot run /nonexistent/gpuq-shell: No such file or directory\n"
