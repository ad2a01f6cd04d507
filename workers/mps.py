"""NVIDIA MPS on a node: where an MPS control daemon runs, a shared job's CUDA allocations beyond
its share are refused by the driver itself (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), on top of the
worker's watchdog, which stops a job only after it went over.

MPS runs one server per user at a time for the whole node: while one user's processes are its
clients, another user's client waits, inside its first CUDA call, until they have all ended. On
the lent H100 (driver 580) a root stack's warm worker, an MPS client itself, so kept every other
user's job waiting for ever; and a job that asked the daemon at its start was let in while
another user's job, started three seconds before, was still importing torch, which then waited
51 s for it. So gpuq keeps its own processes out of MPS (``keep_out``), only shared command jobs
join it (allocations' shells stay out too: cli/alloc.py), and one joins only while no other
user's shared command is placed on the node (SQL, where a placement is written before its job
starts) and the daemon serves no other user; else it runs outside MPS, with a CUDA context of its
own beside the MPS server's, held to its share by the watchdog, and its output says so
(``placement``).
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuq.service import constants as c

# The default pipe directory of `nvidia-cuda-mps-control -d`; CUDA_MPS_PIPE_DIRECTORY moves it.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
OUTSIDE = c.MPS_OUTSIDE  # where CUDA finds no daemon
# How long the daemon's control may take to answer one question.
CONTROL_TIMEOUT = 5.0

# The daemon's pipe directory as this process found it before keep_out() pointed CUDA away.
_daemon_directory: str | None = None


@dataclass(frozen=True)
class Server:
    """One MPS server of the node: the user it serves and how many clients it has now."""

    pid: int
    uid: int
    clients: int


@dataclass(frozen=True)
class Placement:
    """The variables a job's processes get for MPS and, when it is kept out, the line saying why."""

    env: dict[str, str]
    note: str | None = None


def pipe_directory() -> str:
    """Where this node's MPS daemon, if any, has its control."""
    if _daemon_directory is not None:
        return _daemon_directory
    return os.environ.get(PIPE_VARIABLE) or DEFAULT_PIPE_DIRECTORY


def running(directory: str | None = None) -> bool:
    """Whether an MPS control daemon listens here: its ``control`` exists, a named pipe in older
    drivers and a Unix socket in newer ones (driver 580 on the lent H100)."""
    try:
        mode = (Path(directory or pipe_directory()) / "control").stat().st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:
        return False


def keep_out() -> None:
    """Keep this process (a worker, before its first CUDA call) out of MPS: its warm CUDA context
    lives as long as it does, and as an MPS client of its user (root on a machine's stack) it would
    keep every other user's job waiting in its first CUDA call."""
    global _daemon_directory
    if _daemon_directory is None:
        _daemon_directory = pipe_directory()
    os.environ[PIPE_VARIABLE] = OUTSIDE


def memory_limit_env(gpus: int, share_mib: int) -> dict[str, str]:
    """The variable that pins a client's device memory on each of its ``gpus`` visible GPUs (CUDA
    numbers them 0.. in the order CUDA_VISIBLE_DEVICES lists them) to ``share_mib``."""
    return {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{i}={share_mib}M" for i in range(gpus))}


def servers(directory: str) -> list[Server] | None:
    """The node's MPS servers, asked of the daemon with its own program; None if it did not answer."""
    listed = _ask(directory, "get_server_list")
    if listed is None:
        return None
    found = []
    for pid in listed:
        clients = _ask(directory, f"get_client_list {pid}")
        try:
            uid = os.stat(f"/proc/{pid}").st_uid  # a server runs as the user it serves
        except OSError:
            continue  # it has just exited
        if clients is None:
            return None
        found.append(Server(pid, uid, len(clients)))
    return found


def _ask(directory: str, question: str) -> list[int] | None:
    """The numbers (pids) the daemon answers ``question`` with, one a line."""
    try:
        done = subprocess.run(["nvidia-cuda-mps-control"], input=question + "\n", capture_output=True, text=True,
                              timeout=CONTROL_TIMEOUT, env={**os.environ, PIPE_VARIABLE: directory})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def placement(uid: int, gpus: int, share_mib: int | None, others: Callable[[], Collection[str]],
              ask: Callable[[str], list[Server] | None] | None = None) -> Placement:
    """MPS for a command job whose processes run as ``uid`` on ``gpus`` GPUs.

    Only a shared job (``share_mib``: its share and context reserve, what the driver pins it to on
    each GPU) joins the daemon, and only while neither gpuq's other shared commands on this node
    (``others()``: their owners, other than the job's; from SQL, so a job placed a moment ago
    counts before its first CUDA call; asked only of a shared job beside a daemon) nor the daemon
    (``ask``, default ``servers``: programs outside gpuq too) have another user's clients. Every
    other job stays out: a whole GPU gains nothing from MPS, and a client would keep other users'
    jobs waiting."""
    directory = pipe_directory()
    if not running(directory):
        return Placement({})
    if share_mib is None:
        return Placement({PIPE_VARIABLE: OUTSIDE})
    if users := others():
        return _outside(_serving(sorted(users)))
    found = (ask or servers)(directory)
    if found is None:
        return _outside("this node's MPS daemon did not say whom it serves")
    clients = sorted({s.uid for s in found if s.uid != uid and s.clients > 0})
    if clients:
        return _outside(_serving(map(_name, clients)))
    return Placement({PIPE_VARIABLE: directory, **memory_limit_env(gpus, share_mib)})


def _serving(users: Iterable[str]) -> str:
    return f"MPS serves {', '.join(users)}'s jobs on this node now, and would keep this one waiting until they end"


def _outside(why: str) -> Placement:
    note = f"gpuq: {why}: it runs outside MPS, held to its share by gpuq's watchdog"
    return Placement({PIPE_VARIABLE: OUTSIDE}, note)


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"
