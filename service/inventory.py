"""Which GPUs exist, on which node, who serves them and how they are doing: the ``gpus`` table."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpuq.service import node_drains, node_use
from gpuq.service.constants import State
from gpuq.service.db import rows_changed
from gpuq.service.devices import GpuInfo, GpuReading
from gpuq.service.models import Allocation, Gpu, Job, utcnow
from gpuq.service.settings import Settings


def live_cutoff(settings: Settings) -> datetime:
    """Heartbeats older than this mean the worker is lost."""
    return utcnow() - timedelta(seconds=settings.worker_timeout)


# How the drain reason of a GPU that `gpuq up`'s supervisor left out begins: its worker could not
# start. A worker that registers it later has started, so its registration lifts that drain (and
# only that one: a GPU drained as lost stays drained until an admin resumes its node).
WORKER_DID_NOT_START = "its worker did not start"
# How the drain reason of a GPU whose memory needs a reset or a repair begins (workers/heartbeat.py).
UNHEALTHY = "GPU unhealthy"
# And of one NVML reads lost.
LOST = "GPU lost"


def health_drain(lost: str | None, unhealthy: str | None) -> str:
    """The drain reason of a GPU NVML reads ``lost``, else ``unhealthy`` (``GpuReading``'s words):
    the heartbeat's, and a failed job's end's that found it first (workers/gpu_fault.py)."""
    return f"{LOST}: {lost}" if lost else f"{UNHEALTHY}: {unhealthy}"


def _row(session: Session, node: str, info: GpuInfo, queue: str) -> Gpu:
    gpu = session.scalar(select(Gpu).where(Gpu.node == node, Gpu.index == info.index))
    if gpu is None:
        gpu = Gpu(node=node, index=info.index)
        session.add(gpu)
    gpu.uuid, gpu.name, gpu.memory_total_mib = info.uuid, info.name, info.memory_total_mib
    gpu.simulated, gpu.queue, gpu.retired_at = info.simulated, queue, None  # back, if it was retired
    return gpu


def register(session: Session, node: str, info: GpuInfo, queue: str, worker: str, pid: int,
             node_cpus: int | None = None, node_host_mem_mib: int | None = None) -> int:
    """Record (or refresh) the GPU a worker serves, and the CPU cores and host memory its node offers
    jobs (service/node_use.py); returns its row id."""
    gpu = _row(session, node, info, queue)
    gpu.worker, gpu.worker_pid = worker, pid
    gpu.node_cpus, gpu.node_host_mem_mib = node_cpus, node_host_mem_mib
    gpu.heartbeat_at = utcnow()
    if gpu.drain_reason is not None and gpu.drain_reason.startswith(WORKER_DID_NOT_START):
        gpu.drain_reason = None
    session.flush()
    return gpu.id


def leave_out(session: Session, node: str, info: GpuInfo, queue: str, why: str) -> None:
    """The GPU whose worker could not start: offline and drained, ``why`` its reason (after
    ``WORKER_DID_NOT_START``), listed by `gpuq status` with the others, until its worker starts."""
    gpu = _row(session, node, info, queue)
    gpu.worker = gpu.worker_pid = gpu.heartbeat_at = gpu.utilization = gpu.memory_used_mib = None
    gpu.drain_reason = f"{WORKER_DID_NOT_START}: {why}"
    session.flush()


def retire_missing(session: Session, node: str, present: list[int]) -> list[int]:
    """Retire the GPUs of ``node`` that are not among ``present`` (its devices now) and hold no
    job: the indices retired. A GPU taken out of a node (or out of GPUQ_FAKE_GPUS) was listed
    offline for ever, and counted among the node's GPUs, so a submit for more than the node has
    now was accepted to wait for ever. One that still holds a job keeps its row until that job
    is reaped, and is retired at a later start."""
    held = select(Allocation.gpu_id)
    gone = list(session.scalars(select(Gpu.index).where(
        Gpu.node == node, Gpu.index.not_in(present), Gpu.retired_at.is_(None), Gpu.id.not_in(held))
        .order_by(Gpu.index)))
    if gone:
        _mark_retired(session, Gpu.node == node, Gpu.index.in_(gone))
    return gone


def _mark_retired(session: Session, *where: Any) -> None:
    """Retire the GPUs ``where`` picks: off the lists, with no worker or live reading left."""
    session.execute(update(Gpu).where(*where).values(retired_at=utcnow(), worker=None, worker_pid=None,
                                                      heartbeat_at=None, utilization=None, memory_used_mib=None))


def retire(session: Session, settings: Settings, node: str, indices: list[int] | None = None) -> list[int]:
    """Retire GPUs of ``node`` (`gpuq retire`, as a node taken out of slurm.conf): all its GPUs, or
    those ``indices``; the indices retired. A retired GPU is neither listed nor counted among the
    node's GPUs; a worker that starts on it again brings it back. Only a GPU with no live worker and
    no job may go (a live one would be back at its next heartbeat, and a job's GPUs are its own
    until it ends): InvalidSpec or StateConflict, and nothing retired, for any other."""
    from gpuq.service.errors import InvalidSpec, StateConflict

    if not node.strip():
        raise InvalidSpec("give the node's name (gpuq status lists them)")
    rows = {g.index: g for g in session.scalars(select(Gpu).where(Gpu.node == node, Gpu.retired_at.is_(None)))}
    if not rows:
        raise InvalidSpec(f"no node {node} with GPUs is known to gpuq")
    chosen = sorted(rows) if indices is None else sorted(set(indices))
    missing = [i for i in chosen if i not in rows]
    if missing:
        raise InvalidSpec(f"node {node} has no GPU {missing[0]} (its GPUs: {', '.join(map(str, sorted(rows)))})")
    cutoff = live_cutoff(settings)
    for i in chosen:
        g = rows[i]
        if g.heartbeat_at is not None and g.heartbeat_at >= cutoff:
            raise StateConflict(f"GPU {i} of node {node} has a live worker ({g.worker or 'pid ' + str(g.worker_pid)}): "
                                "stop it first (`gpuq down` there, or its container), or drain the node")
    held = dict(session.execute(select(Allocation.gpu_id, Allocation.job_id)
                                .where(Allocation.gpu_id.in_([rows[i].id for i in chosen]))).all())
    for i in chosen:
        if rows[i].id in held:
            raise StateConflict(f"GPU {i} of node {node} holds job {held[rows[i].id]}: it is retired once that job "
                                "has ended (`gpuq cancel`, or the reaper's end of a lost worker's job)")
    _mark_retired(session, Gpu.id.in_([rows[i].id for i in chosen]))
    return chosen


def gpu_drain_reason(session: Session, gpu_id: int) -> str | None:
    """Why the GPU (by its row id) is drained on its own; None if it is not."""
    return session.scalar(select(Gpu.drain_reason).where(Gpu.id == gpu_id))


def drain_reason(session: Session, node: str, index: int) -> str | None:
    """Why GPU ``index`` of ``node`` is drained on its own (None: it is not, or is not known)."""
    return session.scalar(select(Gpu.drain_reason).where(Gpu.node == node, Gpu.index == index))


def gpu_id_of(session: Session, node: str, index: int) -> int | None:
    """The row id of GPU ``index`` of ``node``; None if it is not known."""
    return session.scalar(select(Gpu.id).where(Gpu.node == node, Gpu.index == index))


def beat(session: Session, gpu_id: int, reading: GpuReading) -> None:
    """A heartbeat: the worker is alive, and this is how its GPU looks. Processes on the GPU that
    are not the worker's or its jobs' (nor MPS's server) are foreign: other programs' memory."""
    foreign = [p for p in reading.processes or () if p.foreign]
    session.execute(update(Gpu).where(Gpu.id == gpu_id).values(
        heartbeat_at=utcnow(), memory_used_mib=reading.memory_used_mib, utilization=reading.utilization,
        foreign_mib=sum(p.memory_mib or 0 for p in foreign),
        foreign=[{"pid": p.pid, "mib": p.memory_mib, "user": p.user, "name": p.name} for p in foreign] or None))


def drain_gpu(session: Session, gpu_id: int, reason: str) -> bool:
    """Give this one GPU out no more until an admin resumes its node; True if newly drained."""
    return rows_changed(session.execute(update(Gpu).where(Gpu.id == gpu_id, Gpu.drain_reason.is_(None))
                                        .values(drain_reason=reason))) == 1


def sign_off(session: Session, gpu_id: int) -> None:
    """The worker stopped on purpose: its GPU is offline until a worker registers it again."""
    session.execute(update(Gpu).where(Gpu.id == gpu_id).values(
        heartbeat_at=None, worker=None, worker_pid=None, utilization=None, memory_used_mib=None))


def worker_gone(session: Session, gpu_id: int, pid: int) -> None:
    """The worker process ``pid`` of the GPU is gone (seen by a job's rank 0 on its node): the GPU
    is offline at once, not after the heartbeat's timeout, in which the scheduler would place jobs
    on it again. Nothing changes if another worker registered it since."""
    session.execute(update(Gpu).where(Gpu.id == gpu_id, Gpu.worker_pid == pid).values(
        heartbeat_at=None, worker=None, worker_pid=None, utilization=None, memory_used_mib=None))


@dataclass(frozen=True)
class GpuView:
    """A GPU as `gpuq status` shows it."""

    node: str
    index: int
    name: str
    memory_used_mib: int | None
    memory_total_mib: int
    utilization: int | None
    online: bool
    worker: str | None
    job_id: int | None
    job_user: str | None
    heartbeat_at: datetime | None
    drained: bool = False
    foreign_mib: int | None = None
    drain_reason: str | None = None
    node_drained: bool = False  # drained with its node (drain_reason is the node's)
    own_drain_reason: str | None = None  # drained on its own (lost, its worker did not start), node or not
    # The shared jobs on it (``Holders.shares``; job_id is then None).
    shares: tuple[dict[str, Any], ...] = ()
    # Its node's maintenance window to come, ``{"at", "until": ISO times, "note": why and by whom}``
    # (service/node_drains.py).
    node_drain_ahead: dict[str, Any] | None = None
    # Its node's offer to jobs and what its started jobs reserve of it (``NodeReserved``).
    node_cpus: int | None = None
    node_cpus_reserved: float = 0.0
    node_host_mem_mib: int | None = None
    node_host_mem_reserved_mib: int = 0


@dataclass(frozen=True)
class NodeReserved:
    """A node's CPU cores and host memory for jobs (None: not reported) and what its started jobs
    reserve of them (`--cpus`, `--host-mem`; service/node_use.py), as `gpuq status` and `gpuq
    devices` give them with each of its GPUs."""

    node_cpus: int | None = None
    node_cpus_reserved: float = 0.0
    node_host_mem_mib: int | None = None
    node_host_mem_reserved_mib: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# The CPU cores and host memory each node's started jobs reserve.
_RESERVED = (select(Job.node, func.sum(Job.cpus), func.sum(Job.host_mem_mib))
             .where(Job.state.in_((State.DISPATCHED, State.RUNNING))).group_by(Job.node))


def node_reserved(session: Session, gpus: list[Gpu]) -> dict[str, NodeReserved]:
    """Each node of ``gpus`` (not retired): its offer, the least its GPUs' workers report, and what
    is reserved of it."""
    offers = node_use.offers_of(gpus)
    cores, mem = offers[node_use.CPUS], offers[node_use.HOST_MEM]
    if not (cores or mem):
        return {}
    reserved = {node: (c or 0.0, m or 0) for node, c, m in session.execute(_RESERVED)}
    return {node: NodeReserved(cores.get(node), float(reserved.get(node, (0.0, 0))[0]), mem.get(node),
                               int(reserved.get(node, (0.0, 0))[1]))
            for node in {*cores, *mem}}


@dataclass(frozen=True)
class Holders:
    """What holds a GPU: its whole-GPU job (id, name, user), or its shared jobs, each with its
    share and what it uses of it (``{"job_id", "job_name", "user", "share_mib", "used_mib"}``)."""

    whole: tuple[int | None, str | None, str | None] = (None, None, None)
    shares: tuple[dict[str, Any], ...] = ()


def holders(session: Session) -> list[tuple[Gpu, Holders]]:
    """Every GPU, by node and index, with what holds it: one read for `gpuq status` and `gpuq devices`."""
    rows = session.execute(
        select(Gpu, Job.id, Job.name, Job.user, Allocation.share_mib, Allocation.used_mib)
        .where(Gpu.retired_at.is_(None))
        .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
        .outerjoin(Job, Job.id == Allocation.job_id).order_by(Gpu.node, Gpu.index, Job.id)
    ).all()
    gpus: dict[int, Gpu] = {}
    whole: dict[int, tuple[int | None, str | None, str | None]] = {}
    shares: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for g, job_id, job_name, user, share_mib, used_mib in rows:
        gpus[g.id] = g
        if share_mib is not None:
            shares[g.id].append({"job_id": job_id, "job_name": job_name, "user": user, "share_mib": share_mib,
                                 "used_mib": used_mib})
        elif job_id is not None:
            whole[g.id] = (job_id, job_name, user)
    return [(g, Holders(whole.get(g.id, (None, None, None)), tuple(shares.get(g.id, ())))) for g in gpus.values()]


def view(session: Session, settings: Settings) -> list[GpuView]:
    """Each GPU with its whole-GPU job, or its shared jobs and what each uses of its share."""
    cutoff = live_cutoff(settings)
    drained, ahead = node_drains.notes(session)
    gpus = holders(session)
    reserved = node_reserved(session, [g for g, _ in gpus])
    return [
        GpuView(node=g.node, index=g.index, name=g.name, memory_used_mib=g.memory_used_mib,
                memory_total_mib=g.memory_total_mib, utilization=g.utilization,
                online=g.heartbeat_at is not None and g.heartbeat_at >= cutoff, worker=g.worker,
                job_id=held.whole[0], job_user=held.whole[2], heartbeat_at=g.heartbeat_at,
                drained=g.node in drained or g.drain_reason is not None, foreign_mib=g.foreign_mib,
                drain_reason=drained.get(g.node) or g.drain_reason, node_drained=g.node in drained,
                own_drain_reason=g.drain_reason, shares=held.shares,
                node_drain_ahead=ahead.get(g.node), **reserved.get(g.node, NodeReserved()).as_dict())
        for g, held in gpus
    ]


def record_share_use(session: Session, gpu_id: int, used: dict[int, int | None]) -> None:
    """What each shared job on this GPU uses of its memory now (job id -> MiB), from its worker."""
    for job_id, mib in used.items():
        session.execute(update(Allocation).where(Allocation.gpu_id == gpu_id, Allocation.job_id == job_id)
                        .values(used_mib=mib))
