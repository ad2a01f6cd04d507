"""What the scheduler reads from SQL for a pass (``read_queue``): the pending jobs, the live GPUs,
who uses how many, each user's fair share, and which jobs cannot be considered and why.

A submit reads it too, to place its own jobs (``allocating.place_at_submit``): what both read is
Prepared."""

from __future__ import annotations

import math
from collections import Counter, defaultdict, namedtuple
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Select, bindparam, func, select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import deadline, dependencies, held_back, node_drains, policy
from gpuq.service.constants import State
from gpuq.service.display import ADMIN_HELD, preemption_asked
from gpuq.service.fair_share import FairShare
from gpuq.service.forecast import Awaiting, start_times
from gpuq.service.held_back import ArrayLimits
from gpuq.service.inventory import live_cutoff
from gpuq.service.lifecycle import waiting
from gpuq.service.models import Allocation, Gpu, Job, table, utcnow
from gpuq.service.node_use import needs, node_uses, offers_of
from gpuq.service.prepared import Prepared
from gpuq.service.queue_state import JobRequest, Preemptible
from gpuq.service.settings import Settings
from gpuq.service.units import AFTER_ANY, AFTER_CORR, AFTER_OK, AFTER_START

# Core rows, and statements built once: the ORM's per-row bookkeeping is most of the cost at
# 10,000 jobs, and building the statement most of it for a submit's few. What a quick pass (many a
# second under a flood) and a submit read is Prepared; a whole pass's read of every pending job is
# not (SQLAlchemy makes its rows in C).
_t = table(Job).c
_PENDING_COLUMNS = (_t.id, _t.user, _t.gpus, _t.priority, _t.submitted_at, _t.mem_mib, _t.on_node, _t.time_limit_s,
                    _t.held, _t.after, _t.after_kind, _t.reason, _t.shared, _t.array_id, _t.array_limit,
                    _t.begin_at, _t.gpu_type, _t.singleton, _t.name, _t.exclude_nodes, _t.preemptible,
                    _t.deadline_at, _t.cpus, _t.host_mem_mib)
# A pending job as ``_PENDING_COLUMNS`` read it, made from the values it was written with.
_PENDING_NAMES: list[str] = [str(col.name) for col in _PENDING_COLUMNS]
_PendingRow = namedtuple("_PendingRow", _PENDING_NAMES)  # type: ignore[misc]


def pending_row(values: dict[str, Any]) -> Any:
    """A job row's ``values`` (a column name each, as an insert's) as ``read_queue``'s ``only`` takes it."""
    return _PendingRow(**{name: values.get(name) for name in _PENDING_NAMES})


_ALL_PENDING = select(*_PENDING_COLUMNS).where(_t.state == State.PENDING)
_DRAINS = Prepared(node_drains.DRAINS)
_ALLOCATED = Prepared(select(table(Allocation).c.gpu_id, _t.user, _t.started_at, _t.time_limit_s,
                             table(Allocation).c.share_mib, _t.gpu_share, _t.id, _t.preemptible, _t.priority,
                             _t.cancel_requested_at, _t.reason, _t.node, _t.cpus, _t.host_mem_mib).join_from(
    table(Allocation), table(Job), table(Allocation).c.job_id == _t.id))
_g = table(Gpu).c
_LIVE_GPUS = Prepared(select(_g.id, _g.node, _g.index, _g.queue, _g.memory_total_mib, _g.memory_used_mib,
                             _g.foreign_mib, _g.name, _g.node_cpus, _g.node_host_mem_mib)
                      .where(_g.heartbeat_at >= bindparam("cutoff"), _g.drain_reason.is_(None)))


def _users_waiting() -> Select[Any]:
    """The users with a waiting job that is not held, in name order: a skip from each user to the
    next through the index (a recursive query), where DISTINCT would read every waiting job."""
    j = table(Job).alias("j")
    first = select(func.min(_t.user).label("user")).where(*waiting()).cte("waiting_users", recursive=True)
    after = first.alias("previous")
    following = select(func.min(j.c.user)).where(*waiting(j), j.c.user > after.c.user).scalar_subquery()
    users = first.union_all(select(following).where(after.c.user.is_not(None)))
    return select(users.c.user).where(users.c.user.is_not(None))


