"""`gpuq why`: why a job waits, in a sentence with the figures, like SLURM's REASON but spelled out."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuq.service import constants as c
from gpuq.service import deadline, dependencies, node_use, policy
from gpuq.service.constants import State
from gpuq.service.display import expected_at, gpu_hours_text, preempted_by, time_limit, utc, window_span
from gpuq.service.forecast import NO_START
from gpuq.service.inventory import live_cutoff
from gpuq.service.jobs import get_job
from gpuq.service.models import Allocation, Gpu, Job, utcnow
from gpuq.service.node_drains import drained_nodes, drains_ahead, notes
from gpuq.service.node_use import CPUS, SLACK, WORDS, NodeUse
from gpuq.service.queue_read import QueueRead, planned_starts, read_queue
from gpuq.service.settings import Settings
from gpuq.service.units import AFTER_KINDS


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def why(session: Session, settings: Settings, job_id: int) -> str:
    """A sentence (or a few) saying why job ``job_id`` is where it is."""
    job = get_job(session, job_id)
    if job.state != State.PENDING:
        tail = f": {job.reason}" if job.reason else ""
        where = f" on {job.node}" if job.node else ""
        verb = "" if job.state in c.END_STATES else "is "
        if job.state == State.RUNNING:
            where += _running_where(session, job)
        return f"job {job.id} {verb}{job.state}{where}{tail}"
    said = _waiting(session, settings, job)
    if job.deadline_at is not None:
        said += "; " + deadline.latest_start(job.deadline_at, job.time_limit_s)
    return said


def _waiting(session: Session, settings: Settings, job: Job) -> str:
    """Why pending job ``job`` waits."""
    # A held job is not looked at by the scheduler: its reason says held from the submit on.
    reason = job.reason or ("held" if job.held else "waiting for its first scheduling pass")
    head = f"job {job.id} waits ({reason})"
    if job.held and job.admin_hold:
        return f"{head}: it is held by an admin; only an admin's `gpuq release {job.id}` lets it start"
    if job.held:
        return f"{head}: it is held; `gpuq release {job.id}` lets it start"
    if reason == policy.DEPENDENCY and job.after:
        deps, states = dependencies.look_up(session, job.after)
        deps = dependencies.standing(job.after_kind, deps, states)
        if not job.singleton or not dependencies.all_met(job.after_kind, job.after, deps):
            pending = ", ".join(deps[d].describe(states.get(d), job.after_kind) if d in deps else f"job {d} (gone)"
                                for d in job.after)
            said = f"{head}: it waits for {pending} {AFTER_KINDS[job.after_kind]} (-d {job.after_kind})"
            read, decision = _pass(session, settings)
            start = planned_starts(session, read, decision).get(job.id)
            if start is not None:  # when those are expected to end (start), and then its GPUs free
                said += "; " + _start_line(start, read.policy.now)
            return said
    if reason == policy.DEPENDENCY and job.singleton:
        ahead = dependencies.singleton_ahead(session, job.id, job.user, job.name, job.priority)
        said = f"{head}: --dependency singleton starts one job of {job.user}'s named {job.name!r} at a time"
        return f"{said}, and job {ahead[0]} ({ahead[1]}) is ahead of it" if ahead else said
    if reason == policy.USER_LIMIT:
        read, decision = _pass(session, settings)
        # As the limit counts them: a shared job its charged part of each of its GPUs.
        held = round(read.policy.gpus_in_use.get(job.user, 0.0), 2)
        needs = (f"this job needs {job.gpus} more" if not job.shared
                 else "a shared job starts only while they hold less, its share counted as its part of the GPU")
        said = (f"{head}: {job.user} holds {held:g} GPU{'' if held == 1 else 's'} and the limit is "
                f"{settings.gpu_limit_of(job.user)} at once; {needs}")
        start = planned_starts(session, read, decision).get(job.id)
        if start is not None:  # when their running and earlier jobs leave them room
            said += "; " + _start_line(start, read.policy.now)
        return said
    if reason == policy.BEGIN_TIME and job.begin_at is not None:
        left = max(int((job.begin_at - utcnow()).total_seconds()), 0)
        said = (f"{head}: it may start from {utc(job.begin_at)} (--begin), in {time_limit(left)}; "
                f"`gpuq update {job.id} --begin now` lets it start sooner")
        read, decision = _pass(session, settings)
        start = planned_starts(session, read, decision).get(job.id)
        if start is not None and start > job.begin_at.timestamp() + 60:  # its GPUs are busy past its moment
            said += "; " + _start_line(start, read.policy.now)
        return said
    if reason == policy.ARRAY_LIMIT and job.array_id is not None and job.array_limit is not None:
        read, decision = _pass(session, settings)
        # Its array's running tasks, as the pass counted them against the limit (their ends).
        started = len(read.array_limits.get(job.array_id, (0, []))[1])
        said = (f"{head}: {started} task{'' if started == 1 else 's'} of array {job.array_id} run now, and it "
                f"runs at most {job.array_limit} at once (--array ...%{job.array_limit}; "
                f"`gpuq update --array {job.array_id} --array-limit N` changes it)")
        start = planned_starts(session, read, decision).get(job.id)
        return said if start is None else f"{said}; {_start_line(start, read.policy.now)}"
    if reason == policy.PREEMPTING:
        stopping = session.execute(select(Job.id, Job.user).where(
            Job.state == State.RUNNING, Job.reason == preempted_by(job.id, job.user)).order_by(Job.id)).all()
        whose = ", ".join(f"{victim} ({user})" for victim, user in stopping)
        them = f"job {whose} on its GPUs is" if len(stopping) == 1 else \
            f"jobs {whose} on its GPUs are" if stopping else "jobs on its GPUs are"
        return (f"{head}: the preemptible {them} being stopped and requeued; it starts once they have (within "
                f"GPUQ_PREEMPT_GRACE, {settings.preempt_grace:g} s)")
    if reason == policy.NODE_DRAINED:
        drained = drained_nodes(session)
        if job.on_node is None:
            nodes = ", ".join(f"{n} ({why})" if why else n for n, why in sorted(drained.items())
                              if n not in (job.exclude_nodes or ()))
            return f"{head}: the nodes with {job.gpus} GPU{'s' if job.gpus != 1 else ''} for it are drained: {nodes}"
        why_drained = drained.get(job.on_node)
        return f"{head}: it asked for node {job.on_node}, which is drained{f' ({why_drained})' if why_drained else ''}"
    if reason == policy.NODE_DRAINING:
        nodes = "; ".join(f"{n} at {utc(datetime.fromisoformat(d['at']))} ({d['note']})"
                          for n, d in sorted(drains_ahead(session).items())
                          if d["until"] is None and n not in (job.exclude_nodes or ()) and job.on_node in (None, n))
        limit = (f"its time limit of {time_limit(job.time_limit_s)} would end after that" if job.time_limit_s
                 else "it has no time limit, so it could not end by then")
        return (f"{head}: the nodes it fits are to drain before it could end there ({nodes}), and {limit}; it "
                "starts once they are resumed, or with a time limit that ends in time (`gpuq update --time`)")
    need = f"needs {job.gpus} GPU{'s' if job.gpus != 1 else ''}" + (f" of type {job.gpu_type}" if job.gpu_type else "")
    if job.mem_mib:
        need += f" with {_gib(job.mem_mib)} {'to share' if job.shared else 'free'}"
    if job.cpus:
        need += f" and {job.cpus:g} CPU core{'' if job.cpus == 1 else 's'} (--cpus)"
    if job.host_mem_mib:
        need += f" and {_gib(job.host_mem_mib)} of host memory (--host-mem)"
    need += f" on node {job.on_node}" if job.on_node else " on one node"
    parts = [f"{head}: it {need}"]
    if job.preemptible:
        parts.append("it is preemptible (--preemptible): it comes after every job that is not, and starts only "
                     "on GPUs none of those waits for")
    read, decision = _pass(session, settings)
    state = read.policy
    if reason == policy.PRIORITY:
        parts.extend(_ahead_lines(state, decision, settings, job))
    parts.extend(_room_lines(session, settings, job) if job.shared else _gpu_lines(session, settings, job))
    for kind, amount in node_use.needs(job).items():
        parts.extend(_node_lines(state.node_use[kind], kind, amount, job, state.now))
    parts.append(_start_line(planned_starts(session, read, decision).get(job.id), state.now))
    return "; ".join(parts)


def _pass(session: Session, settings: Settings) -> tuple[QueueRead, policy.Decision]:
    """The queue as a whole pass reads it, and the pass's decision."""
    read = read_queue(session, settings)
    return read, policy.decide(read.policy)


