"""Preemption in the policy, a pure function: which preemptible jobs a waiting job stops, and what
it never stops (service/preemption.py, policy.decide)."""

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuq.service.policy import (
    PREEMPTING,
    PRIORITY,
    RESOURCES,
    SHARED_CONTEXT_MIB,
    USER_LIMIT,
    GpuState,
    JobRequest,
    QueueState,
    decide,
    queue_order,
)
from gpuq.service.queue_state import Preemptible

NOW = 1_000_000.0


def gpu(gpu_id, node="a", busy_until=None, victim=None, preempted=False, foreign=0, total=16384):
    """A GPU; ``victim``: (job id, priority, started) of the preemptible job on it."""
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=total,
                    foreign_mib=foreign,
                    busy_until=math.inf if victim is not None or preempted else busy_until,
                    preemptible=Preemptible(*victim) if victim is not None else None, preempted=preempted)


def job(job_id, gpus=1, user="u", priority=0, preemptible=False, limit=None, mem=None, shared=False):
    return JobRequest(id=job_id, user=user, gpus=gpus, priority=priority, submitted=job_id, time_limit_s=limit,
                      preemptible=preemptible, mem_mib=mem, shared=shared)


def placed(decision):
    return {p.job_id: [g.id for g in p.gpus] for p in decision.placements}


def test_a_waiting_job_stops_the_preemptible_job_on_the_gpu_it_needs():
    d = decide(QueueState(NOW, [job(5)], [gpu(1, victim=(90, 0, NOW - 60))]))
    assert d.preemptions == {90: 5} and d.waiting == {5: PREEMPTING} and placed(d) == {}


def test_a_free_gpu_is_taken_before_anyone_is_preempted():
    d = decide(QueueState(NOW, [job(5)], [gpu(1, victim=(90, 0, NOW - 60)), gpu(2)]))
    assert placed(d) == {5: [2]} and d.preemptions == {}


def test_the_lowest_priority_then_the_latest_started_is_preempted_first():
    gpus = [gpu(1, victim=(90, 0, NOW - 600)), gpu(2, victim=(91, 0, NOW - 60)), gpu(3, victim=(92, 5, NOW - 1))]
    assert decide(QueueState(NOW, [job(5)], gpus)).preemptions == {91: 5}
    gpus[0] = gpu(1, victim=(90, -1, NOW - 600))
    assert decide(QueueState(NOW, [job(5)], gpus)).preemptions == {90: 5}


def test_a_gang_preempts_on_one_node_the_fewest_jobs_it_can():
    gpus = [gpu(1, "a", victim=(90, 0, NOW)), gpu(2, "a", victim=(91, 0, NOW)),
            gpu(3, "b", victim=(92, 0, NOW)), gpu(4, "b", victim=(92, 0, NOW)), gpu(5, "c")]
    d = decide(QueueState(NOW, [job(5, gpus=2)], gpus))
    assert d.preemptions == {92: 5}  # one two-GPU job on b, not two jobs on a
    # With a free GPU on a node, one job there is enough.
    gpus[4] = gpu(5, "a")
    assert decide(QueueState(NOW, [job(5, gpus=2)], gpus)).preemptions in ({90: 5}, {91: 5})


def test_gpus_being_freed_by_a_preemption_are_waited_for_not_preempted_again():
    # The pass after: the victim was asked to stop and has not yet; nothing more is preempted.
    gpus = [gpu(1, preempted=True), gpu(2, victim=(91, 0, NOW))]
    d = decide(QueueState(NOW, [job(5)], gpus))
    assert d.preemptions == {} and d.waiting == {5: PREEMPTING}
    # A second waiting job takes the other one, not the GPU the first is waiting for.
    d = decide(QueueState(NOW, [job(5), job(6)], gpus))
    assert d.preemptions == {91: 6} and d.waiting == {5: PREEMPTING, 6: PREEMPTING}


def test_a_gpu_claimed_by_a_preemptor_is_not_given_to_a_later_job():
    # Job 5 needs two GPUs: the free one and a preempted one; job 6 behind it gets neither.
    gpus = [gpu(1), gpu(2, victim=(90, 0, NOW))]
    d = decide(QueueState(NOW, [job(5, gpus=2), job(6, preemptible=True)], gpus))
    assert d.preemptions == {90: 5} and placed(d) == {} and d.waiting[6] in (PRIORITY, RESOURCES)