_WAITING_USERS = Prepared(_users_waiting())
_USER_HEAD = Prepared(select(*_PENDING_COLUMNS).where(*waiting(), _t.user == bindparam("user"))
                      .order_by(_t.priority.desc(), _t.submitted_at, _t.id).limit(bindparam("head")))


@dataclass
class QueueRead:
    """What the scheduler read from SQL for one pass: the policy's input and what only the scheduler needs."""

    policy: policy.QueueState
    # Pending jobs that cannot be considered, and why (held, dependency, drained node).
    not_eligible: dict[int, str]
    # Pending jobs whose dependency can never be met: cancelled with this reason.
    doomed: dict[int, str]
    # The reason each pending job shows now, to write only those that change.
    shown: dict[int, str | None]
    # Jobs that wait for their begin time alone, and that moment (epoch s): what a forecast plans
    # from then on (`gpuq status --start`), as SLURM's expected start of a job with a BeginTime.
    later: list[tuple[JobRequest, float]] = field(default_factory=list)
    # Tasks held back by their array's limit (`--array 0-99%4`), and each such array's limit and
    # its running tasks' expected ends (epoch s): a forecast plans them as the limit lets them run.
    throttled: list[JobRequest] = field(default_factory=list)
    array_limits: ArrayLimits = field(default_factory=dict)
    # Jobs that wait for other jobs to succeed, end or start, as their rows (``_PENDING_COLUMNS``;
    # the pass needs no more of them): a forecast plans them from their dependencies' expected ends
    # (``forecast.Awaited``). Not a singleton's wait, nor afternotok's, which waits for a failure.
    awaiting: list[Any] = field(default_factory=list)


