"""Binding a command with `--cpus` to CPU cores of its own on its node (``GPUQ_CPU_BIND=cores``):
its worker picks them (service/core_sets.py) and the job's first process is put on them between
fork and exec (``sched_setaffinity``), so it and every process it starts run there, and ``nproc``,
``os.sched_getaffinity`` and torch's DataLoader see that many cores, not the node's.

The workers of a node run one job each, so which cores are taken is the node's to know, not one
worker's: they keep it together in one file, ``<home>/cores/<node>.json``, read and rewritten under
an exclusive ``flock`` as a job takes its cores and as it lets them go. An entry names the worker
that holds it (pid and start time): a worker SIGKILLed before it could let its job's cores go
took its job with it (the parent-death signal), and its entry is dropped by the next worker that
reads the record and finds it gone.

Where the worker may make cgroups, the cores are the job's cpuset as well (workers/cgroup.py), and
the kernel keeps every process of the job on them. Elsewhere (a user's own stack) they are its
affinity alone, a placement and not a wall: a process may widen its own again (``taskset``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gpuq.service import core_sets
from gpuq.service.node_use import SLACK
from gpuq.service.settings import Settings
from gpuq.workers.cgroup import JobCgroup

log = logging.getLogger("gpuq.worker")


@dataclass(frozen=True)
class Binding:
    """The cores one job of this node is bound to, as its worker took them."""

    job_id: int
    cores: tuple[int, ...]
    # Whether they are all its own: no other running job of the node is bound to any of them.
    own: bool
    # Its entry in the node's record (what lets it go).
    mark: str

    @property
    def text(self) -> str:
        return core_sets.format_list(self.cores)


def held_by(binding: Binding | None, cpus: float) -> bool:
    """Whether ``binding`` alone holds a job of ``cpus`` cores to them: as many cores as it asked for,
    none shared with another job (without a quota, a fraction of one is not held)."""
    return binding is not None and binding.own and abs(len(binding.cores) - cpus) < SLACK


def held_to_cpus(cpus: float | None, cgroup: JobCgroup | None, binding: Binding | None = None) -> bool:
    """Whether a command or an allocation's shell that asked for ``cpus`` cores (None: none) is held
    to them: by ``cgroup``'s quota, or by cores of its own (``binding``); where not, it is told."""
    return cpus is None or (cgroup is not None and cgroup.cpus is not None) or held_by(binding, cpus)


def record_path(settings: Settings, node: str) -> Path:
    """The node's record of its jobs' cores, in the stack's home (which only gpuq's services write)."""
    return settings.home / "cores" / f"{node}.json"


def _started(pid: int) -> float | None:
    """When process ``pid`` started (None: there is none): a pid reused by another process starts later."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(entry: Any) -> bool:
    """Whether ``entry`` is a binding of a worker still running (one it wrote: its pid started when
    it said, and a list of cores)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("cores"), list):
        return False
    pid = entry.get("pid")
    return isinstance(pid, int) and pid > 0 and _started(pid) == entry.get("since")


@contextmanager
def _record(path: Path) -> Iterator[list[dict[str, Any]]]:
    """The node's entries, those of workers still running, under the node's lock; what the caller
    leaves in the list is written back (whole, through a rename: a worker killed in between leaves
    the old record, never half of one)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = json.loads(path.read_text())
        except FileNotFoundError:
            entries = []
        except (OSError, ValueError) as exc:  # not gpuq's writing: start it afresh, said in the log
            log.warning("the record of node CPU cores %s could not be read (%s); it is started afresh", path, exc)
            entries = []
        if not isinstance(entries, list):
            entries = []
        live = [e for e in entries if _alive(e)]
        read = list(live)
        yield live
        if live != read or len(read) != len(entries):  # taken, let go, or a gone worker's dropped
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(live))
            os.replace(tmp, path)


def take(settings: Settings, node: str, job_id: int, cpus: float, near: Collection[int] = ()) -> Binding:
    """Take ``cpus`` (`--cpus`) worth of this node's cores for ``job_id``: cores no other job of the
    node is bound to where there are enough, those near its GPUs (``near``) first."""
    available = os.sched_getaffinity(0)
    pid = os.getpid()
    with _record(record_path(settings, node)) as entries:
        held: Counter[int] = Counter(core for e in entries for core in e.get("cores", []))
        cores = core_sets.choose(core_sets.cores_for(cpus), available, held, near)
        mark = uuid.uuid4().hex
        entries.append({"job": job_id, "cores": list(cores), "pid": pid, "since": _started(pid), "mark": mark})
    return Binding(job_id, cores, own=not any(held[core] for core in cores), mark=mark)


def let_go(settings: Settings, node: str, binding: Binding) -> None:
    """The job's cores are free again (its command ended). A record that cannot be written now
    costs the job nothing: its entry is dropped once this worker is gone, and until then the next
    jobs take other cores first (the log says so)."""
    try:
        with _record(record_path(settings, node)) as entries:
            entries[:] = [e for e in entries if e.get("mark") != binding.mark]
    except OSError as exc:
        log.warning("job %d: its CPU cores %s could not be let go in node %s's record (%s)", binding.job_id,
                    binding.text, node, exc)


def _shown(settings: Settings, binding: Binding) -> None:
    """Write the job's cores where `gpuq show` reads them; a database that does not answer now
    costs the job nothing but that line (the log says so)."""
    from gpuq.service import bound_cores
    from gpuq.service.db import write_scope

    try:
        with write_scope(settings) as session:
            bound_cores.record(session, binding.job_id, binding.text)
    except Exception as exc:  # noqa: BLE001 - the job runs on its cores either way
        log.warning("job %d: its CPU cores %s could not be written for gpuq show (%s)", binding.job_id, binding.text,
                    exc)


@contextmanager
def bound(settings: Settings, node: str, job_id: int, cpus: float | None,
          near: Collection[int] = ()) -> Iterator[Binding | None]:
    """The cores a command of ``cpus`` (None: it asked for none) runs on while the block runs, then
    let go; None where it is not bound (no --cpus, or ``GPUQ_CPU_BIND=none``)."""
    if cpus is None or settings.cpu_bind != "cores":
        yield None
        return
    try:
        binding = take(settings, node, job_id, cpus, near)
    except OSError as exc:  # the record cannot be written (a full disk): the job runs, unbound, and the log says so
        log.warning("job %d is not bound to CPU cores: the record of node %s's cores cannot be kept (%s)",
                    job_id, node, exc)
        yield None
        return
    try:
        _shown(settings, binding)
        yield binding
    finally:
        let_go(settings, node, binding)
