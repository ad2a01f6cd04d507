"""Placement policy as a pure function: gang on one node, strict order, never a GPU twice."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuq.service.scheduler import FreeGpu, PendingJob, place


def gpus(node: str, *indices: int) -> list[FreeGpu]:
    return [FreeGpu(id=hash((node, i)) & 0xFFFFFF, node=node, index=i, queue=f"q.{node}.{i}") for i in indices]


def test_a_multi_gpu_job_gets_all_its_gpus_on_one_node():
    free = gpus("a", 0) + gpus("b", 0, 1)
    [p] = place([PendingJob(1, 2)], free)
    assert {g.node for g in p.gpus} == {"b"} and [g.index for g in p.gpus] == [0, 1]


def test_a_job_that_does_not_fit_waits_and_nothing_behind_it_jumps_the_queue():
    assert place([PendingJob(1, 3), PendingJob(2, 1)], gpus("a", 0, 1)) == []


def test_best_fit_keeps_the_larger_node_free_for_larger_jobs():
    [p] = place([PendingJob(1, 1)], gpus("big", 0, 1, 2, 3) + gpus("small", 5))
    assert p.gpus[0].node == "small"


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=5),
    jobs=st.lists(st.integers(min_value=1, max_value=8), max_size=30),
)
def test_placement_never_double_books_never_splits_a_gang_and_keeps_queue_order(nodes, jobs):
    free = [g for n, count in enumerate(nodes) for g in gpus(f"n{n}", *range(count))]
    pending = [PendingJob(i, k) for i, k in enumerate(jobs)]
    placements = place(pending, free)
    used = [g.id for p in placements for g in p.gpus]
    assert len(used) == len(set(used))
    for p in placements:
        assert len(p.gpus) == pending[p.job_id].gpus
        assert len({g.node for g in p.gpus}) == 1
    # Strict order: the placed jobs are exactly a prefix of the queue.
    assert [p.job_id for p in placements] == list(range(len(placements)))
    if len(placements) < len(pending):
        blocked = pending[len(placements)]
        left = {}
        for g in free:
            if g.id not in used:
                left[g.node] = left.get(g.node, 0) + 1
        assert all(n < blocked.gpus for n in left.values())
