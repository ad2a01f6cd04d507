"""Which pending jobs each busy GPU starts next if its job ends before the scheduler looks again:
the next-up lists' choice, a pure function over the queue's state and a pass's decision, as
``policy.decide`` is (service/next_up.py writes the lists and a worker takes from them)."""

from __future__ import annotations

from collections import defaultdict

from gpuq.service import node_use, packing, policy
from gpuq.service.policy import queue_order
from gpuq.service.queue_state import Decision, GpuState, JobRequest, QueueState


def choose(state: QueueState, decision: Decision, per_gpu: int, scan: int) -> dict[int, list[int]]:
    """For each busy GPU, the pending one-GPU jobs it should start, best first, if its job ends
    before the scheduler looks again (their order in the queue ranks them across GPUs).

    The queue is walked past the jobs just placed. A job is listed for every busy GPU it fits, so
    whichever of them frees first takes it, and never ahead of a job that could use that GPU:
    a gang that could use a GPU, on a node where it could ever run, closes that GPU's list (when
    it frees, the scheduler decides, as the gang may need it), and a job over its user's limit is
    passed over as ``decide`` does.
    The lists are for GPUs a whole-GPU job holds, and list whole-GPU jobs only: a GPU with shared
    jobs gets none (one of them leaving frees a share, not the GPU), and a shared job is never
    listed (its room is the scheduler's to count) but closes, as a gang does, the lists of the GPUs
    it could ever share, so that no job behind it takes a GPU it could use; so do a
    `--dependency singleton` job (whether another job of its name started is the pass's to see) and
    a job that reserves CPU cores or host memory on a node that counts them (whether its node has
    them free is the pass's to see, and a worker's take counts none).
    The GPUs of a node share their jobs, so each lists ``per_gpu`` times its node's busy GPUs
    (enough for all of them to take several before the scheduler's next pass); the walk looks at
    most ``scan`` jobs.
    """
    placed = {p.job_id for p in decision.placements}
    taken = {g.id for p in decision.placements if not p.shared for g in p.gpus}
    # A node to drain lists nothing: whether a job ends before the drain is the scheduler's to see.
    open_gpus = [g for g in state.gpus if (g.busy_until is not None or g.id in taken) and g.closes_at is None]
    busy_on: dict[str, int] = defaultdict(int)
    for g in open_gpus:
        busy_on[g.node] += 1
    lists: dict[int, list[int]] = {g.id: [] for g in open_gpus}
    in_use = dict(state.gpus_in_use)
    if state.limited:
        job_of = {j.id: j for j in state.jobs}
        for p in decision.placements:
            j = job_of[p.job_id]
            if j.preemptible:  # held to no limit, counted against none
                continue
            in_use[j.user] = in_use.get(j.user, 0) + packing.charged_gpus(j, p.gpus, state.shared_context_mib)
    order = decision.order or queue_order(state)
    for looked, job in enumerate(j for j in order if j.id not in placed):
        if not open_gpus or looked >= scan:
            break
        limit = state.limit_of(job.user)
        if limit and policy.limit_reached(job, in_use.get(job.user, 0), limit):
            continue
        if job.gpus > 1 or job.shared or job.singleton or _reserves_of_a_node(job, open_gpus, state):
            # Where it could ever run, it may need the GPU when it frees: the scheduler decides.
            could = _could_use(job, open_gpus, state)
            open_gpus = [g for g in open_gpus if g.id not in could]
            continue
        usable = [g for g in open_gpus if job.may_use(g.node) and g.fits(job)]
        for g in usable:
            lists[g.id].append(job.id)
        if usable and limit and not job.preemptible:
            in_use[job.user] = in_use.get(job.user, 0) + 1
        open_gpus = [g for g in open_gpus if len(lists[g.id]) < per_gpu * busy_on[g.node]]
    return {gpu: jobs for gpu, jobs in lists.items() if jobs}


def _reserves_of_a_node(job: JobRequest, open_gpus: list[GpuState], state: QueueState) -> bool:
    """Whether ``job`` reserves cores or host memory of a node of ``open_gpus`` that counts them."""
    wants = node_use.needs(job)
    return bool(wants) and any(state.node_use[kind].counts(amount, g.node)
                               for kind, amount in wants.items() for g in open_gpus)


def _could_use(job: JobRequest, open_gpus: list[GpuState], state: QueueState) -> set[int]:
    """The ids of ``open_gpus`` that ``job`` could use once free, on a node where it could ever run."""
    need = packing.need_mib(job, state.shared_context_mib) if job.shared else 0

    def suits(g: GpuState) -> bool:
        return g.is_of(job) and packing.could_ever_share(g, need) if job.shared else g.fits(job)

    usable = [g for g in open_gpus if job.may_use(g.node) and suits(g)]
    nodes = {g.node for g in usable}
    could = {n for n in nodes if sum(h.node == n and suits(h) for h in state.gpus) >= job.gpus}
    return {g.id for g in usable if g.node in could}