def expected_starts(session: Session, settings: Settings, nodes: dict[int, str] | None = None
                    ) -> dict[int, datetime | None]:
    """Each pending job's expected start (`gpuq status --start`): ``forecast.start_times`` of a
    whole pass's queue, a job waiting for its begin time planned from then on, and one waiting for
    other jobs from their expected ends. A job waiting for anything else (held, a singleton, its
    user's limit where their running jobs are not known) has none. ``nodes``, if given, is told the
    node each is planned on (squeue --start's SCHEDNODES)."""
    where: dict[int, list[policy.GpuState]] = {}
    starts = planned_starts(session, *_pass(session, settings), where=where)
    if nodes is not None:
        nodes.update((job_id, gpus[0].node) for job_id, gpus in where.items() if gpus)
    return {job_id: None if t is None else datetime.fromtimestamp(t, UTC) for job_id, t in starts.items()}


def _start_line(start: float | None, now: float) -> str:
    if start is None:
        return f"no start time can be counted on yet ({NO_START})"
    if start <= now:
        return "it can start now: the scheduler's next pass places it"
    return (f"expected to start by {expected_at(start, now)}, if the jobs before it run to their time limits "
            "(`gpuq status --start` for the queue)")


def _running_where(session: Session, job: Job) -> str:
    """Its GPUs and how far into its time limit it is (as squeue's TIME and TIME_LIMIT):
    `` (GPU 0,1), 0:12:03 of its 2:00:00``."""
    from gpuq.service.jobs import gpu_indices_of

    indices = gpu_indices_of(session, [job.id]).get(job.id, [])
    text = f" (GPU {','.join(map(str, indices))})" if indices else ""
    if job.started_at is not None:
        ran = time_limit(int(max((utcnow() - job.started_at).total_seconds(), 0)))
        text += f", {ran} in" + (f" of its {time_limit(job.time_limit_s)}" if job.time_limit_s else " (no time limit)")
    return text


