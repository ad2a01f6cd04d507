"""`gpuq update`: a job's priority, time limit, name and retries changed after its submit, with
SLURM's rules for what may change where, checked in the server; a running job's worker taking
its new time limit."""

from __future__ import annotations

import re
import sys
import time

import pytest
from sqlalchemy import select

from gpuq.service import constants as c
from gpuq.service import jobs
from gpuq.service.changes import Changes
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.errors import InvalidSpec, JobNotFound, NotAllowed
from gpuq.service.models import Job, utcnow
from gpuq.service.rights import Caller
from gpuq.service.scheduler import Scheduler
from gpuq.service.update import update_all
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state
from tests.test_scheduling import end, register, state_of, submit

pytestmark = pytest.mark.timeout(120)
ANN, MALLORY, BOSS = Caller(5001, "ann"), Caller(5002, "mallory"), Caller(5003, "boss")


@pytest.fixture
def settings(settings):
    """As tests/test_scheduling.py's: the passes place, not the submit; boss is an admin."""
    return settings.with_overrides(place_at_submit=False, admins="boss")


def row(settings, job_id):
    with write_scope(settings) as session:
        return session.execute(select(Job.priority, Job.time_limit_s, Job.name, Job.max_retries)
                               .where(Job.id == job_id)).one()


def test_a_pending_jobs_new_priority_starts_it_before_one_submitted_earlier(settings):
    register(settings, "a", 1)
    first, second = submit(settings), submit(settings)
    [outcome] = update_all(settings, [second], Changes(priority=5), ANN)
    assert outcome.changed == {"priority": [0, 5]} and outcome.refused is None
    Scheduler(settings).schedule_once()
    assert state_of(settings, second)[0] == State.DISPATCHED
    assert state_of(settings, first)[0] == State.PENDING


def test_another_users_job_a_missing_one_or_a_priority_over_the_limit_changes_nothing(settings):
    mine, other = submit(settings, user="mallory"), submit(settings)
    before = row(settings, mine), row(settings, other)
    with pytest.raises(NotAllowed, match=f"job {other} belongs to ann"):
        update_all(settings, [mine, other], Changes(priority=3), MALLORY)
    with pytest.raises(JobNotFound, match="no job 999"):
        update_all(settings, [mine, 999], Changes(priority=3), MALLORY)
    with pytest.raises(InvalidSpec, match="--priority 11 is above the users' limit of 10"):
        update_all(settings, [mine], Changes(priority=11), MALLORY)
    assert (row(settings, mine), row(settings, other)) == before
    # An admin may change anyone's, past the users' limit.
    [outcome] = update_all(settings, [other], Changes(priority=50), BOSS)
    assert outcome.changed == {"priority": [0, 50]} and row(settings, other).priority == 50


def test_a_started_job_keeps_its_priority_and_only_an_admin_raises_its_time_limit(settings):
    register(settings, "a", 1)
    job = submit(settings, time="1h")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED
    [refused] = update_all(settings, [job], Changes(priority=5), ANN)
    assert refused.refused == f"job {job} is dispatched; only a pending job's priority can be changed"
    [refused] = update_all(settings, [job], Changes(time_limit_s=7200), ANN)
    assert "only root or an admin may raise a started job's time limit" in refused.refused
    assert row(settings, job).time_limit_s == 3600
    [lowered] = update_all(settings, [job], Changes(time_limit_s=1800, max_retries=2), ANN)
    assert lowered.changed == {"time_limit_s": [3600, 1800], "max_retries": [0, 2]}
    [raised] = update_all(settings, [job], Changes(time_limit_s=7200), BOSS)
    assert raised.changed == {"time_limit_s": [1800, 7200]}
    # A job started without a limit has the longest there is: giving it one lowers it (as SLURM's
    # UNLIMITED to a time), a user's right.
    unlimited = submit(settings)
    end(settings, job, State.SUCCEEDED)
    with write_scope(settings) as session:
        session.execute(Job.__table__.update().where(Job.id == unlimited).values(state=State.RUNNING))
    [limited] = update_all(settings, [unlimited], Changes(time_limit_s=60), ANN)
    assert limited.changed == {"time_limit_s": [None, 60]} and row(settings, unlimited).time_limit_s == 60
    [refused] = update_all(settings, [unlimited], Changes(time_limit_s=61), ANN)
    assert refused.refused is not None and row(settings, unlimited).time_limit_s == 60
    [ended] = update_all(settings, [job], Changes(max_retries=1), ANN)
    assert ended.refused == f"job {job} succeeded; an ended job cannot be changed"


