"""`gpuq alloc`: SLURM's salloc for one node. Waits for GPUs on the node it runs on, then runs
``$SHELL`` (or the command after ``--``) here, as the user, in this terminal, with the GPUs in
CUDA_VISIBLE_DEVICES; the allocation ends when it exits.

The allocation is a job of kind interactive (service/allocations.py), hosted by its first GPU's
worker (workers/allocation.py). This process keeps it alive: it says so to the server every third
of the ``alloc_keepalive`` setting. If it dies (ssh dropped, kill -9), the worker ends the
allocation within that setting plus about a second, and stops every process that carries its run
id, as it does at every end: the shell's exit, the time limit (warned of on the terminal first), or
`gpuq cancel`.

The shell finds gpuq's srun first on its PATH (cli/srun.py, kept in the user's cache directory by
service/slurm_bin.py), so that a step run as in salloc's shell, `srun python train.py`, runs its
command there, as the allocation's one task.
"""

from __future__ import annotations

import os
import pwd
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from types import FrameType
from typing import Annotated, Any

import typer

from gpuq.cli import numbers
from gpuq.cli.client import Client, Refused
from gpuq.cli.command_line import COMMAND_KEY, AllocCommand
from gpuq.cli.follow import HangUp, Waiting, end_line, exit_code_of, hang_up_raises, say
from gpuq.cli.submit import _cwd, typed
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.errors import GpuqError, InvalidSpec
from gpuq.service.job_cpus import CPUS_VARIABLE, THREADS_VARIABLE
from gpuq.service.settings import load_settings

app = typer.Typer()

# After the shell exits, how long to wait for the worker to confirm the end (it stops what the
# shell left behind first: SIGTERM, kill_grace, SIGKILL).
END_WAIT_SECONDS = 120.0


@app.command(cls=AllocCommand)
def alloc(
    ctx: typer.Context,
    gpus: Annotated[numbers.GpuAsk, typer.Option("--gpus", "-G", help="GPUs to hold (1), all on this node; TYPE:COUNT "
                                                 "(a100:2): COUNT of that --gpu-type.", parser=numbers.gpu_count,
                                                 show_default=False)]
    = numbers.ONE_GPU,
    gres: Annotated[numbers.GpuAsk | None, typer.Option(
        "--gres", help="salloc's gpu[:TYPE][:COUNT] (gpu:2, gpu:a100:2): the same as --gpus [TYPE:]COUNT.",
        show_default=False, parser=numbers.gres)] = None,
    gpu_type: Annotated[str | None, typer.Option("--gpu-type", help="Only GPUs of this model (a100, rtx3090), "
                                                 "as `gpuq devices` names them.")] = None,
    mem: Annotated[str | None, typer.Option(help="Free GPU memory needed on each GPU, e.g. 20G (with --shared: "
                                                 "the allocation's share).")] = None,
    shared: Annotated[bool, typer.Option("--shared", help="Share the GPU with other --shared jobs, by --mem.")]
    = False,
    cpus: Annotated[str | None, typer.Option("--cpus", "-c", help="CPU cores the shell's processes may use "
                                             "together, e.g. 4 or 0.5: reserved on its node.")] = None,
    time_limit: Annotated[str | None, typer.Option("--time", "-t", help="Time limit (2h, 30m, or SLURM's 90, 1:30:00, "
                                                                  "2-0:00): warned of 5 minutes before, then "
                                                                  "everything is stopped.")]
    = None,
    name: Annotated[str | None, typer.Option("--name", "-J", help="A name to know the allocation by.")] = None,
    priority: Annotated[int, typer.Option(help="Higher goes first (users up to the configured limit).",
                                          parser=numbers.integer)] = 0,
) -> None:
    """Hold GPUs on this node for a shell (or a command: `gpuq alloc jupyter lab`), as salloc does.

    `gpuq alloc --gpus 1 --time 2h` waits for a GPU here, then starts $SHELL with CUDA_VISIBLE_DEVICES,
    GPUQ_JOB_ID and GPUQ_ALLOC set; `exit` frees the GPU and everything started from the shell is
    stopped. `gpuq alloc --time 4h -- jupyter lab --no-browser --ip 127.0.0.1` holds it for a notebook.
    """
    command = ctx.meta.get(COMMAND_KEY)
    if command is not None and not command:
        raise InvalidSpec("no command given after --")
    cwd = _cwd()
    _check_program(command, cwd)
    if gres is not None:
        from click.core import ParameterSource

        if ctx.get_parameter_source("gpus") == ParameterSource.COMMANDLINE:
            raise InvalidSpec("give --gpus or --gres, not both")
        gpus = gres
    count, gpu_type = typed(gpus, gpu_type)
    body: dict[str, Any] = {"interactive": True, "command": command, "gpus": count, "gpu_type": gpu_type, "mem": mem,
                            "shared": shared, "cpus": cpus,
                            "time": time_limit, "name": name, "priority": priority, "node": load_settings().node,
                            "cwd": cwd, "key": uuid.uuid4().hex}
    client = Client()
    job_id = client.post("/jobs", body, retries=c.SUBMIT_RETRIES, ride_out=True)["jobs"][0]["id"]
    held = _wait_for_start(client, job_id)
    if held["state"] != State.RUNNING:
        raise typer.Exit(_report(client, job_id))
    raise typer.Exit(_hold(client, held, command))


