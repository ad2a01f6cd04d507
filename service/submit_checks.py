"""A submission's checks, before anything is written: GPUs enough of the kind asked for on one node
(those registered, and this node's own), the time limit and --signal, the dependencies, the
user's pending cap and priority; and the idempotency key a refused submission may have used.

They read in one read-only transaction (``check_submission``), so a submit's write transaction
(on SQLite, the one write lock) holds only its inserts and its placement."""

from __future__ import annotations

import time
from collections import Counter

from sqlalchemy import bindparam, false, func, select, true
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import deadline, dependencies, policy, rights
from gpuq.service.allocations import check_node
from gpuq.service.constants import State
from gpuq.service.db import read_scope
from gpuq.service.devices import GpuInfo, open_devices
from gpuq.service.display import time_limit
from gpuq.service.errors import DuplicateSubmission, GpuqError, InvalidSpec, NotAllowed, OverLimit, StateConflict
from gpuq.service.models import Gpu, Job, Submission, table
from gpuq.service.node_use import CPUS, OFFERED_BY, SLACK, WORDS
from gpuq.service.prepared import Prepared
from gpuq.service.settings import Settings
from gpuq.service.spec import JobSpec
from gpuq.service.units import AFTER_ANY, AFTER_OK, JobSignal

_JOBS = table(Job)


_SUBMITTED = table(Submission)


_SUBMITTED_WITH = Prepared(select(_SUBMITTED.c.user, _SUBMITTED.c.job_ids).where(_SUBMITTED.c.key == bindparam("key")))


_GPUS_PER_NODE = Prepared(select(table(Gpu).c.node, func.count()).where(table(Gpu).c.retired_at.is_(None))
                          .group_by(table(Gpu).c.node))


# Held or not as a list of both: the count then seeks this user's jobs in the queue-order index
# (state, held, user, ...) once per value, instead of counting through every pending job of everyone.
_PENDING_OF = Prepared(select(func.count()).select_from(_JOBS).where(
    _JOBS.c.state == State.PENDING, _JOBS.c.held.in_([false(), true()]), _JOBS.c.user == bindparam("user")))


def largest_node(session: Session, settings: Settings, local: list[GpuInfo]) -> tuple[str | None, int]:
    """The node with the most GPUs known to gpuq (registered by workers, or ``local``: this node's)."""
    rows = _GPUS_PER_NODE.run(session.connection(), {})
    best = max(rows, key=lambda r: r[1], default=(None, 0))
    if len(local) > best[1]:
        return settings.node, len(local)
    return best[0], best[1]


def check_submission(settings: Settings, specs: list[JobSpec], key: str | None) -> bool:
    """A submission's checks, in a read-only transaction. Returns whether the submission takes its
    user past half their pending cap (then the write counts again).

    A key used before answers with its jobs whatever the checks would say now: a check that
    refuses looks the key up first. A key that passes the checks is looked up by its insert, whose
    unique key refuses a second use (``_insert``): a statement fewer on every submit, since a key
    comes back only when an answer was lost."""
    first = specs[0]
    with read_scope(settings) as session:
        try:
            if first.kind == c.KIND_INTERACTIVE and first.on_node is not None:
                check_node(session, first.on_node)
            check_resources(session, settings, first)
            check_time_limit(settings, first.time_limit_s)
            check_dependencies(session, first.after, first.after_kind)
            near_cap = check_pending_limit(session, settings, first.user, len(specs))
            check_priority(settings, first)
            check_signal(first)
            deadline.check(first.deadline_at, first.begin_at, first.time_limit_s)
            if first.host_mem_mib is not None and first.kind != c.KIND_COMMAND:
                raise InvalidSpec("--host-mem limits a command's processes; a built-in workload runs in its worker")
            if first.cpus is not None and first.kind == c.KIND_WORKLOAD:
                raise InvalidSpec("--cpus limits a command's processes; a built-in workload runs in its worker")
            if first.mail_events is not None:
                from gpuq.service.mail import check_can_mail

                check_can_mail(settings)
        except GpuqError:
            if key is not None and (made := submitted_with(session, key, first.user)) is not None:
                raise DuplicateSubmission(key, made) from None
            raise
    return near_cap


# This node's GPUs as a submit's checks count them (they also count the GPUs workers registered):
# asked of NVML, or of the simulation, once a minute at most rather than on every submit the server
# takes, where NVML's initialisation alone can cost more than the rest of the submit.
_LOCAL_GPUS_TTL_S = 60.0


_local_gpus: dict[Settings, tuple[float, list[GpuInfo]]] = {}


def local_gpus(settings: Settings) -> list[GpuInfo]:
    now = time.monotonic()
    known = _local_gpus.get(settings)
    if known is None or now - known[0] > _LOCAL_GPUS_TTL_S:
        known = _local_gpus[settings] = (now, open_devices(settings).list())
    return known[1]