def _ahead_lines(state: policy.QueueState, decision: policy.Decision, settings: Settings, job: Job) -> list[str]:
    """The job the queue holds GPUs for (the reservation a whole pass makes now), and why it comes
    before ``job``: its priority, its user's fair share (their GPU-hours, decayed), or its submit."""
    mine = next((j for j in decision.order if j.id == job.id), None)
    # The job the GPUs are held for; with no reservation (a running job without a time limit: no
    # one knows when its GPUs free), the first that waits for GPUs, which holds every job behind it.
    first = decision.reservation.job_id if decision.reservation is not None else next(
        (j.id for j in decision.order if decision.waiting.get(j.id) == policy.RESOURCES), None)
    ahead = next((j for j in decision.order if j.id == first), None)
    if mine is None or ahead is None or ahead.id == mine.id:
        return []
    hours = state.gpu_hours
    if ahead.priority != mine.priority:
        because = f"priority {ahead.priority}, this job's {mine.priority}"
    elif ahead.user != mine.user and hours.get(ahead.user, 0.0) != hours.get(mine.user, 0.0):
        because = (f"fair share: {ahead.user} has used {gpu_hours_text(hours.get(ahead.user, 0.0))} GPU-hours "
                   f"and {mine.user} {gpu_hours_text(hours.get(mine.user, 0.0))} (each hour counting half after "
                   f"{settings.fairshare_half_life_h:g} h)")
    else:
        because = "submitted earlier"
    held = "the GPUs are held for it" if decision.reservation is not None else "it waits for GPUs"
    return [f"job {ahead.id} of {ahead.user} ({ahead.gpus} GPU{'s' if ahead.gpus != 1 else ''}) goes first "
            f"({because}) and {held}"]


def _node_lines(use: NodeUse, kind: str, amount: float, job: Job, now: float) -> list[str]:
    """What of ``kind`` (cores, host memory) is free on each node ``job`` may use that counts it,
    where too little is for its ``amount``."""
    short = []
    for node in sorted(use.offer):
        if (job.on_node and node != job.on_node) or node in (job.exclude_nodes or ()):
            continue
        free = max(use.free_at(node, now), 0.0)
        if free + SLACK < amount:
            held = len(use.holds.get(node, {}))
            of = (f"{free:g} of its {use.offer[node]:g} {WORDS[kind][0]}" if kind == CPUS
                  else f"{_gib(free)} of its {_gib(use.offer[node])} of host memory")
            short.append(f"node {node} has {of} free for jobs "
                         f"({held} running job{' reserves' if held == 1 else 's reserve'} the rest)")
    return short