def test_preemptible_jobs_never_preempt_and_come_after_every_other_job():
    gpus = [gpu(1, victim=(90, 0, NOW))]
    d = decide(QueueState(NOW, [job(5, priority=100, preemptible=True)], gpus))
    assert d.preemptions == {} and d.waiting == {5: RESOURCES}
    order = queue_order(QueueState(NOW, [job(1, preemptible=True, priority=100), job(2, priority=-100)], []))
    assert [j.id for j in order] == [2, 1]


def test_a_preemptible_job_is_held_to_no_user_gpu_limit_and_counts_against_none():
    d = decide(QueueState(NOW, [job(1, preemptible=True), job(2, preemptible=True)], [gpu(1), gpu(2)],
                          gpus_in_use={"u": 4}, user_gpu_limit=2))
    assert placed(d) == {1: [1], 2: [2]}
    # A job that is not preemptible is held to it, and preempts nothing past it.
    d = decide(QueueState(NOW, [job(3)], [gpu(1, victim=(90, 0, NOW))], gpus_in_use={"u": 2}, user_gpu_limit=2))
    assert d.preemptions == {} and d.waiting == {3: USER_LIMIT}


def test_a_job_that_fits_no_preemptible_gpu_preempts_nothing():
    gpus = [gpu(1, victim=(90, 0, NOW), foreign=2000)]  # another program's memory: an unsized job never goes there
    assert decide(QueueState(NOW, [job(5)], gpus)).preemptions == {}
    assert decide(QueueState(NOW, [job(5, mem=8000)], gpus)).preemptions == {90: 5}
    assert decide(QueueState(NOW, [job(5, gpus=2)], gpus)).preemptions == {}


def test_a_shared_job_may_preempt_a_whole_gpu():
    d = decide(QueueState(NOW, [job(5, mem=4000, shared=True)], [gpu(1, victim=(90, 0, NOW))]))
    assert d.preemptions == {90: 5}


def test_the_gpus_reserved_for_the_first_in_line_are_not_preempted_for_a_later_job():
    # Job 1 (two GPUs) cannot start or preempt enough (one GPU is a normal job's); it reserves GPUs
    # 1 and 2 from job 80's end. Job 2 behind it preempts the preemptible job on node b, not a.
    gpus = [gpu(1, "a", busy_until=NOW + 100), gpu(2, "a", victim=(90, 0, NOW)), gpu(3, "b", victim=(91, 0, NOW))]
    gpus[1] = GpuState(**{**gpus[1].__dict__, "busy_until": NOW + 50})
    d = decide(QueueState(NOW, [job(1, gpus=2, limit=3600), job(2, limit=3600)], gpus))
    assert d.reservation is not None and d.reservation.job_id == 1
    assert d.preemptions == {91: 2}


victims = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.sampled_from(["a", "b"])), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(gpus=victims, waiting=st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=5))
def test_no_gpu_is_preempted_twice_or_given_to_two_jobs_and_only_preemptible_jobs_are_stopped(gpus, waiting):
    """Whatever the GPUs (free, normal, preemptible or being freed) and the waiting jobs, a pass
    stops only preemptible jobs, each for one job, and every job that preempts finds enough GPUs
    on one node, none of them placed or claimed twice."""
    states = []
    for i, (kind, _, node) in enumerate(gpus):
        states.append(gpu(i, node, busy_until=NOW + 100 if kind == 1 else None,
                          victim=(100 + i, 0, NOW) if kind == 2 else None, preempted=kind == 3))
    jobs = [job(j, gpus=n, preemptible=p) for j, (n, p) in enumerate(waiting, 1)]
    d = decide(QueueState(NOW, jobs, states))
    preemptible_ids = {g.preemptible.job_id for g in states if g.preemptible is not None}
    assert set(d.preemptions) <= preemptible_ids
    by_id = {j.id: j for j in jobs}
    assert not any(by_id[j].preemptible for j in d.preemptions.values())
    placed_gpus = [g for p in d.placements for g in placed(d)[p.job_id]]
    assert len(placed_gpus) == len(set(placed_gpus))
    victims_gpus = {g.id for g in states if g.preemptible is not None and g.preemptible.job_id in d.preemptions}
    assert not victims_gpus & set(placed_gpus)
    assert all(d.waiting[j] == PREEMPTING for j in d.preemptions.values())


