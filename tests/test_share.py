"""`gpuq share` (service/fair_share.py ``standings``, SLURM's sshare): each user's recent GPU-hours,
decayed, the place in the fair share they give at equal priority (the order the scheduler uses,
which `gpuq why` names), and their jobs and GPUs now; through the server, as JSON and as a table."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from gpuq.service import constants as c
from gpuq.service.db import write_scope
from gpuq.service.display import gpu_hours_text
from gpuq.service.fair_share import standings
from gpuq.service.models import utcnow
from tests.conftest import run_cli
from tests.test_usage import add_job

pytestmark = pytest.mark.timeout(60)


def _lab(settings) -> None:
    """ann ran 2 GPUs for 10 hours, ending now; carl has run 1 GPU for the last hour and still does;
    bob has used nothing and has two jobs waiting; dan waits too, with nothing used."""
    from tests.test_scheduling import submit

    now = utcnow()
    with write_scope(settings) as session:
        add_job(session, "ann", "a", now - timedelta(hours=10), now, gpus=2)
        add_job(session, "carl", "a", now - timedelta(hours=1), None)
    for user in ("bob", "bob", "dan"):
        submit(settings, user=user, gpus=2)


def test_standings_order_users_by_decayed_gpu_hours_and_count_their_jobs_and_gpus(settings):
    _lab(settings)
    with write_scope(settings) as session:
        got = {s.user: s for s in standings(session, settings)}
    assert [u for u in got] == ["bob", "dan", "carl", "ann"]  # first in the order first
    # bob and dan used nothing: they share the first place (their jobs then go by submit time).
    assert [got[u].order for u in got] == [1, 1, 3, 4]
    assert gpu_hours_text(got["ann"].gpu_hours) == "19.6"  # 20 GPU-hours, decayed over 10 h (168 h half-life)
    assert gpu_hours_text(got["carl"].gpu_hours) == "1.0"
    assert (got["carl"].running, got["carl"].gpus, got["carl"].pending) == (1, 1.0, 0)
    assert (got["bob"].running, got["bob"].gpus, got["bob"].pending) == (0, 0.0, 2)
    assert (got["ann"].running, got["ann"].pending) == (0, 0)


def test_gpuq_share_shows_every_users_standing_as_a_table_and_as_json(use_settings):
    s = use_settings
    assert run_cli(["share"], s).stdout == "no recent GPU-hours and no jobs: every user starts even\n"
    _lab(s)
    out = run_cli(["share"], s)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["fair share", "ORDER  USER  GPU-HOURS  GPUS  RUNNING  PENDING"]
    assert [ln.split() for ln in lines[2:6]] == [["1", "bob", "0", "0", "0", "2"], ["1", "dan", "0", "0", "0", "1"],
                                                 ["3", "carl", "1.0", "1", "1", "0"],
                                                 ["4", "ann", "19.6", "0", "0", "0"]]
    assert "each hour counting half after 168 h" in lines[6]
    answer = json.loads(run_cli(["share", "--json"], s).stdout)
    assert answer["half_life_h"] == 168.0
    assert [(u["user"], u["order"], u["pending"]) for u in answer["users"]] == [
        ("bob", 1, 2), ("dan", 1, 1), ("carl", 3, 0), ("ann", 4, 0)]
    assert run_cli(["share", "extra"], s).returncode == c.EXIT_USAGE


def test_gpuq_share_gives_each_users_gpu_limit_where_anyone_has_one(settings, monkeypatch):
    from tests.conftest import ThreadServer, settings_env

    limited = settings.with_overrides(user_gpu_limit=2, user_gpu_limits="carl=1,dan=0")
    _lab(limited)
    for key, value in settings_env(limited).items():
        monkeypatch.setenv(key, value)
    server = ThreadServer(limited)
    try:
        out = run_cli(["share"], limited)
        answer = json.loads(run_cli(["share", "--json"], limited).stdout)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "ORDER  USER  GPU-HOURS  GPUS  LIMIT  RUNNING  PENDING"
    assert [ln.split()[1::3] for ln in lines[2:6]] == [["bob", "2"], ["dan", "-"], ["carl", "1"], ["ann", "2"]]
    assert answer["limited"] is True
    assert {u["user"]: u["gpu_limit"] for u in answer["users"]} == {"bob": 2, "dan": 0, "carl": 1, "ann": 2}