def _room_lines(session: Session, settings: Settings, job: Job) -> list[str]:
    """A shared job's figures: each live GPU's room for shares, and what the job needs there."""
    from gpuq.service import packing

    gpus = read_queue(session, settings, head=1).policy.gpus
    request = policy.JobRequest(id=job.id, user=job.user, gpus=job.gpus, mem_mib=job.mem_mib, node=job.on_node,
                                shared=True, gpu_type=job.gpu_type)
    of_type = [g for g in gpus if g.is_of(request)]  # another model's room is no room for it
    return packing.room_lines(request, of_type, settings.shared_context_mib) or ["no live GPU is known to gpuq"]


def _gpu_lines(session: Session, settings: Settings, job: Job) -> list[str]:
    cutoff = live_cutoff(settings)
    drained, ahead = notes(session)
    rows = session.execute(select(Gpu, Job).where(Gpu.retired_at.is_(None))
                           .outerjoin(Allocation, Allocation.gpu_id == Gpu.id)
                           .outerjoin(Job, Job.id == Allocation.job_id).order_by(Gpu.node, Gpu.index)).all()
    by_node: dict[str, list[str]] = {}
    now = utcnow()
    gpus: dict[int, Gpu] = {}
    held_by: dict[int, list[Job]] = {}
    for gpu, holder in rows:
        gpus.setdefault(gpu.id, gpu)
        if holder is not None:
            held_by.setdefault(gpu.id, []).append(holder)

    def ends(holder: Job) -> str:
        if not (holder.time_limit_s and holder.started_at):
            return ""
        return f", ends within {_within(holder.time_limit_s - (now - holder.started_at).total_seconds())}"

    # A whole job's GPUs on a node, one phrase for them all ("GPU 0,1,2,3 run job 5 of ann"): a
    # gang on four GPUs read as the same line four times.
    whole_of: dict[tuple[str, int], list[int]] = {}
    for gpu in gpus.values():
        holders = held_by.get(gpu.id, [])
        if len(holders) == 1 and not holders[0].shared and gpu.heartbeat_at is not None and gpu.heartbeat_at >= cutoff:
            whole_of.setdefault((gpu.node, holders[0].id), []).append(gpu.index)
    for gpu in gpus.values():
        if job.on_node and gpu.node != job.on_node:
            continue
        if job.gpu_type and not policy.is_model(gpu.name, job.gpu_type):
            continue  # another model: it could never run there
        holders = held_by.get(gpu.id, [])
        if gpu.heartbeat_at is None or gpu.heartbeat_at < cutoff:
            text = f"GPU {gpu.index} offline (no worker)"
        elif len(holders) == 1 and not holders[0].shared:
            indices = whole_of[(gpu.node, holders[0].id)]
            if indices[0] != gpu.index:
                continue  # said with its job's first GPU
            text = (f"GPU {','.join(map(str, indices))} {'runs' if len(indices) == 1 else 'run'} job "
                    f"{holders[0].id} of {holders[0].user}{ends(holders[0])}")
        elif holders:
            # A whole-GPU job needs every one of them gone: said, since it reads as a GPU half free.
            each = "; ".join(f"job {h.id} of {h.user}{ends(h)}" for h in holders)
            text = (f"GPU {gpu.index} shared by {len(holders)} job{'s' if len(holders) != 1 else ''} "
                    f"({each}), all of which must end before a whole-GPU job starts there")
        else:
            free = gpu.memory_total_mib - max(gpu.memory_used_mib or 0, gpu.foreign_mib or 0)
            short = job.mem_mib is not None and free < job.mem_mib and _gib(free) == _gib(job.mem_mib)
            # In MiB where GiB would round a GPU just short of the job's --mem to the very figure it asks.
            text = f"GPU {gpu.index} with " + (f"{free:,} MiB free (it needs {job.mem_mib:,})" if short
                                               else f"{_gib(free)} free")
        for p in gpu.foreign or []:
            used = _gib(p.get("mib") or 0)
            text += f", used by pid {p.get('pid')} of user {p.get('user')} ({used}), not started by gpuq"
        by_node.setdefault(gpu.node, []).append(text)
    lines = []
    for node, texts in by_node.items():
        prefix = f"node {node}" + (" (drained)" if node in drained else "")
        if node in ahead:
            window = ahead[node]
            prefix += (f" (drains {window_span(window['at'], window['until'])}; before that, only jobs that "
                       "end by then start there)")
        lines.append(f"{prefix}: " + ", ".join(texts))
    return lines or ["no GPU is known to gpuq"]


def _within(seconds: float) -> str:
    """A time left, rounded up (a job 16 s from its limit ends within 16 s, not 0 min)."""
    if seconds < 60:
        return f"{max(math.ceil(seconds), 0)} s"
    return f"{math.ceil(seconds / 60)} min"