def test_a_started_jobs_owner_makes_it_preemptible_and_only_an_admin_makes_it_not(settings):
    register(settings, "a", 2)
    job = submit(settings, time="1h")
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED

    def preemptible() -> bool:
        with write_scope(settings) as session:
            return bool(session.get(Job, job).preemptible)

    [made] = update_all(settings, [job], Changes(preemptible=True), ANN)
    assert made.changed == {"preemptible": [False, True]} and preemptible()
    [refused] = update_all(settings, [job], Changes(preemptible=False), ANN)
    assert refused.refused == (f"job {job} is dispatched; only root or an admin may make a started job not "
                               "preemptible (it would count against its user's GPU limit past it)")
    assert preemptible()
    [unmade] = update_all(settings, [job], Changes(preemptible=False), BOSS)
    assert unmade.changed == {"preemptible": [True, False]} and not preemptible()
    # Where fair share charges preemptible jobs less, its whole run would be charged so: admins only.
    discounted = settings.with_overrides(preemptible_charge=0.5)
    [refused] = update_all(discounted, [job], Changes(preemptible=True), ANN)
    assert refused.refused == (f"job {job} is dispatched; only root or an admin may make a started job preemptible "
                               "here: fair share would charge its whole run at GPUQ_PREEMPTIBLE_CHARGE (0.5)")
    assert not preemptible()
    # Being stopped (asked to, its worker not done yet), it keeps what it is.
    with write_scope(settings) as session:
        session.execute(Job.__table__.update().where(Job.id == job).values(state=State.RUNNING,
                                                                         cancel_requested_at=utcnow()))
    [stopping] = update_all(settings, [job], Changes(preemptible=True), ANN)
    assert stopping.refused == f"job {job} is being stopped already; its preemptibility stays as it is"
    assert not preemptible()


def test_a_jobs_word_on_requeue_changes_whether_it_waits_or_started_and_a_bad_one_is_refused(settings):
    register(settings, "a", 2)
    job = submit(settings, time="1h")

    def requeue() -> bool | None:
        with write_scope(settings) as session:
            return session.get(Job, job).requeue

    [made] = update_all(settings, [job], Changes(requeue=True), ANN)
    assert made.changed == {"requeue": [None, True]} and requeue() is True
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED
    # Started: its owner may say either (a requeue uses no GPU-hour the job would not have used).
    [unmade] = update_all(settings, [job], Changes(requeue=False), ANN)
    assert unmade.changed == {"requeue": [True, False]} and requeue() is False
    [same] = update_all(settings, [job], Changes(requeue=False), ANN)
    assert same.changed == {} and same.refused is None
    with pytest.raises(InvalidSpec, match=r"^--requeue must be true or false \(--no-requeue\)$"):
        Changes.of({"requeue": "yes"})


def test_only_root_or_an_admin_gives_a_job_more_time_than_the_queues_maximum(settings):
    limited = settings.with_overrides(max_time="2h")
    job = submit(limited, time="1h")
    with pytest.raises(InvalidSpec, match=r"--time 3:00:00 is more than this queue's maximum, 2:00:00"):
        update_all(limited, [job], Changes(time_limit_s=3 * 3600), ANN)
    assert row(limited, job).time_limit_s == 3600
    [within] = update_all(limited, [job], Changes(time_limit_s=2 * 3600), ANN)
    assert within.changed == {"time_limit_s": [3600, 7200]}
    [raised] = update_all(limited, [job], Changes(time_limit_s=3 * 3600), BOSS)
    assert raised.changed == {"time_limit_s": [7200, 10800]}


def test_one_refusal_among_many_leaves_the_others_changed(settings):
    register(settings, "a", 1)
    running, waiting = submit(settings), submit(settings)
    Scheduler(settings).schedule_once()
    outcomes = update_all(settings, [running, waiting], Changes(priority=2), ANN)
    assert [o.refused is None for o in outcomes] == [False, True]
    assert row(settings, waiting).priority == 2 and row(settings, running).priority == 0


