"""The scheduler against a real database and Redis: nodes, memory, limits, holds, dependencies,
arrays, sweeps, retries, time limits, drain, and the reasons `gpuq status` and `gpuq why` give."""

from __future__ import annotations

import re
import sys
from datetime import timedelta

import pytest
from sqlalchemy import delete, func, select, update

from gpuq.service import constants as c
from gpuq.service import inventory, job_output, jobs, lifecycle, next_up, node_drains, spec, submitting, usage
from gpuq.service.celery_app import queue_name
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import open_devices
from gpuq.service.errors import InvalidSpec, NotAllowed, StateConflict
from gpuq.service.explain import why
from gpuq.service.models import Allocation, Job, JobUsage, utcnow
from gpuq.service.scheduler import Scheduler
from gpuq.workers.probe import GpuProbe
from gpuq.workers.runner import run_job
from gpuq.workers.sampler import Sampler
from gpuq.workers.state import WorkerState


@pytest.fixture
def settings(settings):
    """These tests watch the scheduler's passes decide, so nothing is placed at submit; placing at
    submit has its own tests (``test_a_submission_*``)."""
    return settings.with_overrides(place_at_submit=False)


def register(settings, node: str, count: int, foreign: str = "") -> list[int]:
    devices = open_devices(settings.with_overrides(fake_gpus=count, node=node, fake_gpu_foreign=foreign))
    ids = []
    with write_scope(settings) as session:
        for info in devices.list():
            gpu_id = inventory.register(session, node, info, queue_name(settings, node, info.index),
                                        f"gpu{info.index}@{node}", 1)
            inventory.beat(session, gpu_id, devices.read(info.index))
            ids.append(gpu_id)
    return ids


def submit(settings, argv=("true",), *, user="ann", gpus=1, **sched) -> int:
    make = lambda extra: spec.command_spec(list(argv), gpus=gpus, user=user)  # noqa: E731
    return submitting.submit_all(settings, spec.expand(make, spec.Scheduling(**sched), None, []))[0].id


def state_of(settings, job_id):
    with write_scope(settings) as session:
        j = jobs.get_job(session, job_id)
        return j.state, j.reason, j.node


def gpus_of(settings, job_id):
    with write_scope(settings) as session:
        return [(g.node, g.index) for g in jobs.job_gpus(session, job_id)]


def test_a_gang_goes_to_the_node_that_has_all_its_gpus_free(settings):
    register(settings, "a", 1)
    register(settings, "b", 3)
    job = submit(settings, gpus=3)
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED
    assert gpus_of(settings, job) == [("b", 0), ("b", 1), ("b", 2)]


def test_memory_requests_avoid_gpus_that_foreign_processes_fill_and_why_names_them(settings):
    register(settings, "a", 2, foreign="0:4096:4242:bob")  # of 8 GiB each
    big = submit(settings, mem="6G")
    blocked = submit(settings, mem="6G")
    Scheduler(settings).schedule_once()
    assert gpus_of(settings, big) == [("a", 1)]
    assert state_of(settings, blocked)[:2] == (State.PENDING, "resources")
    with write_scope(settings) as session:
        text = why(session, settings, blocked)
    assert f"job {blocked} waits (resources): it needs 1 GPU with 6.0 GiB free on one node" in text
    assert "GPU 0 with 4.0 GiB free, used by pid 4242 of user bob (4.0 GiB), not started by gpuq" in text
    assert f"GPU 1 runs job {big} of ann" in text


def test_an_idle_mps_server_on_a_gpu_is_not_another_programs_use_of_it(settings):
    # Seen on the lent H100: the MPS server (66 MiB) stays up between its clients, and counted as
    # foreign it kept a whole-GPU job that gave no --mem pending ("resources") for ever.
    from gpuq.service.devices import GpuProcess, GpuReading

    a, b = register(settings, "a", 2)
    server = GpuProcess(pid=706, memory_mib=66, name="nvidia-cuda-mps-server", user="root")
    other = GpuProcess(pid=4242, memory_mib=66, name="python3", user="bob")
    with write_scope(settings) as session:
        inventory.beat(session, a, GpuReading(memory_used_mib=678, processes=(server,)))
        inventory.beat(session, b, GpuReading(memory_used_mib=678, processes=(server, other)))
    first, second = submit(settings), submit(settings)
    Scheduler(settings).schedule_once()
    assert gpus_of(settings, first) == [("a", 0)]
    assert state_of(settings, second)[:2] == (State.PENDING, "resources")  # bob's program holds GPU 1


def test_why_gives_mib_where_gib_would_round_a_gpu_just_short_to_the_figure_the_job_asks(settings):
    # "needs 1 GPU with 8.0 GiB free ... GPU 0 with 8.0 GiB free": a GPU 19 MiB short read as enough.
    register(settings, "a", 1, foreign="0:19:4242:bob")  # of 8 GiB
    job = submit(settings, mem="8G")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[:2] == (State.PENDING, "resources")
    with write_scope(settings) as session:
        text = why(session, settings, job)
    assert "GPU 0 with 8,173 MiB free (it needs 8,192)" in text, text


def test_why_of_a_running_job_gives_its_gpus_and_its_time_and_of_a_held_one_says_held_from_its_submit(settings):
    # "job 16 is running on vm": no GPU, no time; a held job read "waits (waiting for its first
    # scheduling pass): it is held" until a pass had looked at it.
    register(settings, "a", 2)
    held = submit(settings, hold=True)
    with write_scope(settings) as session:
        said = why(session, settings, held)
    assert said == f"job {held} waits (held): it is held; `gpuq release {held}` lets it start"
    job = submit(settings, gpus=2, time="2h")
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job).values(state=State.RUNNING,
                                                                 started_at=utcnow() - timedelta(minutes=12)))
    with write_scope(settings) as session:
        text = why(session, settings, job)
    assert re.fullmatch(rf"job {job} is running on a \(GPU 0,1\), 0:12:0\d in of its 2:00:00", text), text


def test_why_of_a_whole_gpu_job_names_every_shared_job_that_must_end_first(settings):
    # A shared GPU read as one line per job ("GPU 0 runs job 5 of ann, GPU 0 runs job 6 of bob"),
    # and not that a whole-GPU job waits for all of them.
    register(settings, "a", 1)
    small = [submit(settings, user=u, shared=True, mem="1G") for u in ("ann", "bob")]
    Scheduler(settings).schedule_once()
    whole = submit(settings, user="cat")
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        text = why(session, settings, whole)
    assert (f"node a: GPU 0 shared by 2 jobs (job {small[0]} of ann; job {small[1]} of bob), all of which "
            "must end before a whole-GPU job starts there") in text, text


def test_a_gpu_no_longer_on_its_node_is_retired_unless_it_holds_a_job_and_comes_back_when_registered(settings):
    # A GPU taken out of a node stayed listed offline for ever, and counted among the node's GPUs:
    # a submit for more GPUs than the node has now was accepted, to wait for ever.
    register(settings, "a", 3)
    job = submit(settings)
    Scheduler(settings).schedule_once()
    assert gpus_of(settings, job) == [("a", 0)]
    with write_scope(settings) as session:
        assert inventory.retire_missing(session, "a", []) == [1, 2]  # GPU 0 holds a job: kept until it is reaped
    with write_scope(settings) as session:
        assert [(g.node, g.index) for g in inventory.view(session, settings)] == [("a", 0)]
        assert inventory.retire_missing(session, "a", []) == []  # once
    with pytest.raises(InvalidSpec, match="--gpus 3 is more than any node has"):  # (this node's own has 2)
        submit(settings, gpus=3)
    register(settings, "a", 3)  # registered again by their workers: back
    assert submit(settings, gpus=3)
    with write_scope(settings) as session:
        assert [g.index for g in inventory.view(session, settings)] == [0, 1, 2]


