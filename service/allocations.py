"""Allocations: GPUs held for a shell or a command that `gpuq alloc` runs in the user's own
terminal (SLURM's salloc for one node). An allocation is a job of kind interactive: queued, placed
and accounted like any other, hosted by its first GPU's worker (workers/allocation.py), which
stops everything it started at its end.

Its client keeps it (service/kept_jobs.py): it says it is alive every third of the
``alloc_keepalive`` setting, and ends it with its shell's exit code. One it stops hearing from is
ended as client_lost by the worker (running), or cancelled by the scheduler (still waiting), so a
dropped ssh holds no GPU for long. A `gpuq run`'s job is kept the same way, and its client says so
through the same call (``keep_alive``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import simulated_memory
from gpuq.service.constants import State
from gpuq.service.db import require_schema, rows_changed, write_scope
from gpuq.service.errors import InvalidSpec, StateConflict
from gpuq.service.job_cpus import cpu_variables
from gpuq.service.jobs import get_job, job_gpus
from gpuq.service.kept_jobs import KEEPALIVE, client_call, keep_again
from gpuq.service.lifecycle import Actor, move
from gpuq.service.models import Gpu, Job, table, utcnow
from gpuq.service.rights import Caller
from gpuq.service.settings import Settings

_JOBS = table(Job)
_ID = _JOBS.c.id == bindparam("job_id")
_INTERACTIVE = _JOBS.c.kind == c.KIND_INTERACTIVE
# The variable every process of an allocation carries: how its worker finds them at the end.
RUN_ID_VARIABLE = "GPUQ_RUN_ID"

CLIENT_END = move("an allocation's client ended it", Actor.USER, State.RUNNING, None, _ID, _INTERACTIVE,
                  _JOBS.c.client_exit_code.is_(None), client_exit_code=bindparam("code"))


def new_run_id() -> str:
    """The allocation's run id (RUN_ID_VARIABLE): made by the server, never taken from the client."""
    return uuid.uuid4().hex


def check_node(session: Session, node: str) -> None:
    """InvalidSpec unless ``node`` has GPUs gpuq knows: an allocation is on the node its client runs on."""
    nodes = sorted(set(session.scalars(select(Gpu.node).where(Gpu.retired_at.is_(None)))))
    if node not in nodes:
        where = f"nodes with GPUs: {', '.join(nodes[:8])}" if nodes else "no node has reported GPUs yet"
        raise InvalidSpec(f"gpuq alloc gives GPUs on the node it runs on, and node {node} has no gpuq GPUs "
                          f"({where}); run it there")


@dataclass(frozen=True)
class Held:
    """An allocation as its client sees it, at each keepalive."""

    id: int
    state: str
    reason: str | None
    run_id: str
    gpu_indices: list[int]
    node: str | None
    # Epoch seconds its --time runs out; None: no limit (or not started).
    deadline: float | None
    keepalive_s: float
    failure: str | None
    exit_code: int | None
    # What the shell gets beside its GPUs' variables, as a job does from its worker: its --cpus
    # (service/job_cpus.py), and on simulated GPUs where it says what simulated GPU memory it holds
    # (a shared allocation's watchdog reads it).
    env: dict[str, str]

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def keep_alive(settings: Settings, job_id: int, caller: Caller, again: bool = False) -> Held:
    """Note that a kept job's client is alive (an allocation's, or a `gpuq run`'s: its job has no
    run id, GPUs to give a shell or shell variables); what it needs to know of the job. ``again``:
    a `gpuq run` resumed after Ctrl-Z keeps the job it let go of (``kept_jobs.keep_again``)."""
    require_schema(settings)
    with write_scope(settings) as session:
        job = client_call(session, settings, job_id, caller)
        if again:
            keep_again(session, job, utcnow())
        elif job.keepalive_at is None:
            raise StateConflict(f"job {job_id} is not kept by a client (gpuq alloc, gpuq run): nothing keeps it alive")
        else:
            session.execute(KEEPALIVE, {"job_id": job_id, "now": utcnow()})
        if job.kind != c.KIND_INTERACTIVE:  # a run's job: no shell here to give GPUs, a run id or variables
            return Held(id=job.id, state=job.state, reason=job.reason, run_id="", gpu_indices=[], node=job.node,
                        deadline=None, keepalive_s=settings.alloc_keepalive / 3, failure=job.failure,
                        exit_code=job.exit_code, env={})
        gpus = [g.index for g in job_gpus(session, job_id)] if job.state == State.RUNNING else []
        job = get_job(session, job_id)
        deadline = (job.started_at.timestamp() + job.time_limit_s) if job.started_at and job.time_limit_s else None
        return Held(id=job.id, state=job.state, reason=job.reason, run_id=(job.env or {}).get(RUN_ID_VARIABLE, ""),
                    gpu_indices=gpus, node=job.node, deadline=deadline, keepalive_s=settings.alloc_keepalive / 3,
                    failure=job.failure, exit_code=job.exit_code, env=_shell_env(settings, job.cpus))


def _shell_env(settings: Settings, cpus: float | None) -> dict[str, str]:
    """Its cores' variables (the client keeps its terminal's OMP_NUM_THREADS over this one), and
    on simulated GPUs where the shell's processes say what simulated GPU memory they hold."""
    env = cpu_variables(cpus, {})
    if settings.fake_gpus:
        env[simulated_memory.ENV_VARIABLE] = str(simulated_memory.memory_dir(settings))
    return env


def end_by_client(settings: Settings, job_id: int, exit_code: int, caller: Caller) -> None:
    """The allocation's shell (or command) exited with ``exit_code``: its worker ends it and
    stops whatever it left running."""
    if not -255 <= exit_code <= 255:
        raise InvalidSpec(f"exit_code must be between -255 and 255, got {exit_code}")
    require_schema(settings)
    with write_scope(settings) as session:
        job = client_call(session, settings, job_id, caller)
        if job.kind != c.KIND_INTERACTIVE:
            raise StateConflict(f"job {job_id} is not an allocation (gpuq alloc)")
        if job.state in c.END_STATES:
            return  # it ended meanwhile (time limit, cancel): nothing left to end
        if job.state != State.RUNNING:
            raise StateConflict(f"allocation {job_id} is {job.state}; only a running one can be ended by its client")
        rows_changed(session.execute(CLIENT_END, {"job_id": job_id, "code": exit_code}))


@dataclass(frozen=True)
class ClientState:
    """What the worker hosting an allocation reads of its client."""

    keepalive_at: datetime | None
    exit_code: int | None


_CLIENT = select(_JOBS.c.keepalive_at, _JOBS.c.client_exit_code).where(_ID)


def client_state(session: Session, job_id: int) -> ClientState:
    row = session.execute(_CLIENT, {"job_id": job_id}).one_or_none()
    return ClientState(None, None) if row is None else ClientState(row.keepalive_at, row.client_exit_code)
