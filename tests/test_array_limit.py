"""`--array 0-99%4`: at most N of an array's tasks at once (SLURM's array throttle), the others
waiting for "array limit" while other jobs take the GPUs the array leaves; `gpuq update
--array-limit` changes N. Against a real database and Redis, and through a real stack."""

from __future__ import annotations

import json
import re
import sys
from itertools import pairwise

import pytest
from sqlalchemy import select

from gpuq.service import constants as c
from gpuq.service import spec, submitting
from gpuq.service.changes import Changes
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec
from gpuq.service.explain import why
from gpuq.service.models import Job, NextUp, utcnow
from gpuq.service.rights import Caller
from gpuq.service.scheduler import Scheduler
from gpuq.service.units import parse_array
from gpuq.service.update import update_all
from tests.conftest import run_cli, stack_on_database, wait_for_state
from tests.test_scheduling import end, register, state_of, submit

pytestmark = pytest.mark.timeout(120)
ANN = Caller(5001, "ann")


def submit_array(settings, indices: str, argv=("true",), user="ann", **sched) -> list[int]:
    make = lambda extra: spec.command_spec(list(argv), user=user)  # noqa: E731
    return [j.id for j in submitting.submit_all(settings, spec.expand(make, spec.Scheduling(**sched), indices, []))]


def states(settings, ids: list[int]) -> list[str]:
    with write_scope(settings) as session:
        return [session.get(Job, i).state for i in ids]


# --- the option ---------------------------------------------------------------------------------

def test_array_takes_a_percent_limit_after_its_indices_and_refuses_a_malformed_one():
    assert parse_array("0-9%4") == (list(range(10)), 4)
    assert parse_array("1,3,5") == ([1, 3, 5], None)
    assert parse_array("0-6:3 % 2") == ([0, 3, 6], 2)
    for bad in ("0-9%0", "0-9%", "0-9%x", "0-9%-1", "0-9%2%3", "0-9%10001"):
        with pytest.raises(InvalidSpec, match=r"--array's %N \(tasks at once\) takes a whole number from 1 to 10,000"):
            parse_array(bad)
    with pytest.raises(InvalidSpec, match="--array takes ranges like"):
        parse_array("%4")


def test_every_task_of_a_limited_array_carries_the_limit_and_a_sweep_alone_has_none():
    make = lambda extra: spec.command_spec(["true"], user="ann")  # noqa: E731
    tasks = spec.expand(make, spec.Scheduling(), "0-3%2", ["lr=1,2"])
    assert len(tasks) == 8 and {t.array_limit for t in tasks} == {2}
    assert {t.array_limit for t in spec.expand(make, spec.Scheduling(), None, ["lr=1,2"])} == {None}


# --- the scheduler ------------------------------------------------------------------------------

@pytest.fixture
def settings(settings):
    return settings.with_overrides(place_at_submit=False)


def test_a_limited_array_runs_n_tasks_at_once_and_leaves_the_other_gpus_to_later_jobs(settings):
    register(settings, "a", 4)
    tasks = submit_array(settings, "0-5%2")
    # Said from the submit on: before any pass, `gpuq status` does not read "waiting for GPUs".
    assert [state_of(settings, t)[1] for t in tasks] == [None, None] + ["array limit"] * 4
    later = submit(settings, user="bob")
    Scheduler(settings).schedule_once()
    assert states(settings, tasks) == [State.DISPATCHED] * 2 + [State.PENDING] * 4
    assert state_of(settings, later)[0] == State.DISPATCHED  # the array holds no GPU it may not use
    assert {state_of(settings, t)[1] for t in tasks[2:]} == {"array limit"}
    with write_scope(settings) as session:
        said = why(session, settings, tasks[2])
    assert said == (f"job {tasks[2]} waits (array limit): 2 tasks of array {tasks[0]} run now, and it runs at most "
                    f"2 at once (--array ...%2; `gpuq update --array {tasks[0]} --array-limit N` changes it)")
    # One task ends: one more starts, the lowest index first, and still two at once.
    end(settings, tasks[0], State.SUCCEEDED)
    Scheduler(settings).schedule_once()
    assert states(settings, tasks) == [State.SUCCEEDED, State.DISPATCHED, State.DISPATCHED] + [State.PENDING] * 3


def test_a_task_its_arrays_limit_holds_back_is_expected_to_start_as_the_tasks_before_it_end(settings):
    from gpuq.service.explain import expected_starts

    register(settings, "a", 4)
    tasks = submit_array(settings, "0-3%2", time="10m")
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        starts = expected_starts(session, settings)
        said = why(session, settings, tasks[3])
    # Two run for ten minutes; the other two follow them, GPUs free or not (`gpuq status --start`).
    waits = [(starts[t] - utcnow()).total_seconds() for t in tasks[2:]]
    assert all(540 < w <= 600 for w in waits), waits
    assert re.search(r"changes it\); expected to start by [\d: -]+ UTC, in 0:(09:\d\d|10:00), if the jobs", said)