def test_why_names_the_job_that_goes_first_and_whether_by_priority_or_fair_share(settings):
    from tests.test_usage import add_job

    register(settings, "a", 2)
    with write_scope(settings) as session:  # ann ran 2 GPUs for 10 hours; bob nothing
        add_job(session, "ann", "a", utcnow() - timedelta(hours=10), utcnow(), gpus=2)
    running = submit(settings, user="carl", time="1h")  # a limit: the queue can hold GPUs for the next
    Scheduler(settings).schedule_once()
    assert state_of(settings, running)[0] == State.DISPATCHED
    anns, bobs = submit(settings, user="ann", gpus=2), submit(settings, user="bob", gpus=2)
    Scheduler(settings).schedule_once()
    assert state_of(settings, anns)[:2] == (State.PENDING, "priority")
    with write_scope(settings) as session:
        text = why(session, settings, anns)
    # Before: the first job waiting for GPUs by priority and id, ann's own, with no why.
    # ann's 20 GPU-hours, decayed over the 10 hours since they began: 19.6.
    assert re.search(rf"job {bobs} of bob \(2 GPUs\) goes first \(fair share: bob has used 0 GPU-hours and "
                     r"ann 19\.6 \(each hour counting half after 168 h\)\) and the GPUs are held for it", text), text
    urgent = submit(settings, user="ann", gpus=2, priority=5)
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        text = why(session, settings, bobs)
    assert f"job {urgent} of ann (2 GPUs) goes first (priority 5, this job's 0)" in text
    # The urgent job starts, with no time limit: no one knows when its GPUs free, so none are held,
    # and the first job waiting for GPUs is named all the same.
    end(settings, running, State.SUCCEEDED)
    with write_scope(settings) as session:
        session.execute(delete(Allocation).where(Allocation.job_id == running))
    Scheduler(settings).schedule_once()
    assert state_of(settings, urgent)[0] == State.DISPATCHED
    with write_scope(settings) as session:
        text = why(session, settings, anns)
    assert f"job {bobs} of bob (2 GPUs) goes first (fair share: " in text and text.endswith(
        "and it waits for GPUs; node a: GPU 0,1 run job 5 of ann; no start time can be counted on yet (a job "
        "before it on the GPUs it needs has no time limit, or waits behind one that has none, or it is past the "
        "first 500 jobs of the queue)"), text


def test_a_user_at_the_gpu_limit_waits_while_others_start(settings):
    s = settings.with_overrides(user_gpu_limit=1)
    register(s, "a", 3)
    first, second, other = submit(s, user="ann"), submit(s, user="ann"), submit(s, user="bob")
    Scheduler(s).schedule_once()
    assert state_of(s, first)[0] == State.DISPATCHED and state_of(s, other)[0] == State.DISPATCHED
    assert state_of(s, second)[:2] == (State.PENDING, "user limit")
    with write_scope(s) as session:
        assert "ann holds 1 GPU and the limit is 1 at once" in why(session, s, second)


def test_a_users_own_gpu_limit_holds_them_in_place_of_everyones(settings):
    s = settings.with_overrides(user_gpu_limit=1, user_gpu_limits="ann=2,cy=0")
    register(s, "a", 6)
    anns = [submit(s, user="ann") for _ in range(3)]
    bobs = [submit(s, user="bob") for _ in range(2)]
    cys = [submit(s, user="cy", gpus=2)]
    Scheduler(s).schedule_once()
    started = {j for j in (*anns, *bobs, *cys) if state_of(s, j)[0] == State.DISPATCHED}
    assert started == {anns[0], anns[1], bobs[0], cys[0]}
    assert state_of(s, anns[2])[:2] == state_of(s, bobs[1])[:2] == (State.PENDING, "user limit")
    with write_scope(s) as session:
        assert "ann holds 2 GPUs and the limit is 2 at once" in why(session, s, anns[2])
        assert "bob holds 1 GPU and the limit is 1 at once" in why(session, s, bobs[1])


def test_a_worker_takes_a_listed_job_only_while_its_user_is_under_their_own_limit(settings):
    from gpuq.service.models import NextUp

    s = settings.with_overrides(user_gpu_limits="ann=1")
    gpus = register(s, "a", 2)
    running, anns, bobs = submit(s, user="ann"), submit(s, user="ann"), submit(s, user="bob")
    with write_scope(s) as session:
        session.add(Allocation(job_id=running, gpu_id=gpus[0], rank=0))
        session.add_all(NextUp(gpu_id=gpus[1], job_id=j, rank=r) for r, j in enumerate((anns, bobs)))
    with write_scope(s) as session:
        taken = next_up.take_next(session, gpus[1], "w1", "a", 60, s.gpu_limit_of)
    assert taken is not None and taken[0].id == bobs  # ann holds her one GPU: her listed job is passed over
    assert state_of(s, anns)[0] == State.PENDING


def test_why_counts_a_users_shared_jobs_against_the_gpu_limit_by_their_part_of_the_gpu(settings):
    s = settings.with_overrides(user_gpu_limit=1)
    register(s, "a", 2)  # 8 GiB each: a 3.5 GiB share with its 0.5 GiB reserve is half of one
    first = submit(s, user="ann", shared=True, mem="3584M")
    Scheduler(s).schedule_once()
    whole, second, third = (submit(s, user="ann"), submit(s, user="ann", shared=True, mem="3584M"),
                            submit(s, user="ann", shared=True, mem="3584M"))
    Scheduler(s).schedule_once()
    assert [state_of(s, j)[0] for j in (first, second)] == [State.DISPATCHED] * 2
    assert [state_of(s, j)[:2] for j in (whole, third)] == [(State.PENDING, "user limit")] * 2
    with write_scope(s) as session:
        assert "ann holds 1 GPU and the limit is 1 at once; this job needs 1 more" in why(session, s, whole)
        assert ("ann holds 1 GPU and the limit is 1 at once; a shared job starts only while they hold less"
                in why(session, s, third))
    end(s, second, State.SUCCEEDED)
    with write_scope(s) as session:
        session.execute(delete(Allocation).where(Allocation.job_id == second))
        assert "ann holds 0.5 GPUs and the limit is 1 at once; this job needs 1 more" in why(session, s, whole)


def test_held_jobs_wait_until_released_and_only_their_owner_may_release(settings):
    register(settings, "a", 1)
    job = submit(settings, user="ann", hold=True)
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[:2] == (State.PENDING, "held")
    with pytest.raises(NotAllowed, match="belongs to ann"):
        jobs.set_held(settings, job, False, user="mallory")
    with pytest.raises(NotAllowed):
        jobs.cancel(settings, job, user="mallory")
    jobs.set_held(settings, job, False, user="ann")
    with pytest.raises(StateConflict, match="not held"):
        jobs.set_held(settings, job, False, user="ann")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED


def test_an_admin_may_act_on_anyones_job(settings):
    s = settings.with_overrides(admins="root, boss")
    register(s, "a", 1)
    job = submit(s, user="ann", hold=True)
    jobs.set_held(s, job, False, user="boss")
    assert jobs.cancel(s, job, user="boss").state == State.CANCELLED


def end(settings, job_id, state):
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id).values(state=state, ended_at=utcnow()))


def test_after_waits_for_success_and_a_failed_dependency_cancels_with_the_reason(settings):
    register(settings, "a", 2)
    first = submit(settings, hold=True)
    then = submit(settings, after=str(first))
    regardless = submit(settings, after_any=str(first))
    # From its submit, before any pass: `gpuq status` read "waiting for GPUs" until the first.
    assert state_of(settings, then)[:2] == state_of(settings, regardless)[:2] == (State.PENDING, "dependency")
    Scheduler(settings).schedule_once()
    assert state_of(settings, then)[:2] == (State.PENDING, "dependency")
    with write_scope(settings) as session:
        assert f"it waits for job {first} (pending) to succeed" in why(session, settings, then)
    end(settings, first, State.FAILED)
    Scheduler(settings).schedule_once()
    assert state_of(settings, then)[:2] == (State.CANCELLED, f"dependency never satisfied: job {first} failed")
    assert state_of(settings, regardless)[0] == State.DISPATCHED