def read_queue(session: Session, settings: Settings, fair_share: FairShare | None = None,
               head: int | None = None, only: Sequence[Any] | None = None, also: Sequence[Any] = ()) -> QueueRead:
    """What one pass needs from SQL. With ``head``, only each user's first ``head`` pending jobs
    that are not held (a quick pass; see ``_pending``), else every pending job. ``only``: every
    pending job there is, known to the caller (a submit's own rows, when no other job waits), as
    rows with ``_PENDING_COLUMNS``' names; they are not read again. ``also``: jobs not written, as
    such rows, read as pending with the rest (a submit's estimate, service/estimate.py)."""
    now = utcnow()
    conn = session.connection()  # Prepared statements: a submit reads this to place its job
    drains = node_drains.Drains.of(_DRAINS.run(conn, {}), now)
    drained = drains.now
    busy: dict[int, float] = {}
    # Each GPU's shared jobs, (expected end, MiB of share and reserve); each user's GPUs, (expected
    # end, GPUs charged).
    shares: dict[int, list[tuple[float, int]]] = defaultdict(list)
    holds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    preemptible: dict[int, Preemptible] = {}
    preempted: set[int] = set()
    # Each GPU's shares that a preemption may take, and those it is taking (``GpuState``'s).
    preemptible_shares: dict[int, list[tuple[Preemptible, float, int]]] = defaultdict(list)
    preempted_shares: dict[int, list[tuple[float, int]]] = defaultdict(list)
    exempt = settings.preempt_exempt_s
    exempt_until: dict[int, float] = {}
    exempt_jobs: dict[int, float] = {}  # by job, for its node's cores and memory (a gang's rows: one job)
    uses = node_uses()
    for a in _ALLOCATED.run(conn, {}):
        gpu_id, user, started, limit, share_mib, gpu_share = a[:6]
        ends = (started or now).timestamp() + limit if limit else math.inf
        if a.preemptible and (now - (started or now)).total_seconds() < exempt:
            exempt_jobs[a.id] = (started or now).timestamp() + exempt
        if a.node is not None:  # a gang's rows hold its node's cores and memory once
            for kind, amount in needs(a).items():
                uses[kind].holds.setdefault(a.node, {})[a.id] = (ends, amount)
        if share_mib is None:
            busy[gpu_id] = ends
            if a.cancel_requested_at is not None:
                if preemption_asked(a.reason):
                    preempted.add(gpu_id)
            elif a.preemptible and (now - (started or now)).total_seconds() >= exempt:
                preemptible[gpu_id] = Preemptible(a.id, a.priority, (started or now).timestamp())
            elif a.preemptible:  # not yet: a later pass preempts it, and the forecast plans so
                exempt_until[gpu_id] = (started or now).timestamp() + exempt
            if not a.preemptible:  # held to no user limit, and counting against none
                holds[user].append((ends, 1.0))
            continue
        shares[gpu_id].append((ends, share_mib))
        if a.cancel_requested_at is not None:
            if preemption_asked(a.reason):
                preempted_shares[gpu_id].append((ends, share_mib))
        elif a.preemptible and (now - (started or now)).total_seconds() >= exempt:
            # One within GPUQ_PREEMPT_EXEMPT holds its share as any job does until then.
            preemptible_shares[gpu_id].append((Preemptible(a.id, a.priority, (started or now).timestamp()), ends,
                                               share_mib))
        # A shared job counts what it is charged (its share of the GPU), as fair share does; a
        # preemptible one counts against no limit.
        if not a.preemptible:
            holds[user].append((ends, gpu_share if gpu_share is not None else 1.0))
    in_use = {user: sum(charge for _, charge in held) for user, held in holds.items()}
    live = _LIVE_GPUS.run(conn, {"cutoff": live_cutoff(settings)})
    for kind, offer in offers_of(live).items():  # a node reporting none counts none
        uses[kind].offer = {node: float(offered) for node, offered in offer.items()}
    gpus = [policy.GpuState(id=g.id, node=g.node, index=g.index, queue=g.queue, memory_total_mib=g.memory_total_mib,
                            memory_used_mib=g.memory_used_mib or 0, foreign_mib=g.foreign_mib or 0,
                            busy_until=busy.get(g.id), shares=tuple(sorted(shares.get(g.id, []))),
                            model=g.name, preemptible=preemptible.get(g.id), preempted=g.id in preempted,
                            preemptible_shares=tuple(preemptible_shares.get(g.id, ())),
                            preempted_shares=tuple(preempted_shares.get(g.id, ())),
                            exempt_until=exempt_until.get(g.id), **_window(drains, g.node))
            for g in live if g.node not in drained]
    # A job too big for every node in service but not for a drained one waits for the drain to
    # end, not for "resources" (every node drained, the usual case, left every job reading so).
    per_node = Counter(g.node for g in live)
    in_service = max((n for node, n in per_node.items() if node not in drained), default=0)
    in_drained = max((n for node, n in per_node.items() if node in drained), default=0)

    def drain_keeps(gpus: int, exclude: Sequence[str] | None) -> bool:
        """Whether a job of ``gpus`` GPUs, kept off ``exclude``, would fit a drained node and no other."""
        if not exclude:
            return in_service < gpus <= in_drained
        nodes = [(node, n) for node, n in per_node.items() if node not in exclude]
        return (max((n for node, n in nodes if node not in drained), default=0) < gpus
                <= max((n for node, n in nodes if node in drained), default=0))
    pending, last = _pending(session, head) if only is None else _heads(only, head)
    pending = [*pending, *also] if also else pending
    # Fair share orders users against each other: a quick pass over one user's queue needs none
    # (the whole pass, which also explains every wait, always reads it).
    users = {row.user for row in pending}
    hours = (fair_share or FairShare(settings)).gpu_hours(session, now) if head is None or len(users) > 1 else {}
    # The earliest place in the queue a user's job left unread could have: a preemptible job read
    # may come after one left out, which is not (a quick pass leaves it to the next whole one).
    cut = min((policy.order_key(replace(request_of(r), preemptible=False), hours) for r in last),
              default=None) if head is not None else None
    deps, states = dependencies.look_up(conn, (d for row in pending for d in (row.after or [])))
    jobs, not_eligible, doomed = [], {}, {}
    later: list[tuple[JobRequest, float]] = []
    awaiting: list[Any] = []
    for row in pending:
        waits_for = dependencies.standing(row.after_kind, deps, states) if row.after else deps
        never = dependencies.never_met(row.after_kind, row.after, waits_for) if row.after else None
        if never is None and row.deadline_at is not None:
            never_in_time = deadline.missed(row.deadline_at, row.time_limit_s, now)
            if never_in_time is not None:  # cancelled now, held or waiting alike: it could no longer end in time
                doomed[row.id] = never_in_time
                continue
        if never is not None:
            # Cancelled now, held or before its begin time alike (as SLURM's kill_invalid_depend):
            # no release or later moment could let it run, and its chain should learn so as soon
            # as the dependency failed (or, for afternotok, succeeded).
            doomed[row.id] = f"dependency never satisfied: {never}"
            continue
        if row.held:
            # In the hold's own words where it wrote them: who requeued and held it, an admin's hold
            # (a whole pass wrote "held" over them, and `gpuq why` lost who held the job).
            held_by = row.reason is not None and row.reason.startswith((c.REQUEUED_HELD_BY, ADMIN_HELD))
            not_eligible[row.id] = row.reason if held_by else policy.HELD
            continue
        unmet = bool(row.after) and not dependencies.all_met(row.after_kind, row.after, waits_for)
        if row.begin_at is not None and row.begin_at > now:
            not_eligible[row.id] = policy.BEGIN_TIME
            if not unmet:
                later.append((request_of(row), row.begin_at.timestamp()))
            elif row.after_kind in FORESEEN_KINDS and not row.singleton:
                awaiting.append(row)  # from its begin time or its dependencies' end, the later
            continue
        if unmet:
            not_eligible[row.id] = policy.DEPENDENCY
            if row.after_kind in FORESEEN_KINDS and not row.singleton:
                awaiting.append(row)
            continue
        if row.on_node in drained or (row.on_node is None and drained and drain_keeps(row.gpus, row.exclude_nodes)):
            not_eligible[row.id] = policy.NODE_DRAINED
            continue
        job = request_of(row)
        if cut is None or policy.order_key(job, hours) <= cut:
            jobs.append(job)
    jobs, throttled, array_limits = held_back.within_array_limits(conn, pending, jobs, hours, not_eligible, now)
    jobs = held_back.one_singleton_each(conn, pending, jobs, hours, not_eligible)
    state = policy.QueueState(now=now.timestamp(), jobs=jobs, gpus=gpus, gpu_hours=hours,
                              gpus_in_use=in_use, user_gpu_limit=settings.user_gpu_limit,
                              user_gpu_limits=settings.gpu_limits,
                              user_holds=dict(holds) if settings.gpu_limited else {},
                              shared_context_mib=settings.shared_context_mib, node_use=uses,
                              exempt_until=exempt_jobs)
    return QueueRead(state, not_eligible, doomed, {row.id: row.reason for row in pending}, later, throttled,
                     array_limits, awaiting)