def test_changes_are_checked_as_submit_checks_them(settings):
    job = submit(settings)
    for body, message in [({}, "give something to change"), ({"priority": 1001}, "--priority must be between"),
                          ({"priority": "5"}, "--priority must be a whole number"),
                          ({"priority": True}, "--priority must be a whole number"),
                          ({"retries": -1}, "--retries must be between 0 and 100"),
                          ({"time": "1:99:99"}, "--time takes 2h"), ({"time": 7200}, "--time must be text"),
                          ({"name": " "}, "--name must not be empty"),
                          ({"name": "a\x1b[2Jb"}, "--name must not contain control characters"),
                          ({"owner": "root"}, "no such change: 'owner'")]:
        with pytest.raises(InvalidSpec, match=message):
            Changes.of(body)
    with pytest.raises(InvalidSpec, match="--name changes one job at a time"):
        update_all(settings, [job, submit(settings)], Changes(name="x"), ANN)
    [same] = update_all(settings, [job], Changes(priority=0), ANN)
    assert same.changed == {} and same.refused is None
    [named] = update_all(settings, [job], Changes(name="renamed", time_limit_s=90), ANN)
    assert named.changed == {"name": ["true", "renamed"], "time_limit_s": [None, 90]}
    assert row(settings, job)[1:3] == (90, "renamed")


def test_a_pending_jobs_gpus_and_type_change_as_submit_checks_them_and_it_leaves_the_next_up_lists(settings):
    from gpuq.service import spec, submitting
    from gpuq.service.models import NextUp
    from tests.test_gpu_type import A100, RTX, rename

    a, b = register(settings, "a", 2)
    rename(settings, {a: A100, b: RTX})
    running = submit(settings)
    Scheduler(settings).schedule_once()
    waiting = submit(settings, hold=True)
    with write_scope(settings) as session:  # listed next on a busy GPU, as a pass lists one-GPU jobs
        session.add(NextUp(gpu_id=b, job_id=waiting, rank=0))

    def gpus_of(job_id):
        with write_scope(settings) as session:
            return session.execute(select(Job.gpus, Job.gpu_type).where(Job.id == job_id)).one()

    [grown] = update_all(settings, [waiting], Changes.of({"gpus": 2}), ANN)
    assert (grown.changed, grown.refused) == ({"gpus": [1, 2]}, None)
    with write_scope(settings) as session:  # listed for one GPU, it waits for two now: off the list
        assert session.scalars(select(NextUp.job_id).where(NextUp.job_id == waiting)).all() == []
    # What a submit refuses is refused whole, and nothing changes.
    for body, says in (({"gpus": 3}, "--gpus 3 is more than any node has (the largest, a, has 2)"),
                       ({"gpu_type": "a100"}, "--gpus 2 is more than any node has of --gpu-type a100"),
                       ({"gpu_type": "h100"}, "--gpu-type h100: no GPU is one (gpuq's GPUs: NVIDIA A100"),
                       ({"gpus": 0}, "--gpus must be at least 1"), ({"gpus": "2"}, "--gpus must be a whole number"),
                       ({"gpu_type": "a100;rm"}, "--gpu-type takes a GPU model")):
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            update_all(settings, [waiting], Changes.of(body), ANN)
        assert tuple(gpus_of(waiting)) == (2, None)
    [typed] = update_all(settings, [waiting], Changes.of({"gpus": 1, "gpu_type": "a100"}), ANN)
    assert typed.changed == {"gpus": [2, 1], "gpu_type": [None, "a100"]}
    [untyped] = update_all(settings, [waiting], Changes.of({"gpu_type": "any"}), ANN)  # any model again
    assert untyped.changed == {"gpu_type": ["a100", None]} and tuple(gpus_of(waiting)) == (1, None)
    # A started job keeps its GPUs; a workload is held to the GPUs it runs on.
    [kept] = update_all(settings, [running], Changes(gpus=2), ANN)
    assert kept.refused == f"job {running} is dispatched; only a pending job's GPUs can be changed"
    matmul = submitting.submit_all(settings, [spec.workload_spec("matmul", [], user="ann")])[0].id
    with pytest.raises(InvalidSpec, match="matmul runs on one GPU; got --gpus 2"):
        update_all(settings, [matmul], Changes(gpus=2), ANN)