def submit_array(settings, tasks: int) -> list[int]:
    make = lambda extra: spec.command_spec(["true"], user="ann")  # noqa: E731
    return [j.id for j in submitting.submit_all(settings, spec.expand(make, spec.Scheduling(hold=True),
                                                                      f"0-{tasks - 1}", []))]


def test_after_an_arrays_id_waits_for_every_task_and_any_failed_task_cancels_it(settings):
    # As SLURM's afterok on an array job: it waited for the first task alone, and ran after a
    # sweep whose other tasks had failed.
    register(settings, "a", 1)
    tasks = submit_array(settings, 3)
    then, regardless = submit(settings, after=str(tasks[0])), submit(settings, after_any=str(tasks[0]))
    only_second = submit(settings, after=str(tasks[1]))  # a later task's id is that task alone
    end(settings, tasks[0], State.SUCCEEDED)
    end(settings, tasks[1], State.SUCCEEDED)
    Scheduler(settings).schedule_once()
    assert state_of(settings, then)[:2] == (State.PENDING, "dependency")
    assert state_of(settings, regardless)[:2] == (State.PENDING, "dependency")
    with write_scope(settings) as session:
        assert f"it waits for array {tasks[0]} (2 of 3 tasks ended) to succeed" in why(session, settings, then)
    end(settings, tasks[2], State.FAILED)
    Scheduler(settings).schedule_once()
    assert state_of(settings, then)[:2] == (
        State.CANCELLED, f"dependency never satisfied: job {tasks[2]} failed (a task of array {tasks[0]})")
    assert state_of(settings, regardless)[0] == State.DISPATCHED or state_of(settings, only_second)[0] == \
        State.DISPATCHED  # one GPU: one of the two goes first
    with pytest.raises(StateConflict, match=f"--after {tasks[0]}: job {tasks[2]} failed \\(a task of array"):
        submit(settings, after=str(tasks[0]))


def test_after_a_job_that_does_not_exist_is_refused(settings):
    register(settings, "a", 1)
    with pytest.raises(InvalidSpec, match="--after: no job 999"):
        submit(settings, after="999")


def test_after_a_job_that_already_failed_is_refused_at_submit_and_after_any_is_not(settings):
    # It was accepted and cancelled at once, which `gpuq run` reported as 130, as for a Ctrl-C.
    register(settings, "a", 1)
    failed, done = submit(settings, hold=True), submit(settings, hold=True)
    end(settings, failed, State.FAILED)
    end(settings, done, State.SUCCEEDED)
    with pytest.raises(StateConflict, match=f"--after {failed}: job {failed} failed, so this job would never start"):
        submit(settings, after=f"{done},{failed}")
    assert submit(settings, after=str(done)) and submit(settings, after_any=str(failed))


def test_priority_is_bounded_for_users_and_not_for_admins(settings):
    register(settings, "a", 1)
    with pytest.raises(InvalidSpec, match="above the users' limit of 10"):
        submit(settings, user="ann", priority=50)
    s = settings.with_overrides(admins="boss")
    assert submit(s, user="boss", priority=500)


def test_fair_share_puts_the_user_with_fewer_recent_gpu_hours_first(settings):
    register(settings, "a", 1)
    old = submit(settings, user="heavy")
    with write_scope(settings) as session:  # heavy used 4 GPUs for 10 hours yesterday
        session.execute(update(Job).where(Job.id == old).values(
            state=State.SUCCEEDED, gpus=1, started_at=utcnow() - timedelta(hours=30),
            ended_at=utcnow() - timedelta(hours=20)))
    heavy, light = submit(settings, user="heavy"), submit(settings, user="light")
    Scheduler(settings).schedule_once()
    assert state_of(settings, light)[0] == State.DISPATCHED
    assert state_of(settings, heavy)[:2] == (State.PENDING, "resources")


def test_a_drained_node_starts_nothing_new_until_resumed(settings):
    register(settings, "a", 1)
    with write_scope(settings) as session:
        node_drains.set_drained(session, "a", True, "driver update")
    job = submit(settings, node="a")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[:2] == (State.PENDING, "node drained")
    with write_scope(settings) as session:
        assert "node a, which is drained (driver update; since " in why(session, settings, job)
        node_drains.set_drained(session, "a", False)
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED


def test_a_job_that_only_a_drained_node_could_run_waits_for_the_node_not_for_resources(settings):
    # With every node drained, each waiting job read "resources", and the README's reason never showed.
    register(settings, "a", 1)
    register(settings, "b", 2)
    with write_scope(settings) as session:
        node_drains.set_drained(session, "b", True, "maintenance")
    small, pair = submit(settings), submit(settings, gpus=2)
    Scheduler(settings).schedule_once()
    assert state_of(settings, small)[0] == State.DISPATCHED  # a fits: no drain in its way
    assert state_of(settings, pair)[:2] == (State.PENDING, "node drained")
    with write_scope(settings) as session:
        assert re.search(r"the nodes with 2 GPUs for it are drained: b \(maintenance; since [\d: -]+ UTC\)$",
                         why(session, settings, pair))
        node_drains.set_drained(session, "a", True, "maintenance")
    waiting = submit(settings)
    Scheduler(settings).schedule_once()
    assert state_of(settings, waiting)[:2] == (State.PENDING, "node drained")
    with write_scope(settings) as session:
        node_drains.set_drained(session, "b", False)
    Scheduler(settings).schedule_once()
    assert state_of(settings, pair)[0] == State.DISPATCHED


def test_a_gpu_whose_worker_did_not_start_gets_nothing_until_a_worker_registers_it_and_a_lost_one_stays_drained(
        settings):
    """`gpuq up`'s supervisor leaves out a GPU whose worker cannot start: drained with the reason,
    offline, nothing placed there. A worker that registers it has started, which lifts that drain;
    a GPU drained for another reason (lost) stays drained until its node is resumed."""
    (gpu_a,) = register(settings, "a", 1)
    info = open_devices(settings.with_overrides(fake_gpus=1)).list()[0]
    with write_scope(settings) as session:
        inventory.leave_out(session, "a", info, queue_name(settings, "a", 0), "worker-gpu0 exited 3 times at start")
    job = submit(settings, node="a")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.PENDING
    with write_scope(settings) as session:
        (view,) = inventory.view(session, settings)
        assert not view.online and view.drained and not view.node_drained
        assert view.drain_reason == f"{inventory.WORKER_DID_NOT_START}: worker-gpu0 exited 3 times at start"
    assert register(settings, "a", 1) == [gpu_a]
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED
    with write_scope(settings) as session:
        assert inventory.drain_reason(session, "a", 0) is None
        inventory.drain_gpu(session, gpu_a, "GPU lost (planted)")
    register(settings, "a", 1)
    with write_scope(settings) as session:
        assert inventory.drain_reason(session, "a", 0) == "GPU lost (planted)"


def test_an_array_makes_one_job_per_index_sharing_one_array_id(settings, tmp_path):
    register(settings, "a", 1)
    make = lambda extra: spec.command_spec(["echo", "{index}"], cwd=str(tmp_path))  # noqa: E731
    made = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(), "0-6:3", []))
    assert [j.array_index for j in made] == [0, 3, 6]
    assert {j.array_id for j in made} == {made[0].id}
    assert [j.argv for j in made] == [["echo", "0"], ["echo", "3"], ["echo", "6"]]
    assert [j.env["GPUQ_ARRAY_INDEX"] for j in made] == ["0", "3", "6"]
    with write_scope(settings) as session:
        assert jobs.array_jobs(session, made[0].id) == [j.id for j in made]
        # Each job returned is the row stored under its id.
        for j in made:
            stored = session.get(Job, j.id)
            assert (stored.array_index, stored.argv, stored.env, stored.array_id) == (
                j.array_index, j.argv, j.env, j.array_id)