def test_the_preempted_gpu_lists_its_preemptor_first_and_preemptible_jobs_past_the_user_limit():
    from gpuq.service.next_up_choice import choose as next_up

    state = QueueState(NOW, [job(6, preemptible=True), job(5), job(7, preemptible=True)],
                       [gpu(1, victim=(90, 0, NOW)), gpu(2, busy_until=NOW + 60)], gpus_in_use={"u": 1},
                       user_gpu_limit=1)
    d = decide(state)
    assert d.preemptions == {} and d.waiting[5] == USER_LIMIT  # u holds its one GPU (gpu 2)
    # Whichever GPU frees first takes u's preemptible jobs, past the limit, in their order.
    assert next_up(state, d, 4, 100) == {1: [6, 7], 2: [6, 7]}
    state = QueueState(NOW, [job(6, preemptible=True), job(5)], [gpu(1, victim=(90, 0, NOW))])
    d = decide(state)
    assert d.preemptions == {90: 5} and next_up(state, d, 4, 100) == {1: [5, 6]}


def test_a_job_that_preempts_is_expected_to_start_now_on_its_gpus_and_the_next_after_it():
    from gpuq.service.forecast import start_times

    state = QueueState(NOW, [job(5, limit=600), job(6, limit=600)], [gpu(1, victim=(90, 0, NOW))])
    d = decide(state)
    assert d.preemptions == {90: 5} and [p.job_id for p in d.claims] == [5]
    assert start_times(state, d) == {5: NOW, 6: NOW + 600}


def test_a_job_that_is_not_preemptible_is_expected_to_start_when_the_others_end_not_the_scavengers():
    from gpuq.service.forecast import start_times

    # GPU 1: a scavenger with no time limit; GPU 2: a job for another hour. Job 1 needs both: it
    # cannot preempt now (GPU 2 is not the scavenger's), and in an hour it will, whatever the
    # scavenger's limit. Job 2 (preemptible) waits for everyone: GPU 2 once job 1 has ended, as
    # the scavenger may hold GPU 1 for ever.
    gpus = [gpu(1, victim=(90, 0, NOW - 600)), gpu(2, busy_until=NOW + 3600)]
    state = QueueState(NOW, [job(1, gpus=2, limit=3600), job(2, preemptible=True, limit=600)], gpus)
    d = decide(state)
    assert d.waiting == {1: RESOURCES, 2: PRIORITY} and not d.preemptions
    assert start_times(state, d) == {1: NOW + 3600, 2: NOW + 7200}
    # A shared job stops a scavenger too: expected at once on its GPU, as the pass claims it.
    shared = QueueState(NOW, [job(3, shared=True, mem=4096, limit=600)], gpus)
    d = decide(shared)
    assert d.preemptions == {90: 3} and start_times(shared, d) == {3: NOW}


def test_a_scavenger_within_its_exempt_time_is_planned_firm_until_it_may_be_preempted_and_no_wall_after():
    from gpuq.service.forecast import start_times

    # GPU 1: a scavenger with no time limit that may be preempted in 10 minutes (GPUQ_PREEMPT_EXEMPT):
    # no pass stops it before, so job 1 is expected then, not never; job 2, preemptible itself,
    # waits for the scavenger's end, which never comes.
    exempt = GpuState(id=1, node="a", index=1, queue="q1", memory_total_mib=16384, busy_until=math.inf,
                      exempt_until=NOW + 600)
    state = QueueState(NOW, [job(1, limit=600), job(2, preemptible=True, limit=600)], [exempt])
    d = decide(state)
    assert d.waiting == {1: RESOURCES, 2: PRIORITY} and not d.preemptions
    assert start_times(state, d) == {1: NOW + 600, 2: None}
    # One whose limit ends before its exempt time is over is simply a job until then.
    ends_first = replace(exempt, busy_until=NOW + 300)
    state = QueueState(NOW, [job(1, limit=600)], [ends_first])
    assert start_times(state, decide(state)) == {1: NOW + 300}