def test_a_pending_jobs_memory_and_node_change_as_submit_checks_them_and_it_leaves_the_next_up_lists(settings):
    from gpuq.service import spec, submitting
    from gpuq.service.models import NextUp

    [a] = register(settings, "a", 1)
    register(settings, "b", 1)
    running = submit(settings)
    Scheduler(settings).schedule_once()
    waiting = submit(settings, hold=True)
    shared = submit(settings, hold=True, shared=True, mem="2G")
    with write_scope(settings) as session:  # listed next on a busy GPU, as a pass lists one-GPU jobs
        session.add(NextUp(gpu_id=a, job_id=waiting, rank=0))

    def asks(job_id):
        with write_scope(settings) as session:
            return tuple(session.execute(select(Job.mem_mib, Job.on_node).where(Job.id == job_id)).one())

    [moved] = update_all(settings, [waiting], Changes.of({"mem": "1G", "node": "b"}), ANN)
    assert (moved.changed, moved.refused) == ({"mem_mib": [None, 1024], "on_node": [None, "b"]}, None)
    with write_scope(settings) as session:  # listed for any node and no memory: off the list
        assert session.scalars(select(NextUp.job_id).where(NextUp.job_id == waiting)).all() == []
    # What a submit refuses is refused whole, and nothing changes.
    for body, says in (({"mem": "20G"}, "--mem 20480 MiB is more than any GPU has (8192 MiB)"),
                       ({"mem": "lots"}, "--mem takes a size like 20G or 512M; got 'lots'"),
                       ({"mem": "4G", "node": "zz"}, "--node zz: no such node is known to gpuq"),
                       ({"node": " "}, "--node must not be empty (any: no node asked)"),
                       ({"node": 3}, "--node must be text")):
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            update_all(settings, [waiting], Changes.of(body), ANN)
        assert asks(waiting) == (1024, "b")
    [back] = update_all(settings, [waiting], Changes.of({"mem": "none", "node": "ANY"}), ANN)
    assert back.changed == {"mem_mib": [1024, None], "on_node": ["b", None]} and asks(waiting) == (None, None)
    # A shared job's memory is its share: changed, never dropped.
    [share] = update_all(settings, [shared], Changes.of({"mem": "3G"}), ANN)
    assert share.changed == {"mem_mib": [2048, 3072]}
    with pytest.raises(InvalidSpec, match=f"job {shared} is shared: its --mem is its share"):
        update_all(settings, [shared], Changes.of({"mem": "none"}), ANN)
    # A started job keeps its memory and node; an allocation's node is its client's.
    [kept] = update_all(settings, [running], Changes(on_node="b"), ANN)
    assert kept.refused == f"job {running} is dispatched; only a pending job's node can be changed"
    alloc = submitting.submit_all(settings, [spec.interactive_spec(None, node="a", user="ann", run_id="r1")])[0].id
    with pytest.raises(InvalidSpec, match=f"job {alloc} is an allocation: its node is the one its client runs on"):
        update_all(settings, [alloc], Changes(on_node="b"), ANN)


def test_a_pending_jobs_sharing_changes_with_a_share_to_pack_by_and_it_leaves_the_next_up_lists(settings):
    from gpuq.service.models import NextUp

    [a] = register(settings, "a", 1)
    running = submit(settings)
    Scheduler(settings).schedule_once()
    whole = submit(settings, hold=True, mem="2G")
    bare = submit(settings, hold=True)
    with write_scope(settings) as session:  # listed next on a busy GPU, for a whole GPU
        session.add(NextUp(gpu_id=a, job_id=whole, rank=0))

    def sharing(job_id):
        with write_scope(settings) as session:
            return tuple(session.execute(select(Job.shared, Job.mem_mib).where(Job.id == job_id)).one())

    [made] = update_all(settings, [whole], Changes.of({"shared": True}), ANN)
    assert (made.changed, made.refused) == ({"shared": [False, True]}, None) and sharing(whole) == (True, 2048)
    with write_scope(settings) as session:  # listed for a whole GPU: off the list
        assert session.scalars(select(NextUp.job_id).where(NextUp.job_id == whole)).all() == []
    # A job that asks no memory has no share to pack by: refused whole, unless the update gives one.
    with pytest.raises(InvalidSpec, match=f"job {bare} asks no GPU memory: --shared needs --mem, its share"):
        update_all(settings, [whole, bare], Changes.of({"shared": True}), ANN)
    assert sharing(bare) == (False, None)
    [both] = update_all(settings, [bare], Changes.of({"shared": True, "mem": "1G"}), ANN)
    assert both.changed == {"mem_mib": [None, 1024], "shared": [False, True]} and sharing(bare) == (True, 1024)
    [back] = update_all(settings, [whole], Changes.of({"shared": False}), ANN)
    assert back.changed == {"shared": [True, False]} and sharing(whole) == (False, 2048)
    with pytest.raises(InvalidSpec, match=re.escape("--shared must be true or false (--whole)")):
        Changes.of({"shared": "yes"})
    # A started job keeps its sharing: its placement and its watch were made for it.
    [kept] = update_all(settings, [running], Changes(shared=True), ANN)
    assert kept.refused == f"job {running} is dispatched; only a pending job's sharing can be changed"


