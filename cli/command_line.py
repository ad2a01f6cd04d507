"""How `gpuq submit`, `run` and `alloc` split their command lines into gpuq's options and the
job's own command, before click parses the options: at ``--``, or, for submit and run, where a
job script or a program is named in a workload's place (cli/script.py). The command's words are
handed on untouched, in the context's ``meta``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typer.core import TyperCommand

if TYPE_CHECKING:
    import click

COMMAND_KEY = "gpuq.command"
# Set where the command is named without -- (cli/script.py): `gpuq submit train.sh`, `gpuq run nvidia-smi`.
NAMED_KEY = "gpuq.named"
# `gpuq run --detach`: leave once the job runs.
DETACH_KEY = "gpuq.detach"


class CommandLine(TyperCommand):
    """Splits the command line at ``--``, or at its first word past gpuq's options where that word
    names the command (``names_command``): what follows is the user's command, untouched."""

    def names_command(self, word: str) -> bool:
        """Whether ``word``, the first past gpuq's options, starts the command without a ``--``."""
        return False

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from gpuq.cli.script import first_word

        before = args[:args.index("--")] if "--" in args else args
        at = first_word(self.params, before)
        if at is not None and self.names_command(before[at]):
            ctx.meta[COMMAND_KEY] = args[at:]
            ctx.meta[NAMED_KEY] = True
            args = args[:at]
        elif "--" in args:
            cut = args.index("--")
            ctx.meta[COMMAND_KEY] = args[cut + 1:]
            args = args[:cut]
        return super().parse_args(ctx, args)


class SubmitCommand(CommandLine):
    """`gpuq submit`'s command line: a job script or a program may be named in a workload's place
    (`gpuq submit -G 2 train.sh --lr 0.1`, `gpuq run nvidia-smi`), the command from there on
    (cli/script.py)."""

    def names_command(self, word: str) -> bool:
        from gpuq.cli.script import names_a_workload

        return not names_a_workload(word)


class RunCommand(SubmitCommand):
    """`gpuq run`: `gpuq submit`'s options (the same function runs both) and ``--detach``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import click

        super().__init__(*args, **kwargs)
        for param in self.params:
            # Still read, to be refused in one line, but not offered: run follows one job, in the terminal.
            if param.name in ("array", "sweep", "as_json") and isinstance(param, click.Option):
                param.hidden = True
        self.params.append(click.Option(
            ["--detach"], is_flag=True, expose_value=False, help="Leave once the job runs (`gpuq attach ID` "
            "follows it again).", callback=lambda ctx, _, value: ctx.meta.__setitem__(DETACH_KEY, value)))


class AllocCommand(CommandLine):
    """`gpuq alloc`'s command line: its first word past gpuq's options starts the command, as salloc
    takes one (`gpuq alloc -G 1 jupyter lab --no-browser`)."""

    def names_command(self, word: str) -> bool:
        return True
