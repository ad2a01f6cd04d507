"""Drained nodes: a node an admin drained finishes its running jobs and starts no new ones until
it is resumed (`gpuq drain`, `gpuq resume`; SLURM's DRAIN state), and a drain planned ahead, for a
maintenance window (`gpuq drain NODE --at TIME`).

A planned drain is SLURM's maintenance reservation over the node, open-ended: until its time the
node starts only jobs whose time limit ends by then (a job without a limit never starts there), so
that nothing is running when the admin takes it down; from its time on the node is drained as if
drained then, and stays so until `gpuq resume`. Running jobs are never stopped by it. A job that
fits no node but those to drain before it could end waits (``policy.NODE_DRAINING``) without
holding the queue behind it, as a job that fits only drained nodes does.

The ``nodes`` table holds both: ``drained`` for a drain now, ``drain_at`` for a planned one, whose
row reads as drained once its time has come (``drained_now``): nothing has to flip it then."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from gpuq.service.db import rows_changed
from gpuq.service.display import utc
from gpuq.service.errors import InvalidSpec, StateConflict
from gpuq.service.models import Gpu, Node, table, utcnow

_NODES = table(Node)
# Every node drained now or to be drained: the scheduler's read, once a pass (a handful of rows).
DRAINS = select(_NODES.c.name, _NODES.c.drained, _NODES.c.drain_at).where(
    or_(_NODES.c.drained.is_(True), _NODES.c.drain_at.is_not(None)))


@dataclass(frozen=True)
class Drains:
    """The nodes drained now, and those to drain later with when (epoch s), as a pass reads them."""

    now: frozenset[str]
    ahead: dict[str, float]

    @classmethod
    def of(cls, rows: Any, now: datetime) -> Drains:
        """From ``DRAINS``' rows, at ``now``."""
        drained, ahead = set(), {}
        for name, is_drained, at in rows:
            if is_drained or at <= now:
                drained.add(name)
            else:
                ahead[name] = at.timestamp()
        return cls(frozenset(drained), ahead)


def read(session: Session, now: datetime | None = None) -> Drains:
    return Drains.of(session.execute(DRAINS).all(), now or utcnow())


def drained_now(node: Node, now: datetime) -> bool:
    return node.drained or (node.drain_at is not None and node.drain_at <= now)


def _known(session: Session, name: str) -> Node:
    """The node's row, made where gpuq knows the node by its GPUs alone."""
    row = session.get(Node, name)
    if row is not None:
        return row
    if session.scalar(select(Gpu.id).where(Gpu.node == name).limit(1)) is None:
        raise InvalidSpec(f"no node {name} is known to gpuq")
    row = Node(name=name, drained=False)
    session.add(row)
    return row


def set_drained(session: Session, node: str, drained: bool, reason: str | None = None, by: str | None = None
                ) -> bool:
    """Drain a node now (running jobs finish, nothing new starts there) or resume it; ``by``: who
    drained it. A drain planned for later is brought forward to now (keeping its reason unless
    given another), and resuming lifts it too. True where a drained node was only given a new reason."""
    row = _known(session, node)
    now = utcnow()
    planned = row.drain_at is not None and row.drain_at > now
    if not drained:
        # Resuming a node also gives back its GPUs drained one by one (a lost GPU, once fixed).
        freed = rows_changed(session.execute(update(Gpu).where(Gpu.node == node, Gpu.drain_reason.is_not(None))
                                             .values(drain_reason=None)))
        if not drained_now(row, now) and not planned:
            if freed:
                return False
            raise StateConflict(f"node {node} is not drained")
        row.drained, row.drain_at, row.drain_reason, row.drained_at, row.drained_by = False, None, None, None, None
        return False
    if drained_now(row, now):
        if reason is not None and reason != row.drain_reason:
            # Drained again with a new reason: the reason changes (as `scontrol update ... reason=`),
            # with no resume in between that would let jobs start there.
            row.drained, row.drain_at = True, None
            row.drain_reason, row.drained_at, row.drained_by = reason, utcnow(), by
            return True
        raise StateConflict(f"node {node} is already drained (give --reason to change its reason)")
    row.drained, row.drain_at = True, None
    row.drain_reason = reason if reason is not None or not planned else row.drain_reason
    row.drained_at, row.drained_by = now, by
    return False


def plan(session: Session, node: str, at: datetime, reason: str | None = None, by: str | None = None
         ) -> datetime | None:
    """Drain ``node`` at ``at`` (a maintenance window's start); the time it was to drain before,
    where this moves a planned drain (its reason kept unless given another), else None."""
    row = _known(session, node)
    now = utcnow()
    if at <= now:
        raise InvalidSpec(f"--at {utc(at)} is past already: drain the node now with `gpuq drain {node}`")
    if drained_now(row, now):
        raise StateConflict(f"node {node} is drained already: `gpuq resume {node}` first to drain it later instead")
    before = row.drain_at
    row.drain_at = at
    row.drain_reason = reason if reason is not None or before is None else row.drain_reason
    row.drained_at, row.drained_by = at, by  # drained from then on, by whom: what `sinfo -R` lists then
    return before


def drained_nodes(session: Session) -> dict[str, str | None]:
    """Each node drained now, with its reason, who drained it and since when (as `sinfo -R` lists
    them): ``maintenance; by root since 2026-11-26 16:30 UTC``."""
    now = utcnow()
    return {n.name: _drain_note(n) for n in _rows(session) if drained_now(n, now)}


def drains_ahead(session: Session) -> dict[str, dict[str, Any]]:
    """Each node to drain later: ``{"at": ISO time, "note": its reason and who planned it}``."""
    now = utcnow()
    return {n.name: {"at": n.drain_at.isoformat(), "note": _plan_note(n)} for n in _rows(session)
            if n.drain_at is not None and not drained_now(n, now)}


def _rows(session: Session) -> list[Node]:
    return list(session.scalars(select(Node).where(or_(Node.drained.is_(True), Node.drain_at.is_not(None)))))


def _drain_note(node: Node) -> str | None:
    signed = " ".join(([f"by {node.drained_by}"] if node.drained_by else []) +
                      ([f"since {node.drained_at:%Y-%m-%d %H:%M} UTC"] if node.drained_at else []))
    if not signed:
        return node.drain_reason  # drained before gpuq kept who and when
    return f"{node.drain_reason or 'no reason given'}; {signed}"


def _plan_note(node: Node) -> str:
    return f"{node.drain_reason or 'no reason given'}" + (f"; by {node.drained_by}" if node.drained_by else "")

