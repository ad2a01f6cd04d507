"""The `/metrics` histograms kept between scrapes (server/histograms.py), on both databases: what the
server sums once for the jobs long ended, plus what it reads afresh, is always what summing every
job would give, as jobs start and end and the line of settled jobs moves."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from gpuq.server.histograms import SETTLE, Settled
from gpuq.service import constants as c
from gpuq.service import spec, submitting
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.models import EarlierAttempt, Job, JobUsage, utcnow

pytestmark = pytest.mark.timeout(120)

BOUNDS = [1.0, 10.0, 60.0, 600.0]


def job(settings, *, submitted: datetime, started: datetime | None, ended: datetime | None,
        state: str = State.SUCCEEDED) -> int:
    made = submitting.submit(settings, spec.command_spec(["true"], cwd="/", user="ann"))
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == made.id).values(
            state=state, submitted_at=submitted, started_at=started, ended_at=ended))
    return made.id


def expected(settings, kind: str) -> dict:
    """The histogram summed from every job in Python, as /metrics summed it before."""
    with write_scope(settings) as session:
        rows = session.execute(select(Job.state, Job.submitted_at, Job.started_at, Job.ended_at)).all()
    if kind == "wait":
        values = [(start - sub).total_seconds() for _, sub, start, _ in rows if start is not None]
    else:
        values = [(end - start).total_seconds() for state, _, start, end in rows
                  if start is not None and end is not None and state in c.END_STATES]
    return {"le": BOUNDS, "counts": [sum(1 for v in values if v <= b) for b in BOUNDS], "count": len(values),
            "sum": pytest.approx(sum(values))}


def scrape(settings, settled: Settled, now: datetime) -> tuple[dict, dict]:
    with write_scope(settings) as session:
        return (settled.histogram(session, "wait", BOUNDS, now), settled.histogram(session, "duration", BOUNDS, now))


def test_the_settled_sums_and_the_fresh_ones_are_always_what_every_job_sums_to(settings):
    now = utcnow()
    ago = lambda **kw: now - timedelta(**kw)  # noqa: E731
    job(settings, submitted=ago(hours=3), started=ago(hours=3) + timedelta(seconds=5), ended=ago(hours=2))
    job(settings, submitted=ago(hours=2), started=ago(hours=2) + timedelta(seconds=0.5), ended=ago(hours=1),
        state=State.FAILED)
    running = job(settings, submitted=ago(minutes=3), started=ago(minutes=2), ended=None, state=State.RUNNING)
    job(settings, submitted=ago(minutes=1), started=None, ended=None, state=State.PENDING)
    job(settings, submitted=ago(hours=5), started=None, ended=ago(hours=4), state=State.CANCELLED)  # never ran
    settled = Settled()
    assert scrape(settings, settled, now) == (expected(settings, "wait"), expected(settings, "duration"))
    line = settled.lines[("duration", tuple(BOUNDS))]
    assert line.upto == now - SETTLE and line.sums.count == 2  # the two long ended, summed once

    # The running job ends, another starts and ends, one ends whose end was written a few minutes
    # late (inside SETTLE): each is counted by the next scrape.
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == running).values(state=State.SUCCEEDED, ended_at=now))
    job(settings, submitted=now, started=now + timedelta(seconds=20), ended=now + timedelta(seconds=700))
    job(settings, submitted=ago(minutes=9), started=ago(minutes=8), ended=ago(minutes=6))
    later = now + timedelta(seconds=30)
    assert scrape(settings, settled, later) == (expected(settings, "wait"), expected(settings, "duration"))

    # Hours later the line has moved past them all: they are settled sums now, and still counted once.
    hours = now + timedelta(hours=2)
    assert scrape(settings, settled, hours) == (expected(settings, "wait"), expected(settings, "duration"))
    assert settled.lines[("duration", tuple(BOUNDS))].sums.count == 5
    # A server started now sums the same from nothing.
    assert scrape(settings, Settled(), hours) == (expected(settings, "wait"), expected(settings, "duration"))


def test_other_bounds_are_summed_on_their_own_and_only_a_few_sets_are_kept(settings):
    now = utcnow()
    job(settings, submitted=now - timedelta(hours=2), started=now - timedelta(hours=2), ended=now - timedelta(hours=1))
    settled = Settled()
    with write_scope(settings) as session:
        for top in range(12):
            h = settled.histogram(session, "duration", [float(top + 1), 7200.0], now)
            assert h["counts"] == [0, 1] and h["count"] == 1
    assert len(settled.lines) == 8


def every_job_by_state_and_user(settings) -> dict:
    with write_scope(settings) as session:
        return {(s, u): n for s, u, n in session.execute(select(Job.state, Job.user, func.count())
                                                         .group_by(Job.state, Job.user))}


def counted(settings, settled: Settled, now: datetime) -> dict:
    with write_scope(settings) as session:
        return settled.jobs(session, now)


def test_the_jobs_by_state_and_user_are_always_what_counting_every_job_gives(settings):
    now = utcnow()
    ago = lambda **kw: now - timedelta(**kw)  # noqa: E731
    job(settings, submitted=ago(hours=3), started=ago(hours=3), ended=ago(hours=2))
    job(settings, submitted=ago(hours=3), started=ago(hours=3), ended=ago(hours=2), state=State.FAILED)
    running = job(settings, submitted=ago(minutes=3), started=ago(minutes=2), ended=None, state=State.RUNNING)
    job(settings, submitted=ago(minutes=1), started=None, ended=None, state=State.PENDING)
    settled = Settled()
    assert counted(settings, settled, now) == every_job_by_state_and_user(settings)
    assert settled.kept["jobs"].sums == {(State.SUCCEEDED, "ann"): 1, (State.FAILED, "ann"): 1}
    # The running job ends and one more ends late (inside SETTLE); then the line passes them all.
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == running).values(state=State.TIMED_OUT, ended_at=now))
    job(settings, submitted=ago(minutes=9), started=ago(minutes=8), ended=ago(minutes=6))
    for when in (now + timedelta(seconds=30), now + timedelta(hours=2)):
        assert counted(settings, settled, when) == every_job_by_state_and_user(settings)
    assert sum(settled.kept["jobs"].sums.values()) == 4
    assert counted(settings, Settled(), now + timedelta(hours=2)) == every_job_by_state_and_user(settings)


def cpu_of_every_job(settings) -> dict:
    with write_scope(settings) as session:
        return {u: pytest.approx(t) for u, t in session.execute(
            select(Job.user, func.sum(JobUsage.cpu_s)).join(JobUsage, JobUsage.job_id == Job.id)
            .where(JobUsage.cpu_s.is_not(None), Job.state.in_(c.END_STATES)).group_by(Job.user))}


def used(settings, job_id: int, cpu_s: float | None, user: str = "ann") -> None:
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id).values(user=user))
        session.add(JobUsage(job_id=job_id, wall_s=1.0, gpu_hours=0.0, idle_s=0.0, samples=0, cpu_s=cpu_s))


def test_each_users_cpu_seconds_are_always_what_summing_every_ended_command_gives(settings):
    now = utcnow()
    ago = lambda **kw: now - timedelta(**kw)  # noqa: E731
    used(settings, job(settings, submitted=ago(hours=3), started=ago(hours=3), ended=ago(hours=2)), 12.5)
    used(settings, job(settings, submitted=ago(hours=3), started=ago(hours=3), ended=ago(hours=2)), 0.0, "bob")
    used(settings, job(settings, submitted=ago(hours=3), started=ago(hours=3), ended=ago(hours=2)), None, "cy")
    running = job(settings, submitted=ago(minutes=3), started=ago(minutes=2), ended=None, state=State.RUNNING)
    settled = Settled()

    def cpu(when: datetime, settled: Settled = settled) -> dict:
        with write_scope(settings) as session:
            return settled.cpu(session, when)

    assert cpu(now) == cpu_of_every_job(settings) == {"ann": 12.5, "bob": 0.0}  # a user who used none is there
    # The running job ends with its CPU time, and one more ends late (inside SETTLE); then the line passes them.
    with write_scope(settings) as session:
        session.execute(update(Job).where(Job.id == running).values(state=State.SUCCEEDED, ended_at=now))
    used(settings, running, 3.0)
    used(settings, job(settings, submitted=ago(minutes=9), started=ago(minutes=8), ended=ago(minutes=6)), 4.0, "bob")
    for when in (now + timedelta(seconds=30), now + timedelta(hours=2)):
        assert cpu(when) == cpu_of_every_job(settings) == {"ann": 15.5, "bob": 4.0}
    assert settled.kept["cpu"].sums == {"ann": 15.5, "bob": 4.0}
    assert cpu(now + timedelta(hours=2), Settled()) == cpu_of_every_job(settings)


def attempt(settings, job_id: int, user: str, ended: datetime, cause: str | None, cpu_s: float | None) -> None:
    with write_scope(settings) as session:
        session.add(EarlierAttempt(job_id=job_id, user=user, node="n1", charged=1.0, started_at=ended - timedelta(
            minutes=5), ended_at=ended, cause=cause, cpu_s=cpu_s))


def every_attempt(settings) -> tuple[dict, dict]:
    """Every earlier attempt's CPU seconds by user, and the attempts by user and cause, summed in SQL."""
    a = EarlierAttempt
    with write_scope(settings) as session:
        cpu = dict(session.execute(select(a.user, func.sum(a.cpu_s)).where(a.cpu_s.is_not(None))
                                   .group_by(a.user)).all())
        reruns = {(u, why): n for u, why, n in session.execute(
            select(a.user, a.cause, func.count()).where(a.cause.is_not(None)).group_by(a.user, a.cause))}
    return cpu, reruns