def _window(drains: node_drains.Drains, node: str) -> dict[str, float | None]:
    """A GPU's ``closes_at`` and ``reopens_at``: its node's maintenance window to come, if any."""
    start, end = drains.ahead.get(node, (None, None))
    return {"closes_at": start, "reopens_at": end}


# The dependencies a forecast can plan a job after: their success or end (assumed a success), or start.
FORESEEN_KINDS = (AFTER_OK, AFTER_ANY, AFTER_CORR, AFTER_START)


def planned_starts(session: Session, read: QueueRead, decision: policy.Decision,
                   where: dict[int, list[policy.GpuState]] | None = None) -> dict[int, float | None]:
    """The expected starts of a read queue and its decision (``forecast.start_times``): a job
    waiting for its begin time planned from then on, a task its array's limit holds back as the
    limit lets it run, and a job waiting for others from their expected ends (``where``: told each
    one's GPUs). `gpuq status --start`, `gpuq why` and `submit --test-only` all read it."""
    waits, ends = awaited(session, read)
    return start_times(read.policy, decision, later=read.later, where=where, throttled=read.throttled,
                       arrays=read.array_limits, awaiting=waits, awaited_ends=ends)


def awaited(session: Session, read: QueueRead) -> tuple[list[Awaiting], dict[int, float]]:
    """The jobs ``read`` found waiting for others, as a forecast plans them, and the expected end
    of each started job they wait for (``forecast.start_times``' ``awaiting`` and ``ends``): read
    only for a forecast, which a pass makes none of."""
    if not read.awaiting:
        return [], {}
    now = read.policy.now
    jobs, ends = dependencies.unended(session.connection(), (d for row in read.awaiting for d in row.after), now)

    def not_ended(d: int, kind: str) -> list[int]:
        """The jobs not ended that id ``d`` stands for: an aftercorr task's own alone (its id may be
        its array's too), else the job's or every task of the array's."""
        if kind == AFTER_CORR:
            return [d] if d in jobs.get(d, ()) else []
        return jobs.get(d, [])

    out = []
    for row in read.awaiting:
        after = tuple(dict.fromkeys(j for d in row.after for j in not_ended(d, row.after_kind)))
        begin = row.begin_at.timestamp() if row.begin_at is not None else now
        out.append(Awaiting(request_of(row), after, row.after_kind == AFTER_START, max(now, begin)))
    return out, ends