def test_a_pending_jobs_new_dependency_holds_it_back_off_the_next_up_lists_and_a_loop_is_refused(settings):
    from gpuq.service.errors import StateConflict
    from gpuq.service.models import NextUp
    from tests.test_scheduling import submit_array

    [gpu] = register(settings, "a", 1)
    first = submit(settings, hold=True)
    job = submit(settings)
    with write_scope(settings) as session:  # listed next on the GPU, as a pass lists one-GPU jobs
        session.add(NextUp(gpu_id=gpu, job_id=job, rank=0))

    def waits(job_id):
        with write_scope(settings) as session:
            return tuple(session.execute(select(Job.after, Job.after_kind, Job.reason).where(Job.id == job_id)).one())

    [outcome] = update_all(settings, [job], Changes.of({"dependency": f"afterok:{first}"}), ANN)
    assert (outcome.changed, outcome.refused) == ({"dependency": [None, f"afterok:{first}"]}, None)
    # It says why it waits at once, and no worker may take it from a list without looking.
    assert waits(job) == ([first], "afterok", "dependency")
    with write_scope(settings) as session:
        assert session.scalars(select(NextUp.job_id).where(NextUp.job_id == job)).all() == []
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[:2] == (State.PENDING, "dependency")
    # A loop, which a submit cannot make (it names earlier jobs only), is refused whole: directly,
    # through another job, on itself, and through its own array's id.
    then = submit(settings, after=str(job))
    tasks = submit_array(settings, 2)
    for target, body, says in (
            (first, {"after": str(job)}, f"--dependency afterok:{job}: job {job} waits for job {first} already "
                                         "(directly or through others), so neither would ever start"),
            (first, {"after_any": str(then)}, f"--dependency afterany:{then}: job {then} waits for job {first}"),
            (first, {"dependency": f"afterok:{first}"}, f"job {first} cannot wait for itself"),
            (tasks[1], {"after": str(tasks[0])}, f"job {tasks[1]} is a task of array {tasks[0]}: it would wait "
                                                 "for itself"),
            (job, {"after": "999"}, "--after: no job 999")):
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            update_all(settings, [target], Changes.of(body), ANN)
    assert waits(first) == (None, "afterok", "held") and waits(tasks[1])[0] is None and waits(job)[0] == [first]
    # A job that failed cannot be waited for to succeed, as at submit; any end of it can.
    failed = submit(settings, hold=True)
    end(settings, failed, State.FAILED)
    with pytest.raises(StateConflict, match=f"--after {failed}: job {failed} failed, so this job would never start"):
        update_all(settings, [job], Changes.of({"after": str(failed)}), ANN)
    [any_end] = update_all(settings, [job], Changes.of({"after_any": f"{failed}"}), ANN)
    assert any_end.changed == {"dependency": [f"afterok:{first}", f"afterany:{failed}"]}
    # None any more: it runs on the next pass, though the job it waited for first is still held.
    [cleared] = update_all(settings, [job], Changes.of({"dependency": "none"}), ANN)
    assert cleared.changed == {"dependency": [f"afterany:{failed}", None]} and waits(job) == (None, "afterok", None)
    Scheduler(settings).schedule_once()
    assert state_of(settings, job)[0] == State.DISPATCHED
    [started] = update_all(settings, [job], Changes.of({"after": str(first)}), ANN)
    assert started.refused == f"job {job} is dispatched; only a pending job's dependencies can be changed"
    with pytest.raises(InvalidSpec, match=re.escape("--dependency aftercorr is given at submit")):
        update_all(settings, [submit(settings, hold=True)], Changes.of({"dependency": f"aftercorr:{first}"}), ANN)
    for body, says in (({"after": "1", "dependency": "afterok:2"}, "give --dependency or --after / --after-any"),
                       ({"dependency": "afterburstbuffer:5"}, "--dependency afterburstbuffer (after a burst "
                                                              "buffer's stage-out) is not one gpuq has"),
                       ({"after": 5}, "--after must be text"), ({"after": ""}, "--after")):
        with pytest.raises(InvalidSpec, match=re.escape(says)):
            Changes.of(body)


# --- through the server and a real worker -------------------------------------------------------

@pytest.fixture(scope="module", params=["sqlite"])
def one_gpu(request, tmp_path_factory, redis_url):
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=1)