def check_resources(session: Session, settings: Settings, spec: JobSpec) -> None:
    local = local_gpus(settings)
    node, most = largest_node(session, settings, local)
    if most == 0:
        raise InvalidSpec("no GPU is known to gpuq yet: start the workers first (`gpuq up`, or "
                          "`gpuq worker --gpu I` on each GPU node)")
    if spec.on_node is not None:
        n = session.scalar(select(func.count()).select_from(Gpu).where(Gpu.node == spec.on_node,
                                                                       Gpu.retired_at.is_(None))) or 0
        if spec.on_node == settings.node:
            n = max(n, len(local))
        if n == 0:
            raise InvalidSpec(f"--node {spec.on_node}: no such node is known to gpuq")
        if spec.gpus > n:
            raise InvalidSpec(f"--gpus {spec.gpus} is more than node {spec.on_node} has ({n})")
    elif spec.gpus > most:
        raise InvalidSpec(f"--gpus {spec.gpus} is more than any node has (the largest, {node}, has {most})")
    if spec.exclude_nodes:
        check_exclude(session, settings, spec, local)
    if spec.gpu_type is not None:
        check_gpu_type(session, settings, spec, local)
    limit = settings.gpu_limit_of(spec.user)
    if limit and spec.gpus > limit and not spec.preemptible:
        # Accepted, it waited for ever ("user limit"), as one past any node's GPUs would; a
        # preemptible job is held to no limit.
        whose = (f"{spec.user} may hold at once (GPUQ_USER_GPU_LIMITS)" if spec.user in settings.gpu_limits
                 else "a user may hold at once (GPUQ_USER_GPU_LIMIT)")
        raise InvalidSpec(f"--gpus {spec.gpus} is more than the {limit} {whose}: it would never start")
    for kind in OFFERED_BY:
        check_node_offer(session, spec, kind)
    if spec.mem_mib is not None:
        biggest = session.scalar(select(func.max(Gpu.memory_total_mib)).where(Gpu.retired_at.is_(None))) or 0
        here = max((g.memory_total_mib for g in local), default=0)
        most = max(biggest, here)
        if spec.mem_mib > most:
            raise InvalidSpec(f"--mem {spec.mem_mib} MiB is more than any GPU has ({most} MiB)")
        if spec.shared and spec.mem_mib + settings.shared_context_mib > most:
            raise InvalidSpec(f"--mem {spec.mem_mib} MiB and the {settings.shared_context_mib} MiB a shared job's CUDA "
                              f"context is given are more than any GPU has ({most} MiB); drop --shared")


def check_node_offer(session: Session, spec: JobSpec, kind: str) -> None:
    """InvalidSpec where what ``spec`` reserves of ``kind`` (--cpus, --host-mem) is more than any node
    it may run on offers jobs (service/node_use.py): it would wait for ever. Nodes whose workers
    report none are not counted."""
    amount = getattr(spec, kind)
    if amount is None:
        return
    column = getattr(Gpu, OFFERED_BY[kind])
    query = select(Gpu.node, func.min(column)).where(Gpu.retired_at.is_(None), column.is_not(None)).group_by(Gpu.node)
    if spec.on_node is not None:
        query = query.where(Gpu.node == spec.on_node)
    offered: dict[str, int] = {node: most for node, most in session.execute(query)
                               if node not in (spec.exclude_nodes or ()) and most is not None}
    if not offered:
        return
    node, most = max(offered.items(), key=lambda item: (item[1], item[0]))
    if amount > most + SLACK:
        words, option = WORDS[kind]
        asked = f"{amount:g}" if kind == CPUS else f"{amount} MiB"
        where = f"node {node} offers jobs ({most}" if spec.on_node is not None or len(offered) == 1 else \
            f"any node offers jobs (the most, {node}'s, {most}"
        raise InvalidSpec(f"{option} {asked} is more {words} than {where}; GPUQ_{OFFERED_BY[kind].upper()}): it "
                          "would never start")


def check_signal(spec: JobSpec) -> None:
    """InvalidSpec for a --signal that could not be sent as asked: on a built-in workload (it runs in
    its worker, which the signal would reach), or without a time limit to come before."""
    if spec.signal is None:
        return
    sent = JobSignal.parse(spec.signal)
    if spec.kind != c.KIND_COMMAND:
        raise InvalidSpec("--signal is for a command (after --); a built-in workload runs in its worker")
    if spec.time_limit_s is None:
        raise InvalidSpec(f"--signal {sent.text} is sent ahead of a time limit: give --time (this queue sets no "
                          "default time limit, GPUQ_DEFAULT_TIME)")
    if sent.before_s >= spec.time_limit_s:
        limit = time_limit(spec.time_limit_s)
        raise InvalidSpec(f"--signal {sent.text}: {sent.before_s} s before a time limit of {limit} is before its start")