def request_of(row: Any) -> policy.JobRequest:
    """The policy's view of a pending job row (``_PENDING_COLUMNS``)."""
    return policy.JobRequest(id=row.id, user=row.user, gpus=row.gpus, priority=row.priority,
                             submitted=row.submitted_at.timestamp(), mem_mib=row.mem_mib, node=row.on_node,
                             time_limit_s=row.time_limit_s, shared=bool(row.shared), gpu_type=row.gpu_type,
                             singleton=bool(row.singleton), exclude=frozenset(row.exclude_nodes or ()),
                             array=row.array_id if row.array_limit is not None else None,
                             preemptible=bool(row.preemptible), cpus=row.cpus, host_mem_mib=row.host_mem_mib)


def _heads(rows: Sequence[Any], head: int | None) -> tuple[list[Any], list[Any]]:
    """``_pending``'s answer over ``rows``, all the pending jobs there are, instead of SQL's."""
    if head is None:
        return list(rows), []
    got = sorted((r for r in rows if not r.held), key=lambda r: (-r.priority, r.submitted_at, r.id))[:head]
    return got, got[-1:] if len(got) == head else []


def _pending(session: Session, head: int | None) -> tuple[list[Any], list[Any]]:
    """The pending jobs a pass looks at, and []; or, with ``head``, each user's first ``head``
    jobs that are not held (in their queue order) and each user's ``head``-th job (the last one
    read of a user whose jobs were cut short).

    A user's queue order is their own jobs' (priority, then submission): every job of theirs
    left out comes after their ``head``-th one. So up to the earliest such last-read job of any
    user (``read_queue``'s cut), the head holds every eligible job, and ``policy.decide`` over
    those decides as over the whole queue. Reading it costs a few index seeks per user
    (``ix_jobs_queue_order``), however long the queue: a window over every pending job cost
    about 35 ms at 10,000, on every submit and job end."""
    conn = session.connection()
    if head is None:
        return list(conn.execute(_ALL_PENDING).all()), []
    rows, last = [], []
    for user, in _WAITING_USERS.run(conn, {}):
        got = _USER_HEAD.run(conn, {"user": user, "head": head})
        rows += got
        if len(got) == head:
            last.append(got[-1])
    return rows, last
