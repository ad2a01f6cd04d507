"""A job run one rank per GPU worker: its worker sets where the ranks meet and asks the job's other
GPUs' workers to run theirs (``start_ranks``); each of those runs its rank (``run_rank``).

(The torch side of a rank, for the workloads, is ``workers/workloads/ranks.py``.)
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import psutil
from kombu.exceptions import OperationalError

from gpuq.service.celery_app import send_run_rank
from gpuq.service.db import write_scope
from gpuq.service.errors import JobCancelled
from gpuq.service.inventory import worker_gone
from gpuq.service.jobs import job_gpus, rank_to_run, set_rendezvous
from gpuq.service.settings import Settings
from gpuq.workers.identity import run_as
from gpuq.workers.job import JobRun
from gpuq.workers.owner_files import OwnerFiles, umask_of
from gpuq.workers.state import WorkerState
from gpuq.workers.watch import StopWatcher

if TYPE_CHECKING:
    from gpuq.workers.builtin import Rank

log = logging.getLogger("gpuq.worker")

# Seconds rank 0 looks for a lost peer worker after its workload failed.
PEER_LOOK_SECONDS = 2.0


@dataclass(frozen=True)
class Peer:
    """Another rank of a job this worker runs rank 0 of, and the worker process that runs it."""

    rank: int
    gpu_id: int
    worker: str | None
    pid: int | None


def start_ranks(state: WorkerState, job: JobRun) -> tuple[Rank, list[Peer]]:
    """Set where the job's ranks meet and ask each of its other GPUs' workers to run its rank; this
    worker's rank, and the others' workers as they were then (``lost_peers``).

    Each rank then runs in the warm worker pinned to its own GPU; this worker runs rank 0.
    """
    from gpuq.workers.builtin import Rank

    init_method = f"tcp://{advertise_addr(state.settings)}:{free_port()}"
    with write_scope(state.settings) as session:
        set_rendezvous(session, job.id, init_method)
        peers = [Peer(rank, gpu.id, gpu.worker, gpu.worker_pid)
                 for rank, gpu in enumerate(job_gpus(session, job.id)) if rank]
    for rank, queue in enumerate(job.gpu_queues[1:], start=1):
        try:
            send_run_rank(state.app, queue, job.id, rank)
        except (OperationalError, OSError) as exc:
            # The broker restarting as rank 0 asks (the message is lost with it either way): the
            # scheduler sends every running job's ranks again once it sees the broker restarted
            # (``leases.ranks_to_send_again``), and rank 0 waits at the meeting point meanwhile.
            # Raised here, it failed the job.
            log.warning("%s: job %s: rank %s's message not sent (%s); the scheduler sends it again",
                        state.name, job.id, rank, exc)
    return Rank(0, len(job.gpu_queues), init_method), peers


def lost_peers(peers: list[Peer], within: float = PEER_LOOK_SECONDS) -> list[Peer]:
    """The peers whose worker process is gone (dead, or a zombie its parent has not reaped yet).

    Rank 0's collectives fail the moment a peer's worker dies ("connection reset"), which reads
    as the workload's own error and would use up one of its retries; it is the worker that was
    lost, as when a one-GPU job's worker dies. A job's ranks run on one node, so the peers'
    pids are this node's to look at. A peer that failed on its own (its rank raised) has a live
    worker: looked at for up to ``within`` seconds, as the dying process may still be exiting."""
    deadline = time.monotonic() + within
    while True:
        lost = [p for p in peers if p.pid is not None and not _alive(p.pid)]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.1)


def mark_lost(settings: Settings, peers: list[Peer]) -> None:
    """Take the lost peers' GPUs offline until their workers register again (``inventory.worker_gone``)."""
    with write_scope(settings) as session:
        for peer in peers:
            if peer.pid is not None:
                worker_gone(session, peer.gpu_id, peer.pid)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_rank(state: WorkerState, job_id: int, rank: int) -> bool:
    """Run rank ``rank`` of a running job on this worker's GPU; False if it is not ours to run.

    Only rank 0 (the job's own worker) writes output, metrics and the end state; a failing rank
    here makes rank 0's collectives fail, and so the job.
    """
    from gpuq.workers.builtin import Rank, run_workload

    with write_scope(state.settings) as session:
        job = rank_to_run(session, job_id, state.gpu_id, rank)
        if job is None:
            log.info("%s: rank %s of job %s is not this GPU's to run; message dropped", state.name, rank, job_id)
            return False
        # A rank's job is a built-in workload whose ranks met (rank_to_run asks both).
        workload, params, gpus, meet = cast(str, job.workload), dict(job.params), job.gpus, cast(str, job.rendezvous)
        owner, started_at, env = job.user, job.started_at, dict(job.env or {})
    # Each attempt has a meeting point of its own: the same rank of the same attempt runs once here,
    # whatever the scheduler sent again after a Redis restart (``leases.ranks_to_send_again``).
    if (job_id, rank, meet) in state.ranks_run:
        log.info("%s: rank %s of job %s already ran here; message dropped", state.name, rank, job_id)
        return False
    state.ranks_run.add((job_id, rank, meet))
    log.info("%s: job %s rank %s/%s started", state.name, job_id, rank, gpus)
    state.job_started(job_id, started_at)
    watcher = state.watch.watch(StopWatcher(state.settings, job_id, state.interrupt, rank=True))
    try:
        run_workload(job_id, workload, params, gpus, lambda line: log.info("job %s rank %s: %s", job_id, rank, line),
                     watcher.stopped, None, Rank(rank, gpus, meet),
                     files=OwnerFiles(run_as(owner, state.node), umask=umask_of(env)))
    except JobCancelled:
        log.info("%s: job %s rank %s stopped: job cancelled or ended", state.name, job_id, rank)
    except Exception:
        log.exception("%s: job %s rank %s failed", state.name, job_id, rank)
    finally:
        watcher.done.set()
        state.job_ended(job_id)
    log.info("%s: job %s rank %s done", state.name, job_id, rank)
    return True


def advertise_addr(settings: Settings) -> str:
    """The address other nodes reach this one at (GPUQ_ADVERTISE_ADDR, else the host name's)."""
    if settings.advertise_addr:
        return settings.advertise_addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