def test_a_running_jobs_lowered_time_limit_stops_it_timed_out_at_the_new_limit(one_gpu):
    s = one_gpu.settings
    job = cli_submit(s, ["--time", "1h", "--", sys.executable, "-c", "import time; time.sleep(120)"])
    assert wait_for_state(s, job, [State.RUNNING]) == State.RUNNING
    # Root (this test) may raise it; an ordinary user's raise is refused (tests/test_multiuser.py).
    raised = run_cli(["update", str(job), "--time", "2h"], s)
    assert raised.returncode == 0 and raised.stdout.strip() == f"job {job}: time limit 1:00:00 → 2:00:00"
    # `gpuq show` gives what is left of it, as squeue's TIME_LEFT: the new limit less the time run.
    elapsed = next(line for line in run_cli(["show", str(job)], s).stdout.splitlines() if "elapsed" in line)
    assert re.fullmatch(r"\s*elapsed  [0-9.]+s \(1:59:[0-5][0-9] left of its time limit\)", elapsed), elapsed
    lowered = run_cli(["update", str(job), "--time", "3s"], s)
    assert lowered.returncode == 0, lowered.stderr
    assert lowered.stdout.strip() == f"job {job}: time limit 2:00:00 → 0:00:03"
    assert wait_for_state(s, job, c.END_STATES, timeout=30) == State.TIMED_OUT, one_gpu.logs()
    assert "time limit of 0:00:03 reached" in run_cli(["why", str(job)], s).stdout
    with write_scope(s) as session:
        ran = jobs.get_job(session, job)
        assert 3 <= (ran.ended_at - ran.started_at).total_seconds() < 3 + 2 * c.CANCEL_POLL_SECONDS + 5


@pytest.fixture
def held(one_gpu):
    """A held job of the stack's, to change, cancelled after the test."""
    job = cli_submit(one_gpu.settings, ["--hold", "--", "true"])
    yield job
    run_cli(["cancel", str(job)], one_gpu.settings)


def test_update_prints_both_sides_of_a_time_limit_as_h_mm_ss_and_no_limit_as_none(one_gpu, held):
    s, job = one_gpu.settings, held
    said = [run_cli(["update", str(job), "--time", t], s) for t in ("30m", "90s", "1d", "2:30:00")]
    assert [(r.returncode, r.stdout) for r in said] == [
        (0, f"job {job}: time limit none → 0:30:00\n"), (0, f"job {job}: time limit 0:30:00 → 0:01:30\n"),
        (0, f"job {job}: time limit 0:01:30 → 24:00:00\n"), (0, f"job {job}: time limit 24:00:00 → 2:30:00\n")]
    # What it prints, `--time` takes back: the same limit, so nothing changes.
    again = run_cli(["update", str(job), "--time", "2:30:00"], s)
    assert again.stdout == f"job {job}: unchanged (it has these values already)\n"


def test_update_requeue_prints_the_change_as_show_says_it(one_gpu, held):
    s, job = one_gpu.settings, held
    made = run_cli(["update", str(job), "--requeue"], s)
    assert (made.returncode, made.stdout) == (0, f"job {job}: requeue as its retries say → yes\n"), made
    assert "requeue on a failure of its worker or GPU" in run_cli(["show", str(job)], s).stdout
    unmade = run_cli(["update", str(job), "--no-requeue"], s)
    assert unmade.stdout == f"job {job}: requeue yes → no\n", unmade
    assert "no requeue" in run_cli(["show", str(job)], s).stdout


def test_update_gpus_takes_sbatchs_type_count_and_prints_the_change(one_gpu, held):
    s, job = one_gpu.settings, held
    typed = run_cli(["update", str(job), "--gpus", "simulated:1"], s)
    assert (typed.returncode, typed.stdout) == (0, f"job {job}: GPU type any → simulated\n"), typed
    wide = run_cli(["update", str(job), "--gpus", "2"], s)  # the stack has one GPU
    assert wide.returncode == c.EXIT_USAGE and "--gpus 2 is more than any node has" in wide.stderr, wide
    assert wide.stderr.count("\n") == 1
    both = run_cli(["update", str(job), "--gpus", "a100:1", "--gpu-type", "rtx"], s)
    assert both.returncode == c.EXIT_USAGE and "name two GPU types" in both.stderr
    back = run_cli(["update", str(job), "--gpu-type", "any"], s)
    assert back.stdout == f"job {job}: GPU type simulated → any\n", back


def test_update_prints_excluded_nodes_and_dependencies_as_sbatch_writes_them():
    from gpuq.cli.control import _changed

    assert _changed({"id": 7, "changed": {"exclude_nodes": [None, ["a", "b"]], "dependency": ["afterok:5", None]}}) == (
        "job 7: excluded nodes none → a,b, dependency afterok:5 → none")