def test_a_large_array_is_inserted_in_batches_and_each_job_returned_under_its_own_id(settings, tmp_path):
    # On SQLite inserted as several multi-row statements, the ids coming back unordered and matched
    # to the rows by their order; on PostgreSQL the ids are drawn first. Either way each job
    # returned must be the row stored under its id.
    register(settings, "a", 1)
    make = lambda extra: spec.command_spec(["echo", "{index}"], cwd=str(tmp_path))  # noqa: E731
    made = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(), "0-2499", []))
    with write_scope(settings) as session:
        stored = dict(session.execute(select(Job.id, Job.array_index).where(Job.array_id == made[0].id)).all())
    assert len(stored) == 2500 and {j.id: j.array_index for j in made} == stored


def test_an_arrays_every_column_is_stored_as_returned_and_postgresql_writes_it_as_one_prepared_insert(
        settings, tmp_path):
    # PostgreSQL draws the ids of an array's rows from the jobs' sequence and writes them as one
    # prepared INSERT on the driver's cursor: SQLAlchemy's own batch, one statement of a thousand
    # rows' VALUES, cost two thirds of an array submission's time there. Whatever the path, every
    # column must be stored as submitted, JSON, nulls and dates included, ids ascending by index.
    from sqlalchemy import event

    from gpuq.service.db import get_engine

    register(settings, "a", 1)
    make = lambda extra: spec.command_spec(["echo", "{index}"], cwd=str(tmp_path), env={"A": "1"})  # noqa: E731
    seen: list[str] = []
    listener = lambda conn, cursor, statement, *rest: seen.append(statement)  # noqa: E731
    event.listen(get_engine(settings), "before_cursor_execute", listener)
    try:
        made = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(priority=3, retries=2), "0-299", []))
    finally:
        event.remove(get_engine(settings), "before_cursor_execute", listener)
    assert [j.array_index for j in made] == list(range(300))
    assert [j.id for j in made] == sorted(j.id for j in made) and len({j.id for j in made}) == 300
    columns = [col.key for col in Job.__table__.columns]
    with write_scope(settings) as session:
        stored = {row.id: row for row in session.execute(select(Job.__table__).where(Job.array_id == made[0].id))}
    assert set(stored) == {j.id for j in made}
    for j in made:
        assert {k: getattr(stored[j.id], k) for k in columns} == {k: getattr(j, k) for k in columns}, j.id
    assert made[7].argv == ["echo", "7"] and made[7].env["A"] == "1" and made[7].max_retries == 2
    jobs_inserts = [sql for sql in seen if sql.lstrip().upper().startswith("INSERT INTO JOBS")]
    if settings.database.startswith("postgresql"):
        assert jobs_inserts == [], "an array's rows went through SQLAlchemy's multi-row INSERT"


def test_a_sweep_makes_the_cross_product_with_each_jobs_parameters(settings):
    register(settings, "a", 1)
    make = lambda extra: spec.workload_spec("train", ["--epochs", "1", *extra])  # noqa: E731
    sweeps = ["lr=0.1,0.01", "batch-size=64,128"]
    made = submitting.submit_all(settings, spec.expand(make, spec.Scheduling(), None, sweeps))
    assert sorted((j.params["lr"], j.params["batch_size"]) for j in made) == [
        (0.01, 64), (0.01, 128), (0.1, 64), (0.1, 128)]
    with pytest.raises(InvalidSpec, match="train has no parameter --bs"):
        spec.expand(make, spec.Scheduling(), None, ["bs=1,2"])


def test_an_array_swept_gives_each_index_with_each_value_its_own_name_and_fills_in_both():
    make = lambda extra: spec.command_spec(["echo", "{index}", "{lr}"], cwd="/", user="ann", name="run")  # noqa: E731
    made = spec.expand(make, spec.Scheduling(), "0-1", ["lr=a,b"])
    assert [(j.name, j.argv, j.env["GPUQ_ARRAY_INDEX"], j.env["GPUQ_SWEEP_LR"]) for j in made] == [
        ("run[0,lr=a]", ["echo", "0", "a"], "0", "a"), ("run[0,lr=b]", ["echo", "0", "b"], "0", "b"),
        ("run[1,lr=a]", ["echo", "1", "a"], "1", "a"), ("run[1,lr=b]", ["echo", "1", "b"], "1", "b")]
    # Two names that would set one variable (GPUQ_SWEEP_LR) are refused, not one value lost.
    with pytest.raises(InvalidSpec, match="set the same GPUQ_SWEEP_ variable"):
        spec.expand(make, spec.Scheduling(), None, ["lr=1", "LR=2"])


def claim_and_run(settings, job_id) -> str:
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job_id)[0]
    return run_job(WorkerState(settings=settings, node=gpu.node, gpu_index=gpu.index, gpu_id=gpu.id,
                               name=f"gpu{gpu.index}@{gpu.node}"), job_id)


def test_a_failing_job_runs_again_up_to_its_retries_and_keeps_each_attempt(settings, tmp_path):
    register(settings, "a", 1)
    runs = tmp_path / "runs"
    # Run by this process's user: a root worker runs a job as its owner, and "ann" has no account here.
    job = submit(settings, [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x'); raise SystemExit(2)"],
                 retries=2, user=spec.current_user())
    results = [claim_and_run(settings, job) for _ in range(3)]
    assert results == [State.FAILED] * 3 and runs.read_text() == "xxx"
    with write_scope(settings) as session:
        j = jobs.get_job(session, job)
        assert j.state == State.FAILED and len(j.attempts) == 2
        assert all(a["exit_code"] == 2 and a["reason"] == "exited with status 2" for a in j.attempts)


def test_a_retried_jobs_progress_rows_are_the_next_attempts_alone(settings):
    # A retried train job listed the lost attempt's epochs, then the retry's from 1 again.
    register(settings, "a", 1)
    job = submit(settings, retries=1)
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job).values(state=State.RUNNING, started_at=utcnow(),
                                                                lease_token="t"))
        for epoch in (1, 2):
            job_output.record_metric(session, job, {"epoch": epoch})
    with write_scope(settings) as session:
        assert lifecycle.end_attempt(session, job, State.FAILED, token="t", failure=c.FAILURE_EXIT, exit_code=1,
                                     reason="exited with status 1")
    with write_scope(settings) as session:
        assert jobs.get_job(session, job).state == State.PENDING
        assert job_output.read_metrics(session, job) == []
        session.execute(update(Job).where(Job.id == job).values(state=State.RUNNING, started_at=utcnow(),
                                                                lease_token="u"))
        job_output.record_metric(session, job, {"epoch": 1})
    with write_scope(settings) as session:  # an attempt that ends the job keeps its rows
        assert lifecycle.end_attempt(session, job, State.FAILED, token="u", failure=c.FAILURE_EXIT, exit_code=1,
                                     reason="exited with status 1")
    with write_scope(settings) as session:
        assert jobs.get_job(session, job).state == State.FAILED
        assert job_output.read_metrics(session, job) == [{"epoch": 1}]


@pytest.mark.timeout(60)
def test_a_job_past_its_time_limit_is_stopped_and_marked_timed_out(settings, tmp_path):
    register(settings, "a", 1)
    job = submit(settings, [sys.executable, "-c", "import time; time.sleep(60)"], time="2s", user=spec.current_user())
    assert claim_and_run(settings, job) == State.TIMED_OUT
    state, reason, _ = state_of(settings, job)
    assert reason == "time limit of 0:00:02 reached"
    with write_scope(settings) as session:
        j = jobs.get_job(session, job)
        assert 2 <= (j.ended_at - j.started_at).total_seconds() < 15


