"""Jobs their client keeps (service/kept_jobs.py): only a kept job is kept alive, by its owner (or
an admin, or root) alone; a waiting one whose client fell silent is cancelled as client_lost by the
scheduler's pass, with the words of its client's command, and one heard from in time is left."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import update

from gpuq.service import allocations, broker, kept_jobs, spec, submitting
from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.errors import NotAllowed, StateConflict
from gpuq.service.jobs import get_job
from gpuq.service.models import Job, utcnow
from gpuq.service.rights import Caller
from tests.test_scheduling import register

pytestmark = pytest.mark.timeout(60)

ANN, BOB = Caller(5001, "ann"), Caller(5002, "bob")


def submitted(settings, kept: bool, **fields) -> int:
    made = replace(spec.command_spec(["true"], user="ann"), kept=kept, **fields)
    return submitting.submit_all(settings, [made])[0].id


def heard_at(settings, job_id: int, seconds_ago: float) -> None:
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id)
                        .values(keepalive_at=utcnow() - timedelta(seconds=seconds_ago)))


def server_up(settings, seconds: float | None) -> None:
    """The server's word in Redis, as it says it: up for ``seconds``; None: it is not up."""
    conn = broker.shared(settings)
    kept_jobs.beat(conn, settings, None if seconds is None else time.time() - seconds)


def row(settings, job_id: int) -> Job:
    with write_scope(settings) as session:
        job = get_job(session, job_id)
        session.expunge(job)
    return job


def test_only_a_kept_job_is_kept_alive_and_only_by_its_owner(settings):
    kept, plain = submitted(settings, True, held=True), submitted(settings, False, held=True)
    heard_at(settings, kept, 20)
    held = allocations.keep_alive(settings, kept, ANN)
    assert (held.state, held.keepalive_s, held.run_id, held.gpu_indices) == (c.State.PENDING,
                                                                            settings.alloc_keepalive / 3, "", [])
    assert not kept_jobs.lapsed(settings, row(settings, kept).keepalive_at)
    assert (utcnow() - row(settings, kept).keepalive_at).total_seconds() < 5
    with pytest.raises(NotAllowed, match=f"job {kept} is ann's; only they or an admin may keep it alive"):
        allocations.keep_alive(settings, kept, BOB)
    allocations.keep_alive(settings, kept, Caller(0, "root"))
    with pytest.raises(StateConflict, match=f"job {plain} is not kept by a client"):
        allocations.keep_alive(settings, plain, ANN)
    assert row(settings, plain).keepalive_at is None


def test_a_waiting_kept_job_whose_client_fell_silent_is_cancelled_as_client_lost(settings):
    silent, heard, plain = (submitted(settings, True, held=True), submitted(settings, True, held=True),
                            submitted(settings, False, held=True))
    heard_at(settings, silent, settings.alloc_keepalive + 5)
    heard_at(settings, heard, settings.alloc_keepalive - 5)
    # Not while the server is away (its clients cannot speak), nor before it was up that long.
    for up in (None, settings.alloc_keepalive - 1):
        server_up(settings, up)
        with write_scope(settings) as session:
            assert kept_jobs.abandon_waiting(session, settings, utcnow()) == 0
    server_up(settings, settings.alloc_keepalive + 10)
    with write_scope(settings) as session:
        assert kept_jobs.abandon_waiting(session, settings, utcnow()) == 1
    gone = row(settings, silent)
    assert (gone.state, gone.failure, gone.reason) == (c.State.CANCELLED, c.FAILURE_CLIENT_LOST,
                                                       "its client (gpuq run) stopped answering while it waited")
    assert gone.ended_at is not None
    assert row(settings, heard).state == row(settings, plain).state == c.State.PENDING


