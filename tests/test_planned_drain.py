"""A drain planned ahead (`gpuq drain NODE --at TIME`, a maintenance window): until its time the
node starts only jobs that end by then, a job that fits only such nodes waits without holding the
queue, and from its time on the node is drained. As pure functions (the policy, next-up lists, the
forecast) and through the scheduler on a real database."""

import math
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st
from sqlalchemy import update

from gpuq.service import next_up, node_drains
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.explain import why
from gpuq.service.forecast import start_times
from gpuq.service.models import Node, utcnow
from gpuq.service.next_up_choice import choose as next_up_lists
from gpuq.service.policy import NODE_DRAINING, PRIORITY, JobRequest, QueueState, decide
from gpuq.service.scheduler import Scheduler
from tests.test_policy import NOW, gpu, job, placed
from tests.test_scheduling import register, run_job, state_of, submit, worker_on

HOUR = 3600.0


def closing(g, at):
    return replace(g, closes_at=at)


def test_a_node_to_drain_starts_only_jobs_that_end_by_then_and_the_others_wait_without_holding_the_queue():
    gpus = [closing(gpu(1), NOW + HOUR), closing(gpu(2), NOW + HOUR)]
    jobs = [job(1), job(2, limit=2 * HOUR), job(3, limit=600), job(4, limit=HOUR)]
    d = decide(QueueState(NOW, jobs, gpus))
    # No limit, or one past the drain: they wait for the node's resume; the short ones behind them start.
    assert d.waiting == {1: NODE_DRAINING, 2: NODE_DRAINING}
    assert sorted(placed(d)) == [3, 4]  # a job ending at the very moment of the drain still starts


def test_a_job_that_fits_another_node_reserves_it_and_backfills_nothing_past_the_drain():
    # b is busy for 100 s: the job without a limit waits for it, and only jobs that end by the drain
    # start on a, whatever the reservation on b lets.
    gpus = [closing(gpu(1, node="a"), NOW + HOUR), gpu(2, node="b", busy_until=NOW + 100)]
    jobs = [job(1), job(2, limit=2 * HOUR), job(3, limit=600)]
    d = decide(QueueState(NOW, jobs, gpus))
    assert d.reservation is not None and d.reservation.job_id == 1 and d.reservation.node == "b"
    assert placed(d) == {3: [1]}
    assert d.waiting == {1: "resources", 2: PRIORITY}


def test_a_shared_job_and_a_preempting_job_are_held_to_the_drain_too():
    shared = [JobRequest(1, "u", 1, mem_mib=1000, shared=True), JobRequest(2, "u", 1, mem_mib=1000, shared=True,
                                                                           time_limit_s=60)]
    d = decide(QueueState(NOW, shared, [closing(gpu(1), NOW + HOUR)]))
    assert placed(d) == {2: [1]} and d.waiting[1] == NODE_DRAINING
    # A scavenger on the only GPU: a job that could not end before the drain stops nobody for it.
    from gpuq.service.queue_state import Preemptible
    held = replace(gpu(1, busy_until=math.inf), preemptible=Preemptible(9, 0, NOW - HOUR), closes_at=NOW + HOUR)
    d = decide(QueueState(NOW, [job(1, limit=2 * HOUR)], [held]))
    assert d.preemptions == {} and d.waiting[1] == NODE_DRAINING
    d = decide(QueueState(NOW, [job(1, limit=600)], [held]))
    assert d.preemptions == {9: 1}


def test_jobs_of_one_kind_with_other_limits_are_each_judged_against_the_drain():
    # A pass remembers the kinds of job that found no GPUs; a long job's failure must not turn the
    # short one of the same shape away.
    gpus = [closing(gpu(1, node="a"), NOW + HOUR), gpu(2, node="b", busy_until=NOW + 5 * HOUR)]
    d = decide(QueueState(NOW, [job(1, limit=2 * HOUR), job(2, limit=600)], gpus))
    assert placed(d) == {2: [1]}


def test_a_node_to_drain_gets_no_next_up_list():
    gpus = [closing(gpu(1, node="a", busy_until=NOW + 100), NOW + HOUR), gpu(2, node="b", busy_until=NOW + 100)]
    state = QueueState(NOW, [job(1, limit=60)], gpus)
    assert next_up_lists(state, decide(state), per_gpu=4, scan=100) == {2: [1]}


