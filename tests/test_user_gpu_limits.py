"""A user's own GPU limit (GPUQ_USER_GPU_LIMITS) on a real stack: the scheduler and the workers that
take their GPUs' next jobs themselves both hold the user to it, while a user it does not name keeps
everyone's (none here)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from gpuq.service import spec
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.models import Job
from tests.conftest import cli_submit, run_cli, stack_on_database, wait_for_state

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def two_gpus(request, tmp_path_factory, redis_url):
    """Two simulated GPUs; the tests' user (who submits) may hold one at a time, everyone else any."""
    yield from stack_on_database(request, tmp_path_factory, redis_url, fake_gpus=2,
                                 user_gpu_limits=f"{spec.current_user()}=1,nobody-else=2")


def test_a_users_own_limit_holds_their_jobs_to_one_gpu_at_a_time_however_they_start(two_gpus, tmp_path):
    s = two_gpus.settings
    ids = [cli_submit(s, ["-t", "5m", "--", "sleep", "0.4"], cwd=tmp_path) for _ in range(4)]
    most = 0
    deadline = time.monotonic() + 60
    while True:
        with write_scope(s) as session:
            states = dict(session.execute(select(Job.id, Job.state).where(Job.id.in_(ids))).all())
            running = session.scalar(select(func.count()).select_from(Job).where(
                Job.id.in_(ids), Job.state.in_((State.DISPATCHED, State.RUNNING))))
        most = max(most, running)
        if all(state in (State.SUCCEEDED, State.FAILED) for state in states.values()):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.02)
    assert set(states.values()) == {State.SUCCEEDED}, two_gpus.logs()
    assert most == 1  # two GPUs free all along: only the limit kept the second job back
    # `gpuq why` and `gpuq share` give the user's own limit.
    waiting = [cli_submit(s, ["-t", "5m", "--", "sleep", "30"], cwd=tmp_path) for _ in range(2)]
    assert wait_for_state(s, waiting[0], (State.RUNNING,)) == State.RUNNING
    deadline = time.monotonic() + 10
    while run_cli(["status", "-o", "reason", "-h", "-j", str(waiting[1])], s).stdout.strip() != "user limit":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    why = run_cli(["why", str(waiting[1])], s).stdout
    assert f"{spec.current_user()} holds 1 GPU and the limit is 1 at once" in why, why
    rows = [line.split() for line in run_cli(["share"], s).stdout.splitlines()]
    assert rows[1][4] == "LIMIT" and [row[4] for row in rows if row[1:2] == [spec.current_user()]] == ["1"]
    assert run_cli(["cancel", *map(str, waiting)], s).returncode == 0
