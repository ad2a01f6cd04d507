"""The command group that turns gpuq's errors into one line on stderr and a named exit code."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as click_errors
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - an older typer on plain click
    from click import exceptions as click_errors
    from click.exceptions import UsageError

from gpuq.cli.render import one_line
from gpuq.service import constants as c
from gpuq.service.errors import GpuqError

if TYPE_CHECKING:
    import click

MESSAGE_WIDTH = 2000

# `gpuq` alone prints its help (no_args_is_help): a UsageError since click 8.2, and not an error.
NoArgsIsHelp: tuple[type[Exception], ...] = tuple(
    e for e in (getattr(click_errors, "NoArgsIsHelpError", None),) if e is not None)


class GpuqGroup(TyperGroup):
    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        # The root's own options are parsed here, before ``invoke``: `gpuq --bogus` too is one line.
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except NoArgsIsHelp:
            raise
        except UsageError as exc:
            usage_error(exc)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpuqError as exc:
            # Messages quote the user's input: escaped and cut, they stay one readable line.
            typer.echo(f"gpuq: {one_line(str(exc), MESSAGE_WIDTH)}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except NoArgsIsHelp:
            raise
        except UsageError as exc:
            usage_error(exc)


_SHORT_FORM = re.compile(r"('--[\w-]+') / '-\w'")


def click_message(exc: click_errors.ClickException) -> str:
    """Click's message on one line, an option with a short form named by its long one alone
    ('--gpus', not '--gpus' / '-G')."""
    return _SHORT_FORM.sub(r"\1", " ".join(exc.format_message().split()))


def usage_error(exc: UsageError) -> NoReturn:
    """End as bad input (exit 2) with click's message as one line on stderr, naming the help to
    read (`gpuq: No such command 'stauts' (gpuq --help)`), not click's usage box of four lines."""
    # A malformed option (`--priority 1e9`) is bad input too.
    where = "" if exc.ctx is None else f" ({' '.join(['gpuq', *_command_words(exc.ctx)])} --help)"
    text = click_message(exc)
    if where and text.endswith("."):
        text = text[:-1]
    typer.echo(f"gpuq: {text}{where}", err=True)
    raise typer.Exit(c.EXIT_USAGE) from None


def _command_words(ctx: click.Context) -> list[str]:
    """The words after `gpuq` that name ``ctx``'s command (`db upgrade`); none for gpuq itself."""
    words = []
    while ctx.parent is not None:
        words.append(ctx.info_name or "")
        ctx = ctx.parent
    return words[::-1]
