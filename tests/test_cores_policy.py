"""CPU cores and host memory as a node's consumables (`--cpus`, `--host-mem`, SLURM's cons_tres) in
the policy, a pure function: where a job that reserves them may start, what the first job in line
keeps of them, preemption for them, the next-up lists and the forecast (service/node_use.py,
placing, preemption, forecast)."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuq.service import next_up_choice
from gpuq.service.forecast import start_times
from gpuq.service.node_use import CPUS, HOST_MEM, NodeUse, offered_cores, offered_host_mem_mib
from gpuq.service.policy import PREEMPTING, RESOURCES, GpuState, JobRequest, QueueState, decide
from gpuq.service.queue_state import Preemptible

pytestmark = pytest.mark.timeout(60)

NOW = 1_000_000.0


def gpu(gpu_id, node="a", busy_until=None, victim=None):
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=16384,
                    busy_until=math.inf if victim is not None else busy_until,
                    preemptible=Preemptible(*victim) if victim is not None else None)


def job(job_id, cpus=None, gpus=1, limit=None, node=None, preemptible=False, mem=None):
    return JobRequest(id=job_id, user="u", gpus=gpus, submitted=job_id, time_limit_s=limit, cpus=cpus, node=node,
                      preemptible=preemptible, host_mem_mib=mem)


def use(offer, **holds):
    """One kind's offer (node -> amount) and the running jobs' holds (node -> [(job id, end, amount)])."""
    return NodeUse(dict(offer), {node: {j: (end, c) for j, end, c in held} for node, held in holds.items()})


def cores(offer, **holds):
    """Nodes' cores and the running jobs' holds of them, and no host memory counted (``QueueState.node_use``)."""
    return {CPUS: use(offer, **holds), HOST_MEM: NodeUse()}


def placed(decision):
    return {p.job_id: [g.id for g in p.gpus] for p in decision.placements}


def test_jobs_asking_more_cores_together_than_their_node_offers_do_not_start_together():
    jobs = [job(1, cpus=3, limit=100), job(2, cpus=3, limit=100), job(3, cpus=1, limit=600)]
    d = decide(QueueState(NOW, jobs, [gpu(10), gpu(11), gpu(12)], node_use=cores({"a": 4})))
    # The first takes 3 of 4; the second waits for its cores although GPUs are free (from the
    # first's end); the third fits beside, and leaves the second its 3 then.
    assert sorted(placed(d)) == [1, 3] and d.waiting == {2: RESOURCES}
    assert [dict(p.needs) for p in d.placements] == [{CPUS: 3}, {CPUS: 1}]


def test_a_job_without_cpus_or_a_node_that_reports_no_cores_is_held_to_none():
    running = cores({"a": 4}, a=[(90, math.inf, 4)])
    d = decide(QueueState(NOW, [job(1), job(2, cpus=2, node="b")], [gpu(10), gpu(11, node="b")], node_use=running))
    assert placed(d) == {1: [10], 2: [11]}


def test_a_job_goes_to_the_node_whose_cores_are_free_and_a_gang_counts_them_once():
    gpus = [gpu(10), gpu(11), gpu(20, node="b"), gpu(21, node="b")]
    d = decide(QueueState(NOW, [job(1, cpus=4, gpus=2)], gpus, node_use=cores({"a": 4, "b": 4}, a=[(90, math.inf, 1)])))
    assert placed(d) == {1: [20, 21]}


def test_the_first_job_in_line_keeps_the_cores_it_waits_for_and_only_a_job_ending_before_may_take_them():
    # Job 90 holds 3 of node a's 4 cores for 100 s more; job 1 needs 4: it is expected then, and
    # reserves them. Job 2 (2 cores, no limit) would hold them past that: it waits. Job 3 (1 core,
    # 50 s) ends before: it backfills.
    running = cores({"a": 4}, a=[(90, NOW + 100, 3)])
    state = QueueState(NOW, [job(1, cpus=4), job(2, cpus=1), job(3, cpus=1, limit=50)],
                       [gpu(10, busy_until=NOW + 100), gpu(11), gpu(12)], node_use=running)
    d = decide(state)
    assert d.reservation is not None and (d.reservation.job_id, d.reservation.start, d.reservation.needs) == (
        1, NOW + 100, ((CPUS, 4),))
    assert list(placed(d)) == [3] and 2 in d.waiting
    assert start_times(state, d)[1] == NOW + 100


def test_a_job_that_asks_more_cores_than_any_node_has_holds_nobody_back():
    d = decide(QueueState(NOW, [job(1, cpus=64), job(2, cpus=1)], [gpu(10)], node_use=cores({"a": 4})))
    assert placed(d) == {2: [10]} and d.waiting == {1: RESOURCES} and d.reservation is None


def test_a_waiting_job_preempts_the_preemptible_jobs_whose_cores_it_needs():
    # Its GPU is free, but a preemptible job on the other GPU holds 3 of the 4 cores: it is stopped.
    running = cores({"a": 4}, a=[(90, math.inf, 3)])
    d = decide(QueueState(NOW, [job(1, cpus=2)], [gpu(10), gpu(11, victim=(90, 0, NOW - 60))], node_use=running))
    assert d.preemptions == {90: 1} and d.waiting == {1: PREEMPTING}
    assert [(c.job_id, [g.id for g in c.gpus], c.needs) for c in d.claims] == [(1, [10], ((CPUS, 2),))]
    # Without enough cores even then, nobody is stopped.
    d = decide(QueueState(NOW, [job(1, cpus=2)], [gpu(10), gpu(11, victim=(90, 0, NOW - 60))],
                          node_use=cores({"a": 4}, a=[(90, math.inf, 1), (91, math.inf, 3)])))
    assert d.preemptions == {} and d.waiting == {1: RESOURCES}


def test_a_preemptible_job_on_a_gpu_the_waiting_job_cannot_use_is_stopped_for_the_cores_it_holds():
    # Job 1 asks for an A100, which is free; the preemptible job 90 on the node's H100 holds 3 of its
    # 4 cores. A GPU job 1 could never use, but its cores are what job 1 waits for: 90 stops for them.
    a100 = dataclasses.replace(gpu(10), model="NVIDIA A100-SXM4-80GB")
    h100 = dataclasses.replace(gpu(11, victim=(90, 0, NOW - 60)), model="NVIDIA H100 80GB HBM3")
    wanted = dataclasses.replace(job(1, cpus=2), gpu_type="a100")
    d = decide(QueueState(NOW, [wanted], [a100, h100], node_use=cores({"a": 4}, a=[(90, math.inf, 3)])))
    assert d.preemptions == {90: 1} and d.waiting == {1: PREEMPTING}
    assert [(c.job_id, [g.id for g in c.gpus]) for c in d.claims] == [(1, [10])]
    # The lowest priority, then the latest started, of such jobs first, and no more than it needs:
    # 91 (priority 0, started later) alone frees the 2 cores job 1 lacks, and 90 runs on.
    a100s = [dataclasses.replace(gpu(10), model="NVIDIA A100-SXM4-80GB")]
    h100s = [dataclasses.replace(gpu(11, victim=(90, 0, NOW - 600)), model="NVIDIA H100 80GB HBM3"),
             dataclasses.replace(gpu(12, victim=(91, 0, NOW - 60)), model="NVIDIA H100 80GB HBM3")]
    d = decide(QueueState(NOW, [wanted], a100s + h100s,
                          node_use=cores({"a": 4}, a=[(90, math.inf, 2), (91, math.inf, 2)])))
    assert d.preemptions == {91: 1}
    # A job that is not preemptible holding them: nobody is stopped, and it waits.
    firm = [a100, dataclasses.replace(gpu(11, busy_until=math.inf), model="NVIDIA H100 80GB HBM3")]
    d = decide(QueueState(NOW, [wanted], firm, node_use=cores({"a": 4}, a=[(92, math.inf, 3)])))
    assert d.preemptions == {} and d.waiting == {1: RESOURCES}


def test_the_forecast_plans_a_job_that_is_not_preemptible_past_a_scavengers_cores_and_a_preemptible_one_not():
    # Job 1 waits for the A100 (a firm job's, 100 s more); the scavenger 90 on the H100 holds 3 of
    # the 4 cores with no time limit. Its turn come, job 1 would stop 90 for them: it is expected
    # when the A100 frees. A preemptible job in its place would wait for 90's cores: no moment.
    a100 = dataclasses.replace(gpu(10, busy_until=NOW + 100), model="NVIDIA A100-SXM4-80GB")
    h100 = dataclasses.replace(gpu(11, victim=(90, 0, NOW - 60)), model="NVIDIA H100 80GB HBM3")
    held = cores({"a": 4}, a=[(90, math.inf, 3), (91, NOW + 100, 1)])
    for preemptible, expected in ((False, NOW + 100), (True, None)):
        wanted = dataclasses.replace(job(1, cpus=2, preemptible=preemptible), gpu_type="a100")
        state = QueueState(NOW, [wanted], [a100, h100], node_use=held)
        d = decide(state)
        assert d.preemptions == {} and start_times(state, d)[1] == expected, preemptible


def test_the_forecast_plans_a_firm_job_past_a_scavengers_cores_once_its_exempt_time_is_over():
    # As above, but 90 started within GPUQ_PREEMPT_EXEMPT: its cores are its own until then, and no
    # longer (they counted as held to its end, with no time limit: no moment at all).
    a100 = dataclasses.replace(gpu(10, busy_until=NOW + 100), model="NVIDIA A100-SXM4-80GB")
    held = cores({"a": 4}, a=[(90, math.inf, 3), (91, NOW + 100, 1)])
    wanted = dataclasses.replace(job(1, cpus=2), gpu_type="a100")
    for exempt_until, expected in ((NOW + 50, NOW + 100), (NOW + 300, NOW + 300)):
        h100 = dataclasses.replace(gpu(11, busy_until=math.inf), model="NVIDIA H100 80GB HBM3",
                                   exempt_until=exempt_until)
        state = QueueState(NOW, [wanted], [a100, h100], node_use=held, exempt_until={90: exempt_until})
        d = decide(state)
        assert d.preemptions == {} and start_times(state, d)[1] == expected, exempt_until


def test_a_job_that_reserves_cores_is_listed_for_no_gpu_and_closes_the_lists_it_could_use():
    state = QueueState(NOW, [job(1, cpus=1), job(2)], [gpu(10, busy_until=NOW + 10)], node_use=cores({"a": 4}))
    assert next_up_choice.choose(state, decide(state), 2, 100) == {}
    # Where its node counts no cores, it is listed as any one-GPU job.
    state = QueueState(NOW, [job(1, cpus=1), job(2)], [gpu(10, busy_until=NOW + 10)])
    assert next_up_choice.choose(state, decide(state), 2, 100) == {10: [1, 2]}


def test_the_forecast_starts_a_job_when_its_nodes_cores_come_free_and_holds_the_planned_ones():
    running = cores({"a": 4}, a=[(90, NOW + 100, 4)])
    state = QueueState(NOW, [job(1, cpus=2, limit=300), job(2, cpus=3, limit=60), job(3, cpus=2, limit=60)],
                       [gpu(10, busy_until=NOW + 100), gpu(11), gpu(12), gpu(13)], node_use=running)
    starts = start_times(state)
    # Job 1 at 100 s (2 of 4 cores until 400 s); job 2 needs 3: after job 1; job 3 fits beside job 1.
    assert starts == {1: NOW + 100, 2: NOW + 400, 3: NOW + 100}


def test_host_memory_is_reserved_as_cores_are_and_a_job_needs_both_free():
    # 48 of node a's 64 GiB are held for 100 s: a --host-mem 32G job waits until then, and a job
    # with room for its memory but not for its cores waits too.
    node_use = {CPUS: use({"a": 4}, a=[(90, NOW + 100, 1)]), HOST_MEM: use({"a": 65536}, a=[(90, NOW + 100, 49152)])}
    state = QueueState(NOW, [job(1, mem=32768, limit=60), job(2, mem=8192, cpus=4, limit=60),
                             job(3, mem=8192, cpus=1, limit=60)],
                       [gpu(10, busy_until=NOW + 100), gpu(11), gpu(12), gpu(13)], node_use=node_use)
    d = decide(state)
    assert placed(d) == {} or 1 not in placed(d)
    assert 1 in d.waiting and d.reservation is not None and d.reservation.job_id == 1
    assert dict(d.reservation.needs) == {HOST_MEM: 32768} and d.reservation.start == NOW + 100
    # Job 3 fits beside (8 GiB, 1 core) and ends before job 1's start; job 2 lacks cores.
    assert list(placed(d)) == [3] and 2 in d.waiting
    starts = start_times(state, d)
    assert starts[1] == NOW + 100 and starts[2] == NOW + 100


def test_node_use_counts_holds_by_their_ends():
    held = use({"a": 8}, a=[(1, 10.0, 4), (2, 20.0, 2), (3, math.inf, 1)])
    assert [held.free_at("a", t) for t in (0.0, 10.0, 20.0)] == [1, 5, 7]
    assert [held.ready_at(c, "a", 0.0) for c in (1, 2, 5, 7, 8)] == [0.0, 10.0, 10.0, 20.0, math.inf]
    assert held.fit(2, "a", 10.0, also=3) and not held.fit(3, "a", 10.0, also=3)
    assert held.fit(None, "a", 0.0) and held.fit(99, "b", 0.0) and not held.ever_fits(9, "a")
    assert held.release("a", [1, 3]) == 5 and held.free_at("a", 0.0) == 6
    assert offered_cores(6) == 6 and offered_cores(0) >= 1
    assert offered_host_mem_mib(4096) == 4096 and offered_host_mem_mib(0) > 1024


@settings(max_examples=300, deadline=None)
@given(nodes=st.dictionaries(st.sampled_from("ab"),
                             st.tuples(st.sampled_from([2, 4, 8]), st.sampled_from([1024, 4096])), min_size=1),
       busy=st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from([0.0, 2.0, 4.0]), st.sampled_from([0, 512, 2048]),
                               st.sampled_from([50.0, 500.0, math.inf])), max_size=3),
       jobs=st.lists(st.tuples(st.integers(1, 2), st.sampled_from([None, 1.0, 2.5, 4.0]),
                               st.sampled_from([None, 512, 3000]), st.sampled_from([None, 60, 3600])),
                     min_size=1, max_size=8))
def test_no_pass_reserves_more_of_a_node_than_it_offers_nor_what_the_first_in_line_keeps(nodes, busy, jobs):
    """Whatever the queue: the cores and memory the running jobs and those placed in one pass hold
    on a node stay within its offer, and a job placed on the reserved node past the reserved start
    leaves the reserved job its share then."""
    gpus = [gpu(10 * i + k, node=n) for i, n in enumerate(sorted(nodes)) for k in range(3)]
    node_use = {CPUS: use({n: c for n, (c, _) in nodes.items()}), HOST_MEM: use({n: m for n, (_, m) in nodes.items()})}
    for j, (n, cpus, mem, end) in enumerate(busy):
        if n in nodes:
            node_use[CPUS].hold(n, 900 + j, NOW + end, cpus or None)
            node_use[HOST_MEM].hold(n, 900 + j, NOW + end, mem or None)
    requests = [JobRequest(id=i, user="u", gpus=g, submitted=i, cpus=c, host_mem_mib=m, time_limit_s=t)
                for i, (g, c, m, t) in enumerate(jobs, start=1)]
    d = decide(QueueState(NOW, requests, gpus, node_use=node_use))
    by_id = {r.id: r for r in requests}
    for kind, offered in ((CPUS, node_use[CPUS]), (HOST_MEM, node_use[HOST_MEM])):
        for n in nodes:
            placed_here = [getattr(by_id[p.job_id], kind) or 0 for p in d.placements if p.gpus[0].node == n]
            if any(placed_here):  # a node over its offer before the pass takes nothing more of it
                assert offered.free_at(n, NOW) - sum(placed_here) >= -1e-9
    r = d.reservation
    if r is not None and r.needs:
        for kind, kept in r.needs:
            late = [getattr(by_id[p.job_id], kind) or 0 for p in d.placements if p.gpus[0].node == r.node
                    and (by_id[p.job_id].time_limit_s is None or NOW + by_id[p.job_id].time_limit_s > r.start)]
            if any(late):
                assert node_use[kind].free_at(r.node, r.start) - sum(late) >= kept - 1e-9