def test_the_forecast_plans_nothing_on_a_node_past_its_drain():
    g = closing(gpu(1, busy_until=NOW + 1000), NOW + 2000)
    starts = start_times(QueueState(NOW, [job(1, limit=900), job(2, limit=1200), job(3)], [g]))
    # The first fits between the running job's end and the drain; the others would run past it.
    assert starts == {1: NOW + 1000, 2: None, 3: None}


def test_a_job_that_could_not_end_before_a_window_with_an_end_is_planned_from_its_end_not_held_as_draining():
    g = replace(gpu(1), closes_at=NOW + HOUR, reopens_at=NOW + 3 * HOUR)
    state = QueueState(NOW, [job(1), job(2, limit=2 * HOUR), job(3, limit=600)], [g])
    d = decide(state)
    # The first waits for the window's end, reserving the GPU from then: the short job still fits before.
    assert d.waiting[1] == "resources" and d.reservation.start == NOW + 3 * HOUR
    assert placed(d) == {3: [1]} and d.waiting[2] == PRIORITY
    starts = start_times(state, d)
    assert starts[3] == NOW and starts[1] == NOW + 3 * HOUR
    only_limited = QueueState(NOW, [job(2, limit=2 * HOUR)], [g])
    assert start_times(only_limited) == {2: NOW + 3 * HOUR}


gpu_lists = st.lists(
    st.tuples(st.sampled_from("ab"), st.sampled_from([None, None, 100.0, math.inf])),
    min_size=1, max_size=6,
)
# Each node's window (a node's GPUs share it): none, or its start and its end (None: until resumed).
windows = st.fixed_dictionaries({n: st.sampled_from([None, None, (500.0, None), (5000.0, None), (500.0, 3500.0)])
                                 for n in "ab"})


def gpus_with(specs, window):
    return [replace(gpu(i + 1, node=n, busy_until=None if b is None else NOW + b),
                    closes_at=None if window[n] is None else NOW + window[n][0],
                    reopens_at=None if window[n] is None or window[n][1] is None else NOW + window[n][1])
            for i, (n, b) in enumerate(specs)]


job_lists = st.lists(
    st.tuples(st.integers(1, 3), st.sampled_from([None, 60, 400, 4000]), st.booleans()),
    max_size=8,
).map(lambda specs: [JobRequest(i + 1, "u", g, submitted=i, time_limit_s=t, shared=s, mem_mib=2000 if s else None)
                     for i, (g, t, s) in enumerate(specs)])


@examples(max_examples=300, deadline=None)
@given(specs=gpu_lists, window=windows, jobs=job_lists)
def test_no_job_is_placed_listed_reserved_or_planned_to_run_into_its_nodes_window(specs, window, jobs):
    gpus = gpus_with(specs, window)
    state = QueueState(NOW, jobs, gpus)
    d = decide(state)
    limit = {j.id: math.inf if j.time_limit_s is None else j.time_limit_s for j in jobs}
    for p in d.placements:
        assert all(g.closes_at is None or NOW + limit[p.job_id] <= g.closes_at for g in p.gpus)
    lists = next_up_lists(state, d, per_gpu=4, scan=100)
    assert not any(g.closes_at is not None for g in gpus if g.id in lists)
    where: dict = {}
    starts = start_times(state, d, where=where)
    for job_id, start in starts.items():
        if start is not None:
            assert all(g.closes_at is None or start + limit[job_id] <= g.closes_at
                       or (g.reopens_at is not None and start >= g.reopens_at) for g in where[job_id])
    r = d.reservation
    if r is not None:
        by_id = {g.id: g for g in gpus}
        rl = limit[r.job_id]
        assert all(by_id[i].closes_at is None or r.start + rl <= by_id[i].closes_at
                   or (by_id[i].reopens_at is not None and r.start >= by_id[i].reopens_at) for i in r.gpu_ids)


# Through the scheduler, on the test database (SQLite, and PostgreSQL where the suite runs it).

@pytest.fixture
def settings(settings):
    """The scheduler's passes decide here: nothing is placed at submit."""
    return settings.with_overrides(place_at_submit=False)


def _plan(settings, node, hours, reason="driver update"):
    with write_scope(settings) as session:
        return node_drains.plan(session, node, utcnow() + timedelta(hours=hours), reason=reason, by="root")


