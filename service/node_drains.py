"""Drained nodes: a node an admin drained finishes its running jobs and starts no new ones until
it is resumed (`gpuq drain`, `gpuq resume`; SLURM's DRAIN state), and a maintenance window, a drain
planned ahead (`gpuq drain NODE --at TIME [--until TIME]`).

A window is SLURM's maintenance reservation over the node: until its start the node starts only
jobs whose time limit ends by then (a job without a limit never starts there), so that nothing is
running when the admin takes it down; from its start on the node is drained as if drained then;
at its end (``--until``) it is in service again by itself, and without one it stays drained until
`gpuq resume`. Running jobs are never stopped by it. A job that fits no node but those to drain
for good before it could end waits (``policy.NODE_DRAINING``) without holding the queue behind it,
as a job that fits only drained nodes does; one that fits a node whose window ends is planned there
from its end.

The ``nodes`` table holds both: ``drained`` for a drain now, ``drain_at`` and ``drain_until`` for a
window, whose row reads as drained while it lasts (``drained_now``): nothing has to flip it then.
A window past its end is cleared by the scheduler's whole passes (``end_windows``), so that the
node's next-up lists (which a node with a window set does not use) come back."""

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
# The nodes drained now or with a window.
_SET = or_(_NODES.c.drained.is_(True), _NODES.c.drain_at.is_not(None))
# Their state, the scheduler's read once a pass (a handful of rows).
DRAINS = select(_NODES.c.name, _NODES.c.drained, _NODES.c.drain_at, _NODES.c.drain_until).where(_SET)


def _drained(is_drained: bool, at: datetime | None, until: datetime | None, now: datetime) -> bool:
    """Whether a node is drained at ``now``: drained until resumed, or in its window."""
    return is_drained or (at is not None and at <= now and (until is None or now < until))


@dataclass(frozen=True)
class Drains:
    """The nodes drained now, and the windows to come as (start, end or None), epoch s, by node."""

    now: frozenset[str]
    ahead: dict[str, tuple[float, float | None]]

    @classmethod
    def of(cls, rows: Any, now: datetime) -> Drains:
        """From ``DRAINS``' rows, at ``now``."""
        drained, ahead = set(), {}
        for name, is_drained, at, until in rows:
            if _drained(is_drained, at, until, now):
                drained.add(name)
            elif at > now:
                ahead[name] = (at.timestamp(), None if until is None else until.timestamp())
        return cls(frozenset(drained), ahead)


def read(session: Session, now: datetime | None = None) -> Drains:
    return Drains.of(session.execute(DRAINS).all(), now or utcnow())


def drained_now(node: Node, now: datetime) -> bool:
    return _drained(node.drained, node.drain_at, node.drain_until, now)


def _ahead(node: Node, now: datetime) -> bool:
    """Whether the node has a window still to start."""
    return not node.drained and node.drain_at is not None and node.drain_at > now


def _clear(node: Node, drained: bool = False) -> None:
    node.drained, node.drain_at, node.drain_until = drained, None, None
    node.drain_reason, node.drained_at, node.drained_by = None, None, None


# The name that stands for every node gpuq knows, as SLURM's `Nodes=ALL` (a maintenance window for
# the whole cluster, `gpuq resume ALL` after it).
ALL = "ALL"


def named(session: Session, names: list[str]) -> list[str]:
    """The nodes ``names`` names, each once, in order: ALL is every node with GPUs in service and
    every node drained or with a window (whose GPUs may be retired meanwhile)."""
    out: dict[str, None] = {}
    for name in names:
        if name != ALL:
            out[name] = None
            continue
        every = set(session.scalars(select(Gpu.node).where(Gpu.retired_at.is_(None))))
        every.update(session.scalars(select(_NODES.c.name).where(_SET)))
        if not every:
            raise InvalidSpec("no node is known to gpuq yet: ALL names none")
        out.update(dict.fromkeys(sorted(every)))
    return list(out)


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
    """Drain a node now, until resumed (running jobs finish, nothing new starts there), or resume
    it; ``by``: who drained it. A window, to come or under way, becomes this drain (keeping its
    reason unless given another); resuming calls a window off or ends it. True where a drained node
    was only given a new reason."""
    row = _known(session, node)
    now = utcnow()
    planned = _ahead(row, now)
    if not drained:
        # Resuming a node also gives back its GPUs drained one by one (a lost GPU, once fixed).
        freed = rows_changed(session.execute(update(Gpu).where(Gpu.node == node, Gpu.drain_reason.is_not(None))
                                             .values(drain_reason=None)))
        was = planned or drained_now(row, now)
        _clear(row)  # a window past its end too, that no pass has cleared yet
        if not was and not freed:
            raise StateConflict(f"node {node} is not drained")
        return False
    if row.drained:
        if reason is not None and reason != row.drain_reason:
            # Drained again with a new reason: the reason changes (as `scontrol update ... reason=`),
            # with no resume in between that would let jobs start there.
            row.drain_reason, row.drained_at, row.drained_by = reason, utcnow(), by
            return True
        raise StateConflict(f"node {node} is already drained (give --reason to change its reason)")
    kept = row.drain_reason if (planned or drained_now(row, now)) and reason is None else reason
    _clear(row, drained=True)
    row.drain_reason, row.drained_at, row.drained_by = kept, now, by
    return False


