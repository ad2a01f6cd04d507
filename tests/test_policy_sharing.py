"""Shared GPUs in the scheduling policy: shared jobs packed by memory, best fit, never beside a
whole-GPU job, gangs on one node, and EASY backfill's promise to the first waiting job kept."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuq.service.next_up_choice import choose as next_up
from gpuq.service.packing import charged_fraction, charged_gpus, room_lines
from gpuq.service.policy import (
    PRIORITY,
    RESOURCES,
    USER_LIMIT,
    GpuState,
    JobRequest,
    QueueState,
    decide,
)

pytestmark = pytest.mark.timeout(60)

NOW = 1_000_000.0
GIB = 1024


def gpu(gpu_id, node="a", total=16 * GIB, foreign=0, busy_until=None, shared_mib=0, shared_jobs=0, shared_until=None):
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=total,
                    foreign_mib=foreign, busy_until=busy_until, shares=shares(shared_mib, shared_jobs, shared_until))


def shares(mib: int, jobs: int, until: float | None) -> tuple[tuple[float, int], ...]:
    """``jobs`` shared jobs holding ``mib`` together, all until ``until`` (None: no time limit)."""
    end = math.inf if until is None else until
    return tuple((end, mib // jobs + (mib % jobs if i == 0 else 0)) for i in range(jobs))


def job(job_id, gpus=1, user="u", mem=None, shared=False, limit=None, node=None, priority=0):
    return JobRequest(id=job_id, user=user, gpus=gpus, priority=priority, submitted=job_id, mem_mib=mem,
                      node=node, time_limit_s=limit, shared=shared)


def share(job_id, mem_gib, **kw):
    return job(job_id, mem=int(mem_gib * GIB), shared=True, **kw)


def placed(decision):
    return {p.job_id: [g.id for g in p.gpus] for p in decision.placements}


# --- Random queues over random GPUs -------------------------------------------------------------

@st.composite
def gpu_lists(draw):
    out = []
    for i in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["free", "free", "whole", "shared", "shared"]))
        ends = st.sampled_from([100.0, 5000.0, math.inf]).map(lambda d: NOW + d)
        kw = {}
        if kind == "whole":
            kw["busy_until"] = draw(ends)
        elif kind == "shared":
            kw = dict(shared_mib=draw(st.sampled_from([2000, 8000, 15000])), shared_jobs=draw(st.integers(1, 3)),
                      shared_until=draw(st.one_of(st.none(), ends)))
        out.append(gpu(i + 1, node=draw(st.sampled_from("ab")), total=draw(st.sampled_from([16 * GIB, 24 * GIB])),
                       foreign=draw(st.sampled_from([0, 0, 1000, 6000])), **kw))
    return out


@st.composite
def job_lists(draw):
    out = []
    for i in range(draw(st.integers(0, 12))):
        shared = draw(st.booleans())
        mem = draw(st.sampled_from([1000, 3000, 7000, 12000] if shared else [None, 2000, 14000]))
        out.append(job(i + 1, gpus=draw(st.sampled_from([1, 1, 1, 2, 3])), user=draw(st.sampled_from("xyz")),
                       mem=mem, shared=shared, limit=draw(st.sampled_from([None, 60, 4000, 10000])),
                       node=draw(st.sampled_from([None, None, "a"])), priority=draw(st.integers(-1, 1))))
    return out


@st.composite
def snapshots(draw, user_limits=(0,)):
    return QueueState(NOW, draw(job_lists()), draw(gpu_lists()), gpu_hours={"x": 3.0, "y": 1.0},
                      gpus_in_use=draw(st.dictionaries(st.sampled_from("xyz"), st.sampled_from([0, 0.5, 1]))),
                      user_gpu_limit=draw(st.sampled_from(user_limits)),
                      shared_context_mib=draw(st.sampled_from([0, 512])))


def ends(j):
    return math.inf if j.time_limit_s is None else NOW + j.time_limit_s


def loads(snap, placements):
    """Each GPU's whole-GPU jobs' ends and shared jobs' (end, MiB), with ``placements`` applied."""
    jobs = {j.id: j for j in snap.jobs}
    whole = {g.id: [] if g.busy_until is None else [g.busy_until] for g in snap.gpus}
    shares = {g.id: [] for g in snap.gpus}
    for g in snap.gpus:
        if g.shared_jobs:
            shares[g.id].append((math.inf if g.shared_until is None else g.shared_until, g.shared_mib))
    for p in placements:
        j = jobs[p.job_id]
        for g in p.gpus:
            if p.shared:
                shares[g.id].append((ends(j), j.mem_mib + snap.shared_context_mib))
            else:
                whole[g.id].append(ends(j))
    return whole, shares


