"""What the SQL claim guarantees, tested on the plain functions under the Celery task: a job runs
at most once, only on the GPU it was dispatched to, and a GPU is never allocated twice."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from gpuq.service import constants as c
from gpuq.service import inventory, jobs, leases, lifecycle, spec, submitting
from gpuq.service.celery_app import make_app, queue_name
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import open_devices
from gpuq.service.models import Allocation, EarlierAttempt, Gpu, Job, utcnow
from gpuq.service.scheduler import Scheduler
from gpuq.workers.runner import run_job
from gpuq.workers.state import WorkerState


@pytest.fixture
def settings(settings):
    """Jobs here are placed by the scheduler's passes, which the tests run themselves."""
    return settings.with_overrides(place_at_submit=False)


def register_gpus(settings) -> list[int]:
    ids = []
    with write_scope(settings) as session:
        for info in open_devices(settings).list():
            q = queue_name(settings, settings.node, info.index)
            ids.append(inventory.register(session, settings.node, info, q, f"gpu{info.index}@{settings.node}", 1))
    return ids


def dispatched_command(settings, argv, cwd) -> int:
    """A command job, placed and dispatched by a real scheduler pass (message sent to Redis)."""
    job = submitting.submit(settings, spec.command_spec(argv, cwd=str(cwd)))
    placements = Scheduler(settings).schedule_once()
    assert [p.job_id for p in placements] == [job.id]
    return job.id


def worker(settings, gpu_id: int, index: int) -> WorkerState:
    return WorkerState(settings=settings, node=settings.node, gpu_index=index, gpu_id=gpu_id, name=f"gpu{index}@t")


def test_a_message_delivered_twice_runs_the_job_once(settings, tmp_path):
    register_gpus(settings)
    runs = tmp_path / "runs"
    job_id = dispatched_command(settings, [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x')"], tmp_path)
    with write_scope(settings) as session:
        rank0 = jobs.job_gpus(session, job_id)[0]
    state = worker(settings, rank0.id, rank0.index)
    assert run_job(state, job_id) == State.SUCCEEDED
    assert run_job(state, job_id) is None
    assert runs.read_text() == "x"


def test_a_message_reaching_another_gpus_worker_is_dropped(settings, tmp_path):
    gpu_ids = register_gpus(settings)
    job_id = dispatched_command(settings, ["true"], tmp_path)
    with write_scope(settings) as session:
        mine = jobs.job_gpus(session, job_id)[0].id
    other = next(g for g in gpu_ids if g != mine)
    assert run_job(worker(settings, other, 9), job_id) is None
    with write_scope(settings) as session:
        assert jobs.get_job(session, job_id).state == State.DISPATCHED


def test_a_message_for_a_job_that_does_not_exist_changes_nothing(settings):
    gpu_ids = register_gpus(settings)
    assert run_job(worker(settings, gpu_ids[0], 0), 424242) is None


def test_a_message_for_a_cancelled_job_does_not_start_it(settings, tmp_path):
    register_gpus(settings)
    job_id = dispatched_command(settings, ["true"], tmp_path)
    assert jobs.cancel(settings, job_id).state == State.CANCELLED
    with write_scope(settings) as session:
        gpus = session.scalars(select(Gpu)).all()
        assert jobs.job_gpus(session, job_id) == []
    for g in gpus:
        assert run_job(worker(settings, g.id, g.index), job_id) is None


def test_the_database_refuses_to_allocate_one_gpu_to_two_jobs(settings, tmp_path):
    gpu_ids = register_gpus(settings)
    with pytest.raises(IntegrityError):
        with write_scope(settings) as session:
            a = Job(name="a", user="u", kind=c.KIND_COMMAND, argv=["true"], cwd="/", gpus=1, params={})
            b = Job(name="b", user="u", kind=c.KIND_COMMAND, argv=["true"], cwd="/", gpus=1, params={})
            session.add_all([a, b])
            session.flush()
            session.add_all([Allocation(job_id=a.id, gpu_id=gpu_ids[0], rank=0),
                             Allocation(job_id=b.id, gpu_id=gpu_ids[0], rank=0)])


def test_the_scheduler_sends_one_message_with_only_the_job_id_to_the_gpus_own_queue(settings, tmp_path):
    import json

    from gpuq.service import broker

    register_gpus(settings)
    job_id = dispatched_command(settings, ["true"], tmp_path)
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job_id)[0]
        assert jobs.get_job(session, job_id).state == State.DISPATCHED
    r = broker.client(settings)
    messages = r.lrange(gpu.queue, 0, -1)
    r.delete(gpu.queue)
    assert len(messages) == 1
    envelope = json.loads(messages[0])
    assert envelope["content-type"] == "application/json"
    assert envelope["headers"]["task"] == c.RUN_JOB_TASK
    body = json.loads(__import__("base64").b64decode(envelope["body"]))
    assert body[0] == [job_id] and body[1] == {}


def expire_lease(settings, job_id):
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow().replace(year=2000)))