@pytest.mark.parametrize("option,value,message", [
    ("mem", "lots", "--mem takes a size like 20G"),
    ("time", "soon", "--time takes 2h, 30m, 90s"),
    ("time", "0s", "--time must be at least 1s"),
    ("after", "x", "--after takes job ids"),
    ("retries", -1, "--retries must be between 0 and 100"),
    ("priority", 5000, "--priority must be between -1000 and 1000"),
])
def test_malformed_scheduling_options_are_refused(option, value, message):
    with pytest.raises(InvalidSpec, match=message):
        spec.Scheduling(**{option: value}).fields()


def test_a_node_request_for_an_unknown_node_or_too_many_gpus_there_is_refused(settings):
    register(settings, "a", 2)
    with pytest.raises(InvalidSpec, match="--node zz: no such node"):
        submit(settings, node="zz")
    with pytest.raises(InvalidSpec, match="more than node a has"):
        submit(settings, node="a", gpus=3)


def test_a_job_of_more_gpus_than_a_user_may_hold_at_once_is_refused_not_left_waiting_for_ever(settings):
    register(settings, "a", 4)
    limited = settings.with_overrides(user_gpu_limit=2)
    with pytest.raises(InvalidSpec, match=r"--gpus 3 is more than the 2 a user may hold at once "
                                          r"\(GPUQ_USER_GPU_LIMIT\): it would never start"):
        submit(limited, gpus=3)
    assert state_of(limited, submit(limited, gpus=2))[0] in (State.PENDING, State.DISPATCHED)
    # A user's own limit stands in for it, either way; 0 is none.
    own = settings.with_overrides(user_gpu_limit=2, user_gpu_limits="ann=3, bob=1,cy=0")
    with pytest.raises(InvalidSpec, match=r"--gpus 2 is more than the 1 bob may hold at once "
                                          r"\(GPUQ_USER_GPU_LIMITS\): it would never start"):
        submit(own, gpus=2, user="bob")
    with pytest.raises(InvalidSpec, match=r"--gpus 4 is more than the 3 ann may hold"):
        submit(own, gpus=4)
    for user, gpus in (("ann", 3), ("cy", 4), ("dee", 2)):
        assert state_of(own, submit(own, gpus=gpus, user=user))[0] in (State.PENDING, State.DISPATCHED)


def test_the_queues_default_time_limit_goes_to_jobs_without_time_and_past_its_maximum_is_refused(settings):
    register(settings, "a", 1)
    limited = settings.with_overrides(default_time="1:00:00", max_time="2-00:00:00")

    def time_limit(job_id):
        with write_scope(settings) as session:
            return jobs.get_job(session, job_id).time_limit_s

    assert time_limit(submit(limited)) == 3600
    assert time_limit(submit(limited, time="30")) == 1800
    assert time_limit(submit(limited, time="2-00:00:00")) == 2 * 86400
    assert time_limit(submit(settings.with_overrides(max_time="2h"))) == 7200  # no default: the maximum
    assert time_limit(submit(settings)) is None  # neither: no limit, as before
    with write_scope(settings) as session:
        before = session.scalar(select(func.count()).select_from(Job))
    with pytest.raises(InvalidSpec, match=r"--time 49:00:00 is more than this queue's maximum, 48:00:00 "
                                          r"\(GPUQ_MAX_TIME\)"):
        submit(limited, time="49h")
    with write_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before


def worker_on(settings, job_id) -> WorkerState:
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job_id)[0]
    return WorkerState(settings=settings, node=gpu.node, gpu_index=gpu.index, gpu_id=gpu.id,
                       name=f"gpu{gpu.index}@{gpu.node}")


def test_workers_taking_from_lists_that_share_jobs_at_once_pass_over_each_others_job(settings):
    # PostgreSQL: a node's GPUs list the same jobs, and their workers take at once. The second
    # takes the next job instead of waiting for the first one's transaction (and then finding
    # its job gone). On SQLite the write lock makes takes one at a time anyway.
    import threading

    from gpuq.service.models import NextUp

    with write_scope(settings) as session:
        if session.connection().dialect.name == "sqlite":
            pytest.skip("SQLite's takes run one at a time under its write lock")
    gpus = register(settings, "a", 2)
    listed = [submit(settings) for _ in range(3)]
    with write_scope(settings) as session:
        session.add_all(NextUp(gpu_id=g, job_id=j, rank=r) for g in gpus for r, j in enumerate(listed))
    got = {}
    with write_scope(settings) as first:
        got[gpus[0]] = next_up.take_next(first, gpus[0], "w0", "a", 60)[0].id  # its transaction stays open

        def second() -> None:
            with write_scope(settings) as session:
                got[gpus[1]] = next_up.take_next(session, gpus[1], "w1", "a", 60)[0].id

        other = threading.Thread(target=second)
        other.start()
        other.join(10)
        assert not other.is_alive(), "the second take waited for the first one's transaction"
    assert got == {gpus[0]: listed[0], gpus[1]: listed[1]}
    with write_scope(settings) as session:
        assert [session.get(Job, j).state for j in listed] == [State.RUNNING, State.RUNNING, State.PENDING]


def test_a_take_whose_gpu_another_transaction_allocates_meanwhile_starts_nothing_and_its_transaction_goes_on(
        settings):
    # PostgreSQL: the take and the GPU's allocation are one statement. An allocation of the same
    # GPU that another transaction writes meanwhile (uncommitted when the take reads the GPU as
    # free, committed as the take writes its own) fails the statement on the unique key: the
    # listed job must stay pending, and the transaction that ended a job must go on to commit.
    import threading

    from gpuq.service.models import NextUp

    with write_scope(settings) as session:
        if session.connection().dialect.name == "sqlite":
            pytest.skip("SQLite's write lock lets no other transaction allocate meanwhile")
    gpu = register(settings, "a", 1)[0]
    listed, other = submit(settings), submit(settings)
    with write_scope(settings) as session:
        session.add(NextUp(gpu_id=gpu, job_id=listed, rank=0))
    got: dict[str, object] = {}
    with write_scope(settings) as allocating:
        allocating.add(Allocation(job_id=other, gpu_id=gpu, rank=0))
        allocating.flush()  # written, not committed: the take cannot see it yet

        def take() -> None:
            with write_scope(settings) as session:
                got["taken"] = next_up.take_next(session, gpu, "w0", "a", 60)
                session.add(NextUp(gpu_id=gpu, job_id=other, rank=1))  # the transaction still writes
            got["committed"] = True

        taker = threading.Thread(target=take)
        taker.start()
        taker.join(1.0)
        assert taker.is_alive(), "the take did not wait on the other transaction's allocation"
    taker.join(10)
    assert got == {"taken": None, "committed": True}
    with write_scope(settings) as session:
        assert session.get(Job, listed).state == State.PENDING and session.get(Job, listed).worker is None
        assert [a.job_id for a in session.scalars(select(Allocation).where(Allocation.gpu_id == gpu))] == [other]
        assert session.get(NextUp, (gpu, other)) is not None