def earliest_start(snap, j, placements):
    """When job ``j`` could start at the earliest if ``placements`` were made and each job ran to
    its time limit (inf: not known), by walking the jobs' ends: an oracle apart from the policy."""
    whole, shares = loads(snap, placements)
    times = {NOW} | {e for es in whole.values() for e in es} | {e for ss in shares.values() for e, _ in ss}
    for t in sorted(e for e in times if NOW <= e < math.inf):
        for node in {g.node for g in snap.gpus if j.node in (None, g.node)}:
            ready = 0
            for g in (g for g in snap.gpus if g.node == node):
                if any(e > t for e in whole[g.id]):
                    continue
                held = sum(m for e, m in shares[g.id] if e > t)
                if j.shared:
                    ready += g.memory_total_mib - g.foreign_mib - held >= j.mem_mib + snap.shared_context_mib
                else:
                    ready += held == 0 and not any(e > t for e, _ in shares[g.id]) and g.fits(j)
            if ready >= j.gpus:
                return t
    return math.inf


@settings(max_examples=200, deadline=None)
@given(snap=snapshots())
def test_shares_plus_reserves_plus_foreign_use_never_exceed_a_gpus_memory(snap):
    d = decide(snap)
    _, shares = loads(snap, d.placements)
    for g in snap.gpus:
        if len(shares[g.id]) > (1 if g.shared_jobs else 0):  # a shared job was placed on it
            assert sum(m for _, m in shares[g.id]) + g.foreign_mib <= g.memory_total_mib


@settings(max_examples=200, deadline=None)
@given(snap=snapshots())
def test_whole_and_shared_jobs_never_sit_on_one_gpu(snap):
    d = decide(snap)
    by_id = {g.id: g for g in snap.gpus}
    whole = [g.id for p in d.placements if not p.shared for g in p.gpus]
    shared = {g.id for p in d.placements if p.shared for g in p.gpus}
    assert len(whole) == len(set(whole)) and not set(whole) & shared
    assert all(by_id[g].busy_until is None and by_id[g].shared_jobs == 0 for g in whole)
    assert all(by_id[g].busy_until is None for g in shared)


@settings(max_examples=200, deadline=None)
@given(snap=snapshots())
def test_gangs_stay_on_one_node(snap):
    d = decide(snap)
    jobs = {j.id: j for j in snap.jobs}
    for p in d.placements:
        j = jobs[p.job_id]
        assert p.shared == j.shared and len(p.gpus) == j.gpus == len({g.id for g in p.gpus})
        assert len({g.node for g in p.gpus}) == 1 and j.node in (None, p.gpus[0].node)
    assert set(d.waiting) | set(placed(d)) == set(jobs) and not set(d.waiting) & set(placed(d))


@settings(max_examples=200, deadline=None)
@given(snap=snapshots(user_limits=(1, 2)))
def test_users_stay_within_their_gpu_limit_counting_shared_jobs_as_their_charged_fraction(snap):
    d = decide(snap)
    jobs = {j.id: j for j in snap.jobs}
    held = dict(snap.gpus_in_use)
    for p in d.placements:
        j = jobs[p.job_id]
        held[j.user] = held.get(j.user, 0) + charged_gpus(j, p.gpus, snap.shared_context_mib)
        assert held[j.user] <= snap.user_gpu_limit + 1e-9


