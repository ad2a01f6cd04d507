"""Device samples in SQL: job summaries, the idle flag, the per-user/per-node report, and the
roll-up into minute aggregates, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from sqlalchemy import select

from gpuq.service import accounting, samples, usage
from gpuq.service import constants as c
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import GpuProcess, GpuReading
from gpuq.service.errors import InvalidSpec
from gpuq.service.models import DeviceMinute, DeviceSample, EarlierAttempt, Gpu, Job, JobUsage

NOW = datetime(2026, 3, 2, 12, 0, 0, tzinfo=UTC)


def add_gpu(session, node: str, index: int) -> int:
    gpu = Gpu(node=node, index=index, uuid=f"GPU-{node}-{index}", name="Simulated GPU", memory_total_mib=8192,
              queue=f"q.{node}.{index}", simulated=True)
    session.add(gpu)
    session.flush()
    return gpu.id


def add_job(session, user: str, node: str, start: datetime, end: datetime | None, gpus: int = 1) -> int:
    job = Job(name=f"{user}-job", user=user, kind=c.KIND_COMMAND, argv=["true"], cwd="/", gpus=gpus,
              state=State.SUCCEEDED if end else State.RUNNING, node=node, submitted_at=start, started_at=start,
              ended_at=end)
    session.add(job)
    session.flush()
    return job.id


def add_samples(session, gpu_id, job_id, start, utils, mem=1000, power=100.0, step=1.0):
    """One sample a ``step`` seconds from ``start`` for each utilisation in ``utils``."""
    rows = [samples.sample_row(gpu_id, job_id, start + timedelta(seconds=i * step), step,
                               GpuReading(utilization=u, memory_used_mib=mem + i, power_w=power, temperature_c=40 + i,
                                          processes=(GpuProcess(pid=10, memory_mib=5, name="python", gpuq=True),)),
                               power * step)
            for i, u in enumerate(utils)]
    samples.record(session, gpu_id, rows)


def test_job_summary_has_gpu_hours_memory_utilisation_energy_and_idle_seconds(settings):
    start = NOW - timedelta(seconds=100)
    with write_scope(settings) as s:
        g0, g1 = add_gpu(s, "n1", 0), add_gpu(s, "n1", 1)
        job = add_job(s, "ann", "n1", start, NOW, gpus=2)
        add_samples(s, g0, job, start, [0, 5, 50, 100], mem=1000, power=100.0)
        add_samples(s, g1, job, start, [20, 20], mem=3000, power=50.0, step=2.0)
    with write_scope(settings) as s:
        usage.record_usage(s, job)
    with write_scope(settings) as s:
        u = s.get(JobUsage, job)
        assert u.wall_s == pytest.approx(100) and u.gpu_hours == pytest.approx(200 / 3600)
        assert u.memory_peak_mib == 3001 and u.samples == 6
        # Weighted by the seconds each sample stands for: 4 x 1 s on GPU 0, 2 x 2 s on GPU 1.
        assert u.utilization_mean == pytest.approx((0 + 5 + 50 + 100 + 2 * 20 + 2 * 20) / 8)
        assert u.memory_mean_mib == pytest.approx((1000 + 1001 + 1002 + 1003 + 2 * 3000 + 2 * 3001) / 8)
        assert u.energy_j == pytest.approx(4 * 100.0 + 2 * 100.0)
        assert u.idle_s == pytest.approx(2.0)  # the 0% and 5% seconds


def test_a_job_and_its_user_hold_no_more_idle_gpu_time_than_gpu_time(settings):
    # A job of 10 s read idle for 12 (its samples' intervals reach back before its start): `gpuq
    # stats ID` said "idle 12 GPU-seconds" beside a wall time of 10, and the user's idle GPU-hours
    # passed their GPU-hours.
    start = NOW - timedelta(seconds=10)
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n1", 0)
        job = add_job(s, "ann", "n1", start, NOW)
        add_samples(s, gpu, job, start, [0] * 6, step=2.0)
    with write_scope(settings) as s:
        usage.record_usage(s, job)
    with write_scope(settings) as s:
        u = s.get(JobUsage, job)
        assert u.wall_s == pytest.approx(10) and u.idle_s == pytest.approx(10)
        [ann] = accounting.report(s, NOW - timedelta(hours=1), NOW + timedelta(seconds=1), NOW)["users"]
        assert ann.idle_hours <= ann.gpu_hours and ann.gpu_hours == pytest.approx(10 / 3600)


def test_a_retried_jobs_summary_is_its_last_attempts_samples_beside_that_attempts_wall_time(settings):
    # Before: the last attempt's 20 s of wall time beside every attempt's samples (its first
    # attempt's 60 readings at 100% made a 20 s job peak and burn energy it never did).
    first, last = NOW - timedelta(seconds=200), NOW - timedelta(seconds=20)
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n1", 0)
        job = add_job(s, "ann", "n1", last, NOW)
        add_samples(s, gpu, job, first, [100] * 60, mem=7000, power=300.0)
        add_samples(s, gpu, job, last, [10] * 20, mem=1000, power=50.0)
    with write_scope(settings) as s:
        usage.record_usage(s, job)
    with write_scope(settings) as s:
        u = s.get(JobUsage, job)
        assert u.wall_s == pytest.approx(20) and u.samples == 20
        assert u.utilization_mean == pytest.approx(10) and u.memory_peak_mib == 1019
        assert u.energy_j == pytest.approx(20 * 50.0)
        live = usage.summarize(s, s.get(Job, job), NOW)
        assert (live.samples, live.energy_j) == (20, pytest.approx(1000.0))
        # `gpuq stats ID --plot` draws the same attempt.
        assert len(accounting.job_series(s, job, last)) == 20 and len(accounting.job_series(s, job)) == 80


def test_idle_flag_needs_a_mostly_idle_gpu_through_the_whole_window(settings):
    window = timedelta(seconds=settings.idle_window)
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n1", 0)
        idle = add_job(s, "ann", "n1", NOW - 2 * window, None)
        busy = add_job(s, "bob", "n1", NOW - 2 * window, None)
        young = add_job(s, "cid", "n1", NOW - window / 2, None)
        step = settings.idle_window / 20
        t0 = NOW - window
        add_samples(s, gpu, idle, t0, [0] * 19 + [90], step=step)  # one busy moment: still mostly idle
        add_samples(s, gpu, busy, t0, [3, 80] * 10, step=step)
        add_samples(s, gpu, young, NOW - window / 2, [0] * 10, step=step)
    with write_scope(settings) as s:
        assert usage.idle_jobs(s, settings, NOW) == {idle}


def test_report_counts_gpu_hours_in_the_period_per_user_and_node(settings):
    with write_scope(settings) as s:
        a, b = add_gpu(s, "n1", 0), add_gpu(s, "n2", 0)
        j1 = add_job(s, "ann", "n1", NOW - timedelta(hours=3), NOW - timedelta(hours=1))
        j2 = add_job(s, "bob", "n2", NOW - timedelta(hours=1), None, gpus=2)
        add_samples(s, a, j1, NOW - timedelta(hours=2), [60, 80])
        add_samples(s, b, j2, NOW - timedelta(minutes=30), [10, 10, 10])
        add_samples(s, b, None, NOW - timedelta(minutes=10), [0])  # an idle GPU counts for its node
        add_job(s, "ann", "n2", NOW - timedelta(minutes=50), NOW - timedelta(minutes=20))  # a user on two nodes
    with write_scope(settings) as s:
        rep = accounting.report(s, NOW - timedelta(hours=2), NOW, NOW)
    users = {r.name: r for r in rep["users"]}
    assert users["ann"].gpu_hours == pytest.approx(1.5) and users["ann"].jobs == 2
    assert users["ann"].utilization_mean == pytest.approx(70) and users["ann"].energy_j == pytest.approx(200)
    assert users["bob"].gpu_hours == pytest.approx(2.0) and users["bob"].utilization_mean == pytest.approx(10)
    nodes = {r.name: r for r in rep["nodes"]}
    assert (nodes["n1"].jobs, nodes["n2"].jobs) == (1, 2)  # a node used by two users
    assert (nodes["n1"].gpu_hours, nodes["n2"].gpu_hours) == (pytest.approx(1.0), pytest.approx(2.5))
    assert nodes["n2"].utilization_mean == pytest.approx(30 / 4) and nodes["n2"].energy_j == pytest.approx(400)
    assert [r.name for r in rep["users"]] == ["bob", "ann"]  # most GPU-hours first


def test_report_counts_the_cpu_hours_of_commands_that_ended_in_the_period_per_user_and_node(settings):
    def used(session, job_id: int, cpu_s: float | None) -> None:
        session.add(JobUsage(job_id=job_id, wall_s=1.0, gpu_hours=0.0, idle_s=0.0, samples=0, cpu_s=cpu_s))

    with write_scope(settings) as s:
        used(s, add_job(s, "ann", "n1", NOW - timedelta(hours=3), NOW - timedelta(hours=1)), 1800.0)
        used(s, add_job(s, "ann", "n2", NOW - timedelta(hours=1), NOW - timedelta(minutes=30)), 3600.0)
        used(s, add_job(s, "bob", "n2", NOW - timedelta(hours=4), NOW - timedelta(hours=3)), 7200.0)  # ended before
        used(s, add_job(s, "bob", "n2", NOW - timedelta(hours=1), NOW - timedelta(minutes=10)), None)  # a workload
        add_job(s, "cy", "n1", NOW - timedelta(hours=1), None)  # running: not known yet
    with write_scope(settings) as s:
        rep = accounting.report(s, NOW - timedelta(hours=2), NOW, NOW)
    users = {r.name: r.cpu_hours for r in rep["users"]}
    nodes = {r.name: r.cpu_hours for r in rep["nodes"]}
    assert users == {"ann": pytest.approx(1.5), "bob": 0.0, "cy": 0.0}
    assert nodes == {"n1": pytest.approx(0.5), "n2": pytest.approx(1.0)}
    assert rep["users"][0].as_dict()["cpu_hours"] >= 0


def test_report_counts_an_earlier_attempts_cpu_hours_in_the_period_it_ended_in(settings):
    """A preempted job's first attempt used CPU its usage summary (its last attempt's) no longer
    shows: the report adds it where the attempt ended, as a job's."""
    with write_scope(settings) as s:
        job = add_job(s, "ann", "n1", NOW - timedelta(minutes=30), NOW - timedelta(minutes=10))
        s.add(JobUsage(job_id=job, wall_s=1200.0, gpu_hours=0.33, idle_s=0.0, samples=0, cpu_s=900.0))
        for ended, cpu_s in ((NOW - timedelta(hours=1), 1800.0), (NOW - timedelta(hours=3), 7200.0)):  # in, before
            s.add(EarlierAttempt(job_id=job, user="ann", node="n2", charged=1.0, started_at=ended - timedelta(hours=1),
                                 ended_at=ended, cause="preempted", cpu_s=cpu_s))
    with write_scope(settings) as s:
        rep = accounting.report(s, NOW - timedelta(hours=2), NOW, NOW)
    assert {r.name: r.cpu_hours for r in rep["users"]} == {"ann": pytest.approx(0.75)}
    assert {r.name: r.cpu_hours for r in rep["nodes"]} == {"n1": pytest.approx(0.25), "n2": pytest.approx(0.5)}
    assert {r.name: r.jobs for r in rep["users"]} == {"ann": 1}  # an attempt is not a job of its own