def _come(settings, node):
    """The planned drain's time, come: as the clock would bring it."""
    with write_scope(settings) as session:
        session.execute(update(Node).where(Node.name == node).values(drain_at=utcnow() - timedelta(seconds=1)))


def test_a_planned_drain_lets_short_jobs_start_says_why_the_others_wait_and_drains_the_node_when_it_comes(settings):
    register(settings, "a", 4)
    assert _plan(settings, "a", 1) is None
    long_job, short, limited = submit(settings), submit(settings, time="10m"), submit(settings, time="2h")
    Scheduler(settings).schedule_once()
    assert state_of(settings, short)[0] == State.DISPATCHED
    assert state_of(settings, long_job)[:2] == (State.PENDING, NODE_DRAINING)
    assert state_of(settings, limited)[:2] == (State.PENDING, NODE_DRAINING)
    with write_scope(settings) as session:
        said = why(session, settings, long_job)
        assert "the nodes it fits are to drain before it could end there (a at " in said
        assert "(driver update; by root)" in said and "it has no time limit" in said
        assert "its time limit of 2:00:00 would end after that" in why(session, settings, limited)
        assert node_drains.drained_nodes(session) == {}
        assert list(node_drains.drains_ahead(session)) == ["a"]
    # Planned again: its time moves, its reason stays.
    with write_scope(settings) as session:
        before = node_drains.plan(session, "a", utcnow() + timedelta(hours=2), by="root")
        assert before is not None and node_drains.drains_ahead(session)["a"]["note"] == "driver update; by root"
    _come(settings, "a")
    later = submit(settings, time="1m")
    Scheduler(settings).schedule_once()
    assert state_of(settings, later)[:2] == (State.PENDING, "node drained")
    with write_scope(settings) as session:
        assert node_drains.drained_nodes(session)["a"].startswith("driver update; by root since ")
        assert node_drains.drains_ahead(session) == {}
        node_drains.set_drained(session, "a", False)
        assert node_drains.read(session).now == frozenset() and node_drains.read(session).ahead == {}
    Scheduler(settings).schedule_once()
    assert [state_of(settings, j)[0] for j in (long_job, limited, later)] == [State.DISPATCHED] * 3


def test_a_worker_on_a_node_to_drain_takes_no_listed_job_the_scheduler_did_not_check(settings):
    register(settings, "a", 1)
    first, second = submit(settings), submit(settings)
    Scheduler(settings).schedule_once()  # first placed, second listed next on its GPU
    _plan(settings, "a", 1)
    worker = worker_on(settings, first)
    run_job(worker, first)
    assert state_of(settings, second)[0] == State.PENDING
    with write_scope(settings) as session:
        assert next_up.take_next(session, worker.gpu_id, "w", "a", 60) is None
    # Called off, the list is the worker's again.
    with write_scope(settings) as session:
        node_drains.set_drained(session, "a", False)
    with write_scope(settings) as session:
        taken = next_up.take_next(session, worker.gpu_id, "w", "a", 60)
    assert taken is not None and state_of(settings, second)[0] == State.RUNNING


def test_planning_and_calling_off_a_drain_refuse_what_makes_no_sense(settings):
    from gpuq.service.errors import InvalidSpec, StateConflict

    register(settings, "a", 1)
    with write_scope(settings) as session:
        with pytest.raises(InvalidSpec, match="no node z is known"):
            node_drains.plan(session, "z", utcnow() + timedelta(hours=1))
        with pytest.raises(InvalidSpec, match="is past already"):
            node_drains.plan(session, "a", utcnow() - timedelta(minutes=1))
        with pytest.raises(StateConflict, match="is not drained"):
            node_drains.set_drained(session, "a", False)
        node_drains.set_drained(session, "a", True, "now")
        with pytest.raises(StateConflict, match="is drained until resumed: `gpuq resume a` first"):
            node_drains.plan(session, "a", utcnow() + timedelta(hours=1))
        node_drains.set_drained(session, "a", False)
        # A planned drain brought forward keeps its reason; resuming calls a planned one off.
        node_drains.plan(session, "a", utcnow() + timedelta(hours=1), reason="fans")
        node_drains.set_drained(session, "a", True)
        assert node_drains.drained_nodes(session)["a"].startswith("fans; since ")
        node_drains.set_drained(session, "a", False)
        node_drains.plan(session, "a", utcnow() + timedelta(hours=1), reason="fans")
        node_drains.set_drained(session, "a", False)
        assert node_drains.drains_ahead(session) == {} and node_drains.drained_nodes(session) == {}