def assert_backfill_keeps_the_promise(snap):
    d = decide(snap)
    r = d.reservation
    if r is None:
        return
    first = next(j for j in snap.jobs if j.id == r.job_id)
    position = {j.id: n for n, j in enumerate(d.order)}
    ahead = [p for p in d.placements if position[p.job_id] < position[r.job_id]]
    without = earliest_start(snap, first, ahead)
    # The promise is the earliest start as the jobs' time limits tell it, and backfill keeps it.
    assert r.start == without
    assert earliest_start(snap, first, d.placements) <= without


@settings(max_examples=300, deadline=None)
@given(snap=snapshots())
def test_a_backfilled_job_never_delays_the_first_waiting_job(snap):
    assert_backfill_keeps_the_promise(snap)


@st.composite
def big_shared_job_first(draw):
    """A big shared job first in line on one node's GPUs, partly used, then small shared jobs: the
    reserved job's room at its start is what decides each backfill."""
    gpus = [gpu(i + 1, shared_mib=draw(st.sampled_from([0, 4000, 8000, 12000])), shared_jobs=1,
                shared_until=NOW + draw(st.sampled_from([100.0, 5000.0])), foreign=draw(st.sampled_from([0, 1000])))
            for i in range(draw(st.integers(1, 3)))]
    jobs = [job(1, mem=draw(st.sampled_from([9000, 12000, 14000])), shared=True, gpus=draw(st.integers(1, 2)),
                priority=1)]
    for i in range(draw(st.integers(1, 8))):
        jobs.append(job(i + 2, mem=draw(st.sampled_from([1000, 3000, 5000, 7000])), shared=True,
                        limit=draw(st.sampled_from([None, 60, 4000, 10000]))))
    return QueueState(NOW, jobs, gpus, shared_context_mib=draw(st.sampled_from([0, 512])))


@settings(max_examples=200, deadline=None)
@given(snap=big_shared_job_first())
def test_a_shared_backfill_leaves_a_reserved_shared_job_its_room(snap):
    assert_backfill_keeps_the_promise(snap)


@settings(max_examples=200, deadline=None)
@given(snap=snapshots())
def test_a_shared_job_takes_the_fullest_gpus_that_fit(snap):
    d = decide(snap)
    room = {g.id: g.room_mib for g in snap.gpus}
    whole = {g.id for g in snap.gpus if g.busy_until is not None}
    by_job = {p.job_id: p for p in d.placements}
    for j in d.order:  # up to the reservation, nothing but the room constrains the choice
        if d.reservation is not None and j.id == d.reservation.job_id:
            break
        p = by_job.get(j.id)
        if p is None:
            continue
        if p.shared:
            need = j.mem_mib + snap.shared_context_mib
            left_per_node = []
            for node in {g.node for g in snap.gpus if j.node in (None, g.node)}:
                left = sorted(room[g.id] - need for g in snap.gpus
                              if g.node == node and g.id not in whole and room[g.id] >= need)
                if len(left) >= j.gpus:
                    left_per_node.append(sum(left[: j.gpus]))
            assert sum(room[g.id] - need for g in p.gpus) == min(left_per_node)
            for g in p.gpus:
                room[g.id] -= need
        else:
            whole |= {g.id for g in p.gpus}


# --- Examples ------------------------------------------------------------------------------------