def _check_program(command: list[str] | None, cwd: str) -> None:
    """Refuse, before anything is asked of the server, a command (or a shell) that could not start
    here: with the check and the line `gpuq submit` gives a command (service/spec.py), since this
    process runs it as a job's worker would, on this PATH, from ``cwd``. InvalidSpec (exit 2)."""
    from gpuq.service.spec import command_spec

    argv = command or [_shell()]
    try:  # a fixed name: the name the spec would make of the command is not the allocation's
        command_spec(argv, name="alloc", cwd=cwd, path=os.environ.get("PATH", os.defpath))
    except InvalidSpec as exc:
        if command:
            raise
        raise InvalidSpec(f"cannot run your shell: {exc}; set SHELL, or give a command after --") from None


def _shell() -> str:
    """The shell an allocation without a command runs: $SHELL, else the login shell."""
    return os.environ.get("SHELL") or _login_shell()


def _wait_for_start(client: Client, job_id: int) -> dict[str, Any]:
    """The allocation once it runs (or ended without running), saying it is alive meanwhile.
    Ctrl-C, SIGHUP or SIGTERM while it waits cancels it."""
    waiting = Waiting(job_id)
    with hang_up_raises():
        try:
            while True:
                # A server that restarts meanwhile is waited for (client.RIDE_OUT_SECONDS), as `gpuq
                # run` waits: the allocation keeps its place. A keepalive is safe to send again.
                held = client.post(f"/jobs/{job_id}/keepalive", ride_out=True)
                if held["state"] not in (State.PENDING, State.DISPATCHED):
                    waiting.clear()
                    return held
                waiting.show(held["state"], held["reason"])
                # Until the state changes, or it is time to say we are alive again.
                client.get(f"/jobs/{job_id}/output", ride_out=True, wait=min(held["keepalive_s"], 2.0),
                           state=held["state"])
        except KeyboardInterrupt:
            waiting.clear()
            _cancel_quietly(client, job_id)
            say(sys.stderr, f"\ngpuq: cancelled allocation {job_id} before it started\n")
            raise typer.Exit(c.EXIT_RUN_CANCELLED) from None
        except HangUp as hung:
            waiting.clear()
            _cancel_quietly(client, job_id)
            # A new line first: on a terminal the waiting line is cleared, in a log it ends there.
            say(sys.stderr, f"\ngpuq: {hung}: cancelled allocation {job_id} before it started\n")
            raise typer.Exit(hung.exit_code) from None


def _cancel_quietly(client: Client, job_id: int) -> None:
    try:
        client.post(f"/jobs/{job_id}/cancel")
    except GpuqError:
        pass


# What the server's answer may add to the shell's environment: where simulated GPUs keep their
# memory (service/simulated_memory.py), and the allocation's --cpus as a number and as OpenMP's
# threads (service/job_cpus.py; this terminal's OMP_NUM_THREADS wins). Nothing else: an answer
# forged over plain HTTP, or from a wrong GPUQ_SERVER, set LD_PRELOAD or BASH_ENV and ran its code
# as this user.
FROM_SERVER = ("GPUQ_SIMULATED_MEMORY_DIR", CPUS_VARIABLE, THREADS_VARIABLE)
_NUMBERS = re.compile(r"\d{1,4}(\.\d{1,2})?", re.ASCII)  # what FROM_SERVER's last two may be