def test_a_worker_ending_a_job_starts_the_next_listed_one_itself_in_queue_order(settings):
    register(settings, "a", 1)
    # Run by this process's user: a root worker runs a job as its owner.
    first, second, third = (submit(settings, user=spec.current_user()) for _ in range(3))
    Scheduler(settings).schedule_once()
    assert state_of(settings, first)[0] == State.DISPATCHED and state_of(settings, second)[0] == State.PENDING
    # One message, three jobs: each end takes the next one listed for this GPU, no scheduler between.
    assert run_job(worker_on(settings, first), first) == State.SUCCEEDED
    with write_scope(settings) as session:
        done = [session.get(Job, j) for j in (first, second, third)]
        assert [j.state for j in done] == [State.SUCCEEDED] * 3
        assert done[0].started_at < done[1].started_at < done[2].started_at
        assert all(j.worker == "gpu0@a" and j.dispatched_at == j.started_at for j in done[1:])
        assert session.scalar(select(func.count()).select_from(Allocation)) == 0
        # Each end stored the job's usage summary, as a summary computed now from its samples says.
        for j in done:
            stored = session.get(JobUsage, j.id)
            assert stored is not None and stored.wall_s == pytest.approx((j.ended_at - j.started_at).total_seconds())
            assert stored.samples == usage.summarize(session, j).samples


def test_a_placement_whose_job_left_the_queue_meanwhile_places_the_gpus_next_listed_job_instead(settings,
                                                                                                monkeypatch):
    # Under a flood, the job a pass places on a GPU that fell free is the queue's head, the very job
    # the node's busy GPUs take next from their lists: taken between the pass's read and its write,
    # it left the free GPU idle until the next whole pass. The free GPU's own list stands in.
    import gpuq.service.scheduler as scheduler

    gpus = register(settings, "a", 2)
    running = submit(settings)
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        free = next(g for g in gpus if g not in {h.id for h in jobs.job_gpus(session, running)})
    head, following, last = (submit(settings) for _ in range(3))
    read = scheduler.read_queue

    def read_then_head_taken(*args, **kwargs):
        queue = read(*args, **kwargs)
        with write_scope(settings) as session:  # the busy GPU's worker takes the head meanwhile
            session.execute(update(Job).where(Job.id == head).values(state=State.RUNNING))
        return queue

    monkeypatch.setattr(scheduler, "read_queue", read_then_head_taken)
    placed = Scheduler(settings).schedule_once()
    assert [(p.job_id, p.gpus[0].id) for p in placed] == [(following, free)]
    assert state_of(settings, following)[0] == State.DISPATCHED
    assert state_of(settings, last)[0] == State.PENDING


def test_an_end_whose_usage_summary_the_database_refuses_is_written_again_without_its_last_words(settings,
                                                                                                 caplog):
    # The summary, the rest of the output and the last readings are the end's last words, with no
    # savepoint of their own: a row the database refuses fails the end's first try, and the end
    # (and the next job's start) is written again without them instead of being lost.
    register(settings, "a", 1)
    me = spec.current_user()
    first, second = (submit(settings, ["echo", "hello"], user=me) for _ in range(2))
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:  # a summary already there: the end's own is refused
        session.add(JobUsage(job_id=first, wall_s=-1.0, gpu_hours=0.0, idle_s=0.0, samples=0))
    with caplog.at_level("ERROR", logger="gpuq.worker"):
        assert run_job(worker_on(settings, first), first) == State.SUCCEEDED
    assert [r.getMessage() for r in caplog.records] == [
        f"gpu0@a: job {first}: could not store the rest of its output, its last device readings or its usage summary"]
    with write_scope(settings) as session:
        assert [session.get(Job, j).state for j in (first, second)] == [State.SUCCEEDED, State.SUCCEEDED]
        assert session.get(JobUsage, first).wall_s == -1.0  # not written over
        assert session.get(JobUsage, second).wall_s >= 0  # its end's first try went through
        assert session.scalar(select(func.count()).select_from(Allocation)) == 0