def test_rollup_turns_old_samples_into_minutes_keeping_sums_and_maxima(settings):
    old = NOW - timedelta(days=settings.sample_retention_days, minutes=10)
    with write_scope(settings) as s:
        g0, g1 = add_gpu(s, "n1", 0), add_gpu(s, "n2", 0)
        j1 = add_job(s, "ann", "n1", old, NOW - timedelta(days=1))
        j2 = add_job(s, "bob", "n2", old, None)
        # 150 s at 1 Hz on each GPU across three minutes, plus samples still within retention.
        add_samples(s, g0, j1, old + timedelta(seconds=30), [(i * 7) % 101 for i in range(150)], power=120.0)
        add_samples(s, g1, j2, old, [(i * 13) % 101 for i in range(150)], mem=2000, power=80.0)
        add_samples(s, g1, None, old + timedelta(seconds=150), [0] * 30)
        add_samples(s, g1, j2, NOW - timedelta(hours=1), [50] * 20)

    def snapshot():
        with write_scope(settings) as s:
            per = {g: usage.totals(s, g) for g in (usage.by_user, usage.by_node, usage.by_job)}
            per["all"] = usage.totals(s)
            per["report"] = accounting.report(s, old - timedelta(days=1), NOW, NOW)
            per["summary"] = {j: usage.summarize(s, s.get(Job, j), NOW) for j in (j1, j2)}
            return per

    before = snapshot()
    rolled = samples.rollup(settings, NOW)
    after = snapshot()
    assert rolled == 330
    with write_scope(settings) as s:
        assert s.query(DeviceSample).count() == 20  # only the recent ones are raw
        minutes = s.query(DeviceMinute).all()
        assert all(m.minute.second == 0 and m.minute.microsecond == 0 for m in minutes)
        assert sum(m.samples for m in minutes) == 330
    for key in ("all", usage.by_user, usage.by_node, usage.by_job):
        assert before[key].keys() == after[key].keys()
        for k in before[key]:
            b, a = before[key][k].as_dict(), after[key][k].as_dict()
            assert a == pytest.approx(b), (key, k)
    for j in (j1, j2):
        b, a = before["summary"][j], after["summary"][j]
        assert (a.utilization_mean, a.memory_peak_mib, a.energy_j, a.idle_s, a.samples) == \
            pytest.approx((b.utilization_mean, b.memory_peak_mib, b.energy_j, b.idle_s, b.samples))
    for part in ("users", "nodes"):
        for b, a in zip(before["report"][part], after["report"][part], strict=True):
            assert a.name == b.name and a.jobs == b.jobs
            assert (a.utilization_mean, a.energy_j, a.idle_hours) == pytest.approx(
                (b.utilization_mean, b.energy_j, b.idle_hours))
    assert samples.rollup(settings, NOW) == 0  # nothing left to do: running it again changes nothing


