"""Scheduling policy as a pure function over the queue's state: who goes first, on which GPUs, and why the
others wait. No database, no broker: the scheduler reads the state (service/queue_read.py) and applies the decision.

Order: priority, then fair share (the user with fewer recent GPU-hours first), then submission.
A job gets all its GPUs on one node at once (gang) or none. The first job that does not fit gets a
reservation (EASY backfill): later jobs may start only where they cannot delay it, which needs the
running jobs' time limits; without them nothing starts past a waiting gang (past one that asked
for a GPU type, `--gpu-type`, nothing starts on GPUs of that type, and others stay open to later
jobs: it could never use them).

A preemptible job (``JobRequest.preemptible``, `--preemptible`) comes after every other job, is not
held to its user's GPU limit, and is stopped and requeued when a job that is not preemptible
needs its GPUs (service/preemption.py), as SLURM's scavenger QOS.

A shared job (``JobRequest.shared``) takes its share of memory on each of its GPUs beside other
shared jobs, never beside a whole-GPU job; shared jobs are packed best fit by memory
(service/packing.py).

The state and the decision are plain data (service/queue_state.py, whose types are named here
too, where their callers have always found them); how one pass keeps track of the GPUs as it
places, reserves and claims them is service/placing.py's.
"""

from __future__ import annotations

from gpuq.service import node_use, packing
from gpuq.service.placing import Gpus
from gpuq.service.queue_state import LIMIT_SLACK as LIMIT_SLACK
from gpuq.service.queue_state import SHARED_CONTEXT_MIB as SHARED_CONTEXT_MIB
from gpuq.service.queue_state import Decision as Decision
from gpuq.service.queue_state import GpuState as GpuState
from gpuq.service.queue_state import JobRequest as JobRequest
from gpuq.service.queue_state import Placement as Placement
from gpuq.service.queue_state import QueueState as QueueState
from gpuq.service.queue_state import Reservation as Reservation
from gpuq.service.queue_state import is_model as is_model

# Why a pending job waits (the REASON column).
RESOURCES = "resources"  # first in line, but no node has the GPUs it needs free
PRIORITY = "priority"  # jobs ahead of it in the queue wait for resources
DEPENDENCY = "dependency"  # waits for --after jobs
USER_LIMIT = "user limit"  # its user holds the most GPUs allowed at once
HELD = "held"  # `gpuq hold`
NODE_DRAINED = "node drained"  # asked for a node that is drained
NODE_DRAINING = "node draining"  # fits only nodes that drain (`gpuq drain --at`) before it could end
BEGIN_TIME = "begin time"  # `--begin`: not before its moment
ARRAY_LIMIT = "array limit"  # its array runs as many tasks at once as `--array ...%N` lets it
PREEMPTING = "preempting"  # waits for the preemptible jobs on its GPUs to stop
REASONS = (RESOURCES, PRIORITY, DEPENDENCY, USER_LIMIT, HELD, NODE_DRAINED, NODE_DRAINING, BEGIN_TIME, ARRAY_LIMIT,
           PREEMPTING)


def order_key(job: JobRequest, gpu_hours: dict[str, float]) -> tuple[bool, int, float, float, int]:
    """Where ``job`` stands in the queue: preemptible jobs after all others, then priority, then
    its user's fair share, then submission."""
    return job.preemptible, -job.priority, gpu_hours.get(job.user, 0.0), job.submitted, job.id


def queue_order(state: QueueState) -> list[JobRequest]:
    hours = state.gpu_hours
    return sorted(state.jobs, key=lambda j: order_key(j, hours))


def decide(state: QueueState) -> Decision:
    """Place what can start now and say why everything else waits."""
    gpus = Gpus(state)
    in_use = dict(state.gpus_in_use)
    decision = Decision([], {}, order=queue_order(state))
    blocked = False  # a job waits and no reservation can protect it: nothing else may start
    for job in decision.order:
        limit = state.limit_of(job.user)
        if limit and limit_reached(job, in_use.get(job.user, 0), limit):
            decision.waiting[job.id] = USER_LIMIT
            continue
        if blocked or (decision.reservation is not None and not job.shared and gpus.free_count < job.gpus
                       and not gpus.may_preempt_for(job)):
            # Behind a waiting job, with too few GPUs free anywhere: no need to look (a full
            # cluster with a long queue is the common case, and it must stay cheap).
            decision.waiting[job.id] = PRIORITY
            continue
        if gpus.all_fenced_for(job):
            decision.waiting[job.id] = PRIORITY  # behind a waiting job of its type
            continue
        chosen = gpus.choose(job, decision.reservation)
        if chosen is not None:
            charge = packing.charged_gpus(job, [load.gpu for load in chosen], state.shared_context_mib)
            if limit and not job.preemptible and in_use.get(job.user, 0) + charge > limit + LIMIT_SLACK:
                decision.waiting[job.id] = USER_LIMIT
                continue
            decision.placements.append(gpus.take(job, chosen))
            if not job.preemptible:
                in_use[job.user] = in_use.get(job.user, 0) + charge
            continue
        plan = gpus.preempt(job, decision.reservation)
        if plan is not None:
            # Its GPUs are its own from now on in this pass and the next ones, until they are free.
            decision.preemptions.update(dict.fromkeys(plan.victims, job.id))
            decision.claims.append(Placement(job.id, tuple(load.gpu for load in plan.gpus), shared=job.shared,
                                             needs=tuple(node_use.needs(job).items())))
            decision.waiting[job.id] = PREEMPTING
            in_use[job.user] = in_use.get(job.user, 0) + packing.charged_gpus(
                job, [load.gpu for load in plan.gpus], state.shared_context_mib)
            continue
        if decision.reservation is not None:
            decision.waiting[job.id] = PRIORITY
            continue
        decision.waiting[job.id] = RESOURCES
        if not gpus.could_ever_fit(job):
            continue  # waits for memory others use; holding the queue for it could hold it forever
        decision.reservation = gpus.reserve(job)
        gpus.failed.clear()  # what could not start may start now under the reservation, and the reverse
        if decision.reservation is None:
            if not gpus.could_ever_fit(job, past_drains=True):
                # It fits only nodes to drain before it could end there: it waits for a resume,
                # and holding the queue for it would keep every job off them until then.
                decision.waiting[job.id] = NODE_DRAINING
                continue
            if job.gpu_type is None:
                blocked = True
                decision.blocked_by = job.id
            else:
                gpus.fence(job)
    return decision


def limit_reached(job: JobRequest, held: float, limit: int) -> bool:
    """Whether ``job``'s user may not take it, holding ``held`` GPUs: a whole job's GPUs would pass
    the limit; a shared job's charge is known once its GPUs are chosen, so here only whether its user
    is at the limit already (``decide`` checks the charge after choosing). A preemptible job is
    held to none."""
    if job.preemptible:
        return False
    if job.shared:
        return held >= limit - LIMIT_SLACK
    return held + job.gpus > limit + LIMIT_SLACK
