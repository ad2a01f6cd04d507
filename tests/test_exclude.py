"""`--exclude` (sbatch's -x): nodes a job may not run on, in the policy, the next-up lists, the
expected starts and the submit's checks, on both databases."""

from __future__ import annotations

import re

import pytest

from gpuq.service.errors import InvalidSpec
from gpuq.service.forecast import start_times
from gpuq.service.next_up_choice import choose
from gpuq.service.policy import GpuState, JobRequest, QueueState, decide
from gpuq.service.scheduler import Scheduler
from tests.test_scheduling import register, state_of, submit

pytestmark = pytest.mark.timeout(120)
NOW = 1_000_000.0


def gpu(gpu_id: int, node: str, busy_until: float | None = None) -> GpuState:
    return GpuState(id=gpu_id, node=node, index=gpu_id, queue=f"q{gpu_id}", memory_total_mib=16384,
                    busy_until=busy_until)


def test_the_policy_places_a_job_only_on_a_node_it_did_not_exclude():
    gpus = [gpu(1, "a"), gpu(2, "b")]
    placed = decide(QueueState(NOW, [JobRequest(id=1, user="u", gpus=1, exclude=frozenset({"a"}))], gpus)).placements
    assert [g.node for p in placed for g in p.gpus] == ["b"]
    # Excluding both, it waits; a gang that would fit only on the excluded node waits too.
    both = JobRequest(id=2, user="u", gpus=1, exclude=frozenset({"a", "b"}))
    gang = JobRequest(id=3, user="u", gpus=2, exclude=frozenset({"a"}))
    state = QueueState(NOW, [both, gang], [gpu(1, "a"), gpu(3, "a"), gpu(2, "b")])
    assert decide(state).placements == []


def test_a_job_is_listed_next_and_expected_to_start_only_on_nodes_it_did_not_exclude():
    busy = [gpu(1, "a", busy_until=NOW + 60), gpu(2, "b", busy_until=NOW + 600)]
    job = JobRequest(id=1, user="u", gpus=1, time_limit_s=60, exclude=frozenset({"a"}))
    state = QueueState(NOW, [job], busy)
    assert choose(state, decide(state), per_gpu=4, scan=64) == {2: [1]}
    # Node a frees first, but it may not run there: it starts when b frees.
    assert start_times(state) == {1: NOW + 600}


def test_a_submit_refuses_an_unknown_node_its_own_node_or_excluding_every_node_it_fits(settings):
    settings = settings.with_overrides(place_at_submit=False)
    register(settings, "a", 1)
    register(settings, "b", 3)
    job = submit(settings, exclude="a")
    pair = submit(settings, gpus=2, exclude="a")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[2] == "b" and state_of(settings, pair)[2] == "b"
    # This node ("testnode") has two simulated GPUs of its own, counted before its workers register.
    for sched, says in (({"exclude": "c"}, "--exclude c: no such node is known to gpuq (its nodes: a, b, testnode)"),
                        ({"exclude": "a,b,testnode"}, "--exclude a,b,testnode leaves no node with 1 GPU: the job "
                                                      "would never start"),
                        ({"exclude": "b", "gpus": 3}, "--exclude b leaves no node with 3 GPUs"),
                        ({"exclude": "a", "node": "a"}, "--node a is one --exclude names"),
                        ({"exclude": "a,,b"}, "--exclude takes node names like a or a,b")):
        gpus = sched.pop("gpus", 1)
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            submit(settings, gpus=gpus, **sched)


def test_update_changes_a_pending_jobs_excluded_nodes_as_a_submit_checks_them_and_unlists_it(settings):
    from sqlalchemy import select

    from gpuq.service.changes import Changes
    from gpuq.service.db import write_scope
    from gpuq.service.models import NextUp
    from gpuq.service.rights import Caller
    from gpuq.service.update import update_all

    settings = settings.with_overrides(place_at_submit=False)
    [on_a] = register(settings, "a", 1)
    register(settings, "b", 1)
    ann = Caller(5001, "ann")
    job = submit(settings, hold=True)
    with write_scope(settings) as session:  # listed next on node a's GPU
        session.add(NextUp(gpu_id=on_a, job_id=job, rank=0))
    [outcome] = update_all(settings, [job], Changes.of({"exclude": "a"}), ann)
    assert (outcome.changed, outcome.refused) == ({"exclude_nodes": [None, ["a"]]}, None)
    with write_scope(settings) as session:
        assert session.scalars(select(NextUp.job_id).where(NextUp.job_id == job)).all() == []
    for body, says in (({"exclude": "c"}, "--exclude c: no such node is known to gpuq"),
                       ({"exclude": "a,b,testnode"}, "leaves no node with 1 GPU")):
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            update_all(settings, [job], Changes.of(body), ann)
    from gpuq.service import jobs

    jobs.set_held(settings, job, False, "ann")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[:3:2] == ("dispatched", "b")
    [started] = update_all(settings, [job], Changes.of({"exclude": "none"}), ann)
    assert started.refused == f"job {job} is dispatched; only a pending job's excluded nodes can be changed"
    waiting = submit(settings, hold=True, exclude="b")
    [cleared] = update_all(settings, [waiting], Changes.of({"exclude": "none"}), ann)
    assert cleared.changed == {"exclude_nodes": [["b"], None]}


def test_a_job_whose_only_node_left_is_drained_waits_for_the_node_not_for_resources(settings):
    from gpuq.service import node_drains
    from gpuq.service.db import write_scope
    from gpuq.service.explain import why

    settings = settings.with_overrides(place_at_submit=False)
    register(settings, "a", 1)
    register(settings, "b", 1)
    register(settings, "c", 1)
    with write_scope(settings) as session:
        node_drains.set_drained(session, "b", True, "maintenance")
        node_drains.set_drained(session, "c", True, "new driver")  # excluded too: not named to it
    busy = submit(settings)  # a's GPU
    off_a = submit(settings, exclude="a,c")
    Scheduler(settings).schedule_once()
    assert state_of(settings, busy)[0] == "dispatched"
    # Only b is left to it and b is drained: not "resources" (a busy, and excluded, counted before).
    assert state_of(settings, off_a)[:2] == ("pending", "node drained")
    with write_scope(settings) as session:
        assert re.search(r"the nodes with 1 GPU for it are drained: b \(maintenance; since [\d: -]+ UTC\)$",
                         why(session, settings, off_a))
