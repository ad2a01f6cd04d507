"""Scheduling policy as a pure function: gang, order, fair share, user limits, memory, backfill."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuq.service.next_up_choice import choose as next_up
from gpuq.service.policy import (
    PRIORITY,
    RESOURCES,
    USER_LIMIT,
    GpuState,
    JobRequest,
    QueueState,
    decide,
    queue_order,
)

NOW = 1_000_000.0


def gpu(gpu_id, node="a", busy_until=None, total=16384, used=0, foreign=0):
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=total,
                    memory_used_mib=used, foreign_mib=foreign, busy_until=busy_until)


def job(job_id, gpus=1, user="u", priority=0, mem=None, node=None, limit=None, submitted=None):
    return JobRequest(id=job_id, user=user, gpus=gpus, priority=priority,
                      submitted=submitted if submitted is not None else job_id, mem_mib=mem, node=node,
                      time_limit_s=limit)


def placed(decision):
    return {p.job_id: [g.id for g in p.gpus] for p in decision.placements}


def test_priority_then_fair_share_then_age():
    jobs = [job(1, user="heavy"), job(2, user="light"), job(3, user="heavy", priority=5), job(4, user="light")]
    order = [j.id for j in queue_order(QueueState(NOW, jobs, [], gpu_hours={"heavy": 10.0, "light": 1.0}))]
    assert order == [3, 2, 4, 1]


def test_a_user_over_the_gpu_limit_waits_without_holding_up_others():
    d = decide(QueueState(NOW, [job(1, gpus=2, user="ann"), job(2, user="bob")], [gpu(1), gpu(2), gpu(3)],
                        gpus_in_use={"ann": 1}, user_gpu_limit=2))
    assert placed(d) == {2: [1]} and d.waiting == {1: USER_LIMIT}


def test_a_users_own_gpu_limit_stands_in_for_everyones_and_zero_is_none():
    jobs = [job(1, gpus=2, user="ann"), job(2, gpus=3, user="pi"), job(3, user="bob"), job(4, user="bob")]
    state = QueueState(NOW, jobs, [gpu(i) for i in range(1, 9)], user_gpu_limit=2,
                       user_gpu_limits={"bob": 1, "pi": 0})
    d = decide(state)
    # ann under everyone's 2, the pi under none, bob under his own 1.
    assert placed(d) == {1: [1, 2], 2: [3, 4, 5], 3: [6]} and d.waiting == {4: USER_LIMIT}
    assert (state.limit_of("ann"), state.limit_of("bob"), state.limit_of("pi"), state.limited) == (2, 1, 0, True)
    assert QueueState(NOW, [], [], user_gpu_limits={"pi": 0}).limited is False


def test_memory_request_counts_memory_foreign_processes_hold():
    gpus = [gpu(1, foreign=10000), gpu(2, foreign=2000)]
    d = decide(QueueState(NOW, [job(1, mem=12000)], gpus))
    assert placed(d) == {1: [2]}
    # A job that did not say how much memory it needs is not put beside a foreign process.
    d = decide(QueueState(NOW, [job(2)], [gpu(1, foreign=500)]))
    assert placed(d) == {} and d.waiting == {2: RESOURCES}


def test_node_request_is_honoured():
    d = decide(QueueState(NOW, [job(1, node="b")], [gpu(1, "a"), gpu(2, "b")]))
    assert placed(d) == {1: [2]}


def test_no_backfill_past_a_waiting_gang_without_time_limits():
    # Job 1 needs both GPUs of node a; GPU 2's job has no time limit, so when it ends is unknown.
    gpus = [gpu(1), gpu(2, busy_until=math.inf)]
    d = decide(QueueState(NOW, [job(1, gpus=2), job(2, limit=60)], gpus))
    assert placed(d) == {} and d.waiting == {1: RESOURCES, 2: PRIORITY}


def test_a_short_job_backfills_when_it_ends_before_the_big_job_could_start():
    gpus = [gpu(1), gpu(2, busy_until=NOW + 3600)]
    d = decide(QueueState(NOW, [job(1, gpus=2), job(2, limit=600), job(3, limit=7200), job(4)], gpus))
    assert placed(d) == {2: [1]}
    assert d.reservation.job_id == 1 and d.reservation.start == NOW + 3600
    assert d.waiting == {1: RESOURCES, 3: PRIORITY, 4: PRIORITY}


def test_jobs_may_use_gpus_the_waiting_gang_does_not_need():
    gpus = [gpu(1), gpu(2), gpu(3, busy_until=NOW + 3600)]
    d = decide(QueueState(NOW, [job(1, gpus=3), job(2)], gpus))
    assert placed(d) == {} and d.reservation.gpu_ids == {1, 2, 3}
    gpus = [gpu(1), gpu(2), gpu(3, busy_until=NOW + 3600), gpu(4, "b")]
    d = decide(QueueState(NOW, [job(1, gpus=3), job(2)], gpus))
    assert placed(d) == {2: [4]}  # another node cannot delay job 1


gpu_lists = st.lists(
    st.tuples(st.sampled_from("abc"), st.sampled_from([None, None, 100.0, 5000.0, math.inf]),
              st.sampled_from([0, 0, 3000, 15000])),
    max_size=10,
).map(lambda specs: [gpu(i + 1, node=n, busy_until=None if b is None else NOW + b if not math.isinf(b) else b,
                         foreign=f) for i, (n, b, f) in enumerate(specs)])
job_lists = st.lists(
    st.tuples(st.integers(1, 4), st.sampled_from("xyz"), st.integers(-1, 1), st.sampled_from([None, 2000, 14000]),
              st.sampled_from([None, None, "a"]), st.sampled_from([None, 60, 4000])),
    max_size=12,
).map(lambda specs: [job(i + 1, gpus=g, user=u, priority=p, mem=m, node=n, limit=t)
                     for i, (g, u, p, m, n, t) in enumerate(specs)])


# Some users' own GPU limits (GPUQ_USER_GPU_LIMITS) in place of everyone's: 0 is none.
own_limits = st.dictionaries(st.sampled_from("xyz"), st.sampled_from([0, 1, 2]), max_size=2)


@settings(max_examples=300, deadline=None)
@given(gpus=gpu_lists, jobs=job_lists, default=st.sampled_from([0, 0, 2, 3]),
       held=st.dictionaries(st.sampled_from("xyz"), st.integers(0, 2)), own=own_limits)
def test_policy_never_double_books_splits_a_gang_exceeds_a_limit_or_delays_the_first_in_line(gpus, jobs, default, held,
                                                                                            own):
    snap = QueueState(NOW, jobs, gpus, gpu_hours={"x": 3.0, "y": 1.0}, gpus_in_use=held, user_gpu_limit=default,
                      user_gpu_limits=own)
    d = decide(snap)
    by_id = {g.id: g for g in gpus}
    jobs_by_id = {j.id: j for j in jobs}
    used = [g.id for p in d.placements for g in p.gpus]
    assert len(used) == len(set(used))
    assert all(by_id[g].busy_until is None for g in used)
    per_user = dict(held)
    for p in d.placements:
        j = jobs_by_id[p.job_id]
        assert len(p.gpus) == j.gpus and len({g.node for g in p.gpus}) == 1
        assert all(g.fits(j) for g in p.gpus) and (j.node is None or p.gpus[0].node == j.node)
        per_user[j.user] = per_user.get(j.user, 0) + j.gpus
    for j in (jobs_by_id[p.job_id] for p in d.placements):
        assert not snap.limit_of(j.user) or per_user[j.user] <= snap.limit_of(j.user)
    assert set(d.waiting) | {p.job_id for p in d.placements} == set(jobs_by_id)
    # The first job in line that its user's limit allows is never delayed by a job behind it.
    order = [j for j in queue_order(snap)
             if not (snap.limit_of(j.user) and held.get(j.user, 0) + j.gpus > snap.limit_of(j.user))]
    if order:
        first = order[0]
        fits_now = any(sum(1 for g in gpus if g.node == n and g.busy_until is None and g.fits(first)) >= first.gpus
                       for n in {g.node for g in gpus} if first.node in (None, n))
        assert fits_now == (first.id in placed(d))
    if order and order[0].id not in placed(d):
        r = d.reservation
        if r is not None and r.job_id == order[0].id:
            for p in d.placements:
                j = jobs_by_id[p.job_id]
                if p.gpus[0].node == r.node and {g.id for g in p.gpus} & r.gpu_ids:
                    assert j.time_limit_s is not None and NOW + j.time_limit_s <= r.start


@settings(max_examples=300, deadline=None)
@given(gpus=gpu_lists, jobs=job_lists, default=st.sampled_from([0, 0, 2, 3]),
       held=st.dictionaries(st.sampled_from("xyz"), st.integers(0, 2)), own=own_limits)
def test_next_up_lists_only_fitting_one_gpu_jobs_in_queue_order_and_never_ahead_of_one_that_could_use_the_gpu(
        gpus, jobs, default, held, own):
    snap = QueueState(NOW, jobs, gpus, gpu_hours={"x": 3.0, "y": 1.0}, gpus_in_use=held, user_gpu_limit=default,
                      user_gpu_limits=own)
    d = decide(snap)
    lists = next_up(snap, d, per_gpu=2, scan=1000)
    by_id = {g.id: g for g in gpus}
    placed_now = {p.job_id for p in d.placements}
    busy = {g.id for g in gpus if g.busy_until is not None} | {g.id for p in d.placements for g in p.gpus}
    position = {j.id: n for n, j in enumerate(queue_order(snap))}
    jobs_by_id = {j.id: j for j in jobs}
    for gpu_id, listed in lists.items():
        g = by_id[gpu_id]
        assert gpu_id in busy and listed == sorted(listed, key=position.get)
        assert len(listed) <= 2 * sum(1 for b in busy if by_id[b].node == g.node)
        for job_id in listed:
            j = jobs_by_id[job_id]
            assert job_id not in placed_now and j.gpus == 1 and g.fits(j) and j.node in (None, g.node)
            if snap.limit_of(j.user):
                assert held.get(j.user, 0) + 1 <= snap.limit_of(j.user)
        if snap.limited:
            continue  # (which jobs a limit lets through depends on who takes what first)
        # Every job ahead of the last one listed that could use this GPU is listed before it
        # (a one-GPU job) or ended the list (a gang that could run on this node): taking the
        # list's head delays nobody.
        last = position[listed[-1]]
        for ahead in queue_order(snap)[:last]:
            if ahead.id in placed_now:
                continue
            if g.fits(ahead) and ahead.node in (None, g.node):
                fitting_here = sum(1 for h in gpus if h.node == g.node and h.fits(ahead))
                assert (ahead.gpus == 1 and ahead.id in listed) or (ahead.gpus > 1 and fitting_here < ahead.gpus)


def test_next_up_lists_the_queue_for_busy_gpus_and_stops_at_a_gang_that_could_use_them():
    gpus = [gpu(1, busy_until=math.inf), gpu(2, busy_until=math.inf), gpu(3, node="b", busy_until=math.inf)]
    jobs = [job(1), job(2, node="b"), job(3, gpus=2), job(4), job(5, node="b")]
    snap = QueueState(NOW, jobs, gpus)
    lists = next_up(snap, decide(snap), per_gpu=4, scan=1000)
    # Job 3 needs two GPUs: it closes node a's lists; node b (one GPU) goes on past it.
    assert lists == {1: [1], 2: [1], 3: [1, 2, 4, 5]}