def check_exclude(session: Session, settings: Settings, spec: JobSpec, local: list[GpuInfo]) -> None:
    """InvalidSpec for an ``--exclude`` that names a node gpuq does not know (a typo would exclude
    nothing), the job's own ``--node``, or every node with room for the job's GPUs (it would wait
    for ever)."""
    assert spec.exclude_nodes
    per_node = dict(_GPUS_PER_NODE.run(session.connection(), {}))
    if local:
        per_node[settings.node] = max(per_node.get(settings.node, 0), len(local))
    unknown = [n for n in spec.exclude_nodes if n not in per_node]
    if unknown:
        raise InvalidSpec(f"--exclude {unknown[0]}: no such node is known to gpuq (its nodes: "
                          f"{', '.join(sorted(per_node))})")
    if spec.on_node in spec.exclude_nodes:
        raise InvalidSpec(f"--node {spec.on_node} is one --exclude names")
    left = {n: k for n, k in per_node.items() if n not in spec.exclude_nodes}
    if not any(k >= spec.gpus for k in left.values()):
        raise InvalidSpec(f"--exclude {','.join(spec.exclude_nodes)} leaves no node with {spec.gpus} "
                          f"GPU{'s' if spec.gpus != 1 else ''}: the job would never start")


def check_gpu_type(session: Session, settings: Settings, spec: JobSpec, local: list[GpuInfo]) -> None:
    """InvalidSpec for a --gpu-type no GPU gpuq knows is of (naming the models there are), or of
    which no node (``--node``'s) has ``spec.gpus``: a typo would otherwise wait for ever."""
    assert spec.gpu_type is not None
    gpus = [(node, name) for node, name in session.execute(select(Gpu.node, Gpu.name).where(Gpu.retired_at.is_(None)))]
    if not any(node == settings.node for node, _ in gpus):
        gpus += [(settings.node, g.name) for g in local]  # this node's, before its workers registered them
    per_node = Counter(node for node, name in gpus if policy.is_model(name, spec.gpu_type)
                       and spec.on_node in (None, node) and node not in (spec.exclude_nodes or ()))
    if not per_node:
        models = ", ".join(f"{name} ({n})" for name, n in sorted(Counter(name for _, name in gpus).items()))
        where = f" on node {spec.on_node}" if spec.on_node is not None else ""
        raise InvalidSpec(f"--gpu-type {spec.gpu_type}: no GPU{where} is one (gpuq's GPUs: {models})")
    node, most = per_node.most_common(1)[0]
    if spec.gpus > most:
        raise InvalidSpec(f"--gpus {spec.gpus} is more than any node has of --gpu-type {spec.gpu_type} "
                          f"(the most, {node}, has {most})")


def check_time_limit(settings: Settings, seconds: int | None) -> None:
    """InvalidSpec for a time limit past the queue's maximum (GPUQ_MAX_TIME), at submit and at
    `gpuq update --time`: a lab's MaxTime is refused at once, as SLURM does with EnforcePartLimits,
    rather than left waiting for ever."""
    most = settings.time_limits[1]
    if most is not None and seconds is not None and seconds > most:
        raise InvalidSpec(f"--time {time_limit(seconds)} is more than this queue's maximum, "
                          f"{time_limit(most)} (GPUQ_MAX_TIME)")


def check_pending_limit(session: Session, settings: Settings, user: str, adding: int) -> bool:
    """OverLimit if ``adding`` more jobs take ``user`` past their pending cap; else whether they
    take them past half of it."""
    limit = settings.max_pending_per_user
    if not limit:
        return False
    conn = session.connection()
    pending = _PENDING_OF.run(conn, {"user": user})[0][0]
    if pending + adding > limit:
        raise OverLimit(f"{user} has {pending} jobs pending and the limit is {limit} at once "
                        f"(GPUQ_MAX_PENDING_PER_USER); this submission adds {adding}")
    return 2 * (pending + adding) > limit


def submitted_with(session: Session, key: str, user: str) -> list[int] | None:
    """The ids of the jobs ``user`` submitted with idempotency key ``key``, or None. Another
    user's key is theirs: it is refused, not answered."""
    rows = _SUBMITTED_WITH.run(session.connection(), {"key": key})
    if not rows:
        return None
    row = rows[0]
    if row.user != user:
        raise NotAllowed("that submission key belongs to another user")
    return list(row.job_ids)


def check_priority(settings: Settings, spec: JobSpec) -> None:
    if spec.priority > settings.max_priority and not rights.is_admin_user(settings, spec.user):
        raise InvalidSpec(f"--priority {spec.priority} is above the users' limit of {settings.max_priority}")


def check_dependencies(session: Session, after: list[int] | None, kind: str = AFTER_OK) -> None:
    if not after:
        return
    option = {AFTER_OK: "--after", AFTER_ANY: "--after-any"}.get(kind, f"-d {kind}")
    found, states = dependencies.look_up(session, after)
    found = dependencies.standing(kind, found, states)
    missing = [i for i in after if i not in found]
    if missing:
        raise InvalidSpec(f"{option}: no job {missing[0]}")
    # A job after one that already failed would be cancelled at once (`gpuq run` said 130, as if
    # the user had pressed Ctrl-C): refused here instead, as sbatch refuses a dependency that can
    # never be satisfied (afternotok: one that already succeeded). One that fails later still
    # cancels it, with its reason. An array's id is every task of it (service/dependencies.py).
    doomed = next(((d, why) for d in after if (why := found[d].never_met(kind)) is not None), None)
    if doomed is not None:
        anyway = " (--after-any starts it after any end)" if kind == AFTER_OK else ""
        raise StateConflict(f"{option} {doomed[0]}: {doomed[1]}, so this job would never start{anyway}")
