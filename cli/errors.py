"""The command group that turns gpuq's errors into one line on stderr and a named exit code."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from gpuq.service.errors import GpuqError


class GpuqGroup(TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except GpuqError as exc:
            typer.echo(f"gpuq: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