@pytest.mark.parametrize("text", ["yesterday", "7x", "2026-13-01", ""])
def test_a_bad_time_is_refused_naming_the_flag(text):
    with pytest.raises(InvalidSpec, match="bad --since"):
        accounting.parse_when(text, "--since", NOW)


def test_times_are_dates_ages_or_now():
    assert accounting.parse_when("now", "--until", NOW) == NOW
    assert accounting.parse_when("90m", "--since", NOW) == NOW - timedelta(minutes=90)
    assert accounting.parse_when("2026-03-01T10:00+00:00", "--since", NOW) == NOW - timedelta(days=1, hours=2)


_maybe = lambda values: st.none() | values  # noqa: E731
# No subnormals: a process where a library built with -ffast-math set flush-to-zero (the lent GPU
# machine's PyTorch image) cannot make them, and Hypothesis then refuses to draw any float.
_float = lambda lo, hi: st.floats(lo, hi, allow_subnormal=False)  # noqa: E731
_readings = st.lists(st.fixed_dictionaries({
    "interval_s": _float(0.001, 10.0), "utilization": _maybe(st.integers(0, 100)),
    "memory_used_mib": _maybe(st.integers(0, 81920)), "temperature_c": _maybe(st.integers(20, 95)),
    "power_w": _maybe(_float(0.0, 700.0)), "energy_j": _maybe(_float(0.0, 7000.0))}), max_size=12)


