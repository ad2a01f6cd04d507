"""Options written in a job script, as sbatch reads ``#SBATCH`` lines: ``#GPUQ --gpus 2``.

`gpuq submit -- ./train.sh` (or `-- bash train.sh`) reads the script's leading comment block, up
to its first command, as sbatch does; each ``#GPUQ`` line there holds `gpuq submit` options,
parsed by the command's own parser, so a script takes exactly what the command line takes. An
option given on the command line wins over the script's; a repeatable one (``--env``,
``--sweep``) adds up over the script's lines. The script runs where it is, as the command does:
an edit before the job starts is what runs, unless ``--snapshot`` copied the work tree.
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING, Any

from gpuq.service.errors import InvalidSpec

if TYPE_CHECKING:
    import click

DIRECTIVE = "#GPUQ"
# The head of a script that is read for directives: a job script's comment block is short.
HEAD_BYTES = 64 * 1024
# Options that say how to submit, not what the job is: not for a script to set; --chdir, the
# directory the script itself is found from; and --wrap, a command in place of the script.
NOT_IN_SCRIPTS = {"user", "as_json", "test_only", "parsable", "wait", "chdir", "wrap"}


def script_of(command: list[str], cwd: str) -> str | None:
    """The script a command runs, if one of its first two words names a file here (``./train.sh``,
    ``bash train.sh``): the first that does, else None."""
    for word in command[:2]:
        path = os.path.join(cwd, word)
        if word and not word.startswith("-") and os.path.isfile(path):
            return path
    return None


def directive_lines(path: str) -> list[tuple[int, str]]:
    """The ``#GPUQ`` lines of the script's leading comment block, each with its line number and
    what follows the marker; a script that cannot be read or is not text has none."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return []
    if b"\0" in head:
        return []  # a program, not a script
    found = []
    for number, raw in enumerate(head.decode("utf-8", errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("#"):
            break  # the first command ends the block, as sbatch stops at it
        if line.startswith(DIRECTIVE) and (len(line) == len(DIRECTIVE) or line[len(DIRECTIVE)].isspace()):
            found.append((number, line[len(DIRECTIVE):].strip()))
    return found


def script_options(ctx: click.Context, command: list[str], cwd: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The options the command's script sets that the command line did not: parameter name →
    value, as ``ctx.params`` holds them; and where each came from (parameter name → ``train.sh
    line 3``), for the server's refusal of one to name its line. InvalidSpec, naming the script's
    line, for a directive the command would refuse."""
    import click
    from click.core import ParameterSource

    from gpuq.cli.errors import click_message

    path = script_of(command, cwd)
    if path is None:
        return {}, {}
    shown = os.path.relpath(path, cwd) if path.startswith(cwd) else path
    found: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for number, text in directive_lines(path):
        where = f"{shown} line {number}"
        try:
            words = shlex.split(text, comments=True)
        except ValueError as exc:
            raise InvalidSpec(f"{where}: {DIRECTIVE} {text[:80]}: {exc}") from None
        if not words:
            continue
        if "--" in words:  # the parser would take what follows for the job's command
            raise InvalidSpec(f"{where}: '--': a {DIRECTIVE} line takes gpuq submit's options only")
        try:
            line = ctx.command.make_context(ctx.info_name, words, parent=ctx.parent)
        except click.ClickException as exc:
            raise InvalidSpec(f"{where}: {click_message(exc)}") from None
        stray = [*([line.params["workload"]] if line.params.get("workload") is not None else []), *line.args]
        if stray:
            raise InvalidSpec(f"{where}: {stray[0][:80]!r}: a {DIRECTIVE} line takes gpuq submit's options only")
        for name, value in line.params.items():
            if line.get_parameter_source(name) != ParameterSource.COMMANDLINE:
                continue
            if name in NOT_IN_SCRIPTS:
                raise InvalidSpec(f"{where}: --{name.replace('as_', '').replace('_', '-')} is given on the "
                                  "command line, not in a script")
            if isinstance(value, (list, tuple)):
                found[name] = [*found.get(name, []), *value]
            else:
                found[name] = value
            origins[name] = where
    kept = {name: value for name, value in found.items()
            if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE}
    return kept, {name: origins[name] for name in kept}


def from_script(message: str, origins: dict[str, str]) -> str:
    """A refusal of a submit, with the script line its option came from where it names one
    (``--gpus 3 is more than any node has (train.sh line 3)``): the server knows options, not lines."""
    for name, where in origins.items():
        option = "--" + name.replace("_", "-")
        if message.startswith(option + " ") or message.startswith(option + ":"):
            return f"{message} ({where})"
    return message