def test_a_shared_job_goes_to_the_fullest_gpu_that_fits_and_leaves_empty_gpus_for_whole_jobs():
    gpus = [gpu(1), gpu(2, shared_mib=6 * GIB, shared_jobs=1), gpu(3, shared_mib=12 * GIB, shared_jobs=2)]
    d = decide(QueueState(NOW, [share(1, 3)], gpus))
    assert placed(d) == {1: [3]}  # 16 - 12 = 4 GiB left: 3 + 0.5 fits, least room left over
    d = decide(QueueState(NOW, [share(1, 5)], gpus))
    assert placed(d) == {1: [2]}  # does not fit GPU 3; GPU 2 before the empty GPU 1


def test_several_shared_jobs_pack_onto_one_gpu_in_one_pass_counting_what_each_took():
    d = decide(QueueState(NOW, [share(n, 3.5) for n in range(1, 6)], [gpu(1), gpu(2)]))
    # 4 GiB each with the reserve: four fill GPU 1, the fifth goes to GPU 2.
    assert placed(d) == {1: [1], 2: [1], 3: [1], 4: [1], 5: [2]}
    assert all(p.shared for p in d.placements)


def test_a_shared_job_needs_its_share_plus_the_context_reserve():
    d = decide(QueueState(NOW, [share(1, 15.6)], [gpu(1)]))
    assert placed(d) == {} and d.waiting == {1: RESOURCES}
    d = decide(QueueState(NOW, [share(1, 15.6)], [gpu(1)], shared_context_mib=256))
    assert placed(d) == {1: [1]}


def test_memory_used_by_other_programs_counts_against_a_shared_gpu():
    d = decide(QueueState(NOW, [share(1, 6)], [gpu(1, foreign=6 * GIB, shared_mib=4 * GIB, shared_jobs=1),
                                               gpu(2, foreign=2 * GIB)]))
    assert placed(d) == {1: [2]}


def test_a_whole_gpu_job_waits_for_every_shared_job_to_leave_its_gpu():
    gpus = [gpu(1, shared_mib=2 * GIB, shared_jobs=1, shared_until=NOW + 600)]
    d = decide(QueueState(NOW, [job(1), job(2, limit=60)], gpus))
    assert placed(d) == {} and d.waiting == {1: RESOURCES, 2: PRIORITY}
    assert d.reservation.start == NOW + 600 and d.reservation.gpu_ids == {1}


def test_a_shared_job_never_takes_a_gpu_a_whole_job_holds():
    d = decide(QueueState(NOW, [share(1, 1)], [gpu(1, busy_until=NOW + 60)]))
    assert placed(d) == {} and d.reservation.start == NOW + 60


def test_a_shared_gang_takes_all_its_gpus_on_one_node():
    gpus = [gpu(1, "a"), gpu(2, "b", shared_mib=10 * GIB, shared_jobs=1), gpu(3, "b"), gpu(4, "a")]
    d = decide(QueueState(NOW, [share(1, 4, gpus=2)], gpus))
    assert placed(d) == {1: [2, 3]}  # node b: 1.5 GiB left over on GPU 2, fuller than node a
    d = decide(QueueState(NOW, [share(1, 8, gpus=2)], gpus))
    assert placed(d) == {1: [1, 4]}  # node b has one GPU with 8.5 GiB of room: not enough


def test_a_shared_job_backfills_a_gpu_reserved_for_a_whole_job_only_if_it_ends_before_it_starts():
    gpus = [gpu(1), gpu(2, busy_until=NOW + 3600)]
    d = decide(QueueState(NOW, [job(1, gpus=2), share(2, 2, limit=600), share(3, 2, limit=7200), share(4, 2)], gpus))
    assert placed(d) == {2: [1]}
    assert d.waiting == {1: RESOURCES, 3: PRIORITY, 4: PRIORITY}