def shell_env(held: dict[str, Any], base: Mapping[str, str]) -> dict[str, str]:
    """The environment the allocation's shell runs with: ``base`` (this terminal's), what of the
    server's answer ``FROM_SERVER`` lets through, and the allocation's own variables."""
    job_id = held["id"]
    given = {k: v for k, v in (held.get("env") or {}).items() if k in FROM_SERVER and isinstance(v, str)
             and (k == "GPUQ_SIMULATED_MEMORY_DIR" or _NUMBERS.fullmatch(v))}
    if THREADS_VARIABLE in base:
        given.pop(THREADS_VARIABLE, None)
    # Out of NVIDIA MPS: it serves one user at a time, and a shell's CUDA processes would keep other
    # users' jobs waiting, or wait for theirs (workers/mps.py).
    return dict(base, **given, CUDA_VISIBLE_DEVICES=",".join(map(str, held["gpu_indices"])),
                CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_MPS_PIPE_DIRECTORY=c.MPS_OUTSIDE,
                GPUQ_JOB_ID=str(job_id), GPUQ_RUN_ID=held["run_id"],
                GPUQ_ALLOC=str(job_id), GPUQ_GPUS=str(len(held["gpu_indices"])), GPUQ_NODE=held["node"] or "")


def _hold(client: Client, held: dict[str, Any], command: list[str] | None) -> int:
    """Run the shell (or ``command``) in this terminal while the allocation lasts; the exit code."""
    from gpuq.service.slurm_bin import for_user

    job_id = held["id"]
    env = shell_env(held, os.environ)
    gpus = env["CUDA_VISIBLE_DEVICES"]
    srun = for_user(os.environ)
    if srun is not None:  # a step as salloc's shell runs one, `srun python train.py`: the command, here
        env["PATH"] = srun + os.pathsep + env.get("PATH", os.defpath)
    argv = command or [_shell()]
    until = f" until {time.strftime('%H:%M:%S', time.localtime(held['deadline']))}" if held["deadline"] else ""
    say(sys.stderr, f"gpuq: allocation {job_id}: GPU {gpus} on {held['node']}{until}"
                    + ("; exit the shell to free it" if command is None else "") + "\n")
    try:
        # Behind the gate (cli/gate.py): the shell starts once its worker has put it in the
        # allocation's cgroup. Its signals are blocked from the fork on: the worker may find and
        # signal the gate before its Python has started.
        child = subprocess.Popen([sys.executable, *c.ALLOC_GATE_ARGS, "--", *argv], env=env,
                                 preexec_fn=_block_gate_signal)
    except OSError as exc:
        say(sys.stderr, f"gpuq: cannot run {argv[0]}: {exc.strerror}\n")
        client.post(f"/jobs/{job_id}/end", {"exit_code": 127})
        return _report(client, job_id, 127)
    keeper = _Keeper(client, held, child)
    keeper.start()

    hung_up: list[HangUp] = []

    def hang_up(signum: int, frame: FrameType | None) -> None:
        """SIGHUP or SIGTERM to this client ends the session: the shell (or command) is hung up, as a
        closed terminal would, and its exit ends the allocation (see ``_end_child``)."""
        if not hung_up:
            hung_up.append(HangUp(signum))
            threading.Thread(target=_end_child, args=(child, keeper.stop), name="hang-up", daemon=True).start()

    # The terminal's Ctrl-C and Ctrl-\ are the shell's to act on, not this process's.
    before = {s: signal.signal(s, _ignore) for s in (signal.SIGINT, signal.SIGQUIT)}
    before |= {s: signal.signal(s, hang_up) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:
        # As a command job's: -N for one killed by signal N, which the end then names (SIGKILL).
        code = child.wait()
    finally:
        keeper.stop.set()
        for s, handler in before.items():
            signal.signal(s, handler)
    if not keeper.ended.is_set():
        try:  # safe to send again: the server ignores an end of an ended allocation
            client.post(f"/jobs/{job_id}/end", {"exit_code": code}, ride_out=True)
        except Refused as exc:
            if exc.exit_code != c.EXIT_CONFLICT:
                raise
    ended = _report(client, job_id, code)
    if hung_up:  # this client was told to go: it says so, and exits as the signal says (129, 143)
        say(sys.stderr, f"gpuq: {hung_up[0]}: ended allocation {job_id}\n")
        return hung_up[0].exit_code
    return ended


def _block_gate_signal() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, c.ALLOC_GATE_SIGNALS)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A handler that does nothing: unlike SIG_IGN, exec resets it, so the shell gets its signals."""


def _login_shell() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


def _report(client: Client, job_id: int, code: int | None = None) -> int:
    """Wait for the allocation's end (its worker stops what is left first), say how it ended if it
    was not by the shell's own exit, and return the exit code."""
    deadline = time.monotonic() + END_WAIT_SECONDS
    state = None
    while True:
        end = client.get(f"/jobs/{job_id}/output", ride_out=True, after=2**31 - 1, wait=min(5.0, END_WAIT_SECONDS),
                         state=state)
        state = end["state"]
        if state in c.END_STATES:
            break
        if time.monotonic() >= deadline:
            say(sys.stderr, f"gpuq: allocation {job_id} has not ended yet ({state}); its worker is stopping what "
                            "it started\n")
            return _status(code) if code is not None else c.EXIT_RUN_GPUQ
    by_client = end.get("failure") in (None, c.FAILURE_EXIT) and end.get("exit_code") == code
    if by_client and code is not None:
        return _status(code)
    line = end_line(job_id, end)
    if line:
        say(sys.stderr, line + "\n")
    return exit_code_of(end)


