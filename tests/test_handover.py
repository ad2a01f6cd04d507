"""A GPU handed over on PostgreSQL (service/handover.py): a job's success, its usage summary, the
next listed job's start and the GPU's allocation passed to it, as one statement, against a real
PostgreSQL database. SQLite keeps the statements apart (tests/test_scheduling.py runs the worker's
end on both)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from gpuq.service import handover, inventory, leases, spec, submitting, usage
from gpuq.service.celery_app import queue_name
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import open_devices
from gpuq.service.models import Allocation, Job, JobUsage, NextUp, utcnow
from gpuq.workers.runner import run_job
from gpuq.workers.state import WorkerState
from tests.conftest import new_postgres_database

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def database_url(postgres_server):
    """PostgreSQL's alone: SQLite keeps a job's end and the next one's start as statements apart."""
    url, drop = new_postgres_database(postgres_server)
    yield url
    drop()


@pytest.fixture
def settings(settings):
    with write_scope(settings) as session:
        assert handover.hands_over(session)
    return settings.with_overrides(place_at_submit=False)


def _gpus(settings, count: int) -> list[int]:
    devices = open_devices(settings.with_overrides(fake_gpus=count, node="a"))
    with write_scope(settings) as session:
        return [inventory.register(session, "a", info, queue_name(settings, "a", info.index), f"gpu{info.index}@a", 1)
                for info in devices.list()]


def _submit(settings, gpus: int = 1, user: str = "ann") -> int:
    make = lambda extra: spec.command_spec(["true"], gpus=gpus, user=user)  # noqa: E731
    return submitting.submit_all(settings, spec.expand(make, spec.Scheduling(), None, []), record_code=False)[0].id


def _dispatched(settings, job_id: int, gpus: list[int]) -> None:
    """``job_id`` placed on ``gpus`` (rank 0 first), as a scheduler's pass places it."""
    with write_scope(settings) as session:
        session.add_all(Allocation(job_id=job_id, gpu_id=g, rank=r) for r, g in enumerate(gpus))
        session.execute(update(Job).where(Job.id == job_id).values(state=State.DISPATCHED, node="a"))


def _running(settings, job_id: int, gpus: list[int]) -> str:
    """``job_id`` placed on ``gpus`` and started as its worker's claim starts it; its lease token."""
    _dispatched(settings, job_id, gpus)
    with write_scope(settings) as session:
        return leases.claim(session, job_id, gpus[0], "gpu0@a", 60)[1]


def _listed(settings, gpu: int, *job_ids: int) -> None:
    with write_scope(settings) as session:
        session.add_all(NextUp(gpu_id=gpu, job_id=j, rank=r) for r, j in enumerate(job_ids))


def _hand_over(settings, job_id: int, token: str, gpu: int, summary: bool = True, session=None):
    """``end_and_take`` in a transaction of its own, or in ``session``'s (left open)."""
    now = utcnow()
    totals = usage.summary(usage.Ended(job_id, 1, now - timedelta(seconds=2), now, False, gpu_indices=(0,)),
                           usage.Totals())
    if session is None:
        with write_scope(settings) as session:
            return _hand_over(settings, job_id, token, gpu, summary, session)
    ended, taken = handover.end_and_take(
        session, job_id=job_id, token=token, now=now, exit_code=0, result=None, reason=None,
        summary=totals if summary else None, gpu_id=gpu, worker="gpu0@a", node="a", lease_s=60)
    return ended, (taken[0] if taken is not None else None)


def _held(settings) -> list[tuple[int, int]]:
    with write_scope(settings) as session:
        return sorted(tuple(r) for r in session.execute(select(Allocation.gpu_id, Allocation.job_id)))


def _states(settings, *job_ids: int) -> list[str]:
    with write_scope(settings) as session:
        return [session.get(Job, j).state for j in job_ids]


def test_a_success_hands_its_gpu_to_the_first_waiting_listed_job_with_its_summary_in_one_statement(settings):
    gpu = _gpus(settings, 1)[0]
    ending, held_back, following, last = (_submit(settings) for _ in range(4))
    token = _running(settings, ending, [gpu])
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == held_back).values(held=True))
    _listed(settings, gpu, held_back, following, last)
    with write_scope(settings) as session:
        row = session.scalar(select(Allocation.id).where(Allocation.gpu_id == gpu))
    ended, taken = _hand_over(settings, ending, token, gpu)
    assert ended and taken.id == following and taken.user == "ann" and taken.argv == ["true"]
    assert _states(settings, ending, held_back, following, last) == [
        State.SUCCEEDED, State.PENDING, State.RUNNING, State.PENDING]
    # The allocation row itself passed over: the GPU was never free for a scheduler to give out.
    assert _held(settings) == [(gpu, following)]
    with write_scope(settings) as session:
        assert session.scalar(select(Allocation.id).where(Allocation.gpu_id == gpu)) == row
        job = session.get(Job, following)
        assert job.worker == "gpu0@a" and job.node == "a" and job.lease_token is not None
        assert job.started_at == job.dispatched_at == session.get(Job, ending).ended_at
        assert session.get(JobUsage, ending).wall_s == pytest.approx(2.0)
        assert session.get(JobUsage, ending).gpu_indices == [0]  # what `gpuq show` tells of it now
        assert session.get(JobUsage, following) is None