def plan(session: Session, node: str, at: datetime | None, until: datetime | None = None,
         reason: str | None = None, by: str | None = None) -> tuple[datetime, datetime | None] | None:
    """A maintenance window on ``node``: drained from ``at`` (None: the start of the window it has,
    under way or to come, else now) until ``until`` (None: until `gpuq resume`). Given again it moves the window
    (its reason kept unless given another); the window it replaced, as (start, end), else None."""
    row = _known(session, node)
    now = utcnow()
    if at is not None and at <= now:
        raise InvalidSpec(f"--at {utc(at)} is past already: drain the node now with `gpuq drain {node}`")
    if row.drained:
        raise StateConflict(f"node {node} is drained until resumed: `gpuq resume {node}` first to give it a "
                            "window instead")
    begun = row.drain_at if drained_now(row, now) else None  # a window under way: when it began
    if begun is not None and at is not None:
        raise StateConflict(f"node {node}'s window started at {utc(begun)} already: give --until alone to "
                            f"move its end, or `gpuq resume {node}` first")
    coming = row.drain_at if _ahead(row, now) else None  # a window to come: when it starts
    start = begun or at or coming or now
    if until is not None and until <= max(start, now):
        raise InvalidSpec(f"--until {utc(until)} is not after the window's start, {utc(max(start, now))}")
    had = begun or coming
    before = None if had is None else (had, row.drain_until)
    if before is None or reason is not None:
        row.drain_reason = reason
    row.drain_at, row.drain_until = start, until
    row.drained_at, row.drained_by = start, by  # drained from then on, by whom: what `sinfo -R` lists then
    return before


def window_of(session: Session, node: str) -> tuple[datetime, datetime | None]:
    """The node's window as written: its start and end (None: until resumed)."""
    row = session.get(Node, node)
    assert row is not None and row.drain_at is not None
    return row.drain_at, row.drain_until


def end_windows(session: Session, now: datetime | None = None) -> int:
    """Clear the windows past their end (the nodes are in service again): how many."""
    over = (Node.drained.is_(False), Node.drain_until.is_not(None), Node.drain_until <= (now or utcnow()))
    return rows_changed(session.execute(update(Node).where(*over).values(
        drain_at=None, drain_until=None, drain_reason=None, drained_at=None, drained_by=None)))


def notes(session: Session) -> tuple[dict[str, str | None], dict[str, dict[str, Any]]]:
    """In one read, ``drained_nodes`` and ``drains_ahead``: what every front-end shows under the GPUs."""
    now = utcnow()
    drained: dict[str, str | None] = {}
    ahead: dict[str, dict[str, Any]] = {}
    for n in session.scalars(select(Node).where(_SET)):
        if drained_now(n, now):
            drained[n.name] = _drain_note(n)
        elif n.drain_at is not None and _ahead(n, now):
            ahead[n.name] = {"at": n.drain_at.isoformat(), "until": n.drain_until and n.drain_until.isoformat(),
                             "note": _plan_note(n)}
    return drained, ahead


def drained_nodes(session: Session) -> dict[str, str | None]:
    """Each node drained now, with its reason, who drained it, since when and, in a window, until
    when (as `sinfo -R` lists them): ``maintenance; by root since 2026-11-26 16:30 UTC``."""
    return notes(session)[0]


def drains_ahead(session: Session) -> dict[str, dict[str, Any]]:
    """Each window still to start: ``{"at": ISO time, "until": ISO time or None, "note": its
    reason and who planned it}``."""
    return notes(session)[1]


def _drain_note(node: Node) -> str | None:
    signed = " ".join(([f"by {node.drained_by}"] if node.drained_by else []) +
                      ([f"since {node.drained_at:%Y-%m-%d %H:%M} UTC"] if node.drained_at else []) +
                      ([f"until {node.drain_until:%Y-%m-%d %H:%M} UTC"] if node.drain_until else []))
    if not signed:
        return node.drain_reason  # drained before gpuq kept who and when
    return f"{node.drain_reason or 'no reason given'}; {signed}"


def _plan_note(node: Node) -> str:
    return f"{node.drain_reason or 'no reason given'}" + (f"; by {node.drained_by}" if node.drained_by else "")