def test_a_busy_gpus_next_up_list_holds_no_more_of_a_limited_array_than_may_start(settings):
    # Workers start listed jobs themselves when their job ends, between the scheduler's passes: a
    # list with every task of the array would start them all.
    register(settings, "a", 2)
    blockers = [submit(settings, user="bob", time="1h") for _ in range(2)]
    Scheduler(settings).schedule_once()
    assert states(settings, blockers) == [State.DISPATCHED] * 2
    tasks = submit_array(settings, "0-3%1")
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        listed = set(session.scalars(select(NextUp.job_id)))
    assert listed == {tasks[0]}
    assert [state_of(settings, t)[1] for t in tasks] == ["resources"] + ["array limit"] * 3


def test_a_submit_places_no_more_tasks_of_a_limited_array_than_its_limit(settings):
    register(settings, "a", 4)
    placing = settings.with_overrides(place_at_submit=True)
    tasks = submit_array(placing, "0-9%3")
    assert states(settings, tasks) == [State.DISPATCHED] * 3 + [State.PENDING] * 7


def test_update_raises_lowers_or_lifts_an_arrays_limit_for_its_tasks_yet_to_start(settings):
    register(settings, "a", 4)
    tasks = submit_array(settings, "0-5%1")
    Scheduler(settings).schedule_once()
    assert states(settings, tasks).count(State.DISPATCHED) == 1
    outcomes = update_all(settings, tasks, Changes(array_limit=3), ANN)
    assert [o.changed for o in outcomes] == [{"array_limit": [1, 3]}] * 6
    Scheduler(settings).schedule_once()
    assert states(settings, tasks).count(State.DISPATCHED) == 3
    outcomes = update_all(settings, tasks, Changes(array_limit=0), ANN)  # 0: no limit
    assert outcomes[0].changed == {"array_limit": [3, None]}
    Scheduler(settings).schedule_once()
    assert states(settings, tasks).count(State.DISPATCHED) == 4  # as many as there are GPUs
    with write_scope(settings) as session:
        assert set(session.scalars(select(Job.array_limit).where(Job.id.in_(tasks)))) == {None}
    single = submit(settings)
    [refused] = update_all(settings, [single], Changes(array_limit=2), ANN)
    assert refused.refused == f"job {single} is not a task of an array; --array-limit is an array's"
    for body, message in [({"array_limit": -1}, "--array-limit must be between 1 and 10,000"),
                          ({"array_limit": "2"}, "--array-limit must be a whole number")]:
        with pytest.raises(InvalidSpec, match=message):
            Changes.of(body)


# --- through a real stack ------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["sqlite"])
def three_gpus(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=3)


def test_a_limited_array_through_the_cli_never_runs_more_than_its_limit_and_every_task_ends(three_gpus):
    s = three_gpus.settings
    sleep = [sys.executable, "-c", "import time; time.sleep(0.4)"]
    out = run_cli(["submit", "--array", "0-7%2", "--", *sleep], s)
    assert out.returncode == 0, out.stderr
    first = int(out.stdout.split("jobs ")[1].split("-")[0])
    assert out.stdout.strip() == f"submitted array {first}: jobs {first}-{first + 7} (8, 2 at once at most)"
    shown = run_cli(["show", str(first + 5)], s)
    assert f"array  {first}, task 5; at most 2 of its tasks at once" in shown.stdout
    assert json.loads(run_cli(["show", "--json", str(first)], s).stdout)["array_limit"] == 2
    tasks = list(range(first, first + 8))
    for t in tasks:
        assert wait_for_state(s, t, c.END_STATES, timeout=60) == State.SUCCEEDED, three_gpus.logs()
    with write_scope(s) as session:
        ran = session.execute(select(Job.started_at, Job.ended_at).where(Job.id.in_(tasks))).all()
    # At every start, how many tasks had started and not yet ended (this one included).
    events = sorted([(r.started_at, 1) for r in ran] + [(r.ended_at, -1) for r in ran], key=lambda e: (e[0], e[1]))
    at_once, most = 0, 0
    for _, step in events:
        at_once += step
        most = max(most, at_once)
    assert most == 2, ran  # two at once: the limit, and no fewer while more waited
    assert all(a.started_at <= b.started_at for a, b in pairwise(sorted(ran)))


def test_update_array_limit_through_the_cli_prints_each_change_and_refuses_a_bad_value(three_gpus):
    s = three_gpus.settings
    out = run_cli(["submit", "--json", "--hold", "--array", "0-2%1", "--", "true"], s)
    assert out.returncode == 0, out.stderr
    array = json.loads(out.stdout)[0]["array_id"]
    try:
        changed = run_cli(["update", "--array", str(array), "--array-limit", "2"], s)
        assert changed.returncode == 0, changed.stderr
        assert changed.stdout.strip() == f"updated 3 jobs of array {array}"
        lifted = run_cli(["update", str(array), "--array-limit", "0"], s)
        assert lifted.stdout.strip() == f"job {array}: array limit 2 → none"
        bad = run_cli(["update", str(array), "--array-limit", "x"], s)
        assert bad.returncode == c.EXIT_USAGE and "--array-limit" in bad.stderr
        malformed = run_cli(["submit", "--array", "0-3%0", "--", "true"], s)
        assert malformed.returncode == c.EXIT_USAGE
        assert malformed.stderr.strip() == ("gpuq: --array's %N (tasks at once) takes a whole number from 1 to "
                                            "10,000; got '0-3%0'")
    finally:
        run_cli(["cancel", "--array", str(array)], s)