def test_earlier_attempts_add_their_cpu_seconds_and_count_as_reruns_by_cause_as_they_settle(settings):
    now = utcnow()
    ago = lambda **kw: now - timedelta(**kw)  # noqa: E731
    # A job preempted once long ago and retried after a failure, now succeeded with 2 s of CPU.
    done = job(settings, submitted=ago(hours=4), started=ago(hours=3), ended=ago(hours=2))
    used(settings, done, 2.0)
    attempt(settings, done, "ann", ago(hours=3, minutes=30), "preempted", 5.0)
    attempt(settings, done, "ann", ago(hours=3), "exit", None)  # a workload's: no CPU seconds
    attempt(settings, done, "ann", ago(hours=3), None, 1.0)  # kept before causes were: CPU, no rerun
    settled = Settled()

    def read(when: datetime, settled: Settled = settled) -> tuple[dict, dict]:
        with write_scope(settings) as session:
            return settled.cpu(session, when), settled.reruns(session, when)

    assert read(now) == ({"ann": 8.0}, {("ann", "preempted"): 1, ("ann", "exit"): 1})
    # A job running again after its worker was lost, and bob's job requeued by hand a moment ago
    # (inside SETTLE); then the line passes them all.
    running = job(settings, submitted=ago(minutes=30), started=ago(minutes=1), ended=None, state=State.RUNNING)
    attempt(settings, running, "ann", ago(minutes=2), "worker_lost", None)
    attempt(settings, running, "bob", ago(minutes=1), "requeued", 0.5)
    for when in (now + timedelta(seconds=30), now + timedelta(hours=2)):
        cpu, reruns = read(when)
        sql_cpu, sql_reruns = every_attempt(settings)
        assert cpu == {"ann": 8.0, "bob": 0.5}
        assert sql_cpu == {"ann": 6.0, "bob": 0.5} and cpu_of_every_job(settings) == {"ann": 2.0}
        assert reruns == sql_reruns == {("ann", "preempted"): 1, ("ann", "exit"): 1, ("ann", "worker_lost"): 1,
                                        ("bob", "requeued"): 1}
    assert settled.kept["reruns"].sums == every_attempt(settings)[1]
    assert read(now + timedelta(hours=2), Settled()) == read(now + timedelta(hours=2))