def test_a_shared_job_backfills_beside_a_reserved_shared_job_if_it_leaves_it_room():
    # Job 1 needs 12.5 GiB on GPU 1 and gets it when the shared jobs there end, in an hour.
    gpus = [gpu(1, shared_mib=8 * GIB, shared_jobs=2, shared_until=NOW + 3600), gpu(2, busy_until=math.inf)]
    jobs = [share(1, 12), share(2, 3.5), share(3, 2.5), share(4, 1.5, limit=600)]
    d = decide(QueueState(NOW, jobs, gpus))
    assert d.reservation.job_id == 1 and d.reservation.start == NOW + 3600 and d.reservation.shared_mib == 12800
    # Job 2 (4 GiB, no limit) would leave 16 - 4 = 12 GiB at that time: too little. Job 3 (3 GiB)
    # leaves 13; job 4 would not, but it ends first.
    assert placed(d) == {3: [1], 4: [1]} and d.waiting[2] == PRIORITY


def test_a_reservation_counts_the_jobs_placed_before_it_in_the_same_pass():
    d = decide(QueueState(NOW, [job(1, limit=7200), job(2, gpus=2), job(3, limit=600)],
                          [gpu(1), gpu(2, busy_until=NOW + 3600)]))
    assert placed(d) == {1: [1]} and d.reservation.start == NOW + 7200
    assert d.waiting == {2: RESOURCES, 3: PRIORITY}  # job 3 could not take GPU 2 anyway: it is busy


def test_a_shared_job_without_a_memory_request_is_refused():
    with pytest.raises(ValueError, match="memory"):
        job(1, shared=True)


def test_a_shared_job_is_charged_its_share_and_reserve_of_the_gpus_memory():
    assert charged_fraction(3584, 512, 16384) == 0.25
    assert charged_fraction(40000, 512, 16384) == 1.0
    assert charged_gpus(share(1, 3.5, gpus=2), [gpu(1), gpu(2, total=32 * GIB)], 512) == 0.25 + 0.125
    assert charged_gpus(job(1, gpus=2), [gpu(1), gpu(2)], 512) == 2


def test_the_user_limit_counts_a_shared_job_as_its_charged_fraction():
    jobs = [share(n, 3.5, user="ann") for n in range(1, 7)]
    d = decide(QueueState(NOW, jobs, [gpu(1), gpu(2)], gpus_in_use={"ann": 0.5}, user_gpu_limit=1))
    # A quarter of a GPU each: two more reach the limit of one GPU.
    assert placed(d) == {1: [1], 2: [1]} and all(d.waiting[n] == USER_LIMIT for n in range(3, 7))


def test_next_up_lists_no_shared_job_and_a_shared_job_closes_the_lists_of_gpus_it_could_use():
    gpus = [gpu(1, busy_until=NOW + 3600), gpu(2, "b", busy_until=math.inf, total=4 * GIB),
            gpu(3, shared_mib=12 * GIB, shared_jobs=1)]
    jobs = [job(1), share(2, 6), job(3), share(4, 1)]
    snap = QueueState(NOW, jobs, gpus)
    d = decide(snap)
    assert placed(d) == {4: [3]}
    # Job 2 could use GPU 1 once free, not GPU 2 (4 GiB): GPU 1 lists only job 1, GPU 2 goes on;
    # GPU 3, partly used by shared jobs, gets no list.
    assert next_up(snap, d, per_gpu=4, scan=100) == {1: [1], 2: [1, 3]}


def test_why_lines_give_each_gpus_room_and_what_the_shared_job_needs():
    gpus = [gpu(1, shared_mib=9 * GIB, shared_jobs=2, foreign=int(1.5 * GIB)), gpu(0, busy_until=NOW + 60),
            gpu(2, "b")]
    assert room_lines(share(7, 6), gpus, 512) == [
        "GPU 0 on node a runs a whole-GPU job: no room to share until it ends",
        "GPU 1 on node a: 5.5 GiB left of 16 (2 shared jobs hold 9.0, other programs 1.5), job needs 6.0 + 0.5",
        "GPU 2 on node b: 16.0 GiB left of 16, job needs 6.0 + 0.5",
    ]
    assert len(room_lines(share(7, 6, node="b"), gpus, 512)) == 1
