"""How well jobs used what they asked for (service/efficiency.py, `gpuq stats ID` and `gpuq stats
--array ID`): the share of the time limit a job ran, a nearer limit suggested only where it is
safe to, and an array's tasks summed."""

from __future__ import annotations

import pytest

from gpuq.service import efficiency
from gpuq.service.constants import State

pytestmark = pytest.mark.timeout(30)


def task(job_id: int, state: str = State.SUCCEEDED, wall: float | None = 60.0, limit: int | None = 3600,
         util: float | None = 50.0, samples: int = 10, peak: int | None = 1000) -> dict:
    row = dict(job_id=job_id, index=job_id - 1, state=state, time_limit_s=limit, name="t", user="ann")
    if wall is not None:
        row |= dict(wall_s=wall, gpu_hours=wall / 3600, utilization_mean=util, samples=samples if util else 0,
                    memory_peak_mib=peak, memory_mean_mib=peak, energy_j=wall * 100, idle_s=0.0)
    return row


def test_time_used_is_the_share_of_the_limit_and_none_without_a_limit_or_a_start():
    assert efficiency.time_used(900, 3600) == 0.25
    assert efficiency.time_used(900, None) is None and efficiency.time_used(None, 3600) is None


def test_a_nearer_limit_is_one_and_a_half_runs_in_whole_minutes_and_only_below_a_third_of_the_limit():
    assert efficiency.suggested_limit(250, 3600) == 420  # 375 s, rounded up to 7 minutes
    assert efficiency.suggested_limit(2, 600) == 60  # never under a minute
    assert efficiency.suggested_limit(1201, 3600) is None  # more than a third: near enough
    assert efficiency.suggested_limit(60, None) is None


def test_the_hint_names_the_run_the_limit_the_share_and_a_limit_submit_takes_back():
    from gpuq.service.units import parse_duration

    hint = efficiency.limit_hint(250, 3600)
    assert hint == ("it ran 4:10 of its 1:00:00 limit (7%): a limit nearer that (-t 0:07:00) lets the backfill "
                    "start such jobs sooner")
    assert parse_duration(hint.split("(-t ")[1].split(")")[0]) == 420
    assert "(under 1%)" in efficiency.limit_hint(2, 3600)
    assert efficiency.limit_hint(3000, 3600) is None and efficiency.limit_hint(None, 3600) is None
    # Only a job that succeeded: one that failed early says nothing of what it needs.
    assert efficiency.job_hint(State.FAILED, 250, 3600) is None
    assert efficiency.job_hint(State.SUCCEEDED, 250, 3600) == hint


def test_an_array_is_summed_over_its_started_tasks_with_utilisation_weighted_by_samples():
    tasks = [task(1, wall=60, util=90, samples=30, peak=900), task(2, wall=120, util=30, samples=10, peak=4000),
             task(3, State.FAILED, wall=30, util=None, peak=None), task(4, State.CANCELLED, wall=None)]
    a = efficiency.array_summary(tasks)
    assert (a["tasks"], a["started"], a["states"]) == (4, 3, {State.SUCCEEDED: 2, State.FAILED: 1,
                                                              State.CANCELLED: 1})
    assert a["wall_mean_s"] == 70 and (a["wall_longest_s"], a["longest_task"]) == (120, 2)
    assert a["utilization_mean"] == pytest.approx((90 * 30 + 30 * 10) / 40)
    assert (a["memory_peak_mib"], a["memory_peak_task"]) == (4000, 2)
    assert a["gpu_hours"] == pytest.approx(210 / 3600) and a["energy_j"] == pytest.approx(21000)
    assert (a["time_limit_s"], a["time_limits"]) == (3600, 1) and a["time_used_max"] == pytest.approx(120 / 3600)
    assert a["limit_hint"].startswith("the longest successful task ran 2:00 of its 1:00:00 limit (3%)")


def test_an_array_gets_no_hint_while_a_task_runs_or_if_one_ran_out_of_its_limit():
    running = efficiency.array_summary([task(1, wall=60), task(2, State.RUNNING, wall=30)])
    timed_out = efficiency.array_summary([task(1, wall=60), task(2, State.TIMED_OUT, wall=3600)])
    pending = efficiency.array_summary([task(1, wall=60), task(2, State.PENDING, wall=None)])
    assert running["limit_hint"] is timed_out["limit_hint"] is pending["limit_hint"] is None
    assert timed_out["time_used_max"] == 1.0


def test_an_array_none_of_whose_tasks_started_sums_to_nothing_and_several_limits_are_counted():
    a = efficiency.array_summary([task(1, State.PENDING, wall=None), task(2, State.PENDING, wall=None, limit=60)])
    assert (a["started"], a["wall_mean_s"], a["longest_task"], a["utilization_mean"], a["energy_j"]) == (
        0, None, None, None, None)
    assert (a["time_limit_s"], a["time_limits"], a["gpu_hours"], a["limit_hint"]) == (None, 2, 0, None)


def test_an_arrays_commands_cpu_is_summed_and_a_workloads_array_has_none():
    tasks = [task(1) | dict(cpu_s=12.5), task(2) | dict(cpu_s=7.5), task(3, State.RUNNING) | dict(cpu_s=None),
             task(4, wall=None)]
    assert efficiency.array_summary(tasks)["cpu_s"] == 20.0
    assert efficiency.array_summary([task(1), task(2)])["cpu_s"] is None


def test_a_jobs_cpu_line_reads_its_cores_against_its_cpus():
    from types import SimpleNamespace

    u = SimpleNamespace(cpu_s=30.0, wall_s=20.0, cpus=3.0)
    assert efficiency.cpu_use(u) == [("CPU", "30.0 s, 1.50 cores on average (50% of its --cpus 3)")]
    assert efficiency.cpu_use(SimpleNamespace(cpu_s=30.0, wall_s=20.0, cpus=None)) == [
        ("CPU", "30.0 s, 1.50 cores on average")]
    assert efficiency.cpu_use(SimpleNamespace(cpu_s=0.5, wall_s=0.0, cpus=None)) == [("CPU", "0.5 s")]
    assert efficiency.cpu_use(SimpleNamespace(wall_s=10.0)) == []  # a server from before, or a workload
