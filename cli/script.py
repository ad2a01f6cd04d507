"""Job scripts, as sbatch takes them: `gpuq submit train.sh --lr 0.1`, and the options written in
them as ``#SBATCH`` lines are: ``#GPUQ --gpus 2``.

A script is named where a workload's name would go, as sbatch's one argument: the first word that
is neither one of gpuq's options nor an option's value, when it is a path (a ``.`` or a ``/``,
which no built-in workload's name has). Everything from it on is the job's command, untouched, as
after ``--``: `gpuq submit train.sh --gpus 3` passes ``--gpus 3`` to the script. It runs where it is,
as ``./train.sh`` (a bare name would be looked up in PATH); one that is not executable is run by
the interpreter of its ``#!`` line, as the kernel would run it, since sbatch needs no ``chmod +x``.

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
# What the kernel reads of a script's #! line (BINPRM_BUF_SIZE).
SHEBANG_BYTES = 256


def script_at(params: list[click.Parameter], args: list[str]) -> int | None:
    """Where ``args`` (a `gpuq submit` command line before any ``--``) names a job script: the index
    of its first word that is neither an option nor an option's value, if that word is a path (it
    holds a ``.`` or a ``/``); else None (a workload's name, or no such word)."""
    import click

    takes_value = {name: not (param.is_flag or param.count)
                   for param in params if isinstance(param, click.Option)
                   for name in (*param.opts, *param.secondary_opts)}
    at = 0
    while at < len(args):
        word = args[at]
        if word == "-" or not word.startswith("-"):
            return at if "." in word or "/" in word else None
        if word.startswith("--"):
            if "=" not in word and takes_value.get(word, False):
                at += 1  # its value is the next word
        else:  # -H, -G2 (its value attached), -HG 2 (flags, then one whose value is the next word)
            for place in range(1, len(word)):
                if takes_value.get("-" + word[place], False):
                    at += place == len(word) - 1
                    break
        at += 1
    return None


def script_command(command: list[str], cwd: str) -> list[str]:
    """The command that runs the job script ``command[0]`` (found from ``cwd``) with its arguments:
    the script itself where it is executable, else its ``#!`` line's interpreter on it. InvalidSpec,
    in one line, for a script that is not there or that nothing would run."""
    word, rest = command[0], command[1:]
    path = os.path.join(cwd, word)
    run = word if "/" in word else "./" + word  # exec looks a bare name up in PATH, not here
    if not os.path.isfile(path):
        raise InvalidSpec(f"no such job script: {word} (in {cwd}); a built-in workload's name has no '.' or '/' "
                          "(gpuq workloads)")
    if os.access(path, os.X_OK):
        return [run, *rest]
    interpreter = shebang(path)
    if interpreter is None:
        guess = "python3" if word.endswith(".py") else "bash" if word.endswith(".sh") else "INTERPRETER"
        raise InvalidSpec(f"{word} is not executable and has no #! line to say what runs it: chmod +x it, or name "
                          f"its interpreter: gpuq submit -- {guess} {shlex.quote(word)}")
    return [*interpreter, run, *rest]


def shebang(path: str) -> list[str] | None:
    """The interpreter a script's ``#!`` line names, as the kernel splits it: the program, and at most
    one argument, the rest of the line whole (``#!/usr/bin/env -S python3 -u``); None without one."""
    try:
        with open(path, "rb") as f:
            head = f.read(SHEBANG_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode("utf-8", errors="surrogateescape").strip()
    if not line:
        return None
    return line.split(None, 1)


def script_of(command: list[str], cwd: str) -> str | None:
    """The script a command runs, if one of its first three words names a file here that is not a
    program (``./train.sh``, ``bash train.sh``, ``/bin/bash -x train.sh``, ``/usr/bin/env -S python3 -u
    ./train.py`` as a script's #! line runs it): the first that does, else None."""
    for word in command[:3]:
        path = os.path.join(cwd, word)
        if word and not word.startswith("-") and os.path.isfile(path) and not _is_program(path):
            return path
    return None


def _is_program(path: str) -> bool:
    """Whether the file is a compiled program (``/bin/bash``), not a script: a NUL in its head."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(SHEBANG_BYTES)
    except OSError:
        return False


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
