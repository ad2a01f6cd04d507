"""`gpuq status`, `submit`, `devices` and `stats` stay instant: they never import torch, matplotlib,
the worker machinery, or anything that talks to the database or the broker (the server does)."""

import subprocess
import sys

import pytest

from tests.conftest import settings_env

PROBE = """
import sys
from typer.testing import CliRunner
from gpuq.cli.app import app
r = CliRunner().invoke(app, sys.argv[1:])
assert r.exit_code == 0, r.output
heavy = sorted(m for m in ("torch", "celery", "gpuq.workers", "kombu", "alembic", "matplotlib", "sqlalchemy",
                           "redis", "aiohttp", "psycopg", "gpuq.server", "gpuq.service.db") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""


@pytest.mark.parametrize("args", [["status"], ["submit", "--", "true"], ["submit", "matmul", "--size", "64"],
                                  ["workloads"], ["devices"], ["stats"]])
def test_status_submit_devices_and_stats_import_no_torch_sqlalchemy_celery_redis_or_workers(use_settings, args):
    env = settings_env(use_settings)
    out = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY \n" in out.stdout, out.stdout


@pytest.mark.parametrize("command", ["run", "attach", "alloc"])
def test_run_attach_and_alloc_load_no_torch_sqlalchemy_celery_redis_or_workers(command):
    probe = f"""
import sys
from gpuq.cli.app import app, LazyGroup
import typer.main
group = typer.main.get_command(app)
assert group.get_command(None, {command!r}) is not None
heavy = sorted(m for m in ("torch", "celery", "gpuq.workers", "kombu", "alembic", "sqlalchemy", "redis", "aiohttp",
                           "psycopg", "gpuq.server", "gpuq.service.db") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY \n" in out.stdout, out.stdout
