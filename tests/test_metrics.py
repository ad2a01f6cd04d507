"""/metrics of `gpuq dashboard`, scraped after real jobs ran and parsed with prometheus_client's own
parser: DCGM exporter's GPU metrics with its labels, and gpuq's job metrics, equal to what SQL holds."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from gpuq.service.db import write_scope
from gpuq.service.device_status import device_status
from gpuq.service.models import DeviceMinute, DeviceSample, EarlierAttempt, Gpu, Job, JobUsage
from gpuq.web.metrics import WAIT_BUCKETS
from tests.dashboard_stack import stack_with_jobs

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def ran(request, tmp_path_factory, redis_url):
    yield from stack_with_jobs(request, tmp_path_factory, redis_url)


def scrape(dash) -> dict:
    status, kind, text = dash.get("/metrics")
    assert status == 200 and kind.startswith("text/plain"), (status, kind)
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family, name: str | None = None) -> list:
    return [s for s in family.samples if name is None or s.name == name]


def test_jobs_by_state_and_user_equal_the_jobs_table(ran, dash):
    st, _ = ran
    families = scrape(dash)
    with write_scope(st.settings) as session:
        expected = {(state, user): n for state, user, n in
                    session.execute(select(Job.state, Job.user, func.count()).group_by(Job.state, Job.user))}
    shown = {(s.labels["state"], s.labels["user"]): s.value for s in samples(families["gpuq_jobs"])}
    assert shown == expected
    assert {state for state, _ in shown} >= {"succeeded", "failed", "running", "pending"}
    pending = {s.labels["reason"]: s.value for s in samples(families["gpuq_pending_jobs"])}
    assert pending == {"held": 1, "dependency": 1}
    # Each user's fair-share GPU-hours (`gpuq share`): every user with jobs, none used below 0.
    share = {s.labels["user"]: s.value for s in samples(families["gpuq_user_fairshare_gpu_hours"])}
    assert set(share) == {user for _, user in expected} and all(v >= 0 for v in share.values())
    assert any(v > 0 for v in share.values())  # the jobs that ran


def test_each_users_cpu_seconds_are_a_counter_equal_to_their_ended_commands_and_attempts_in_sql(ran, dash):
    st, jobs = ran
    families = scrape(dash)
    with write_scope(st.settings) as session:
        expected = Counter({user: seconds for user, seconds in session.execute(
            select(Job.user, func.sum(JobUsage.cpu_s)).join(JobUsage, JobUsage.job_id == Job.id)
            .where(JobUsage.cpu_s.is_not(None)).group_by(Job.user))})
        failed_cpu = session.scalar(select(JobUsage.cpu_s).where(JobUsage.job_id == jobs.failed))
        first_cpu = session.scalar(select(EarlierAttempt.cpu_s).where(EarlierAttempt.job_id == jobs.failed))
        expected.update(dict(session.execute(select(EarlierAttempt.user, func.sum(EarlierAttempt.cpu_s))
                                             .group_by(EarlierAttempt.user)).all()))
    cpu = families["gpuq_user_cpu_seconds"]
    assert cpu.type == "counter"
    assert {s.labels["user"]: s.value for s in samples(cpu, "gpuq_user_cpu_seconds_total")} == {
        user: pytest.approx(seconds) for user, seconds in expected.items()}
    # The failed command's python counted, its first attempt's too; the workloads have none.
    assert failed_cpu is not None and failed_cpu > 0 and first_cpu is not None and first_cpu > 0


def test_reruns_are_a_counter_by_user_and_cause_equal_to_the_earlier_attempts_in_sql(ran, dash):
    st, jobs = ran
    families = scrape(dash)
    with write_scope(st.settings) as session:
        expected = {(user, cause): n for user, cause, n in session.execute(
            select(EarlierAttempt.user, EarlierAttempt.cause, func.count())
            .group_by(EarlierAttempt.user, EarlierAttempt.cause))}
        user = session.get(Job, jobs.failed).user
    reruns = families["gpuq_job_reruns"]
    assert reruns.type == "counter"
    shown = {(s.labels["user"], s.labels["cause"]): s.value for s in samples(reruns, "gpuq_job_reruns_total")}
    assert shown == expected == {(user, "exit"): 1}  # the failed job's first attempt, retried


def test_queue_wait_and_duration_histograms_count_the_jobs_that_started_and_ended(ran, dash):
    st, _ = ran
    families = scrape(dash)
    with write_scope(st.settings) as session:
        rows = session.execute(select(Job.state, Job.submitted_at, Job.started_at, Job.ended_at)
                               .where(Job.started_at.is_not(None))).all()
    waits = [(start - sub).total_seconds() for _, sub, start, _ in rows]
    wait = families["gpuq_job_queue_wait_seconds"]
    assert wait.type == "histogram"
    assert samples(wait, "gpuq_job_queue_wait_seconds_count")[0].value == len(waits) == 4
    assert samples(wait, "gpuq_job_queue_wait_seconds_sum")[0].value == pytest.approx(sum(waits))
    buckets = {float(s.labels["le"]): s.value for s in samples(wait, "gpuq_job_queue_wait_seconds_bucket")}
    for bound in WAIT_BUCKETS:
        assert buckets[bound] == sum(1 for w in waits if w <= bound)
    durations = [(end - start).total_seconds() for state, _, start, end in rows if end is not None]
    duration = families["gpuq_job_duration_seconds"]
    assert samples(duration, "gpuq_job_duration_seconds_count")[0].value == len(durations) == 3
    assert samples(duration, "gpuq_job_duration_seconds_sum")[0].value == pytest.approx(sum(durations))


def test_gpu_metrics_have_dcgm_names_and_labels_and_one_sample_s_values(ran, dash):
    st, j = ran
    with write_scope(st.settings) as session:
        gpus = {g.index: g for g in session.scalars(select(Gpu))}
        before = {d.index: d.sampled_at for d in device_status(session, st.settings)}
    families = scrape(dash)
    util = {s.labels["gpu"]: s for s in samples(families["DCGM_FI_DEV_GPU_UTIL"])}
    assert set(util) == {str(i) for i in gpus}
    for index, gpu in gpus.items():
        labels = util[str(index)].labels
        assert labels == {"gpu": str(index), "UUID": gpu.uuid, "device": f"nvidia{index}", "modelName": gpu.name,
                          "Hostname": "testnode", "node": "testnode"}
        shown = {name: [s.value for s in samples(families[name]) if s.labels["gpu"] == str(index)]
                 for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                              "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK")}
        assert all(len(v) == 1 for v in shown.values()), shown
        # Workers keep sampling while the scrape runs: its figures are those of one sample taken
        # since the newest one before the scrape, all from the same sample.
        with write_scope(st.settings) as session:
            rows = session.scalars(select(DeviceSample).where(DeviceSample.gpu_id == gpu.id,
                                                              DeviceSample.sampled_at >= before[index])).all()
        readings = [{"DCGM_FI_DEV_GPU_UTIL": r.utilization, "DCGM_FI_DEV_FB_USED": r.memory_used_mib,
                     "DCGM_FI_DEV_FB_FREE": r.memory_total_mib - r.memory_used_mib,
                     "DCGM_FI_DEV_GPU_TEMP": r.temperature_c, "DCGM_FI_DEV_POWER_USAGE": r.power_w,
                     "DCGM_FI_DEV_SM_CLOCK": r.sm_clock_mhz} for r in rows]
        assert {k: v[0] for k, v in shown.items()} in [{k: float(v) for k, v in r.items()} for r in readings]
    held = samples(families["gpuq_gpu_allocated"])
    assert [(s.labels["job"]) for s in held] == [str(j.running)]
    assert {s.labels["gpu"]: s.value for s in samples(families["gpuq_gpu_up"])} == {str(i): 1.0 for i in gpus}


def test_energy_counter_is_the_sampled_joules_in_millijoules_and_only_grows(ran, dash):
    st, _ = ran
    first = scrape(dash)["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert first.type == "gauge"  # DCGM's name has no _total, which a counter's TYPE line would get
    with write_scope(st.settings) as session:
        joules = Counter()
        for t in (DeviceSample, DeviceMinute):
            for gpu_id, e in session.execute(select(t.gpu_id, func.sum(t.energy_j)).group_by(t.gpu_id)):
                joules[gpu_id] += e or 0.0
        index = {g.id: str(g.index) for g in session.scalars(select(Gpu))}
    shown = {s.labels["gpu"]: s.value for s in first.samples}
    for gpu_id, e in joules.items():
        # The running job's GPU keeps sampling: the scrape came first, so it may only be lower.
        assert 0 < shown[index[gpu_id]] <= e * 1000.0 + 1e-6
        assert shown[index[gpu_id]] >= 0.5 * e * 1000.0
    again = {s.labels["gpu"]: s.value for s in scrape(dash)["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].samples}
    assert all(again[g] >= shown[g] for g in shown)


def test_an_offline_gpu_reports_up_0_and_no_stale_readings(ran, dash):
    st, _ = ran
    families = scrape(dash)
    assert len(samples(families["DCGM_FI_DEV_GPU_UTIL"])) == st.settings.fake_gpus
    # A GPU whose worker fell silent long ago: the collector must not show its last reading as now.
    with write_scope(st.settings) as session:
        session.add(Gpu(node="gone", index=0, uuid="GPU-gone", name="Old GPU", memory_total_mib=1024,
                        memory_used_mib=512, utilization=77, queue="gone-q", heartbeat_at=None))
    try:
        families = scrape(dash)
        up = {(s.labels["Hostname"], s.labels["gpu"]): s.value for s in samples(families["gpuq_gpu_up"])}
        assert up[("gone", "0")] == 0.0
        assert all(s.labels["Hostname"] != "gone" for s in samples(families["DCGM_FI_DEV_GPU_UTIL"]))
    finally:
        with write_scope(st.settings) as session:
            session.execute(Gpu.__table__.delete().where(Gpu.node == "gone"))


def test_a_gpu_given_out_no_more_on_its_own_reports_drained_1_and_the_others_0(ran, dash):
    st, _ = ran
    with write_scope(st.settings) as session:
        session.add(Gpu(node="sick", index=0, uuid="GPU-sick", name="Old GPU", memory_total_mib=1024,
                        queue="sick-q", heartbeat_at=None, drain_reason="GPU unhealthy: retired pages pending"))
    try:
        drained = {(s.labels["Hostname"], s.labels["gpu"]): s.value for s in samples(scrape(dash)["gpuq_gpu_drained"])}
        assert drained == {("sick", "0"): 1.0, **{("testnode", str(i)): 0.0 for i in range(st.settings.fake_gpus)}}
    finally:
        with write_scope(st.settings) as session:
            session.execute(Gpu.__table__.delete().where(Gpu.node == "sick"))


def test_each_nodes_drain_and_its_maintenance_window_to_come_are_gauges(ran, dash):
    from datetime import timedelta

    from gpuq.service import node_drains
    from gpuq.service.models import utcnow

    st, _ = ran
    families = scrape(dash)
    assert {s.labels["node"]: s.value for s in samples(families["gpuq_node_drained"])} == {"testnode": 0.0}
    assert samples(families["gpuq_node_drain_start_seconds"]) == []
    start = utcnow().replace(microsecond=0) + timedelta(hours=3)
    with write_scope(st.settings) as session:
        node_drains.plan(session, "testnode", start, start + timedelta(hours=2), reason="PSU", by="root")
    try:
        families = scrape(dash)
        assert [(s.labels["node"], s.value) for s in samples(families["gpuq_node_drain_start_seconds"])] == [
            ("testnode", start.timestamp())]
        assert [s.value for s in samples(families["gpuq_node_drain_end_seconds"])] == [start.timestamp() + 7200]
        with write_scope(st.settings) as session:
            node_drains.set_drained(session, "testnode", True)  # now, until resumed
        families = scrape(dash)
        assert {s.labels["node"]: s.value for s in samples(families["gpuq_node_drained"])} == {"testnode": 1.0}
        assert samples(families["gpuq_node_drain_start_seconds"]) == []
    finally:
        with write_scope(st.settings) as session:
            node_drains.set_drained(session, "testnode", False)


def test_each_nodes_cores_and_host_memory_offered_and_reserved_are_gauges_equal_to_sql(ran, dash):
    from sqlalchemy import func, select

    from gpuq.service.constants import State
    from gpuq.service.db import write_scope
    from gpuq.service.models import Job

    st, _ = ran
    families = scrape(dash)
    with write_scope(st.settings) as session:
        cpus, mem = session.execute(select(func.coalesce(func.sum(Job.cpus), 0), func.coalesce(func.sum(
            Job.host_mem_mib), 0)).where(Job.state.in_((State.DISPATCHED, State.RUNNING)))).one()
    got = {name: [(s.labels["node"], s.value) for s in samples(families[name])]
           for name in ("gpuq_node_cpus", "gpuq_node_cpus_reserved", "gpuq_node_host_mem_mib",
                        "gpuq_node_host_mem_reserved_mib")}
    # What the test stack's workers report (tests/conftest.py), and what SQL says its jobs reserve.
    assert got == {"gpuq_node_cpus": [("testnode", 64.0)], "gpuq_node_cpus_reserved": [("testnode", float(cpus))],
                   "gpuq_node_host_mem_mib": [("testnode", 65536.0)],
                   "gpuq_node_host_mem_reserved_mib": [("testnode", float(mem))]}