def test_a_client_is_gone_once_silent_past_the_setting_while_its_server_was_up_and_not_before(settings):
    now, limit = utcnow(), settings.alloc_keepalive
    long_ago = now - timedelta(seconds=limit + 1)
    server_up(settings, limit + 60)
    assert kept_jobs.lapsed(settings, None, now)  # never heard from
    assert not kept_jobs.lapsed(settings, now - timedelta(seconds=limit - 1), now)
    assert kept_jobs.lapsed(settings, long_ago, now)
    server_up(settings, None)  # the server away: its clients could not speak
    assert not kept_jobs.lapsed(settings, long_ago, now) and not kept_jobs.lapsed(settings, None, now)
    server_up(settings, limit - 2)  # back since: the whole setting again, from its start
    assert not kept_jobs.lapsed(settings, long_ago, now)
    assert kept_jobs.lost_reason(settings, c.KIND_INTERACTIVE).startswith("its client (gpuq alloc) was not heard")


def test_a_run_lets_go_of_its_job_once_its_owner_asks_but_an_allocation_or_an_ended_job_cannot_be(settings):
    from gpuq.service.jobs import cancel

    kept = submitted(settings, True, held=True)
    with pytest.raises(NotAllowed, match=f"job {kept} is ann's"):
        kept_jobs.let_go(settings, kept, BOB)
    kept_jobs.let_go(settings, kept, ANN)
    assert row(settings, kept).keepalive_at is None
    with pytest.raises(StateConflict, match="is not kept by a client"):  # nothing keeps it alive from now on
        allocations.keep_alive(settings, kept, ANN)
    kept_jobs.let_go(settings, kept, ANN)  # again: nothing to let go of
    register(settings, "a", 1)
    alloc = submitting.submit_all(settings, [replace(spec.interactive_spec(None, node="a", user="ann", run_id="r"),
                                                     held=True)])[0].id
    with pytest.raises(StateConflict, match=f"allocation {alloc} lives only while its client does"):
        kept_jobs.let_go(settings, alloc, ANN)
    cancel(settings, kept, ANN)
    with pytest.raises(StateConflict, match=f"job {kept} cancelled; nothing keeps it"):
        kept_jobs.let_go(settings, kept, ANN)


def test_a_run_resumed_keeps_its_job_again_once_its_owner_asks_but_not_an_ended_job_nor_an_arrays_task(settings):
    from gpuq.service.jobs import cancel

    kept = submitted(settings, True, held=True)
    kept_jobs.let_go(settings, kept, ANN)
    with pytest.raises(NotAllowed, match=f"job {kept} is ann's"):
        allocations.keep_alive(settings, kept, BOB, again=True)
    assert row(settings, kept).keepalive_at is None
    allocations.keep_alive(settings, kept, ANN, again=True)
    assert row(settings, kept).keepalive_at is not None
    allocations.keep_alive(settings, kept, ANN)  # its client's word counts again
    task = submitting.submit_all(settings, [replace(spec.command_spec(["true"], user="ann"), held=True,
                                                    array_index=i) for i in range(2)])[0].id
    with pytest.raises(StateConflict, match=f"job {task} is a task of array {task}"):
        allocations.keep_alive(settings, task, ANN, again=True)
    assert row(settings, task).keepalive_at is None
    cancel(settings, kept, ANN)
    with pytest.raises(StateConflict, match=f"job {kept} cancelled; nothing to keep"):
        allocations.keep_alive(settings, kept, ANN, again=True)


def test_a_runs_watch_stops_its_job_once_its_client_lapsed_and_a_gangs_other_rank_leaves_that_to_rank_0(settings):
    import threading

    from gpuq.workers.watch import StopWatcher

    job_id = submitted(settings, True)
    with write_scope(settings) as session:  # running, as a worker's claim leaves it
        session.execute(update(Job).where(Job.id == job_id).values(state=c.State.RUNNING, started_at=utcnow()))

    def look(rank: bool) -> str:
        watcher = StopWatcher(settings, job_id, threading.Event(), rank=rank)
        watcher.look()
        return watcher.why

    assert look(False) == look(True) == ""  # heard from at its submit
    heard_at(settings, job_id, settings.alloc_keepalive + 1)
    server_up(settings, None)
    assert look(False) == ""  # silent while the server was away: not judged
    server_up(settings, settings.alloc_keepalive + 60)
    assert (look(False), look(True)) == (c.FAILURE_CLIENT_LOST, "")
