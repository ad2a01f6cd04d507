"""The `gpuq` command: one Typer app composed from one sub-app per file."""

from __future__ import annotations

import typer

from gpuq.cli import config, control, devices, jobs, stack, stats, status, submit
from gpuq.cli.errors import GpuqGroup

app = typer.Typer(cls=GpuqGroup, help="gpuq: the job queue in front of your lab's GPUs.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=True)
for sub in (submit.app, status.app, jobs.app, control.app, devices.app, stats.app, stack.app, config.app):
    app.add_typer(sub)
app.add_typer(stack.db_app, name="db")


def main() -> None:
    app(prog_name="gpuq")
