"""Scheduling with real worker processes: two nodes, arrays, dependencies, time limits, holds."""

from __future__ import annotations

import json
import sys

import pytest

from gpuq.service import constants as c
from gpuq.service import db
from gpuq.service.constants import State
from tests.conftest import Stack, make_settings, run_cli
from tests.test_end_to_end import output_of, submit, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, redis_url):
    """Node "alpha" with one GPU's worker and node "beta" with two, serving one queue."""
    home = tmp_path_factory.mktemp("nodes")
    settings = make_settings(home / "home", f"sqlite:///{home / 'gpuq.db'}", redis_url, node="alpha", fake_gpus=1)
    db.upgrade(settings)
    st = Stack(settings, home / "logs")
    st.start_server()
    st.start_scheduler()
    st.start_worker(0, node="alpha")
    for i in (0, 1):
        st.start_worker(i, node="beta", fake_gpus=2)
    st.wait_registered(3)
    yield st
    st.stop()
    db.dispose_engines()


def test_a_two_gpu_job_goes_to_the_node_that_has_two_and_sees_both(two_nodes, tmp_path):
    s = two_nodes.settings
    two_nodes.wait_registered(3)
    code = "import os; print(os.environ['GPUQ_NODE'], os.environ['CUDA_VISIBLE_DEVICES'])"
    job = submit(s, ["--gpus", "2", "--", sys.executable, "-c", code], cwd=tmp_path)
    assert wait_for_state(s, job, c.END_STATES) == State.SUCCEEDED, two_nodes.logs()
    assert output_of(s, job).strip() == "beta 0,1"


def test_array_tasks_each_see_their_index_and_wait_takes_the_array(two_nodes, tmp_path):
    s = two_nodes.settings
    two_nodes.wait_registered(3)
    out = run_cli(["submit", "--array", "0-4", "--json", "--", sys.executable, "-c",
                   "import os; print('task', os.environ['GPUQ_ARRAY_INDEX'])"], s, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    array = made[0]["array_id"]
    waited = run_cli(["wait", "--array", str(array), "--timeout", "90"], s, timeout=120)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert sorted(output_of(s, j["id"]).strip() for j in made) == [f"task {i}" for i in range(5)]


def test_a_dependency_starts_only_after_its_parent_succeeded(two_nodes, tmp_path):
    s = two_nodes.settings
    two_nodes.wait_registered(3)
    marker = tmp_path / "made"
    first = submit(s, ["--", sys.executable, "-c",
                       f"import time; time.sleep(1); open({str(marker)!r}, 'w').write('ok')"])
    second = submit(s, ["--after", str(first), "--", sys.executable, "-c", f"print(open({str(marker)!r}).read())"])
    assert wait_for_state(s, second, c.END_STATES) == State.SUCCEEDED
    assert output_of(s, second).strip() == "ok"


def test_a_job_over_its_time_limit_is_stopped_by_its_worker(two_nodes, tmp_path):
    s = two_nodes.settings
    two_nodes.wait_registered(3)
    job = submit(s, ["--time", "2s", "--", sys.executable, "-c", "import time; time.sleep(120)"])
    waited = run_cli(["wait", str(job), "--timeout", "60"], s, timeout=90)
    assert waited.returncode == c.EXIT_JOB_FAILED and f"job {job} timed_out" in waited.stdout
    assert "time limit of 0:00:02 reached" in run_cli(["why", str(job)], s).stdout


def test_status_shows_why_a_held_job_waits_and_release_lets_it_run(two_nodes):
    s = two_nodes.settings
    two_nodes.wait_registered(3)
    job = submit(s, ["--hold", "--", "true"])
    wait_for_state(s, job, [State.PENDING])
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = next(ln for ln in run_cli(["status"], s).stdout.splitlines() if ln.strip().startswith(str(job)))
        if "held" in line:
            break
    assert "pending" in line and "held" in line
    assert f"`gpuq release {job}`" in run_cli(["why", str(job)], s).stdout
    assert run_cli(["release", str(job)], s).returncode == 0
    assert wait_for_state(s, job, c.END_STATES) == State.SUCCEEDED