def test_an_end_whose_lease_was_lost_writes_nothing_and_takes_nothing(settings):
    gpu = _gpus(settings, 1)[0]
    ending, following = _submit(settings), _submit(settings)
    _running(settings, ending, [gpu])
    _listed(settings, gpu, following)
    assert _hand_over(settings, ending, "another worker's token", gpu) == (False, None)
    assert _states(settings, ending, following) == [State.RUNNING, State.PENDING]
    assert _held(settings) == [(gpu, ending)]
    with write_scope(settings) as session:
        assert session.get(JobUsage, ending) is None


def test_with_nothing_listed_that_may_start_the_job_ends_and_its_gpu_is_freed(settings):
    gpu = _gpus(settings, 1)[0]
    ending, cancelled = _submit(settings), _submit(settings)
    token = _running(settings, ending, [gpu])
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == cancelled).values(state=State.CANCELLED))
    _listed(settings, gpu, cancelled)
    assert _hand_over(settings, ending, token, gpu, summary=False) == (True, None)
    assert _states(settings, ending, cancelled) == [State.SUCCEEDED, State.CANCELLED]
    assert _held(settings) == []


@pytest.mark.parametrize("how", ["drained", "also held"])
def test_a_drained_gpu_or_one_another_job_also_holds_takes_nothing_and_the_ended_jobs_hold_goes(settings, how):
    gpu = _gpus(settings, 1)[0]
    ending, following, sharer = (_submit(settings) for _ in range(3))
    token = _running(settings, ending, [gpu])
    _listed(settings, gpu, following)
    with write_scope(settings) as session:
        if how == "drained":
            inventory.drain_gpu(session, gpu, "maintenance")
        else:  # a share beside the whole job (no placement makes one): the GPU is not the ended job's alone
            session.add(Allocation(job_id=sharer, gpu_id=gpu, rank=0, share_mib=1024))
    assert _hand_over(settings, ending, token, gpu) == (True, None)
    assert _states(settings, ending, following) == [State.SUCCEEDED, State.PENDING]
    assert _held(settings) == ([] if how == "drained" else [(gpu, sharer)])


def test_a_job_of_two_gpus_hands_over_the_gpu_of_its_worker_and_frees_the_other(settings):
    first, second = _gpus(settings, 2)
    ending, following = _submit(settings, gpus=2), _submit(settings)
    token = _running(settings, ending, [first, second])
    _listed(settings, first, following)
    ended, taken = _hand_over(settings, ending, token, first)
    assert ended and taken.id == following
    assert _held(settings) == [(first, following)]


def test_two_gpus_handed_over_at_once_from_lists_that_share_jobs_take_different_ones_without_waiting(settings):
    # A node's GPUs list the same jobs, and their workers end and take at once: the second passes
    # over the job the first one's open transaction is taking (SKIP LOCKED) instead of waiting.
    import threading

    gpus = _gpus(settings, 2)
    ending = [_submit(settings) for _ in gpus]
    tokens = [_running(settings, job, [gpu]) for job, gpu in zip(ending, gpus, strict=True)]
    listed = [_submit(settings) for _ in range(3)]
    for gpu in gpus:
        _listed(settings, gpu, *listed)
    got = {}
    with write_scope(settings) as first:
        got[gpus[0]] = _hand_over(settings, ending[0], tokens[0], gpus[0], session=first)[1].id  # left open

        def second() -> None:
            got[gpus[1]] = _hand_over(settings, ending[1], tokens[1], gpus[1])[1].id

        other = threading.Thread(target=second)
        other.start()
        other.join(10)
        assert not other.is_alive(), "the second handover waited for the first one's transaction"
    assert got == {gpus[0]: listed[0], gpus[1]: listed[1]}
    assert _states(settings, *ending, *listed) == [State.SUCCEEDED] * 2 + [State.RUNNING] * 2 + [State.PENDING]
    assert _held(settings) == [(gpus[0], listed[0]), (gpus[1], listed[1])]


def test_a_summary_the_database_refuses_fails_the_whole_statement(settings):
    gpu = _gpus(settings, 1)[0]
    ending, following = _submit(settings), _submit(settings)
    token = _running(settings, ending, [gpu])
    _listed(settings, gpu, following)
    with write_scope(settings) as session:
        session.add(JobUsage(job_id=ending, wall_s=-1.0, gpu_hours=0.0, idle_s=0.0, samples=0))
    with pytest.raises(IntegrityError):
        _hand_over(settings, ending, token, gpu)
    assert _states(settings, ending, following) == [State.RUNNING, State.PENDING]
    assert _held(settings) == [(gpu, ending)]


def test_the_workers_end_on_postgresql_goes_through_the_handover(settings, monkeypatch):
    # The worker's own end path (workers/end.py) chooses the one statement for a whole job's
    # success: each of three jobs ends and starts the next through it, the last finding none.
    gpu = _gpus(settings, 1)[0]
    ids = [_submit(settings, user=spec.current_user()) for _ in range(3)]  # a root worker runs a job as its owner
    _dispatched(settings, ids[0], [gpu])
    _listed(settings, gpu, *ids[1:])
    calls = []
    real = handover.end_and_take
    monkeypatch.setattr(handover, "end_and_take", lambda *a, **k: calls.append(k["job_id"]) or real(*a, **k))
    state = WorkerState(settings=settings, node="a", gpu_index=0, gpu_id=gpu, name="gpu0@a")
    assert run_job(state, ids[0]) == State.SUCCEEDED
    assert calls == ids
    assert _states(settings, *ids) == [State.SUCCEEDED] * 3 and _held(settings) == []