def test_a_preemptible_job_is_planned_past_its_users_gpu_limit_and_a_planned_scavenger_is_no_wall():
    from gpuq.service.forecast import start_times

    # Ann holds her one GPU for an hour. Her preemptible job takes the free GPU now (it is held to
    # no limit); her next job waits for her hour. Bob's job, not before half an hour (--begin), is
    # planned then on the scavenger's GPU, which it would stop, not after the scavenger's 2 hours.
    gpus = [gpu(1, busy_until=NOW + 3600), gpu(2)]
    jobs = [job(1, user="ann", preemptible=True, limit=7200), job(2, user="ann", limit=600)]
    state = QueueState(NOW, jobs, gpus, gpus_in_use={"ann": 1}, user_gpu_limit=1,
                       user_holds={"ann": [(NOW + 3600, 1.0)]})
    d = decide(state)
    assert placed(d) == {1: [2]} and d.waiting == {2: USER_LIMIT}
    later = [(job(3, user="bob", limit=600), NOW + 1800)]
    where = {}
    assert start_times(state, d, later=later, where=where) == {1: NOW, 2: NOW + 3600, 3: NOW + 1800}
    assert [g.id for g in where[3]] == [2]


def shared_gpu(gpu_id, firm=(), scavengers=(), stopping=(), node="a", total=16384):
    """A GPU shared jobs use: ``firm`` MiB held by jobs that are not preemptible, ``scavengers``
    (job id, priority, started, MiB) by preemptible ones, ``stopping`` MiB by shares being preempted."""
    shares = [(math.inf, mib) for mib in (*firm, *(s[3] for s in scavengers), *stopping)]
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=total,
                    shares=tuple(shares),
                    preemptible_shares=tuple((Preemptible(j, p, t), math.inf, mib) for j, p, t, mib in scavengers),
                    preempted_shares=tuple((math.inf, mib) for mib in stopping))


def test_a_whole_gpu_job_stops_every_preemptible_share_of_a_gpu_and_none_where_one_share_is_firm():
    two = [(90, 0, NOW - 60, 4096), (91, 0, NOW - 30, 4096)]
    d = decide(QueueState(NOW, [job(5)], [shared_gpu(1, scavengers=two)]))
    assert d.preemptions == {90: 5, 91: 5} and d.waiting == {5: PREEMPTING}
    d = decide(QueueState(NOW, [job(5)], [shared_gpu(1, firm=[2048], scavengers=two)]))
    assert d.preemptions == {} and d.waiting == {5: RESOURCES}
    # Where one GPU is shared by a single scavenger and another by two, the one stop is chosen.
    gpus = [shared_gpu(1, scavengers=two), shared_gpu(2, scavengers=[(92, 0, NOW, 512)])]
    d = decide(QueueState(NOW, [job(5)], gpus))
    assert d.preemptions == {92: 5}


def test_a_shared_job_stops_the_fewest_shares_that_make_its_room_lowest_priority_then_latest_started_first():
    # 16 GiB: 4 + 4 + 4 held by scavengers, 4 free; a 6 GiB share (6.5 with its context) needs one stopped.
    scavengers = [(90, 0, NOW - 600, 4096), (91, 0, NOW - 60, 4096), (92, 5, NOW - 1, 4096)]
    d = decide(QueueState(NOW, [job(5, mem=6144, shared=True)], [shared_gpu(1, scavengers=scavengers)]))
    assert d.preemptions == {91: 5} and d.waiting == {5: PREEMPTING}
    assert [[g.id for g in c.gpus] for c in d.claims] == [[1]]
    # 10 GiB (10.5) needs two stopped; with room enough it is placed, nobody stopped.
    d = decide(QueueState(NOW, [job(5, mem=10240, shared=True)], [shared_gpu(1, scavengers=scavengers)]))
    assert set(d.preemptions) == {90, 91}
    d = decide(QueueState(NOW, [job(5, mem=3072, shared=True)], [shared_gpu(1, scavengers=scavengers)]))
    assert d.preemptions == {} and placed(d) == {5: [1]}


