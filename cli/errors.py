"""The command group that turns gpuq's errors into one line on stderr and a named exit code."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 carries its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - an older typer on plain click
    from click.exceptions import UsageError

from gpuq.cli.render import one_line
from gpuq.service import constants as c
from gpuq.service.errors import GpuqError

if TYPE_CHECKING:
    import click

MESSAGE_WIDTH = 2000


class GpuqGroup(TyperGroup):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpuqError as exc:
            # Messages quote the user's input: escaped and cut, they stay one readable line.
            typer.echo(f"gpuq: {one_line(str(exc), MESSAGE_WIDTH)}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except UsageError as exc:
            # A malformed option (`--priority 1e9`) is bad input too: one line, not a usage box.
            where = f" (gpuq {exc.ctx.info_name} --help)" if exc.ctx is not None and exc.ctx.parent else ""
            text = " ".join(exc.format_message().split())
            typer.echo(f"gpuq: {text}{where}", err=True)
            raise typer.Exit(c.EXIT_USAGE) from None
