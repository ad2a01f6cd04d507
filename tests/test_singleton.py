"""sbatch's `--dependency singleton`: one job of a user's name at a time, in queue order, placed by
the scheduler's passes only (never from a next-up list), on both databases and through the CLI."""

from __future__ import annotations

import itertools
import sys

import pytest
from sqlalchemy import select

from gpuq.service import constants as c
from gpuq.service import policy, spec, submitting
from gpuq.service.changes import Changes
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.explain import why
from gpuq.service.models import Job
from gpuq.service.next_up_choice import choose
from gpuq.service.rights import Caller
from gpuq.service.scheduler import Scheduler
from gpuq.service.update import update_all
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state
from tests.test_scheduling import end, register, state_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def settings(settings):
    """The passes place, not the submit: each test says when a pass runs."""
    return settings.with_overrides(place_at_submit=False)


def submit(settings, name: str, *, user: str = "ann", dependency: str | None = "singleton", **sched) -> int:
    make = lambda extra: spec.command_spec(["true"], name=name, user=user)  # noqa: E731
    return submitting.submit_all(settings, spec.expand(make, spec.Scheduling(dependency=dependency, **sched),
                                                       None, []))[0].id


def states(settings, *ids):
    return [state_of(settings, i)[:2] for i in ids]


def test_singletons_of_one_name_start_one_at_a_time_in_queue_order_after_any_job_of_that_name(settings):
    register(settings, "a", 6)
    first, second, third = (submit(settings, "train") for _ in range(3))
    other = submit(settings, "eval")  # another name: not held back
    plain = submit(settings, "train", dependency=None)  # not a singleton: waits for nothing
    bobs = submit(settings, "train", user="bob")  # another user's name is another name
    Scheduler(settings).schedule_once()
    waiting = (State.PENDING, "dependency")
    assert states(settings, first, second, third) == [(State.DISPATCHED, None), waiting, waiting]
    assert [state_of(settings, j)[0] for j in (other, plain, bobs)] == [State.DISPATCHED] * 3
    with write_scope(settings) as session:
        assert why(session, settings, second) == (
            f"job {second} waits (dependency): --dependency singleton starts one job of ann's named 'train' at a "
            f"time, and job {first} (dispatched) is ahead of it")
    # The first ends, but the plain job of that name still holds a GPU: the singletons wait for it too.
    end(settings, first, State.SUCCEEDED)
    Scheduler(settings).schedule_once()
    assert states(settings, second, third) == [waiting, waiting]
    end(settings, plain, State.FAILED)
    Scheduler(settings).schedule_once()
    assert states(settings, second, third) == [(State.DISPATCHED, None), waiting]
    end(settings, second, State.CANCELLED)  # any end will do, as sbatch's
    Scheduler(settings).schedule_once()
    assert state_of(settings, third)[0] == State.DISPATCHED


def test_a_singleton_waiting_for_its_after_keeps_no_later_one_back_and_a_higher_priority_goes_first(settings):
    register(settings, "a", 2)
    blocker = submit(settings, "prep", dependency=None, hold=True)
    after = submit(settings, "train", dependency=f"afterok:{blocker},singleton")
    later = submit(settings, "train")
    urgent = submit(settings, "train", priority=5)
    Scheduler(settings).schedule_once()
    # The one waiting for its --after holds no GPU and keeps none back (two could not then wait
    # for each other); of those ready, the queue's first (by priority) starts, alone.
    assert states(settings, after, later, urgent) == [(State.PENDING, "dependency"), (State.PENDING, "dependency"),
                                                      (State.DISPATCHED, None)]
    with write_scope(settings) as session:
        assert f"it waits for job {blocker} (pending) to succeed" in why(session, settings, after)


def test_a_singleton_is_never_on_a_next_up_list_and_closes_the_lists_of_the_gpus_it_could_use():
    gpus = [policy.GpuState(id=i, node="a", index=i, queue=f"q{i}", memory_total_mib=8192, busy_until=100.0)
            for i in range(2)]
    jobs = [policy.JobRequest(id=1, user="ann", gpus=1, submitted=1.0, singleton=True),
            policy.JobRequest(id=2, user="ann", gpus=1, submitted=2.0)]
    state = policy.QueueState(now=0.0, jobs=jobs, gpus=gpus)
    # A worker takes a listed job without looking at the job's name's others: a pass places it.
    assert choose(state, policy.decide(state), per_gpu=4, scan=64) == {}
    state = policy.QueueState(now=0.0, jobs=[jobs[1]], gpus=gpus)
    assert choose(state, policy.decide(state), per_gpu=4, scan=64) == {0: [2], 1: [2]}


def test_update_makes_a_pending_job_a_singleton_and_back_and_an_array_task_is_refused(settings):
    from tests.test_scheduling import submit_array

    register(settings, "a", 2)
    running = submit(settings, "train", dependency=None)
    job = submit(settings, "train", dependency=None)
    Scheduler(settings).schedule_once()
    assert state_of(settings, running)[0] == State.DISPATCHED and state_of(settings, job)[0] == State.DISPATCHED
    waiting = submit(settings, "train", dependency=None, hold=True)
    ann = Caller(5001, "ann")
    [made] = update_all(settings, [waiting], Changes.of({"dependency": "singleton"}), ann)
    assert made.changed == {"dependency": [None, "singleton"]}
    with write_scope(settings) as session:
        assert session.scalar(select(Job.singleton).where(Job.id == waiting)) is True
    [back] = update_all(settings, [waiting], Changes.of({"dependency": "none"}), ann)
    assert back.changed == {"dependency": ["singleton", None]}
    tasks = submit_array(settings, 2)
    [task] = update_all(settings, [tasks[1]], Changes.of({"dependency": "singleton"}), ann)
    assert task.refused == (f"job {tasks[1]} is a task of array {tasks[0]}: each task has a name of its own; "
                            "--array-limit 1 runs them one at a time")


# --- through the server and real workers ---------------------------------------------------------

@pytest.fixture(scope="module", params=["sqlite"])
def two_gpus(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=2)


def test_a_chain_of_singletons_runs_one_after_another_on_two_free_gpus(two_gpus):
    s = two_gpus.settings
    sleep = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    chain = [cli_submit(s, ["-d", "singleton", "--name", "chain", "--", *sleep]) for _ in range(3)]
    shown = run_cli(["show", str(chain[1])], s).stdout
    assert "one job named 'chain' at a time (singleton)" in shown, shown
    for job in chain:
        assert wait_for_state(s, job, c.END_STATES, timeout=60) == State.SUCCEEDED, two_gpus.logs()
    with write_scope(s) as session:
        ran = session.execute(select(Job.started_at, Job.ended_at).where(Job.id.in_(chain)).order_by(Job.id)).all()
    # Two GPUs were free all along: each started only once the one before it had ended.
    assert all(after.started_at >= before.ended_at for before, after in itertools.pairwise(ran)), ran