def test_a_list_runs_short_once_half_of_what_the_scheduler_wrote_is_gone(settings):
    # next_up_choice.choose lists NEXT_UP_PER_GPU jobs for each busy GPU of the node (the node's GPUs
    # share them): with four busy GPUs a list holds 64, and its worker asks for a refill at half
    # of that, not at half of NEXT_UP_PER_GPU (the lists ran dry under an array on PostgreSQL).
    gpus = register(settings, "a", 4)
    jobs_in_queue = [submit(settings) for _ in range(4 + 70)]
    Scheduler(settings).schedule_once()
    full = c.NEXT_UP_PER_GPU * 4
    listed = sorted(j for g, j in _listed(settings) if g == gpus[0])
    assert len(listed) == full and listed == jobs_in_queue[4:4 + full]

    def short_after_leaving(n: int) -> bool:
        with write_scope(settings) as session:
            session.execute(update(Job).where(Job.id.in_(listed[:n])).values(state=State.CANCELLED))
            return next_up.list_runs_short(session, gpus[0])

    assert not short_after_leaving(full // 2 - 1)
    assert short_after_leaving(full // 2)


def test_usage_summed_from_the_readings_a_worker_holds_is_what_sql_sums_from_the_stored_samples(settings,
                                                                                              monkeypatch):
    # Jobs of a few milliseconds and of 0.3 s under a sampler at 50 Hz that writes every fifth
    # reading: the short ones end with every reading of theirs in hand (summed in Python), the
    # others after a batch was written (summed in SQL). Either way the stored summary is what the
    # samples in SQL say, and no reading is written for a job after its end.
    settings = settings.with_overrides(sample_interval=0.02)
    monkeypatch.setattr(c, "END_READING_GAP", 0.0)  # every end reads: each job has readings to sum
    register(settings, "a", 1)
    me = spec.current_user()
    nap = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    ids = [submit(settings, argv, user=me) for argv in (["true"], nap, ["true"], nap, ["true"])]
    Scheduler(settings).schedule_once()
    state = worker_on(settings, ids[0])
    state.sampler = Sampler(settings, state.gpu_id, GpuProbe(open_devices(settings), 0), lambda: state.job_id)
    state.sampler.start()
    try:
        assert run_job(state, ids[0]) == State.SUCCEEDED
    finally:
        state.sampler.stop()
        state.sampler.join(5)
    with write_scope(settings) as session:
        for job_id in ids:
            j = session.get(Job, job_id)
            stored, now = session.get(JobUsage, job_id), usage.summarize(session, j)
            assert j.state == State.SUCCEEDED and stored.samples >= 1
            for field in ("samples", "memory_peak_mib", "wall_s", "gpu_hours"):
                assert getattr(stored, field) == getattr(now, field), (job_id, field)
            for field in ("utilization_mean", "memory_mean_mib", "energy_j", "idle_s"):
                assert getattr(stored, field) == pytest.approx(getattr(now, field)), (job_id, field)


def test_a_next_up_job_that_was_held_or_cancelled_meanwhile_is_not_started(settings):
    register(settings, "a", 1)
    me = spec.current_user()
    first, held, cancelled, last = (submit(settings, user=me) for _ in range(4))
    Scheduler(settings).schedule_once()
    jobs.set_held(settings, held, True, user=me)
    jobs.cancel(settings, cancelled, user=me)
    run_job(worker_on(settings, first), first)
    assert state_of(settings, held)[0] == State.PENDING
    assert state_of(settings, cancelled)[0] == State.CANCELLED
    assert state_of(settings, last)[0] == State.SUCCEEDED


def test_a_worker_told_to_stop_or_on_a_drained_node_takes_no_next_job(settings):
    register(settings, "a", 1)
    first, second = submit(settings), submit(settings)
    Scheduler(settings).schedule_once()
    worker = worker_on(settings, first)
    worker.stopping.set()  # the first SIGTERM: finish this job, start nothing more
    run_job(worker, first)
    assert state_of(settings, second)[0] == State.PENDING
    third = submit(settings)
    Scheduler(settings).schedule_once()
    assert state_of(settings, second)[0] == State.DISPATCHED
    with write_scope(settings) as session:
        node_drains.set_drained(session, "a", True, "maintenance")
    run_job(worker_on(settings, second), second)
    assert state_of(settings, third)[0] == State.PENDING


def test_a_quick_pass_over_each_users_queue_head_places_what_a_whole_pass_would(settings):
    register(settings, "a", 2)
    register(settings, "b", 2)
    for user, n, gpus in (("ann", c.HEAD_PER_USER + 5, 2), ("bob", 3, 1), ("cy", c.HEAD_PER_USER + 2, 1)):
        for _ in range(n):
            submit(settings, user=user, gpus=gpus)
    from gpuq.service.policy import decide
    from gpuq.service.queue_read import read_queue
    with write_scope(settings) as session:
        whole = read_queue(session, settings)
    expected = sorted((p.job_id, tuple(g.id for g in p.gpus)) for p in decide(whole.policy).placements)
    placed = Scheduler(settings).schedule_once(quick=True)
    assert sorted((p.job_id, tuple(g.id for g in p.gpus)) for p in placed) == expected and expected


def test_a_submission_with_nothing_else_waiting_is_placed_at_submit_and_handed_to_the_scheduler(settings):
    from gpuq.service import broker

    s = settings.with_overrides(place_at_submit=True)
    register(s, "a", 2)
    r = broker.client(s)
    r.delete(broker.dispatch_key(s))
    job = submit(s, gpus=2)
    assert state_of(s, job)[:3:2] == (State.DISPATCHED, "a")
    assert sorted(gpus_of(s, job)) == [("a", 0), ("a", 1)]
    # The scheduler sends its message on waking: no pass of its own stands in between.
    assert broker.wait_for_wake(r, s, 1.0) == (broker.HANDED, [f"{job} {queue_name(s, 'a', 0)}"])
    # All it submitted was placed: no pass is due (a pass would only hold up the worker's claim).
    assert broker.wait_for_wake(r, s, 0.05) == (broker.TIMEOUT, [])


def test_a_queue_a_submit_hands_over_reads_as_the_same_queue_sql_gives(settings):
    # A submit that finds nothing else waiting places its own jobs from the rows it wrote, not
    # read back: they must make the very queue a quick pass reads (heads cut at HEAD_PER_USER in
    # queue order, held jobs left out).
    from gpuq.service.queue_read import _PENDING_NAMES, pending_row, read_queue

    register(settings, "a", 2)
    make = lambda extra: spec.command_spec(["true"], gpus=1, user="ann")  # noqa: E731
    for priority in (0, 5, 0, 9):
        submitting.submit_all(settings, spec.expand(make, spec.Scheduling(priority=priority),
                                                    f"0-{c.HEAD_PER_USER // 2}", []))
    submit(settings, hold=True, priority=9)
    with write_scope(settings) as session:
        rows = [pending_row({n: getattr(j, n) for n in _PENDING_NAMES})
                for j in session.scalars(select(Job).where(Job.state == State.PENDING))]
        from_sql = read_queue(session, settings, head=c.HEAD_PER_USER)
        given = read_queue(session, settings, head=c.HEAD_PER_USER, only=rows)
    assert len(rows) > c.HEAD_PER_USER + 1 and len(given.policy.jobs) == c.HEAD_PER_USER
    assert given.policy.jobs == from_sql.policy.jobs
    assert (given.not_eligible, given.doomed, given.shown) == (from_sql.not_eligible, from_sql.doomed, from_sql.shown)


def test_a_submission_is_left_to_the_scheduler_when_another_job_waits_held_or_on_a_dependency(settings):
    s = settings.with_overrides(place_at_submit=True)
    register(s, "a", 2)
    first = submit(s)
    assert state_of(s, first)[0] == State.DISPATCHED
    # A gang that does not fit now waits; a small job submitted after it must not jump it at
    # submit (without time limits, no backfill past a waiting gang): the scheduler decides.
    gang = submit(s, gpus=2)
    small = submit(s)
    assert state_of(s, gang)[0] == State.PENDING and state_of(s, small)[0] == State.PENDING
    Scheduler(s).schedule_once()
    assert state_of(s, small)[:2] == (State.PENDING, "priority")
    # Held or waiting for a dependency: never placed at submit either.
    with write_scope(s) as session:
        session.execute(update(Job).where(Job.id.in_([gang, small])).values(state=State.CANCELLED))
        session.execute(update(Job).where(Job.id == first).values(state=State.SUCCEEDED, ended_at=utcnow()))
        session.execute(Allocation.__table__.delete())
    held = submit(s, hold=True)
    after = submit(s, after=str(held))
    assert state_of(s, held)[0] == State.PENDING and state_of(s, after)[0] == State.PENDING


def test_a_quick_pass_with_nothing_to_change_writes_nothing_and_a_whole_pass_still_writes(settings):
    from sqlalchemy import event

    from gpuq.service.db import _engine

    register(settings, "a", 1)
    for _ in range(3):
        submit(settings)
    scheduler = Scheduler(settings)
    assert len(scheduler.schedule_once(quick=True)) == 1  # places one, lists the other two
    commits: list[int] = []

    def count(conn) -> None:
        commits.append(1)

    engine = _engine(settings.database)
    event.listen(engine, "commit", count)
    try:
        assert scheduler.schedule_once(quick=True) == []
        assert commits == []  # the lists are as they were: no write lock taken
        scheduler.schedule_once()
        assert commits  # a whole pass reaps lost workers and writes why jobs wait
    finally:
        event.remove(engine, "commit", count)


def test_a_placement_refused_because_its_gpu_was_taken_meanwhile_leaves_its_job_pending_and_the_rest_written(
        settings):
    # A pass (or a submit) placing a job on a GPU another pass, or a worker's take, allocated since
    # it read the queue: the unique allocation key refuses it. The job stays pending with nothing
    # allocated, and the transaction's other writes (the submit's rows, the pass's other
    # placements) stand. Its savepoint was never sent before: SQLite kept the job dispatched with
    # no GPU, and PostgreSQL lost the whole transaction at a COMMIT that rolled back unseen.
    from gpuq.service import policy
    from gpuq.service.allocating import allocate

    gpu = policy.GpuState(id=register(settings, "a", 1)[0], node="a", index=0, queue="q", memory_total_mib=1000)
    first, second = submit(settings), submit(settings)
    with write_scope(settings) as session:
        assert allocate(session, policy.Placement(job_id=first, gpus=(gpu,)))
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == second).values(name="written beside"))
        assert not allocate(session, policy.Placement(job_id=second, gpus=(gpu,)))
    with write_scope(settings) as session:
        assert session.execute(select(Job.name, Job.state).where(Job.id == second)).one() == (
            "written beside", State.PENDING)
        assert session.scalars(select(Allocation.job_id)).all() == [first]


def _listed(settings) -> dict[tuple[int, int], int]:
    from gpuq.service.models import NextUp

    with write_scope(settings) as session:
        return {(r.gpu_id, r.job_id): r.rank for r in session.scalars(select(NextUp))}


def test_next_up_rows_are_what_each_pass_wanted_even_beside_rows_another_scheduler_wrote(settings):
    from sqlalchemy import event

    from gpuq.service.db import _engine

    gpus = register(settings, "a", 2)
    waiting = [submit(settings) for _ in range(6)]
    first, second = Scheduler(settings), Scheduler(settings)
    assert len(first.schedule_once(quick=True)) == 2  # both GPUs busy, four jobs listed on each
    assert _listed(settings) == first.lists.written and len(first.lists.written) == 8
    # Two of the listed jobs leave, two arrive: the next pass writes the difference.
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id.in_(waiting[2:4])).values(state=State.CANCELLED))
    waiting += [submit(settings) for _ in range(2)]
    # Another scheduler (one that ran before this one, or beside it) wrote rows this one does not
    # know of: this one's next pass writes over them instead of failing on the rows' key.
    assert second.schedule_once(quick=True) == []
    statements: list[tuple[str, bool]] = []

    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        if "next_up" in statement and not statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement.split()[0].upper(), executemany))

    engine = _engine(settings.database)
    event.listen(engine, "before_cursor_execute", seen)
    try:
        first.schedule_once(quick=True)
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    # Its pass was written, not lost to a key the other one's rows already held (it would have
    # forgotten its lists), and each GPU lists the jobs left in queue order. The ranks are
    # partly the other scheduler's: they only order a list.
    assert first.lists.written is not None
    listed = _listed(settings)
    assert set(listed) == set(first.lists.written)
    for gpu in gpus:
        assert sorted((rank, job) for (g, job), rank in listed.items() if g == gpu) == [
            (listed[gpu, job], job) for job in waiting[4:]]
    if settings.database.startswith("postgresql"):
        # Every row in one DELETE and one upsert, not a statement a row (each its own parse and
        # run on the server: a dozen a job under a flood).
        assert statements == [("DELETE", False), ("INSERT", False)], statements