def test_a_window_with_an_end_drains_the_node_while_it_lasts_and_gives_it_back_after(settings):
    register(settings, "a", 1)
    with write_scope(settings) as session:
        start = utcnow() + timedelta(hours=1)
        node_drains.plan(session, "a", start, start + timedelta(hours=2), reason="new PSU", by="root")
        assert node_drains.drains_ahead(session)["a"]["until"] == (start + timedelta(hours=2)).isoformat()
    waiting = submit(settings)  # no limit: it could not end before the window, and waits for its end
    Scheduler(settings).schedule_once()
    assert state_of(settings, waiting)[:2] == (State.PENDING, "resources")
    with write_scope(settings) as session:  # the window comes: as the clock would bring it
        session.execute(update(Node).where(Node.name == "a").values(drain_at=utcnow() - timedelta(seconds=1)))
    Scheduler(settings).schedule_once()
    assert state_of(settings, waiting)[:2] == (State.PENDING, "node drained")
    with write_scope(settings) as session:
        assert " until " in node_drains.drained_nodes(session)["a"]
        # Its end moved while it lasts; a start given then is refused.
        import pytest

        from gpuq.service.errors import StateConflict
        with pytest.raises(StateConflict, match="window started at .* already: give --until alone"):
            node_drains.plan(session, "a", utcnow() + timedelta(hours=1))
        before = node_drains.plan(session, "a", None, utcnow() + timedelta(hours=4), by="root")
        assert before is not None and node_drains.drained_nodes(session)["a"].startswith("new PSU; by root since ")
    with write_scope(settings) as session:  # its end comes
        session.execute(update(Node).where(Node.name == "a").values(drain_until=utcnow() - timedelta(seconds=1)))
    with write_scope(settings) as session:
        assert node_drains.drained_nodes(session) == {} and node_drains.drains_ahead(session) == {}
    Scheduler(settings).schedule_once()  # a whole pass: the window cleared, the job placed
    assert state_of(settings, waiting)[0] == State.DISPATCHED
    with write_scope(settings) as session:
        assert session.get(Node, "a").drain_at is None and node_drains.end_windows(session) == 0


def test_an_end_given_alone_moves_the_end_of_the_window_to_come_and_keeps_its_start(settings):
    register(settings, "a", 1)
    with write_scope(settings) as session:
        start = utcnow() + timedelta(hours=1)
        node_drains.plan(session, "a", start, reason="fans")
        node_drains.plan(session, "a", None, start + timedelta(hours=2))
        assert node_drains.window_of(session, "a") == (start, start + timedelta(hours=2))
        assert node_drains.drains_ahead(session)["a"]["note"] == "fans"


def test_a_window_may_start_now_and_a_drain_now_takes_its_place(settings):
    register(settings, "a", 1)
    with write_scope(settings) as session:
        node_drains.plan(session, "a", None, utcnow() + timedelta(hours=1), reason="quick fix")
        assert node_drains.drained_nodes(session)["a"].startswith("quick fix; since ")
        node_drains.set_drained(session, "a", True)  # now until resumed, its reason kept
    with write_scope(settings) as session:
        note = node_drains.drained_nodes(session)["a"]
        assert note.startswith("quick fix; since ") and " until " not in note
        assert session.get(Node, "a").drain_until is None


def test_all_names_every_node_with_gpus_in_service_and_every_drained_one_each_once(settings):
    from sqlalchemy import update as set_rows

    from gpuq.service.errors import InvalidSpec
    from gpuq.service.models import Gpu

    with write_scope(settings) as session:
        with pytest.raises(InvalidSpec, match="no node is known to gpuq yet: ALL names none"):
            node_drains.named(session, [node_drains.ALL])
    register(settings, "b", 1)
    register(settings, "a", 2)
    register(settings, "gone", 1)
    with write_scope(settings) as session:
        node_drains.set_drained(session, "gone", True, "dead PSU")
        session.execute(set_rows(Gpu).where(Gpu.node == "gone").values(retired_at=utcnow()))
    with write_scope(settings) as session:
        assert node_drains.named(session, ["b", node_drains.ALL, "a"]) == ["b", "a", "gone"]
        assert node_drains.named(session, ["x", "x"]) == ["x"]  # an unknown name is the drain's to refuse