def test_room_a_preempted_share_is_freeing_is_waited_for_and_not_preempted_again_nor_given_to_another():
    # The pass after: share 91 was asked to stop; the 6 GiB job waits for it (4 GiB free and 4 being
    # freed: 6.5 of them its own), and the next one (6 GiB too) stops both scavengers left for its room.
    gpu1 = shared_gpu(1, scavengers=[(90, 0, NOW - 600, 4096), (92, 0, NOW - 1, 4096)], stopping=[4096])
    d = decide(QueueState(NOW, [job(5, mem=6144, shared=True)], [gpu1]))
    assert d.preemptions == {} and d.waiting == {5: PREEMPTING}
    d = decide(QueueState(NOW, [job(5, mem=6144, shared=True), job(6, mem=6144, shared=True)], [gpu1]))
    assert d.preemptions == {90: 6, 92: 6} and d.waiting == {5: PREEMPTING, 6: PREEMPTING}


def test_the_forecast_plans_a_job_that_is_not_preemptible_past_the_preemptible_shares_and_a_scavenger_behind():
    from gpuq.service.forecast import start_times

    gpus = [shared_gpu(1, firm=[8192], scavengers=[(90, 0, NOW - 60, 8192)])]
    gpus[0] = GpuState(**{**gpus[0].__dict__, "shares": ((NOW + 100, 8192), (math.inf, 8192)),
                          "preemptible_shares": ((Preemptible(90, 0, NOW - 60), math.inf, 8192),)})
    state = QueueState(NOW, [job(5, limit=60), job(6, limit=60, preemptible=True)], gpus)
    starts = start_times(state)
    # Job 5 (whole GPU) from the firm share's end, the scavenger stopped then; job 6 never (the
    # scavenger without a limit holds its share, and a preemptible job stops none).
    assert starts[5] == NOW + 100 and starts[6] is None


share_kinds = st.lists(st.lists(st.tuples(st.sampled_from(["firm", "scavenger", "stopping"]),
                                          st.sampled_from([1024, 3072, 6144])), max_size=3), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(gpus=share_kinds, waiting=st.lists(st.tuples(st.sampled_from([None, 2048, 5120, 9216]), st.booleans()),
                                          min_size=1, max_size=4))
def test_no_gpu_is_given_more_room_than_its_shares_free_nor_taken_whole_past_a_firm_share(gpus, waiting):
    """Whatever the shares on the GPUs (firm, preemptible, being preempted) and the waiting jobs
    (whole, or shared by their memory), a pass stops only preemptible shares, for jobs that are not
    preemptible; on each GPU the shares placed and claimed fit the room it has once the stopped and
    stopping shares are gone; and a whole-GPU job is placed or claims only a GPU with no firm share,
    every other share on it stopped or stopping."""
    states, victim = [], 100
    for i, shares in enumerate(gpus):
        firm = [m for k, m in shares if k == "firm"]
        stopping = [m for k, m in shares if k == "stopping"]
        scavengers = []
        for k, m in shares:
            if k == "scavenger":
                scavengers.append((victim, 0, NOW - victim, m))
                victim += 1
        states.append(shared_gpu(i, firm=firm, scavengers=scavengers, stopping=stopping))
    jobs = [job(j, mem=mem, shared=mem is not None, preemptible=p) for j, (mem, p) in enumerate(waiting, 1)]
    d = decide(QueueState(NOW, jobs, states))
    by_id = {j.id: j for j in jobs}
    assert not any(by_id[j].preemptible for j in d.preemptions.values())
    for g in states:
        scavenging = {v.job_id: m for v, _, m in g.preemptible_shares}
        assert set(d.preemptions) <= {v for s in states for v, _, _ in
                                      ((p.job_id, e, m) for p, e, m in s.preemptible_shares)}
        taken = [by_id[p.job_id] for p in [*d.placements, *d.claims] if g in p.gpus]
        freed = g.freeing_mib + sum(m for j, m in scavenging.items() if j in d.preemptions)
        if any(not j.shared for j in taken):
            assert len(taken) == 1 and sum(m for _, m in g.firm_shares) == 0
            assert all(j in d.preemptions for j in scavenging)
        elif taken:
            assert sum(j.mem_mib + SHARED_CONTEXT_MIB for j in taken) <= g.room_mib + freed