def _status(code: int) -> int:
    """A shell's status for the shell's (or command's) exit: -N, killed by signal N, is 128+N."""
    return 128 - code if code < 0 else code


class _Keeper(threading.Thread):
    """Says the allocation's client is alive every ``keepalive_s``; warns on the terminal before
    its time limit; stops the shell when the allocation ended without it (time limit, cancel)."""

    def __init__(self, client: Client, held: dict[str, Any], child: subprocess.Popen[bytes]) -> None:
        super().__init__(name="keepalive", daemon=True)
        self.client, self.held, self.child = client, held, child
        self.stop = threading.Event()
        self.ended = threading.Event()

    def run(self) -> None:
        job_id, every = self.held["id"], self.held["keepalive_s"]
        deadline = self.held["deadline"]
        warn_at = None
        if deadline is not None:
            limit = deadline - time.time()
            warn_at = deadline - min(c.ALLOC_WARN_SECONDS, max(limit, 0) / 2)
        next_alive = time.monotonic() + every
        while not self.stop.wait(0.25):
            if warn_at is not None and time.time() >= warn_at:
                warn_at = None
                left = max(deadline - time.time(), 0)
                say(sys.stderr, f"\ngpuq: allocation {job_id} ends in {_minutes(left)} (its --time); "
                                "then everything started in it is stopped\n")
            if time.monotonic() < next_alive:
                continue
            next_alive = time.monotonic() + every
            try:
                now = self.client.post(f"/jobs/{job_id}/keepalive")
            except GpuqError as exc:  # the server restarting: try again next time
                say(sys.stderr, f"gpuq: allocation {job_id}: could not reach the server ({exc}); trying again\n")
                continue
            if now["state"] in c.END_STATES:
                self.ended.set()
                self._stop_child()
                return

    def _stop_child(self) -> None:
        """The worker stops the allocation's processes by their run id; the shell, if it is still
        here (a worker that died cannot), is stopped here too."""
        _end_child(self.child, self.stop)


# How the client ends its shell or command: hung up, as a closed terminal would; then, if it is
# still there (an interactive shell ignores SIGTERM, and a command started under nohup inherits
# SIGHUP ignored), terminated, then killed. What it left behind is the worker's to stop.
_ENDING = ((signal.SIGHUP, 2.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0))


def _end_child(child: subprocess.Popen[bytes], done: threading.Event) -> None:
    """End ``child`` as ``_ENDING`` says; ``done`` set (the child was reaped) stops it early."""
    for sig, wait in _ENDING:
        if child.poll() is not None:
            return
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            return
        if done.wait(wait):
            return


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
