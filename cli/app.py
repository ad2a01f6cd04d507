"""The `gpuq` command: one Typer sub-app per file, composed here and loaded on demand.

A command's module is imported, and its Typer app turned into click commands, only when that
command runs (or when help lists them all): `gpuq status` pays for status.py and the client, not
for the admin commands' imports or the building of thirty commands it will not run.
"""

from __future__ import annotations

import importlib
import inspect
import signal
import sys
from collections.abc import Callable
from typing import Annotated, Any

import click
import typer
import typer.core

from gpuq.cli.errors import GpuqGroup
from gpuq.service import constants as c

# Help in click's plain form: typer renders it with Rich whenever Rich is installed (gpuq installs
# it for `gpuq devices`), and importing typer's Rich help costs 0.1-0.2 s of every `--help`. With Rich
# but no markup, typer (below 0.20, as pinned) still escapes "[default: 1]" as "\[default: 1]", so
# the switch is its own flag, not rich_markup_mode=None.
typer.core.HAS_RICH = False

# command → the module (in gpuq.cli) whose Typer app holds it, and that app's name there.
COMMANDS = {
    "submit": ("submit", "app"), "run": ("submit", "app"), "attach": ("follow", "app"),
    "alloc": ("alloc", "app"), "status": ("status", "app"), "workloads": ("status", "app"),
    "show": ("jobs", "app"), "logs": ("jobs", "app"), "wait": ("ends", "app"), "cancel": ("ends", "app"),
    "resubmit": ("jobs", "app"), "why": ("control", "app"), "hold": ("control", "app"),
    "release": ("control", "app"), "requeue": ("control", "app"), "update": ("control", "app"),
    "drain": ("control", "app"), "resume": ("control", "app"), "retire": ("control", "app"),
    "devices": ("devices", "app"), "stats": ("stats", "app"), "share": ("share", "app"), "history": ("history", "app"),
    "up": ("stack", "app"), "down": ("stack", "app"), "reconfigure": ("stack", "app"), "unit": ("stack", "app"),
    "server": ("stack", "app"), "worker": ("stack", "app"), "scheduler": ("stack", "app"),
    "config": ("config", "app"), "dashboard": ("dashboard", "app"), "db": ("stack", "db_app"),
    "sbatch": ("sbatch", "app"),
}


class LazyGroup(GpuqGroup):
    """The root group: its commands come from their modules the first time they are asked for."""

    # True while `gpuq --help` lists the commands (``format_commands``).
    _listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click's own listing, of commands that carry only their help: building all twenty-six
        # (their parameters into click's) to print a line of each was a quarter of `gpuq --help`.
        self._listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self._listing = False

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        sub_app = getattr(importlib.import_module(f"gpuq.cli.{module}"), attr)
        if name == "db":
            group = typer.main.get_command(sub_app)
            group.name = "db"
            return group
        # Only this command is built: turning a function's parameters into click's is most of a
        # command's start-up after the imports (10 ms for the five of jobs.py).
        for info in sub_app.registered_commands:
            if (info.name or typer.main.get_command_name(info.callback.__name__)) != name:
                continue
            if self._listing:  # its help as typer gives it, and nothing else
                text = inspect.getdoc(info.callback) if info.help is None else inspect.cleandoc(info.help)
                return click.Command(name, help=text, short_help=info.short_help, hidden=info.hidden,
                                     deprecated=info.deprecated)
            command = typer.main.get_command_from_info(info, pretty_exceptions_short=app.pretty_exceptions_short,
                                                       rich_markup_mode=app.rich_markup_mode)
            for param in command.params:
                if isinstance(param.type, click.types.FloatParamType):
                    param.callback = _finite(param.callback)
            return command
        return None


def _finite(then: Callable[..., Any] | None) -> Callable[..., Any]:
    """A float option's callback that refuses NaN first: click's ranges let it through (no
    comparison holds for it), and `gpuq wait --timeout nan` never timed out."""

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if isinstance(value, float) and value != value:
            raise click.BadParameter("nan is not a number", ctx, param)
        return then(ctx, param, value) if then is not None else value

    return check


app = typer.Typer(cls=LazyGroup, help="gpuq: the job queue in front of your lab's GPUs.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=True)


def _version(shown: bool) -> None:
    if shown:
        from gpuq import __version__

        typer.echo(f"gpuq {__version__}")
        raise typer.Exit()


@app.callback()
def gpuq(version: Annotated[bool, typer.Option("--version", help="Print gpuq's version and exit.",
                                               callback=_version, is_eager=True)] = False) -> None:
    """gpuq: the job queue in front of your lab's GPUs."""


def main() -> None:
    from gpuq.cli import client

    client.LEAN = True  # this process is one `gpuq` command: it may do without what it never uses
    try:
        app(prog_name="gpuq")
    except SystemExit as exc:
        # The reader of its output went away (`gpuq status | head -1`): click's 1 read as gpuq's own
        # error; a shell reports a program that SIGPIPE ended as 141, as `gpuq run | head` exits.
        if exc.code == 1 and type(sys.stdout).__name__ == "_PacifyFlushWrapper":
            raise SystemExit(128 + signal.SIGPIPE) from None
        raise
    except OSError as exc:
        # --show-completion and --install-completion tell the shell from this process's parents
        # (shellingham); run from cron, nohup or a service there is none to find.
        if type(exc).__name__ != "ShellDetectionFailure":
            raise
        print("gpuq: cannot tell which shell this is (none among this process's parents); run "
              "`gpuq --show-completion` or `gpuq --install-completion` from the shell it is for", file=sys.stderr)
        sys.exit(c.EXIT_USAGE)
