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
                                  ["workloads"], ["devices"], ["stats"], ["history"], ["share"]])
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


# The probe with the command's exit code and output printed instead of asserted.
CODE_PROBE = PROBE.replace("assert r.exit_code == 0, r.output\n",
                           "print('EXIT', r.exit_code, r.output.replace(chr(10), ' '))\n")


def test_every_command_on_a_job_imports_no_torch_sqlalchemy_celery_redis_or_workers(use_settings, tmp_path):
    # Every user-facing command talks to the server only: show, logs, why, hold, release, resubmit,
    # cancel and wait, on a job queued held (no worker runs it).
    env = settings_env(use_settings)

    def probe(*args: str) -> tuple[int, str]:
        out = subprocess.run([sys.executable, "-c", CODE_PROBE, *args], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "HEAVY \n" in out.stdout, (args, out.stdout)
        code, _, said = out.stdout.split("EXIT ", 1)[1].partition(" ")
        return int(code), said

    code, said = probe("submit", "--hold", "--", "true")
    assert code == 0, said
    job = said.split("submitted job ", 1)[1].split()[0]
    for args in (("show", job), ("logs", job), ("why", job), ("release", job), ("hold", job), ("resubmit", job),
                 ("cancel", job)):
        code, said = probe(*args)
        assert code == 0, (args, said)
    code, said = probe("requeue", job)
    assert code == 4 and "only a running job can be requeued" in said, said  # it ended: refused, nothing heavy
    code, said = probe("wait", job)
    assert code != 0 and "cancelled" in said, said  # ended, not succeeded


def test_the_root_help_lists_every_command_as_click_would_from_the_built_commands():
    # `gpuq --help` lists the commands from their help alone, without building each one.
    import click
    from typer.testing import CliRunner

    from gpuq.cli.app import LazyGroup, app

    listed = CliRunner().invoke(app, ["--help"])
    assert listed.exit_code == 0, listed.output
    real = LazyGroup.format_commands
    try:
        LazyGroup.format_commands = click.Group.format_commands  # every command built, as click does
        built = CliRunner().invoke(app, ["--help"])
    finally:
        LazyGroup.format_commands = real
    assert listed.output == built.output and "status" in listed.output and "submit" in listed.output
