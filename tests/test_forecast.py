"""Expected start times (service/forecast.py), a pure function over the queue's state: what starts
now, what waits for the running jobs' limits, what may go ahead without delaying a job ahead of it,
and what no one can count on."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuq.service.forecast import Awaiting, start_times
from gpuq.service.policy import JobRequest, QueueState, decide
from tests.test_policy import NOW, gpu, job

pytestmark = pytest.mark.timeout(30)
HOUR = 3600


def test_a_gang_waits_for_the_running_jobs_limit_and_a_short_job_goes_ahead_of_it_but_a_long_one_does_not():
    # GPU 1 runs a job for another hour, GPU 2 is free. Job 1 needs both: it starts when the hour is
    # up. Job 2 (30 min) fits before that on GPU 2, so it starts now; job 3 (2 h) would delay job 1.
    gpus = [gpu(1, busy_until=NOW + HOUR), gpu(2)]
    jobs = [job(1, gpus=2, limit=HOUR), job(2, limit=HOUR // 2), job(3, limit=2 * HOUR)]
    assert start_times(QueueState(NOW, jobs, gpus)) == {1: NOW + HOUR, 2: NOW, 3: NOW + 2 * HOUR}


def test_jobs_queue_one_after_another_on_one_gpu_by_their_limits():
    jobs = [job(i, limit=HOUR) for i in (1, 2, 3)]
    assert start_times(QueueState(NOW, jobs, [gpu(1, busy_until=NOW + 600)])) == {
        1: NOW + 600, 2: NOW + 600 + HOUR, 3: NOW + 600 + 2 * HOUR}


def test_behind_a_job_without_a_time_limit_nobody_can_count_on_a_start():
    # Job 1 has no limit and takes the free GPU now: it could hold it for ever.
    assert start_times(QueueState(NOW, [job(1), job(2, limit=HOUR)], [gpu(1)])) == {1: NOW, 2: None}
    # A running job without a limit, the only GPU of the node.
    assert start_times(QueueState(NOW, [job(3, limit=HOUR)], [gpu(1, busy_until=math.inf)])) == {3: None}
    # On another node a GPU frees in an hour: there it starts.
    gpus = [gpu(1, busy_until=math.inf), gpu(2, node="b", busy_until=NOW + HOUR)]
    assert start_times(QueueState(NOW, [job(4, limit=HOUR)], gpus)) == {4: NOW + HOUR}


def test_behind_a_gang_the_scheduler_cannot_reserve_for_nothing_is_expected_to_start_on_the_free_gpu():
    # GPU 1 runs a job with no time limit; GPU 2 is free. Job 1 needs both: no reservation can
    # protect it, so the scheduler starts nothing after it (policy.decide), and the forecast says
    # so instead of "now" for job 2 on the free GPU, however short it is.
    gpus = [gpu(1, busy_until=math.inf), gpu(2)]
    state = QueueState(NOW, [job(1, gpus=2, limit=HOUR), job(2), job(3, limit=60)], gpus)
    decision = decide(state)
    assert decision.placements == [] and decision.blocked_by == 1
    assert start_times(state, decision) == {1: None, 2: None, 3: None}
    # A job ahead of the gang (a higher priority, submitted after it) is not held behind it.
    state = QueueState(NOW, [job(1, gpus=2, limit=HOUR), job(4, limit=60, priority=5)], gpus)
    assert start_times(state) == {4: NOW, 1: None}
    # Where the gang can be reserved for, what ends before its start still goes first.
    gpus = [gpu(1, busy_until=NOW + HOUR), gpu(2)]
    assert start_times(QueueState(NOW, [job(1, gpus=2, limit=HOUR), job(3, limit=60)], gpus)) == {
        1: NOW + HOUR, 3: NOW}


def test_a_job_with_no_limit_of_its_own_starts_once_nothing_is_planned_after_that_moment():
    gpus = [gpu(1, busy_until=NOW + HOUR)]
    assert start_times(QueueState(NOW, [job(1), job(2, limit=60)], gpus)) == {1: NOW + HOUR, 2: None}


def test_what_a_job_asks_for_picks_the_gpus_it_is_planned_on():
    gpus = [gpu(1, busy_until=NOW + HOUR, total=40960), gpu(2, node="b", busy_until=NOW + 600, total=16384)]
    # 20 GiB: only GPU 1 has it. Node b: GPU 2. No GPU has 64 GiB.
    jobs = [job(1, mem=20480, limit=60), job(2, node="b", limit=60), job(3, mem=65536, limit=60)]
    assert start_times(QueueState(NOW, jobs, gpus)) == {1: NOW + HOUR, 2: NOW + 600, 3: None}


def test_a_job_waiting_for_its_begin_time_is_planned_from_that_moment_after_the_jobs_that_may_start_now():
    # Job 1 may not start for two hours (--begin); job 2, behind it, ends before that.
    jobs = [job(2, limit=HOUR, submitted=2)]
    later = [(job(1, limit=HOUR, submitted=1), NOW + 2 * HOUR)]
    assert start_times(QueueState(NOW, jobs, [gpu(1)]), later=later) == {2: NOW, 1: NOW + 2 * HOUR}
    # The scheduler holds nothing for a job before its begin time: a long job that can start before
    # it does, now or once the GPU frees, and the one waiting for its moment goes after it.
    jobs = [job(3, limit=3 * HOUR, submitted=3)]
    assert start_times(QueueState(NOW, jobs, [gpu(1)]), later=later) == {3: NOW, 1: NOW + 3 * HOUR}
    busy = [gpu(1, busy_until=NOW + HOUR)]
    assert start_times(QueueState(NOW, jobs, busy), later=later) == {3: NOW + HOUR, 1: NOW + 4 * HOUR}


def test_a_job_waiting_for_others_is_planned_from_their_expected_ends_and_starts():
    # Two GPUs. Job 9 runs on GPU 1 for another hour; job 1 (2 h) takes GPU 2 now. Job 2 waits for
    # 9 to end, job 3 for 1 and 9 (an array's tasks), job 4 for job 3 (a chain), job 5 for 1's start.
    gpus = [gpu(1, busy_until=NOW + HOUR), gpu(2)]
    first = job(1, limit=2 * HOUR)
    waits = [Awaiting(job(2, limit=HOUR), (9,), False, NOW), Awaiting(job(3, limit=HOUR), (1, 9), False, NOW),
             Awaiting(job(4, limit=HOUR), (3,), False, NOW), Awaiting(job(5, limit=HOUR), (1,), True, NOW)]
    got = start_times(QueueState(NOW, [first], gpus), awaiting=waits, awaited_ends={9: NOW + HOUR})
    # In queue order: job 2 takes GPU 1 as job 9's hour ends; job 3 GPU 2 as job 1's two hours do;
    # job 4 an hour after job 3; job 5 might start with job 1 (now), but no GPU is free before GPU
    # 1 is again, at 2 h.
    assert got == {1: NOW, 2: NOW + HOUR, 3: NOW + 2 * HOUR, 4: NOW + 3 * HOUR, 5: NOW + 2 * HOUR}


def test_a_job_waiting_for_a_held_job_or_one_without_a_time_limit_has_no_start():
    gpus = [gpu(1), gpu(2)]
    waits = [Awaiting(job(2, limit=HOUR), (8,), False, NOW),  # 8: held, planned by no one
             Awaiting(job(3, limit=HOUR), (9,), False, NOW),  # 9: runs with no time limit
             Awaiting(job(4, limit=HOUR), (2,), False, NOW),  # after job 2, which has none
             Awaiting(job(5, limit=HOUR), (9,), True, NOW + HOUR)]  # after 9's start: from its begin
    got = start_times(QueueState(NOW, [], gpus), awaiting=waits, awaited_ends={9: math.inf})
    assert got == {2: None, 3: None, 4: None, 5: NOW + HOUR}
    # Past the depth (the first jobs of the queue that wait, planned first): none either.
    assert start_times(QueueState(NOW, [job(1, limit=60)], [gpu(1, busy_until=NOW + 60)]), depth=1,
                       awaiting=waits[3:], awaited_ends={9: math.inf}) == {1: NOW + 60, 5: None}


def test_a_job_its_users_gpu_limit_holds_and_jobs_past_the_depth_have_no_start():
    jobs = [job(1, user="ann", limit=HOUR), job(2, user="bob", limit=HOUR), job(3, user="cy", limit=HOUR)]
    state = QueueState(NOW, jobs, [gpu(1, busy_until=NOW + 60)], gpus_in_use={"ann": 1}, user_gpu_limit=1)
    assert start_times(state) == {1: None, 2: NOW + 60, 3: NOW + 60 + HOUR}
    assert start_times(state, depth=2) == {1: None, 2: NOW + 60, 3: None}  # job 1 is one of the two


def test_under_a_user_gpu_limit_a_users_jobs_start_as_their_running_and_planned_jobs_leave_them_room():
    # One GPU each at most. Ann's job on GPU 1 runs another hour; GPU 2 is free and Bob's job takes
    # it now. Ann's next job starts when her running one ends (GPU 1 is free then too), her third an
    # hour after that; one asking two GPUs never may.
    gpus = [gpu(1, busy_until=NOW + HOUR), gpu(2)]
    jobs = [job(1, user="ann", limit=HOUR), job(2, user="bob", limit=2 * HOUR), job(3, user="ann", limit=HOUR),
            job(4, user="ann", gpus=2, limit=60)]
    state = QueueState(NOW, jobs, gpus, gpus_in_use={"ann": 1}, user_gpu_limit=1,
                       user_holds={"ann": [(NOW + HOUR, 1.0)]})
    assert start_times(state) == {2: NOW, 1: NOW + HOUR, 3: NOW + 2 * HOUR, 4: None}
    # Without a limit, Ann's jobs wait for GPUs alone; and so they do where her own is none, or 2.
    free = QueueState(NOW, jobs[:3], gpus, gpus_in_use={"ann": 1})
    assert start_times(free) == {1: NOW, 2: NOW + HOUR, 3: NOW + HOUR}
    for own in (0, 2):
        exempt = QueueState(NOW, jobs[:3], gpus, gpus_in_use={"ann": 1}, user_gpu_limit=1,
                            user_gpu_limits={"ann": own}, user_holds={"ann": [(NOW + HOUR, 1.0)]})
        assert start_times(exempt) == {1: NOW, 2: NOW + HOUR, 3: NOW + HOUR}


def shared(job_id, mib, limit=HOUR):
    return JobRequest(id=job_id, user="u", gpus=1, mem_mib=mib, shared=True, time_limit_s=limit, submitted=job_id)


def test_shared_jobs_are_planned_side_by_side_as_the_gpus_memory_holds_them_and_a_whole_gpu_job_after_them():
    # A 16 GiB GPU busy for ten minutes: two 2 GiB shared jobs start together when it frees.
    busy = [gpu(1, busy_until=NOW + 600)]
    assert start_times(QueueState(NOW, [shared(1, 2048), shared(2, 2048)], busy)) == {1: NOW + 600, 2: NOW + 600}
    # Three of 6 GiB (each with its 512 MiB context reserve) do not fit in 16 GiB together: the third
    # starts when the first of the two before it is expected to end.
    jobs = [shared(1, 6144, limit=1800), shared(2, 6144), shared(3, 6144)]
    assert start_times(QueueState(NOW, jobs, busy)) == {1: NOW + 600, 2: NOW + 600, 3: NOW + 2400}
    # Placed now, a shared job starts now; a whole-GPU job behind it waits for it to leave the GPU.
    assert start_times(QueueState(NOW, [shared(1, 2048)], [gpu(1)])) == {1: NOW}
    assert start_times(QueueState(NOW, [shared(1, 2048), job(3, limit=HOUR)], [gpu(1)])) == {1: NOW, 3: NOW + HOUR}


def test_a_shared_job_waiting_for_room_starts_as_the_running_shares_leave_at_their_limits():
    # Two shared jobs hold 12 GiB of the 16, one for half an hour, one for an hour: a 2 GiB job fits
    # beside them now, one of 6 GiB once the first has left, a whole-GPU job once both have.
    held = replace(gpu(1), shares=((NOW + 1800, 6144), (NOW + HOUR, 6144)))
    jobs = [shared(1, 2048), shared(2, 6144), job(3, limit=60)]
    assert start_times(QueueState(NOW, jobs, [held])) == {1: NOW, 2: NOW + 1800, 3: NOW + 1800 + HOUR}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(1, 7200)), min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(1, 4), st.integers(60, 7200), st.integers(0, 3)), min_size=1, max_size=8))
def test_the_plan_never_books_more_gpus_than_a_node_has_at_any_moment(busy_for, asks):
    """Whatever the running jobs and the queue, the jobs planned (and the running ones) never hold
    more GPUs of the node at once than it has, and none starts before now."""
    gpus = [gpu(i + 1, busy_until=None if b is None else NOW + b) for i, b in enumerate(busy_for)]
    jobs = [JobRequest(id=i + 1, user=f"u{user}", gpus=min(n, len(gpus)), time_limit_s=limit, submitted=i)
            for i, (n, limit, user) in enumerate(asks)]
    starts = start_times(QueueState(NOW, jobs, gpus))
    spans = [(NOW, NOW + b, 1) for b in busy_for if b is not None]
    spans += [(starts[j.id], starts[j.id] + j.time_limit_s, j.gpus) for j in jobs if starts[j.id] is not None]
    assert all(start >= NOW for start, _, _ in spans)
    for moment in {start for start, _, _ in spans}:
        assert sum(n for start, end, n in spans if start <= moment < end) <= len(gpus), (starts, spans)
    # With time limits all round and nothing else in the way, every job gets a start.
    assert all(t is not None for t in starts.values())


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(1, 7200)),
       st.lists(st.tuples(st.one_of(st.none(), st.integers(1, 12)), st.integers(60, 7200)), min_size=1, max_size=8))
def test_the_plan_never_books_more_of_a_gpus_memory_than_it_has_nor_a_whole_gpu_beside_anything(busy_for, asks):
    """One 16 GiB GPU, busy or not, and a queue of whole-GPU jobs (None) and shared ones of 1-12 GiB:
    at no moment do the planned shared jobs need more than the GPU's memory, nor does a whole-GPU job
    share it with any other job."""
    jobs = [job(i + 1, limit=limit) if gib is None else shared(i + 1, gib * 1024, limit=limit)
            for i, (gib, limit) in enumerate(asks)]
    state = QueueState(NOW, jobs, [gpu(1, busy_until=None if busy_for is None else NOW + busy_for)])
    starts = start_times(state)
    spans = [] if busy_for is None else [(NOW, NOW + busy_for, None)]
    spans += [(starts[j.id], starts[j.id] + j.time_limit_s, j.mem_mib + state.shared_context_mib if j.shared else None)
              for j in jobs if starts[j.id] is not None]
    assert all(t is not None for t in starts.values())
    for moment in {start for start, _, _ in spans}:
        there = [need for start, end, need in spans if start <= moment < end]
        assert None not in there or len(there) == 1, (starts, spans)
        assert sum(n for n in there if n is not None) <= 16384, (starts, spans)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.lists(st.one_of(st.none(), st.integers(1, 7200)), min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(1, 3), st.integers(60, 7200), st.integers(0, 2)), min_size=1, max_size=8))
def test_under_a_user_gpu_limit_no_user_is_planned_more_gpus_at_once_than_it(limit, busy_for, asks):
    """The GPUs' running jobs are user 0's; whatever the queue, no user's running and planned jobs
    hold more GPUs at any moment than the limit, and a job asking more than it has no start."""
    gpus = [gpu(i + 1, busy_until=None if b is None else NOW + b) for i, b in enumerate(busy_for)]
    running = [(NOW + b, 1.0) for b in busy_for if b is not None]
    jobs = [JobRequest(id=i + 1, user=f"u{user}", gpus=min(n, len(gpus)), time_limit_s=length, submitted=i)
            for i, (n, length, user) in enumerate(asks)]
    state = QueueState(NOW, jobs, gpus, gpus_in_use={"u0": float(len(running))}, user_gpu_limit=limit,
                       user_holds={"u0": running})
    starts = start_times(state)
    spans = [(NOW, end, 1, "u0") for end, _ in running]
    spans += [(starts[j.id], starts[j.id] + j.time_limit_s, j.gpus, j.user) for j in jobs if starts[j.id] is not None]
    for moment in {start for start, _, _, _ in spans}:
        for user in {u for _, _, _, u in spans}:
            held = sum(n for start, end, n, u in spans if u == user and start <= moment < end)
            # The running jobs may be over the limit already (it was lowered): then nothing is added.
            assert held <= max(limit, len(running) if user == "u0" else 0), (starts, spans)
    assert all((starts[j.id] is None) == (j.gpus > limit) for j in jobs), starts


# --- through the server and a real worker -------------------------------------------------------

@pytest.fixture(scope="module", params=["sqlite"])
def one_gpu(request, tmp_path_factory, redis_url):
    from tests.conftest import stack_on_database

    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1)


@pytest.mark.timeout(120)
def test_status_start_and_why_give_a_waiting_jobs_start_from_the_running_jobs_limit(one_gpu):
    import json
    import sys
    from datetime import datetime

    from gpuq.service import constants as c
    from gpuq.service.constants import State
    from tests.conftest import cli_submit, run_cli, wait_for_state

    s = one_gpu.settings
    running = cli_submit(s, ["--time", "1h", "--", sys.executable, "-c", "import time; time.sleep(120)"])
    waiting = cli_submit(s, ["--time", "30m", "--name", "after", "--", "true"])
    held = cli_submit(s, ["--hold", "--", "true"])
    begins = cli_submit(s, ["--begin", "3h", "--time", "10m", "--", "true"])
    try:
        assert wait_for_state(s, running, [State.RUNNING]) == State.RUNNING
        shown = json.loads(run_cli(["show", str(running), "--json"], s).stdout)
        ends = datetime.fromisoformat(shown["started_at"]).timestamp() + 3600
        answer = run_cli(["status", "--start", "--json"], s)
        assert answer.returncode == 0, answer.stderr
        starts = {j["id"]: j for j in json.loads(answer.stdout)["jobs"]}
        assert list(starts) == [waiting, begins, held]  # pending jobs only, the known starts first
        assert abs(datetime.fromisoformat(starts[waiting]["start"]).timestamp() - ends) < 5
        # Not before its begin time, when the GPU is free again.
        begin = json.loads(run_cli(["show", str(begins), "--json"], s).stdout)["begin_at"]
        assert starts[begins]["start"] == begin and starts[begins]["reason"] == "begin time"
        assert starts[held]["start"] is None and starts[held]["reason"] == "held"
        # Where each is planned, as squeue --start's SCHEDNODES: the one node, or none for a held job.
        assert starts[waiting]["planned_node"] == s.node and starts[held]["planned_node"] is None
        table = run_cli(["status", "--start"], s)
        assert table.returncode == 0 and "START" in table.stdout and "after" in table.stdout, table
        rows = {x.split()[0]: x.split() for x in table.stdout.splitlines() if x.split()[:1] in ([str(waiting)],
                                                                                                 [str(held)])}
        assert s.node in rows[str(waiting)] and rows[str(held)][-3:] == ["n/a", "-", "held"], rows
        said = run_cli(["why", str(waiting)], s).stdout
        assert "expected to start by " in said and "if the jobs before it run to their time limits" in said, said
        mixed = run_cli(["status", "--start", "-t", "running"], s)
        assert mixed.returncode == c.EXIT_USAGE and mixed.stderr.count("\n") == 1 and "--start" in mixed.stderr
    finally:
        run_cli(["cancel", str(running), str(waiting), str(held), str(begins)], s)


@pytest.mark.timeout(120)
def test_status_start_and_why_give_a_chain_of_dependent_jobs_their_starts_from_the_running_jobs_limit(one_gpu):
    import json
    import sys
    from datetime import datetime

    from gpuq.service.constants import State
    from tests.conftest import cli_submit, run_cli, wait_for_state

    s = one_gpu.settings
    running = cli_submit(s, ["--time", "1h", "--", sys.executable, "-c", "import time; time.sleep(120)"])
    train = cli_submit(s, ["--time", "30m", "--after", str(running), "--", "true"])
    evaluate = cli_submit(s, ["--time", "10m", "-d", f"afterany:{train}", "--", "true"])
    held = cli_submit(s, ["--hold", "--time", "10m", "--", "true"])
    report = cli_submit(s, ["--time", "10m", "--after", str(held), "--", "true"])
    try:
        assert wait_for_state(s, running, [State.RUNNING]) == State.RUNNING
        shown = json.loads(run_cli(["show", str(running), "--json"], s).stdout)
        ends = datetime.fromisoformat(shown["started_at"]).timestamp() + 3600
        starts = {j["id"]: j for j in json.loads(run_cli(["status", "--start", "--json"], s).stdout)["jobs"]}
        when = {j: datetime.fromisoformat(starts[j]["start"]).timestamp() for j in (train, evaluate)}
        assert abs(when[train] - ends) < 5 and abs(when[evaluate] - (ends + 1800)) < 5, starts
        assert starts[train]["reason"] == starts[evaluate]["reason"] == "dependency"
        assert starts[report]["start"] is None  # it waits for a held job: no one can count on a start
        said = run_cli(["why", str(evaluate)], s).stdout
        assert f"it waits for job {train} (pending) to end (-d afterany); expected to start by " in said, said
        assert "expected to start" not in run_cli(["why", str(report)], s).stdout
    finally:
        run_cli(["cancel", str(running), str(train), str(evaluate), str(held), str(report)], s)


@pytest.mark.timeout(120)
def test_a_shared_job_waiting_for_room_is_expected_when_the_first_running_share_reaches_its_limit(one_gpu):
    import json
    import sys
    from datetime import datetime

    from gpuq.service.constants import State
    from tests.conftest import cli_submit, run_cli, wait_for_state

    s = one_gpu.settings  # one simulated GPU of 8 GiB
    sleep = ["--", sys.executable, "-c", "import time; time.sleep(120)"]
    long = cli_submit(s, ["--shared", "--mem", "3G", "--time", "1h", *sleep])
    short = cli_submit(s, ["--shared", "--mem", "3G", "--time", "30m", *sleep])
    waiting = cli_submit(s, ["--shared", "--mem", "3G", "--time", "10m", "--", "true"])
    try:
        for job_id in (long, short):
            assert wait_for_state(s, job_id, [State.RUNNING]) == State.RUNNING
        started = datetime.fromisoformat(json.loads(run_cli(["show", str(short), "--json"], s).stdout)["started_at"])
        answer = run_cli(["status", "--start", "--json"], s)
        assert answer.returncode == 0, answer.stderr
        [planned] = [j for j in json.loads(answer.stdout)["jobs"] if j["id"] == waiting]
        # Room for a third 3 GiB share (with its reserve) opens when the 30-minute job leaves, not the hour's.
        assert abs(datetime.fromisoformat(planned["start"]).timestamp() - (started.timestamp() + 1800)) < 5, planned
    finally:
        run_cli(["cancel", str(long), str(short), str(waiting)], s)


@pytest.fixture(scope="module", params=["sqlite"])
def limited(request, tmp_path_factory, redis_url):
    """Two simulated GPUs, one at a time per user."""
    from tests.conftest import stack_on_database

    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=2, user_gpu_limit=1)


@pytest.mark.timeout(120)
def test_a_job_its_users_limit_holds_is_expected_when_their_running_job_reaches_its_limit(limited):
    import json
    import sys
    import time
    from datetime import datetime

    from gpuq.service.constants import State
    from tests.conftest import cli_submit, run_cli, wait_for_state

    s = limited.settings
    running = cli_submit(s, ["--time", "1h", "--", sys.executable, "-c", "import time; time.sleep(120)"])
    waiting = cli_submit(s, ["--time", "10m", "--", "true"])
    try:
        assert wait_for_state(s, running, [State.RUNNING]) == State.RUNNING
        started = datetime.fromisoformat(json.loads(run_cli(["show", str(running), "--json"], s).stdout)["started_at"])
        deadline = time.monotonic() + 30
        while True:  # until a scheduler's pass has said why it waits
            answer = run_cli(["status", "--start", "--json"], s)
            assert answer.returncode == 0, answer.stderr
            [planned] = [j for j in json.loads(answer.stdout)["jobs"] if j["id"] == waiting]
            if planned["reason"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # A GPU is free now, but not for this user until their running job's hour is up.
        assert planned["reason"] == "user limit" and planned["start"] is not None, planned
        assert abs(datetime.fromisoformat(planned["start"]).timestamp() - (started.timestamp() + 3600)) < 5, planned
        said = run_cli(["why", str(waiting)], s).stdout
        assert "expected to start by " in said, said
    finally:
        run_cli(["cancel", str(running), str(waiting)], s)


def test_tasks_their_arrays_limit_holds_back_start_as_its_running_and_planned_tasks_end():
    # Array 7 runs at most two tasks at once and five GPUs are free: tasks 1 and 2 start now, 3 and 4
    # (held back) as those two end, GPUs free or not. Array 9 (one at once) runs a task until 600.
    tasks = [replace(job(i, limit=HOUR), array=7) for i in (1, 2)]
    held = [replace(job(i, limit=HOUR), array=7) for i in (3, 4)]
    gpus = [gpu(i) for i in range(1, 6)]
    state = QueueState(NOW, tasks, gpus)
    starts = start_times(state, throttled=[*held, replace(job(5, limit=HOUR), array=9)],
                         arrays={7: (2, []), 9: (1, [NOW + 600])})
    assert starts == {1: NOW, 2: NOW, 3: NOW + HOUR, 4: NOW + HOUR, 5: NOW + 600}
    # Behind a running task without a time limit, no start can be counted on.
    assert start_times(state, throttled=[replace(job(6, limit=HOUR), array=9)], arrays={9: (1, [math.inf])})[6] is None
    # Held back, a task waits for its array, not behind the jobs submitted after it.
    later = job(8, limit=HOUR, submitted=100)
    starts = start_times(QueueState(NOW, [later], [gpu(1, busy_until=NOW + 600)]), throttled=[replace(
        job(3, limit=HOUR), array=7)], arrays={7: (1, [NOW + 600])})
    assert starts == {3: NOW + 600, 8: NOW + 600 + HOUR}