@examples(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(readings=_readings)
def test_readings_summed_in_hand_are_what_sql_sums_from_them(settings, readings):
    # A worker holding every reading of a job sums them itself (Totals.of_samples) instead of
    # reading them back; it must come to what samples.raw_sums does in SQL, null for null.
    with write_scope(settings) as s:
        gpu = s.scalar(select(Gpu.id).where(Gpu.node == "n", Gpu.index == 0)) or add_gpu(s, "n", 0)
        job = add_job(s, "ann", "n", NOW, NOW)
        rows = [dict(samples.sample_row(gpu, job, NOW + timedelta(seconds=i), 1.0, GpuReading(), None),
                     **reading) for i, reading in enumerate(readings)]
        samples.record(s, gpu, rows)
    with write_scope(settings) as s:
        in_sql = usage.job_totals(s, job)
    in_hand = usage.Totals.of_samples(rows)
    for field, value in in_sql.as_dict().items():
        mine = getattr(in_hand, field)
        assert mine == value if value is None else mine == pytest.approx(value, rel=1e-9, abs=1e-9), field


@pytest.mark.parametrize("start,end", [
    (datetime(2026, 1, 1, 12, 0, 0, 1, tzinfo=UTC), datetime(2026, 1, 1, 12, 0, 1, 999999, tzinfo=UTC)),
    (datetime(2026, 1, 1, 12, 0, 59, 999700, tzinfo=UTC), datetime(2026, 1, 1, 12, 1, 0, 200, tzinfo=UTC)),
    (datetime(2026, 1, 1, 23, 59, 59, 999999, tzinfo=UTC), datetime(2026, 1, 2, 0, 0, 0, tzinfo=UTC)),
])
def test_the_databases_seconds_between_two_times_are_pythons_to_the_microsecond(settings, start, end):
    # SQLite reads fractions of a second to the millisecond, rounding: 59.9997 s read as 60.000
    # put a whole second into a metrics histogram's sum (seen once in CI).
    from gpuq.service.dialect import epoch_seconds, seconds_between

    with write_scope(settings) as s:
        job_id = add_job(s, "ann", "n1", start, end)
        s.flush()
        between, whole = s.execute(select(seconds_between(Job.ended_at, Job.started_at, s),
                                          epoch_seconds(Job.started_at, s)).where(Job.id == job_id)).one()
    assert float(between) == pytest.approx((end - start).total_seconds(), abs=1e-9)
    assert whole == int(start.timestamp())  # whole seconds, never rounded up


def test_an_attempt_before_a_retry_is_charged_to_its_user_in_the_report_and_in_fair_share(settings):
    # A job's row holds its last attempt: a job retried after an hour on 2 GPUs was charged nothing
    # for that hour, so --retries bought GPU time free of fair share.
    from gpuq.service import lifecycle
    from gpuq.service.fair_share import FairShare
    from gpuq.service.models import utcnow

    now = utcnow()
    with write_scope(settings) as s:
        job = add_job(s, "ann", "n1", now - timedelta(hours=1), None, gpus=2)
        s.execute(Job.__table__.update().where(Job.id == job).values(lease_token="t", max_retries=1))
    with write_scope(settings) as s:
        assert lifecycle.end_attempt(s, job, State.FAILED, token="t", failure=c.FAILURE_EXIT, exit_code=1,
                                     reason="exited with status 1", now=now)
    with write_scope(settings) as s:
        assert s.get(Job, job).state == State.PENDING and s.get(Job, job).started_at is None
        rep = accounting.report(s, now - timedelta(hours=2), now + timedelta(seconds=1), now)
        hours = FairShare(settings).gpu_hours(s, now + timedelta(seconds=5))
    users = {r.name: r for r in rep["users"]}
    assert users["ann"].gpu_hours == pytest.approx(2.0, rel=1e-3) and users["ann"].jobs == 0
    assert {r.name: r.gpu_hours for r in rep["nodes"]}["n1"] == pytest.approx(2.0, rel=1e-3)
    assert 1.0 < hours["ann"] <= 2.0  # two GPU-hours, decayed by the half-life


@pytest.mark.parametrize("charge", [1.0, 0.5, 0.0])
def test_a_preemptible_jobs_gpu_hours_count_in_fair_share_as_gpuq_preemptible_charge_says(settings, charge):
    """GPUQ_PREEMPTIBLE_CHARGE (a scavenger QOS's UsageFactor): a preemptible job's GPU-hours, its
    earlier attempts' (a preempted one's) too, count that much in fair share; `gpuq stats` reports
    the GPUs' own hours whatever it is."""
    from dataclasses import replace

    from gpuq.service import lifecycle
    from gpuq.service.fair_share import FairShare
    from gpuq.service.models import utcnow

    s_ = replace(settings, preemptible_charge=charge)
    now = utcnow()
    with write_scope(s_) as s:
        plain = add_job(s, "ann", "n1", now - timedelta(hours=1), now)
        scavenger = add_job(s, "bob", "n1", now - timedelta(hours=1), None)
        s.execute(Job.__table__.update().where(Job.id == scavenger).values(
            lease_token="t", preemptible=True, cancel_requested_at=now, reason="preempted by job 1 of ann"))
    with write_scope(s_) as s:
        # Preempted after its hour: the attempt is kept, and the job waits again.
        assert lifecycle.end_attempt(s, scavenger, State.CANCELLED, token="t", reason="stopped", now=now)
        assert s.get(Job, plain).state == State.SUCCEEDED and s.get(Job, scavenger).state == State.PENDING
    with write_scope(s_) as s:
        hours = FairShare(s_).gpu_hours(s, now + timedelta(seconds=5))
        rep = accounting.report(s, now - timedelta(hours=2), now + timedelta(seconds=1), now)
    assert hours.get("bob", 0.0) == pytest.approx(hours["ann"] * charge, rel=1e-6)
    assert {r.name: r.gpu_hours for r in rep["users"]}["bob"] == pytest.approx(1.0, rel=1e-3)


def test_gpuq_preemptible_charge_past_0_to_1_is_refused_naming_it(tmp_path):
    from gpuq.service.errors import ConfigError
    from gpuq.service.settings import load_settings

    with pytest.raises(ConfigError, match="preemptible_charge must be between 0 and 1"):
        load_settings({"GPUQ_HOME": str(tmp_path), "GPUQ_PREEMPTIBLE_CHARGE": "1.5"})