def test_a_running_job_whose_lease_ran_out_fails_as_worker_lost(settings, tmp_path):
    register_gpus(settings)
    job_id = dispatched_command(settings, ["true"], tmp_path)
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job_id)[0]
        assert leases.claim(session, job_id, gpu.id, "gpu@t", 30)
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        assert jobs.get_job(session, job_id).state == State.RUNNING  # its lease still holds
    expire_lease(settings, job_id)
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        job = jobs.get_job(session, job_id)
        assert job.state == State.FAILED and job.reason.startswith("worker lost")
        assert job.failure == c.FAILURE_WORKER_LOST
        assert jobs.job_gpus(session, job_id) == []


def test_only_the_lease_holder_may_end_a_running_job(settings, tmp_path):
    register_gpus(settings)
    job_id = dispatched_command(settings, ["true"], tmp_path)
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job_id)[0]
        claimed = leases.claim(session, job_id, gpu.id, "gpu@t", 30)
        assert claimed and leases.claim(session, job_id, gpu.id, "gpu@t", 30) is None  # a second claim fails
        row, token = claimed  # the claim returns the row it started: what the worker runs
        assert (row.id, row.argv, row.gpus, row.shared) == (job_id, ["true"], 1, False) and row.started_at
    with write_scope(settings) as session:
        assert not lifecycle.end_attempt(session, job_id, State.SUCCEEDED, token="0" * 32)
        assert not leases.renew(session, job_id, "0" * 32, 30)
        assert leases.renew(session, job_id, token, 30)
    with write_scope(settings) as session:
        assert lifecycle.end_attempt(session, job_id, State.SUCCEEDED, token=token)
        assert not lifecycle.end_attempt(session, job_id, State.SUCCEEDED, token=token)  # once
        assert jobs.get_job(session, job_id).state == State.SUCCEEDED


def test_worker_lost_requeues_without_using_a_retry_and_stops_at_the_cap(settings, tmp_path):
    settings = settings.with_overrides(max_requeues=2)
    register_gpus(settings)
    job = submitting.submit(settings, replace(spec.command_spec(["true"], gpus=1, cwd=str(tmp_path)), max_retries=1))
    scheduler = Scheduler(settings)
    for lap in range(3):
        scheduler.schedule_once()
        with write_scope(settings) as session:
            gpu = jobs.job_gpus(session, job.id)[0]
            assert leases.claim(session, job.id, gpu.id, f"gpu@t{lap}", 30)
        expire_lease(settings, job.id)
        with write_scope(settings) as session:
            leases.reap(session, settings)
        with write_scope(settings) as session:
            j = jobs.get_job(session, job.id)
            if lap < 2:
                assert j.state == State.PENDING and j.requeues == lap + 1
                assert j.reason.startswith(f"requeue {lap + 1} of at most 2 after: worker lost")
            else:
                assert j.state == State.FAILED and j.failure == c.FAILURE_WORKER_LOST
                assert "requeued 2 times already: the cap" in j.reason
            # Requeues are not the job's own retries: that one is still unused.
            assert all(a["requeue"] for a in j.attempts)
            # Each requeued attempt's row says why, with no CPU seconds: no worker reaped its command.
            assert session.execute(select(EarlierAttempt.cause, EarlierAttempt.cpu_s)
                                   .where(EarlierAttempt.job_id == job.id)).all() == [("worker_lost", None)] * min(
                                       lap + 1, 2)


