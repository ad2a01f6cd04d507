"""Hosting an allocation (`gpuq alloc`) on its first GPU's worker: the GPUs are held, with their
lease, samples, time limit and cancel, while the client runs a shell or a command in the user's
terminal. The worker runs nothing itself; it watches the client (its keepalive and its end) and, at
the end, stops every process of the allocation: those carrying its run id (GPUQ_RUN_ID) and owned
by its user, their descendants of that user, and whatever it could place in the allocation's
cgroup on the way (every PLACE_EVERY_SECONDS). The shell starts behind a gate (cli/gate.py) that
this worker lets through once it has put it in the cgroup, so where there is one, nothing the
shell starts escapes it; without one, a process that drops the run id and leaves the tree within
PLACE_EVERY_SECONDS is not found.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from gpuq.service import constants as c
from gpuq.service.allocations import RUN_ID_VARIABLE, ClientState, client_state
from gpuq.service.constants import State
from gpuq.service.db import read_scope
from gpuq.service.failures import signal_name
from gpuq.service.kept_jobs import lapsed, lost_reason
from gpuq.workers.cgroup import JobCgroup
from gpuq.workers.core_binding import Binding, bound, held_to_cpus
from gpuq.workers.end import drain_if_left, stopped_end
from gpuq.workers.identity import run_as
from gpuq.workers.job import JobRun
from gpuq.workers.job_processes import cgroup_prefix, stop_tree, verify_gone
from gpuq.workers.state import WorkerState
from gpuq.workers.watch import StopWatcher

log = logging.getLogger("gpuq.worker")
# How often the worker reads the client's keepalive and end from SQL, and how often it looks for
# the allocation's processes to put them in its cgroup (a pass over /proc: not every look).
CLIENT_LOOK_SECONDS = 0.2
PLACE_EVERY_SECONDS = 2.0
# How often it looks for the shell's gate until it has let it through (a user waits for it).
GATE_LOOK_SECONDS = 0.05


@dataclass(frozen=True)
class _Processes:
    """Finds an allocation's live processes: its run id in their environment and its user's uid
    (a process of someone else's that copied the id is not theirs to stop), their descendants of
    that uid (a command run with `env -i` or `env -u GPUQ_RUN_ID` in the shell dropped the id and
    outlived the allocation), or in its cgroup."""

    run_id: str
    uid: int
    cgroup: JobCgroup | None
    # Every process found so far, by pid, with its start time: one that since left the tree (its
    # parent exited) is still the allocation's, where no cgroup holds it.
    seen: dict[int, float] = field(default_factory=dict)

    def __call__(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        me = os.getpid()
        in_cgroup = set(self.cgroup.pids()) if self.cgroup is not None else set()
        theirs: dict[int, psutil.Process] = {}  # the user's other processes, for their parents
        for p in psutil.process_iter(["pid", "uids", "ppid", "create_time"]):
            if p.pid == me:
                continue
            try:
                if p.pid in in_cgroup:
                    found[p.pid] = p
                elif p.info["uids"].real == self.uid:
                    if p.environ().get(RUN_ID_VARIABLE) == self.run_id or \
                            self.seen.get(p.pid) == p.info["create_time"]:  # the very process found before
                        found[p.pid] = p
                    else:
                        theirs[p.pid] = p
            except (psutil.Error, OSError, AttributeError):
                continue
        # Their descendants, however deep: each pass takes the processes whose parent is found.
        while children := [pid for pid, p in theirs.items() if p.info["ppid"] in found]:
            for pid in children:
                found[pid] = theirs.pop(pid)
        for pid, p in found.items():
            self.seen[pid] = p.info["create_time"]
        return list(found.values())


def host(state: WorkerState, job: JobRun, watcher: StopWatcher,
         on_found: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Hold the allocation's GPUs until its client ends it, stops answering, or ``watcher`` says it
    must stop (cancel, time limit, worker shutdown, lease or GPU lost, a share overrun); then stop
    its processes and return its end. ``on_found`` is given each of its processes as they are
    found (a shared allocation's: its share watchdog sums what they hold on its GPUs)."""
    identity = run_as(job.user, state.node)  # an unknown user fails the allocation with its reason
    uid = identity.uid if identity is not None else os.getuid()
    with bound(state.settings, state.node, job.id, job.cpus, state.cores_near(job.gpu_indices)) as binding:
        # Its cores are its cpuset's too, so they are taken first and let go once its processes are stopped.
        cgroup = JobCgroup.create(f"{cgroup_prefix(state.settings, state.name)}alloc{job.id}-{uuid.uuid4().hex[:6]}",
                                  None, job.cpus, binding.cores if binding is not None else ())
        processes = _Processes(job.env.get(RUN_ID_VARIABLE, ""), uid, cgroup)
        try:
            client = _watch(state, job, watcher, processes, on_found, binding)
            leftover = _stop(processes, state.settings.kill_grace, cgroup)
        finally:
            if cgroup is not None:
                cgroup.remove()
    drain_if_left(state, job, tuple(leftover))
    if client is None:
        return stopped_end(state, job, watcher)
    if client.exit_code is None:
        return {"state": State.FAILED, "failure": c.FAILURE_CLIENT_LOST,
                "reason": lost_reason(state.settings, job.kind)}
    if client.exit_code == 0:
        return {"state": State.SUCCEEDED, "exit_code": 0}
    code = client.exit_code
    # A negative code is a signal's (the client sends -N as a command job's end records it).
    ended = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with {code}"
    return {"state": State.FAILED, "failure": c.FAILURE_EXIT, "exit_code": code,
            "reason": f"its shell or command {ended}"}


def _watch(state: WorkerState, job: JobRun, watcher: StopWatcher, processes: _Processes,
           on_found: Callable[[int], None] | None, binding: Binding | None = None) -> ClientState | None:
    """Wait for the allocation's end: the client's (its exit code, or silence: exit_code None), or
    None when ``watcher`` stopped it. Every PLACE_EVERY_SECONDS (every GATE_LOOK_SECONDS until the
    shell's gate is through) its processes are looked for, put in its cgroup and handed to
    ``on_found``, where there is either. Until the gate is through, what is found is put on
    ``binding``'s cores too: the gate before it is let through, so the shell and all it starts
    inherit them (and where no cpuset holds them, a process the user moves with ``taskset`` stays
    where they put it)."""
    settings = state.settings
    placed_at, began = 0.0, time.monotonic()
    gated = False  # the shell's gate (cli/gate.py) was found, placed and let through
    waiting = True  # for it: the user waits at their prompt, so it is looked for at every turn
    while not watcher.stopped.wait(GATE_LOOK_SECONDS if waiting else CLIENT_LOOK_SECONDS):
        try:
            with read_scope(settings) as session:
                client = client_state(session, job.id)
        except Exception:  # noqa: BLE001 - a database blip must not end the allocation
            log.warning("allocation %s: could not read its client's state", job.id)
            continue
        if client.exit_code is not None:
            return client
        if lapsed(settings, client.keepalive_at):
            return ClientState(client.keepalive_at, None)
        waiting = not gated and time.monotonic() - began < c.ALLOC_GATE_SECONDS
        if waiting or time.monotonic() - placed_at >= PLACE_EVERY_SECONDS:
            placed_at = time.monotonic()  # without a cgroup too: ``seen``
            for p in processes():
                if processes.cgroup is not None:
                    processes.cgroup.place(p.pid)
                if binding is not None and not gated:
                    _onto(p.pid, binding.cores)
                if on_found is not None:
                    on_found(p.pid)
                if not gated and _is_gate(p):
                    _let_through(p, held_to_cpus(job.cpus, processes.cgroup, binding))
                    gated = True
    return None


def _is_gate(p: psutil.Process) -> bool:
    try:
        return tuple(p.cmdline()[1:4]) == c.ALLOC_GATE_ARGS  # as cli/alloc.py starts it
    except psutil.Error:
        return False


def _onto(pid: int, cores: tuple[int, ...]) -> None:
    """Put process ``pid`` on ``cores`` (a worker may: it is root, or the allocation's user)."""
    try:
        os.sched_setaffinity(pid, cores)
    except OSError:
        pass  # gone, or the cores changed under it: it is found again at the next look


def _let_through(p: psutil.Process, held: bool) -> None:
    """Tell the gate it is placed: the shell starts, in the allocation's cgroup, and the gate says
    so where it is not ``held`` to its --cpus (sent once: after its exec the shell's own SIGUSR1 or
    SIGUSR2 would end it)."""
    try:
        os.kill(p.pid, c.ALLOC_GATE_SIGNAL if held else c.ALLOC_GATE_UNHELD_SIGNAL)
    except OSError:
        pass  # gone: the client's end says why


def _stop(processes: _Processes, grace: float, cgroup: JobCgroup | None) -> list[int]:
    """SIGTERM every process of the allocation, SIGKILL what is left after ``grace`` seconds, as for
    a command job (it has no process group of its own); the pids still alive after that (a process
    in uninterruptible sleep)."""
    stop_tree(None, grace, processes)
    return verify_gone(processes, c.STOP_VERIFY_SECONDS, None, cgroup)