def test_update_mem_and_node_print_the_change_and_a_bad_one_is_one_line(one_gpu, held):
    s, job = one_gpu.settings, held
    both = run_cli(["update", str(job), "--mem", "512M", "--node", s.node], s)
    assert (both.returncode, both.stdout) == (0, f"job {job}: GPU memory none → 512M, node any → {s.node}\n"), both
    for args, says in ((["--node", "nowhere"], "--node nowhere: no such node is known to gpuq"),
                       (["--mem", "20X"], "--mem takes a size like 20G or 512M")):
        bad = run_cli(["update", str(job), *args], s)
        assert (bad.returncode, bad.stderr.count("\n")) == (c.EXIT_USAGE, 1) and says in bad.stderr, bad
    back = run_cli(["update", str(job), "--mem", "none", "--node", "any"], s)
    assert back.stdout == f"job {job}: GPU memory 512M → none, node {s.node} → any\n", back


def test_update_dependency_prints_sbatchs_form_a_loop_is_one_line_and_the_job_runs_after_it(one_gpu, held):
    s, job = one_gpu.settings, held
    waited = cli_submit(s, ["--hold", "--", "true"])
    try:
        given = run_cli(["update", str(job), "-d", f"afterok:{waited}"], s)
        assert (given.returncode, given.stdout) == (0, f"job {job}: dependency none → afterok:{waited}\n"), given
        assert f"after the success of job {waited}" in run_cli(["show", str(job)], s).stdout
        loop = run_cli(["update", str(waited), "--after", str(job)], s)
        assert (loop.returncode, loop.stdout) == (c.EXIT_USAGE, "")
        assert loop.stderr == (f"gpuq: --dependency afterok:{job}: job {job} waits for job {waited} already "
                               "(directly or through others), so neither would ever start\n")
        # Released, it still waits for the job it was given; that one's success starts it.
        run_cli(["release", str(job)], s)
        time.sleep(1)
        assert wait_for_state(s, job, [State.PENDING]) == State.PENDING
        run_cli(["release", str(waited)], s)
        assert wait_for_state(s, waited, c.END_STATES) == State.SUCCEEDED
        assert wait_for_state(s, job, c.END_STATES) == State.SUCCEEDED, one_gpu.logs()
        ended = run_cli(["update", str(job), "-d", "none"], s)
        assert (ended.returncode, ended.stderr) == (c.EXIT_CONFLICT,
                                                    f"gpuq: job {job} succeeded; an ended job cannot be changed\n")
    finally:
        run_cli(["cancel", str(waited)], s)


def test_a_job_waiting_for_a_whole_gpu_made_shared_runs_beside_the_shared_job_on_it(one_gpu):
    s = one_gpu.settings
    beside = cli_submit(s, ["--shared", "--mem", "1G", "--", sys.executable, "-c", "import time; time.sleep(120)"])
    assert wait_for_state(s, beside, [State.RUNNING]) == State.RUNNING
    waiting = cli_submit(s, ["--mem", "1G", "--", "true"])  # a whole GPU: it waits for the shared job's end
    time.sleep(1.5)  # three of the scheduler's passes
    assert state_of(s, waiting)[0] == State.PENDING
    made = run_cli(["update", str(waiting), "--shared"], s)
    assert (made.returncode, made.stdout) == (0, f"job {waiting}: sharing whole GPUs → shared\n"), made
    assert wait_for_state(s, waiting, c.END_STATES, timeout=30) == State.SUCCEEDED, one_gpu.logs()
    assert state_of(s, beside)[0] == State.RUNNING
    started = run_cli(["update", str(beside), "--whole"], s)
    assert started.returncode == 4 and "only a pending job's sharing can be changed" in started.stderr, started
    run_cli(["cancel", str(beside)], s)