@pytest.mark.parametrize("retries,requeue,again", [
    (0, None, False),  # no word: as its retries say (none: it ends)
    (1, None, True),
    (0, True, True),  # --requeue: back in the queue with no retries asked for
    (2, False, False),  # --no-requeue: ends, its retries kept for failures of its own
])
def test_a_jobs_own_word_on_requeue_decides_whether_a_lost_worker_puts_it_back(settings, tmp_path, retries, requeue,
                                                                               again):
    register_gpus(settings)
    job = submitting.submit(settings, replace(spec.command_spec(["true"], gpus=1, cwd=str(tmp_path)),
                                              max_retries=retries, requeue=requeue))
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job.id)[0]
        assert leases.claim(session, job.id, gpu.id, "gpu@t", 30)
    expire_lease(settings, job.id)
    with write_scope(settings) as session:
        leases.reap(session, settings)
    with write_scope(settings) as session:
        j = jobs.get_job(session, job.id)
        assert j.requeue is requeue
        if again:
            assert (j.state, j.requeues, j.attempts[0]["requeue"]) == (State.PENDING, 1, True)
            assert j.reason.startswith("requeue 1 of at most ")
        else:
            assert (j.state, j.failure, j.requeues) == (State.FAILED, c.FAILURE_WORKER_LOST, 0)
            assert "the cap" not in j.reason


@pytest.mark.parametrize("site,asked,kept", [
    ("retries", None, None), ("yes", None, True), ("no", None, False),
    ("yes", False, False), ("no", True, True),  # a job's own word over the site's
])
def test_a_job_without_a_word_on_requeue_gets_the_sites_and_keeps_it(settings, tmp_path, site, asked, kept):
    from gpuq.server.submission import _fields, specs_of
    from gpuq.service.rights import Caller

    site_settings = settings.with_overrides(requeue=site)
    body = {"command": ["true"], "cwd": str(tmp_path), **({"requeue": asked} if asked is not None else {})}
    [made] = specs_of(site_settings, Caller.of_uid(0), _fields(body))
    assert made.requeue is kept
    # An allocation's shell is never requeued, whatever the site's word.
    [alloc] = specs_of(site_settings, Caller.of_uid(0), _fields({"interactive": True, "node": "n", "cwd": "/"}))
    assert alloc.requeue is None


def test_an_allocation_is_never_requeued_and_a_submit_field_of_the_wrong_type_is_refused():
    from gpuq.server.submission import _allocation, _fields
    from gpuq.service.errors import InvalidSpec

    # Its shell runs in the user's terminal: nothing could run it again.
    with pytest.raises(InvalidSpec, match=r"^an allocation \(gpuq alloc\) takes no --requeue$"):
        _allocation(_fields({"requeue": True, "node": "n", "interactive": True}), "ann", None)
    with pytest.raises(InvalidSpec, match="^submit field 'requeue' must be bool$"):
        _fields({"requeue": "yes"})


def test_a_job_cancelled_while_its_worker_is_lost_ends_cancelled_and_never_runs_again(settings, tmp_path):
    # `gpuq cancel` of a job whose worker had died (or hung) printed "cancelling"; the reaper then
    # requeued it as worker_lost with the cancel cleared, and it ran again elsewhere.
    settings = settings.with_overrides(max_requeues=2)
    register_gpus(settings)
    job = submitting.submit(settings, replace(spec.command_spec(["true"], gpus=1, cwd=str(tmp_path), user="ann"),
                                              max_retries=1))
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job.id)[0]
        assert leases.claim(session, job.id, gpu.id, "gpu@t", 30)
    assert jobs.cancel(settings, job.id, user="ann").state == c.CANCELLING  # asked of a worker that is gone
    expire_lease(settings, job.id)
    with write_scope(settings) as session:
        leases.reap(session, settings)
    with write_scope(settings) as session:
        j = jobs.get_job(session, job.id)
        assert (j.state, j.failure) == (State.CANCELLED, c.FAILURE_CANCELLED)
        assert j.reason.startswith("cancelled by ann (worker lost"), j.reason
        assert j.attempts == [] and j.requeues == 0 and jobs.job_gpus(session, job.id) == []
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        assert jobs.get_job(session, job.id).state == State.CANCELLED


