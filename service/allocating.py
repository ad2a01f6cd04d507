"""A placement written: the dispatch of a placed job and its GPUs' allocation rows, each checked
again in the placing transaction (the job still waits; its GPUs are still free, or still have the
room for its share; its node still has the cores and host memory it reserves), since the pass
(or a submit) read the queue before it wrote. The scheduler's passes write their placements here,
and a submit places its own jobs here when nothing else waits (``place_at_submit``)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import lifecycle, next_up, node_use, packing, policy
from gpuq.service.dialect import savepoint
from gpuq.service.models import Allocation, Gpu, Job, table, utcnow
from gpuq.service.prepared import Prepared
from gpuq.service.queue_read import pending_row, read_queue
from gpuq.service.settings import Settings

log = logging.getLogger("gpuq.scheduler")
_ALLOCATE = Prepared(table(Allocation).insert())
# A submission of more jobs than this is left to the scheduler whole (see ``place_at_submit``).
PLACE_AT_SUBMIT_MAX = 64


# Why ``try_allocate`` placed nothing: the job changed since it was read, or its GPUs did, or its
# node's cores or host memory.
JOB_MOVED, GPUS_TAKEN, NODE_TAKEN = "job moved", "GPUs taken", "node's cores or memory taken"
_J = table(Job).c
# Of each kind a node offers (node_use.KINDS): the node's offer (the least its GPUs' workers report)
# and what its started jobs reserve.
_OFFER_OF = {kind: Prepared(select(
    select(func.min(table(Gpu).c[column])).where(table(Gpu).c.node == bindparam("node"),
                                                 table(Gpu).c.retired_at.is_(None)).scalar_subquery(),
    select(func.coalesce(func.sum(_J[kind]), 0.0)).where(
        # Two equalities, not IN: a Prepared statement has no list to expand.
        _J.node == bindparam("node"), or_(_J.state == c.State.DISPATCHED, _J.state == c.State.RUNNING)
    ).scalar_subquery())) for kind, column in node_use.OFFERED_BY.items()}


def allocate(session: Session, p: policy.Placement, now: datetime | None = None, share_mib: int | None = None) -> bool:
    """Dispatch the placed job, unless it changed since it was read (cancelled, held, or taken
    by a worker from its next-up list) or one of its GPUs was taken meanwhile. A shared placement
    (``p.shared``) holds ``share_mib`` (its share and context reserve) on each GPU, and only if that
    still fits there beside the shares already on it, with no whole-GPU job."""
    return try_allocate(session, p, now, share_mib) is None


def try_allocate(session: Session, p: policy.Placement, now: datetime | None = None,
              share_mib: int | None = None) -> str | None:
    """``allocate``: None once placed, else what stood in the way (JOB_MOVED, GPUS_TAKEN, NODE_TAKEN)."""
    conn = session.connection()  # Core: a submit places its job in its own transaction
    for kind, amount in p.needs:
        if not _node_has(conn, p.gpus[0].node, kind, amount):
            log.info("job %s: its node's %s were taken meanwhile; next pass", p.job_id, node_use.WORDS[kind][0])
            return NODE_TAKEN
    share = None
    if p.shared:
        assert share_mib is not None
        if not _room_for(conn, p, share_mib):
            log.info("job %s: its GPUs' room changed meanwhile; next pass", p.job_id)
            return GPUS_TAKEN
        # ``share_mib`` holds the context reserve already.
        share = max(packing.charged_fraction(share_mib, 0, g.memory_total_mib) for g in p.gpus)
    try:
        with savepoint(session, on_sqlite=True):
            values = {"job_id": p.job_id, "now": now or utcnow(), "node": p.gpus[0].node, "gpu_share": share}
            if lifecycle.DISPATCH.run(conn, values) != 1:
                return JOB_MOVED
            _ALLOCATE.send(conn, [{"job_id": p.job_id, "gpu_id": g.id, "rank": r, "share_mib": share_mib if p.shared
                                  else None} for r, g in enumerate(p.gpus)])
        return None
    except IntegrityError:
        log.info("job %s: a GPU it was placed on was taken meanwhile; next pass", p.job_id)
        return GPUS_TAKEN


# Not Prepared: a list of GPUs expands into the statement when it runs.
_HELD_ON = (select(table(Allocation).c.gpu_id, func.count(), func.sum(table(Allocation).c.share_mib),
                   func.count(table(Allocation).c.share_mib))
            .where(table(Allocation).c.gpu_id.in_(bindparam("gpu_ids", expanding=True)))
            .group_by(table(Allocation).c.gpu_id))
_ROOM_OF = (select(table(Gpu).c.id, table(Gpu).c.memory_total_mib, table(Gpu).c.foreign_mib)
            .where(table(Gpu).c.id.in_(bindparam("gpu_ids", expanding=True))))


def _node_has(conn: Any, node: str, kind: str, amount: float) -> bool:
    """Whether ``node`` still has ``amount`` of ``kind`` (cores, host memory) no started job reserves,
    as SQL has it now (in the placing transaction): the pass read it before the write, and a submit
    may place meanwhile."""
    [(offered, held)] = _OFFER_OF[kind].run(conn, {"node": node})
    return offered is None or held + amount <= offered + node_use.SLACK


def _room_for(conn: Any, p: policy.Placement, share_mib: int) -> bool:
    """Whether each of ``p``'s GPUs still has ``share_mib`` of room for a share and no whole job,
    as SQL has it now (in the placing transaction: on SQLite the writers' lock is held)."""
    ids = [g.id for g in p.gpus]
    held = {gpu_id: (n, total or 0, shares) for gpu_id, n, total, shares in conn.execute(_HELD_ON, {"gpu_ids": ids})}
    for gpu_id, memory, foreign in conn.execute(_ROOM_OF, {"gpu_ids": ids}):
        n, total, shares = held.get(gpu_id, (0, 0, 0))
        if n > shares or memory - (foreign or 0) - total < share_mib:
            return False
    return True


def place_at_submit(session: Session, settings: Settings,
                    rows: list[dict[str, Any]]) -> list[tuple[int, str, str, datetime]]:
    """Place jobs just submitted (in the submit's transaction), as SLURM tries each job once at
    submit: (job id, queue of its first GPU, node, when) for each placed, whose message the
    scheduler sends.

    Only when no other job waits (pending and not held): then the new jobs, one user's, are the
    whole queue, and ``policy.decide`` over them places what the scheduler's next pass would, a
    whole scheduler pass and its wake-up sooner. Otherwise, or for a submission of more than
    PLACE_AT_SUBMIT_MAX jobs, the scheduler decides, with every waiting job in view. ``rows``: the
    jobs' values as written, with their ids; being the whole queue, they are not read back."""
    if not settings.place_at_submit or not rows or len(rows) > PLACE_AT_SUBMIT_MAX:
        return []
    if next_up.anything_waits(session, besides=[r["id"] for r in rows]):
        return []
    queue = read_queue(session, settings, head=c.HEAD_PER_USER, only=[pending_row(r) for r in rows])
    if not queue.policy.jobs:
        return []
    now = utcnow()
    placements = policy.decide(queue.policy).placements
    held = shares_held(queue.policy, placements)
    placed = [p for p in placements if allocate(session, p, now, held.get(p.job_id))]
    return [(p.job_id, p.gpus[0].queue, p.gpus[0].node, now) for p in placed]


def shares_held(state: policy.QueueState, placements: list[policy.Placement]) -> dict[int, int]:
    """What each shared placement holds on each of its GPUs: its job's share and context reserve."""
    shared = {p.job_id for p in placements if p.shared}
    if not shared:
        return {}
    return {j.id: packing.need_mib(j, state.shared_context_mib) for j in state.jobs if j.id in shared}