def test_a_raised_priority_through_the_cli_runs_that_job_next(one_gpu):
    s = one_gpu.settings
    blocker = cli_submit(s, ["--", sys.executable, "-c", "import time; time.sleep(120)"])
    wait_for_state(s, blocker, [State.RUNNING])
    first = cli_submit(s, ["--name", "first", "--", "true"])
    second = cli_submit(s, ["--name", "second", "--", "true"])
    out = run_cli(["update", str(second), "--priority", "3", "--name", "urgent", "--retries", "1"], s)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"job {second}: priority 0 → 3, name second → urgent, retries 0 → 1"
    refused = run_cli(["update", str(blocker), str(first), "--priority", "2"], s)
    assert refused.returncode == c.EXIT_CONFLICT
    assert refused.stdout.strip() == f"job {first}: priority 0 → 2"
    assert refused.stderr.strip() == f"gpuq: job {blocker} is running; only a pending job's priority can be changed"
    nothing = run_cli(["update", str(first)], s)
    assert nothing.returncode == c.EXIT_USAGE and nothing.stdout == ""
    assert nothing.stderr.strip() == ("gpuq: give something to change: --priority, --time, --name, --retries, "
                                      "--array-limit, --begin, --gpus, --gpu-type, --mem, --node, --exclude, "
                                      "--shared/--whole, --requeue/--no-requeue or --dependency")
    assert run_cli(["update", "99999", "--priority", "1"], s).returncode == c.EXIT_NOT_FOUND
    assert run_cli(["cancel", str(blocker)], s).returncode == 0
    for job in (first, second):
        assert wait_for_state(s, job, c.END_STATES) == State.SUCCEEDED
    with write_scope(s) as session:
        started = {j: jobs.get_job(session, j).started_at for j in (first, second)}
    assert started[second] < started[first]


def submit_array(settings, args: list[str]) -> tuple[int, list[int]]:
    """`gpuq submit ARGS` of an array: its id and its tasks' job ids."""
    out = run_cli(["submit", *args], settings)
    found = re.match(r"submitted array (\d+): jobs (\d+)-(\d+) ", out.stdout)
    assert found, out.stdout + out.stderr
    array, first, last = map(int, found.groups())
    return array, list(range(first, last + 1))


def test_an_array_update_is_one_summary_line_counted_by_why_and_exit_4_when_no_task_could_change(one_gpu):
    s = one_gpu.settings
    done, done_ids = submit_array(s, ["--array", "0-3", "--", "true"])
    for job in done_ids:
        assert wait_for_state(s, job, c.END_STATES) == State.SUCCEEDED
    # As `gpuq hold --array` says it: one line, however many tasks (not a line each), and exit 4.
    ended = run_cli(["update", "--array", str(done), "--priority", "5"], s)
    assert (ended.returncode, ended.stdout, ended.stderr) == (
        c.EXIT_CONFLICT, f"updated 0 jobs of array {done}; not 4 succeeded\n", "")
    array, ids = submit_array(s, ["--hold", "--array", "0-2", "--", "true"])
    try:
        run_cli(["release", str(ids[0])], s)
        assert wait_for_state(s, ids[0], c.END_STATES) == State.SUCCEEDED
        some = run_cli(["update", "--array", str(array), "--priority", "5"], s)
        assert (some.returncode, some.stdout, some.stderr) == (
            0, f"updated 2 jobs of array {array}; not 1 succeeded\n", ""), some.stderr
        assert [row(s, j).priority for j in ids] == [0, 5, 5]
        # Tasks that have the values already refused nothing: as `gpuq update ID` of one, no error.
        again = run_cli(["update", "--array", str(array), "--priority", "5"], s)
        assert (again.returncode, again.stdout) == (
            0, f"updated 0 jobs of array {array}; not 2 with these values already, 1 succeeded\n"), again.stderr
        # A job named by id that refuses is an error, after the array's line.
        named = run_cli(["update", str(done_ids[0]), "--array", str(array), "--retries", "1"], s)
        assert named.returncode == c.EXIT_CONFLICT
        assert named.stdout == f"updated 2 jobs of array {array}; not 1 succeeded\n"
        assert named.stderr == f"gpuq: job {done_ids[0]} succeeded; an ended job cannot be changed\n"
    finally:
        run_cli(["cancel", "--array", str(array)], s)


def test_an_arrays_line_counts_its_tasks_refusals_by_why_without_their_job_ids():
    from gpuq.cli.control import array_changed

    refusals = [f"job {i} succeeded; an ended job cannot be changed" for i in (1, 2)] + [
        "job 3 is running; only a pending job's priority can be changed",
        "job 4 is dispatched; only root or an admin may raise a started job's time limit (you may lower it)",
        "job 5 is already held", "job 6 is running; only a pending job can be held"]
    # What the state says already is left out; who may raise a time limit is not.
    assert array_changed(7, "updated", 1_200, refusals) == (
        "updated 1,200 jobs of array 7; not 2 succeeded, 2 running, 1 dispatched: only root or an admin may raise "
        "a started job's time limit (you may lower it), 1 already held")
    assert array_changed(7, "held", 1, []) == "held 1 job of array 7"