def _plan(session, statement, **params) -> str:
    """SQLite's plan for a statement, one line per step."""
    conn = session.connection()
    compiled = statement.compile(dialect=conn.dialect)
    values = compiled.construct_params(params)
    rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(compiled), tuple(values[k] for k in compiled.positiontup))
    return "\n".join(r[3] for r in rows)


def test_a_quick_pass_reads_each_users_first_jobs_in_queue_order_by_index_seeks(settings):
    from gpuq.service.queue_read import _USER_HEAD, _WAITING_USERS, _pending

    head = 4
    made = []
    for user, priorities in (("ann", [0, 5, 0, 5, 0, 0]), ("bob", [1, 0]), ("cy", [0] * 7)):
        made += [(submit(settings, user=user, priority=p), user, p) for p in priorities]
    held = submit(settings, user="dee", hold=True)  # held: not waiting, so not read
    with write_scope(settings) as session:
        rows, last = _pending(session, head)
        # Each user's first `head` jobs: priority first, then submission order.
        expected = [j for u in ("ann", "bob", "cy")
                    for j, _, _ in sorted((m for m in made if m[1] == u), key=lambda m: (-m[2], m[0]))[:head]]
        assert sorted(r.id for r in rows) == sorted(expected) and held not in {r.id for r in rows}
        # The last read of each user cut short (ann, cy), which bounds what a quick pass may decide.
        assert sorted(r.user for r in last) == ["ann", "cy"]
        if session.connection().dialect.name == "sqlite":
            # Seeks through the queue-order index, however long the queue: no scan, no sort.
            for plan in (_plan(session, _WAITING_USERS.statement),
                         _plan(session, _USER_HEAD.statement, user="ann", head=head)):
                assert "ix_jobs_queue_order" in plan and "SCAN jobs" not in plan and "TEMP B-TREE" not in plan, plan


def test_a_take_reads_its_gpus_list_not_every_waiting_job(settings):
    from gpuq.service.next_up import _LISTED, _TAKE_FIRST

    now = utcnow()
    with write_scope(settings) as session:
        if session.connection().dialect.name != "sqlite":
            pytest.skip("SQLite's planner; PostgreSQL plans from its statistics")
        listed = _plan(session, _LISTED, gpu_id=1).splitlines()
        first = _plan(session, _TAKE_FIRST.statement, gpu_id=1, now=now, node="a", worker="w", token="t",
                      expires=now).splitlines()
        # Each starts from the GPU's list and looks each listed job up by its key: a walk over the
        # pending jobs (the plan SQLite chose for a join) cost a step per job in the queue.
        assert listed[0].startswith("SEARCH next_up"), listed
        assert first[0].startswith("SEARCH jobs USING INTEGER PRIMARY KEY") and "SEARCH next_up" in first[2], first
        for plan in (listed, first):
            assert not any("ix_jobs_queue_order" in step or "SCAN" in step for step in plan), plan


def _wal_frames(database: str) -> tuple[int, int]:
    """The SQLite log's frames, and how many of them were copied back into the database file: the
    WAL-index header's mxFrame (byte 16) and its checkpoint record's nBackfill (byte 96)."""
    import struct

    head = open(database + "-shm", "rb").read(100)
    return struct.unpack_from("=I", head, 16)[0], struct.unpack_from("=I", head, 96)[0]


def test_a_checkpoint_copies_the_sqlite_log_back_so_no_job_end_has_to(settings):
    from gpuq.service import db

    with write_scope(settings) as session:
        if session.connection().dialect.name != "sqlite":
            pytest.skip("PostgreSQL has no write-ahead log to copy back")
        # A writer's commit copies the log back only past the backstop, not SQLite's 1,000 pages.
        assert session.connection().exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == c.WAL_BACKSTOP_PAGES
    path = settings.database.split("///", 1)[1]
    for _ in range(5):
        submit(settings)
    frames, copied = _wal_frames(path)
    assert frames > copied  # the submits are in the log only: no commit copied them back
    db.checkpoint(settings)
    assert _wal_frames(path) == (frames, frames)


def test_one_watch_thread_serves_every_job_a_worker_runs_and_still_stops_a_cancelled_one(settings, monkeypatch):
    import threading
    import time

    from tests.conftest import wait_for_state

    register(settings, "a", 1)
    me = spec.current_user()
    first, second, third = (submit(settings, user=me) for _ in range(3))
    Scheduler(settings).schedule_once()
    state = worker_on(settings, first)
    assert run_job(state, first) == State.SUCCEEDED
    assert state_of(settings, third)[0] == State.SUCCEEDED
    watching = state.watch.thread
    assert watching is not None and watching.is_alive() and watching.name == "cancel-watch"
    assert state.watch.watching.job_id == third and state.watch.watching.done.is_set()
    # The same thread, still running, sees a cancel of the next job while it runs.
    slow = submit(settings, argv=("sleep", "30"), user=me)
    Scheduler(settings).schedule_once()
    ended: list[str | None] = []
    runner = threading.Thread(target=lambda: ended.append(run_job(state, slow)))
    runner.start()
    wait_for_state(settings, slow, {State.RUNNING})
    jobs.cancel(settings, slow, user=me)
    runner.join(30)
    assert ended == [State.CANCELLED] and state.watch.thread is watching  # the one thread saw it
    # With no job left to watch it ends in time, and the next job gets a new one.
    monkeypatch.setattr(c, "WATCH_IDLE_SECONDS", 0.5)
    deadline = time.monotonic() + 10
    while watching.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not watching.is_alive() and state.watch.thread is None
    last = submit(settings, user=me)
    Scheduler(settings).schedule_once()
    assert run_job(state, last) == State.SUCCEEDED and state.watch.thread.is_alive()


@pytest.mark.parametrize("left,text", [(15.2, "16 s"), (0.4, "1 s"), (-3, "0 s"), (60, "1 min"), (89, "2 min")])
def test_why_rounds_a_running_jobs_time_left_up(left, text):
    from gpuq.service.explain import _within

    assert _within(left) == text  # 16 s left read "ends within 0 min"


def test_a_running_preemptible_job_is_read_with_when_its_exempt_time_ends_and_none_past_it(settings):
    # The forecast counts its node's cores and memory as its own until then (service/forecast.py).
    from gpuq.service.queue_read import read_queue

    s = settings.with_overrides(preempt_exempt="10m")
    register(s, "a", 2)
    scavenger, firm = submit(s, preemptible=True), submit(s)
    Scheduler(s).schedule_once()
    assert state_of(s, scavenger)[0] == state_of(s, firm)[0] == State.DISPATCHED
    with write_scope(s) as session:
        read = read_queue(session, s)
    assert list(read.policy.exempt_until) == [scavenger]
    assert abs(read.policy.exempt_until[scavenger] - (read.policy.now + 600)) < 60
    with write_scope(s) as session:
        assert read_queue(session, s.with_overrides(preempt_exempt="")).policy.exempt_until == {}