def test_a_waiting_job_cancelled_by_an_admin_names_them(settings, tmp_path):
    job = submitting.submit(settings, spec.command_spec(["true"], gpus=1, cwd=str(tmp_path), user="ann"))
    jobs.cancel(settings, job.id, user="root")
    with write_scope(settings) as session:
        assert jobs.get_job(session, job.id).reason == "cancelled by root"


def test_celery_is_configured_for_one_late_acked_json_job_at_a_time(settings):
    conf = make_app(settings).conf
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert conf.worker_prefetch_multiplier == 1 and conf.worker_concurrency == 1
    assert conf.task_acks_late is True


def test_a_rank_message_runs_only_for_a_running_job_holding_that_gpu_at_that_rank(settings, tmp_path):
    from gpuq.workers.ranks import run_rank

    register_gpus(settings)
    job = submitting.submit(settings, spec.workload_spec("train", ["--strategy", "ddp", "--epochs", "1"], gpus=2))
    Scheduler(settings).schedule_once()
    with write_scope(settings) as session:
        g0, g1 = jobs.job_gpus(session, job.id)
    # Dispatched, not yet running: no rank may start.
    assert run_rank(worker(settings, g1.id, g1.index), job.id, 1) is False
    with write_scope(settings) as session:
        assert leases.claim(session, job.id, g0.id, "gpu@t", 30)
    # Running, but rank 0 has not set where the ranks meet yet.
    assert run_rank(worker(settings, g1.id, g1.index), job.id, 1) is False
    with write_scope(settings) as session:
        jobs.set_rendezvous(session, job.id, "tcp://127.0.0.1:1")
        assert jobs.rank_to_run(session, job.id, g1.id, 1) is not None
        assert jobs.rank_to_run(session, job.id, g0.id, 1) is None  # wrong GPU for rank 1
        assert jobs.rank_to_run(session, job.id, g1.id, 2) is None  # no such rank
        assert jobs.rank_to_run(session, job.id, g0.id, 0) is None  # rank 0 is the job itself


@pytest.mark.parametrize("requeue,by", [(None, "token"), (True, "token"), (False, "token"), (False, "reaper")])
def test_a_preempted_job_is_requeued_unless_it_said_no_requeue_then_it_ends_as_preempted(settings, tmp_path, requeue,
                                                                                         by):
    from gpuq.service.display import preempted_by

    register_gpus(settings)
    job = submitting.submit(settings, replace(spec.command_spec(["true"], gpus=1, cwd=str(tmp_path)),
                                              preemptible=True, requeue=requeue))
    Scheduler(settings).schedule_once()
    reason = preempted_by(99, "alice")
    with write_scope(settings) as session:
        gpu = jobs.job_gpus(session, job.id)[0]
        _, token = leases.claim(session, job.id, gpu.id, "gpu@t", 30)
        assert session.execute(lifecycle.ASK_TO_PREEMPT, {"job_id": job.id, "now": utcnow(),
                                                          "reason": reason}).rowcount == 1
    if by == "reaper":  # its worker died while it stopped: the lease ran out
        expire_lease(settings, job.id)
        with write_scope(settings) as session:
            leases.reap(session, settings)
    else:
        with write_scope(settings) as session:
            assert lifecycle.end_attempt(session, job.id, State.CANCELLED, token=token, failure=c.FAILURE_CANCELLED,
                                         exit_code=143, reason="cancelled")
    with write_scope(settings) as session:
        j = jobs.get_job(session, job.id)
        assert jobs.job_gpus(session, job.id) == []
        if requeue is False:
            # As SLURM's PreemptMode=REQUEUE cancels a job it may not requeue: ended, never run again.
            assert (j.state, j.failure, j.requeues, j.attempts) == (State.CANCELLED, c.FAILURE_PREEMPTED, 0, [])
            assert j.reason == f"{reason}, not requeued (no requeue)"
        else:
            assert (j.state, j.requeues, [(a["state"], a["requeue"]) for a in j.attempts]) == (
                State.PENDING, 0, [("preempted", True)])
            assert j.reason == reason
