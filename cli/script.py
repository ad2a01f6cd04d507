"""Job scripts and programs named where a workload's would go, and the options written in scripts.

`gpuq submit train.sh --lr 0.1` takes a script as sbatch takes one, `gpuq run nvidia-smi` a program
as srun does: the first word that is neither one of gpuq's options nor an option's value, when it
is no built-in workload's name, is the job's command from there on, its words untouched, as after
``--`` (`gpuq submit train.sh --gpus 3` passes ``--gpus 3`` to the script). A path, or a file in the
job's directory, is a script: it runs where it is, as ``./train.sh`` (a bare name would be looked
up in PATH), and one that is not executable is run by the interpreter of its ``#!`` line, as the
kernel would run it, since sbatch needs no ``chmod +x``. Any other word is a program on PATH. A
script may come on stdin too (`gpuq submit < job.sh`, ``from_stdin``): the job carries its text.

`gpuq submit -- ./train.sh` (or `-- bash train.sh`) reads the script's leading comment block, up
to its first command, as sbatch does; each ``#GPUQ`` line there holds `gpuq submit` options,
parsed by the command's own parser, so a script takes exactly what the command line takes. An
option given on the command line wins over the script's; a repeatable one (``--env``,
``--sweep``) adds up over the script's lines. The script runs where it is, as the command does:
an edit before the job starts is what runs, unless ``--snapshot`` copied the work tree.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import TYPE_CHECKING, Any

from gpuq.service.errors import InvalidSpec

if TYPE_CHECKING:
    import click

    from gpuq.cli import sbatch_lines

DIRECTIVE = "#GPUQ"
# The head of a script that is read for directives: a job script's comment block is short.
HEAD_BYTES = 64 * 1024
# Options that say how to submit, not what the job is: not for a script to set; --chdir, the
# directory the script itself is found from; and --wrap, a command in place of the script.
NOT_IN_SCRIPTS = {"user", "as_json", "test_only", "parsable", "wait", "chdir", "wrap"}
# A job's GPUs as a script's lines ask for them: a #GPUQ line's, in either form, over an #SBATCH line's.
_GPU_ASKS = {"gpus", "gres", "gpu_type"}
# What a script given on stdin is called, in a job's name and its lines' errors.
STDIN = "stdin"
# How much of a file is read to tell a compiled program from a script.
PROGRAM_HEAD_BYTES = 256


def first_word(params: list[click.Parameter], args: list[str], unknown: bool = False) -> int | None:
    """The index of the first word of ``args`` (a `gpuq submit` command line before any ``--``)
    that is neither an option nor an option's value: a workload's name, a script, a program; None
    without one. ``unknown``: or the first option that is none of ``params``' (a #GPUQ line's stray)."""
    import click

    takes_value = {name: not (param.is_flag or param.count)
                   for param in params if isinstance(param, click.Option)
                   for name in (*param.opts, *param.secondary_opts)}
    at = 0
    while at < len(args):
        word = args[at]
        if word == "-" or not word.startswith("-"):
            return at
        if word.startswith("--"):
            if unknown and word.split("=", 1)[0] not in takes_value:
                return at
            if "=" not in word and takes_value.get(word, False):
                at += 1  # its value is the next word
        else:  # -H, -G2 (its value attached), -HG 2 (flags, then one whose value is the next word)
            for place in range(1, len(word)):
                if unknown and "-" + word[place] not in takes_value:
                    return at
                if takes_value.get("-" + word[place], False):
                    at += place == len(word) - 1
                    break
        at += 1
    return None


def names_a_workload(word: str) -> bool:
    """Whether ``word`` is a built-in workload's name, which goes before a script or a program of
    the same name (``./train`` is the file)."""
    from gpuq.service.constants import WORKLOAD_NAMES

    return word in WORKLOAD_NAMES


def command_of(command: list[str], cwd: str) -> list[str]:
    """The command that runs ``command`` as named in a workload's place, from ``cwd``: a path, or a
    file there, is a job script (sbatch's), run where it is, by itself where it is executable, else
    by its ``#!`` line's interpreter; any other word a program on PATH (srun's). InvalidSpec, in one
    line, for a word that is none of them, or a script that nothing would run."""
    from gpuq.service import reach
    from gpuq.service.display import printable

    word, rest = command[0], command[1:]
    path = os.path.join(cwd, word)
    shown, here = printable(word[:200]), printable(cwd)  # a word is anything: the error stays one line
    is_file = os.path.isfile(path)
    if "/" not in word and not is_file:
        if reach.which(word, os.environ.get("PATH", os.defpath), cwd) is None:
            raise InvalidSpec(f"{shown} is none of gpuq's workloads (gpuq workloads), no file in {here} and no "
                              "command on PATH")
        return command
    if not is_file:
        raise InvalidSpec(f"no such job script: {shown} (in {here})")
    run = word if "/" in word else "./" + word  # exec looks a bare name up in PATH, not here
    if os.access(path, os.X_OK):
        return [run, *rest]
    interpreter = _interpreter(path)
    if interpreter is None:
        guess = "python3" if word.endswith(".py") else "bash" if word.endswith(".sh") else "INTERPRETER"
        raise InvalidSpec(f"{shown} is not executable and has no #! line to say what runs it: chmod +x it, or name "
                          f"its interpreter: gpuq submit -- {guess} {printable(shlex.quote(word))}")
    return [*interpreter, run, *rest]


def _interpreter(path: str) -> list[str] | None:
    """What the kernel would run the script at ``path`` with (``launchable.kernel_argv``)."""
    from gpuq.service.launchable import SHEBANG_BYTES, kernel_argv

    try:
        with open(path, "rb") as f:
            return kernel_argv(f.read(SHEBANG_BYTES))
    except OSError:
        return None


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
            return b"\0" in f.read(PROGRAM_HEAD_BYTES)
    except OSError:
        return False


def directive_lines(path: str, marker: str = DIRECTIVE) -> list[tuple[int, str]]:
    """The ``#GPUQ`` lines (or ``marker``'s: ``#SBATCH``) of the script's leading comment block,
    each with its line number and what follows the marker; a script that cannot be read or is not
    text has none."""
    return lines_of(_head_text(path), marker)


def _head_text(path: str) -> str:
    """The start of a script (HEAD_BYTES), as text; empty for one that cannot be read or is a program."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return ""
    return "" if b"\0" in head else head.decode("utf-8", errors="replace")


def srun_lines(text: str) -> list[int]:
    """The lines of a script's text that run ``srun``, SLURM's task launcher, which only a SLURM
    script's job finds on its PATH (gpuq.cli.srun, its command as the job's one task)."""
    return [number for number, line in enumerate(text.splitlines(), 1) if _SRUN.match(line)]


_SRUN = re.compile(r"\s*(?:exec\s+)?srun(?:\s|$)")


def lines_of(text: str, marker: str = DIRECTIVE) -> list[tuple[int, str]]:
    """``directive_lines`` of a script's text."""
    found = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("#"):
            break  # the first command ends the block, as sbatch stops at it
        if line.startswith(marker) and (len(line) == len(marker) or line[len(marker)].isspace()):
            found.append((number, line[len(marker):].strip()))
    return found


def from_stdin(text: str) -> list[str]:
    """The command that runs a job script given on stdin (`gpuq submit < job.sh`, as sbatch reads
    one): its ``#!`` line's interpreter (``/bin/sh`` without one) given the script's text with
    ``-c``, so the job carries the script itself, as sbatch keeps a copy. InvalidSpec for a script
    that is empty or not text."""
    from gpuq.service.launchable import kernel_argv

    if not text.strip():
        raise InvalidSpec("nothing to run: name a workload (gpuq workloads), a job script or a command, or give a "
                          "script on stdin (it was empty)")
    if "\0" in text:
        raise InvalidSpec("the script given on stdin is not text (a NUL byte)")
    return [*(kernel_argv(text.encode("utf-8", "surrogateescape")[:PROGRAM_HEAD_BYTES]) or ["/bin/sh"]), "-c", text]


def script_options(ctx: click.Context, command: list[str], cwd: str, text: str | None = None,
                   sbatch_line: str | None = None) -> tuple[dict[str, Any], dict[str, str], sbatch_lines.Lines | None]:
    """The options the command's script sets that the command line did not: parameter name →
    value, as ``ctx.params`` holds them; and where each came from (parameter name → ``train.sh
    line 3``), for the server's refusal of one to name its line. Its ``#SBATCH`` lines are read
    first (cli/sbatch_lines.py), its ``#GPUQ`` lines over them; the sbatch options left out are
    said in one line on stderr; and, where it has ``#SBATCH`` lines (a SLURM script: its job is
    given SLURM's variables, service/slurm_names.py, and, as sbatch's default is, with no
    ``--export`` line, ``--env ALL``), what they say beyond gpuq's options (its tasks); None where
    it has none. Cores and GPUs they give per task are the job's times its tasks. ``sbatch_line``:
    sbatch's command line's options (cli/sbatch.py), read as one more ``#SBATCH`` line over all the
    script's lines; with it the job is a SLURM script's whatever its lines. InvalidSpec, naming
    the script's line, for a directive the command would refuse."""
    import click
    from click.core import ParameterSource

    from gpuq.cli import sbatch_lines
    from gpuq.cli.errors import click_message

    path = script_of(command, cwd) if text is None else STDIN
    if path is None and sbatch_line is None:
        return {}, {}, None
    shown = (command[0] if path is None else STDIN if text is not None
             else os.path.relpath(path, cwd) if path.startswith(cwd) else path)
    found: dict[str, Any] = {}
    origins: dict[str, str] = {}
    left_out: list[str] = []
    from_sbatch: set[str] = set()
    sbatch = sbatch_lines.Lines()  # what the #SBATCH lines say beyond gpuq's options
    body = "" if path is None else _head_text(path) if text is None else text
    lines = [(number, line, marker) for marker in (sbatch_lines.MARKER, DIRECTIVE)
             for number, line in lines_of(body, marker)]
    if sbatch_line is not None:  # sbatch's command line, over every line of the script (number 0)
        lines.append((0, sbatch_line, sbatch_lines.MARKER))
    for number, line_text, marker in lines:
        where = f"{shown} line {number}" if number else "sbatch's command line"
        try:
            words = shlex.split(line_text, comments=True)
        except ValueError as exc:
            raise InvalidSpec(f"{where}: {marker} {line_text[:80]}: {exc}") from None
        if marker == sbatch_lines.MARKER:
            try:
                words, dropped = sbatch_lines.translate(words, sbatch)
            except InvalidSpec as exc:
                raise InvalidSpec(f"{where}: {exc}") from None
            left_out += [f"{option} (line {number})" if number else option for option in dropped]
        if not words:
            continue
        if "--" in words:  # the parser would take what follows for the job's command
            raise InvalidSpec(f"{where}: '--': a {marker} line takes gpuq submit's options only")
        # A word, or an option it does not have: the parser would take them for the job's command
        # (or a workload's name) and its parameters.
        if (at := first_word(ctx.command.params, words, unknown=True)) is not None:
            raise InvalidSpec(f"{where}: {words[at][:80]!r}: a {marker} line takes gpuq submit's options only")
        try:
            line = ctx.command.make_context(ctx.info_name, words, parent=ctx.parent)
        except click.ClickException as exc:
            raise InvalidSpec(f"{where}: {click_message(exc)}") from None
        given = {name for name in line.params if line.get_parameter_source(name) == ParameterSource.COMMANDLINE}
        if marker == DIRECTIVE:  # a #GPUQ line's are the job's own, over any the #SBATCH lines gave per task
            sbatch.per_task -= {"gpus" if name == "gres" else name for name in given}
        if marker == DIRECTIVE and given & _GPU_ASKS:  # its GPUs over the #SBATCH lines', in either form
            for name in _GPU_ASKS & from_sbatch:
                found.pop(name, None)
                origins.pop(name, None)
        elif number == 0 and given & _GPU_ASKS:  # sbatch's command line's over every line's
            for name in _GPU_ASKS:
                found.pop(name, None)
                origins.pop(name, None)
        elif marker == sbatch_lines.MARKER:
            from_sbatch.update(given)
        for name, value in line.params.items():
            if name not in given:
                continue
            if name in NOT_IN_SCRIPTS:
                raise InvalidSpec(f"{where}: --{name.replace('as_', '').replace('_', '-')} is given on the "
                                  "command line, not in a script")
            if isinstance(value, (list, tuple)):
                found[name] = [*found.get(name, []), *value]
            else:
                found[name] = value
            origins[name] = where
    from gpuq.service.display import printable

    if left_out:
        sys.stderr.write(printable(f"gpuq: left out of {shown}, as meaning nothing to gpuq: {', '.join(left_out)}")
                         + "\n")
    slurm = any(marker == sbatch_lines.MARKER for _, _, marker in lines)  # sbatch's command line's too
    if slurm and not sbatch.exported:  # sbatch's default, --export=ALL; the command line's --env replaces it
        from gpuq.service.constants import ENV_ALL

        found["env"] = [ENV_ALL, *found.get("env", [])]
        origins.setdefault("env", f"{shown}, sbatch's --export=ALL")
    _per_task(found, sbatch)
    if not slurm and (srun := srun_lines(body)):  # it would fail there, after its wait in the queue: said now
        sys.stderr.write(printable(f"gpuq: note: {shown} runs srun (line {', '.join(map(str, srun[:5]))}), SLURM's "
                                   "task launcher, which a gpuq job finds only where its script has #SBATCH lines "
                                   "(it runs the command as the job's one task)") + "\n")
    kept = {name: value for name, value in found.items()
            if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE}
    if "gpus" not in kept:  # the command line's GPUs are the job's, none of them a task's
        sbatch.gpus_per_task = None
    return kept, {name: origins[name] for name in kept}, sbatch if slurm else None


def _per_task(found: dict[str, Any], sbatch: sbatch_lines.Lines) -> None:
    """The job's cores and GPUs where the #SBATCH lines gave them per task (``-c 4``,
    ``--gpus-per-task=1``) and asked for more than one task: times its tasks, as SLURM gives a job."""
    tasks = sbatch.task_count
    if tasks == 1:
        return
    if "cpus" in sbatch.per_task and found.get("cpus") is not None:
        try:
            found["cpus"] = f"{float(found['cpus']) * tasks:g}"
        except ValueError:
            pass  # refused as it is, in the line the server says
    if "gpus" in sbatch.per_task and found.get("gpus") is not None:
        from dataclasses import replace

        sbatch.gpus_per_task = found["gpus"].count
        found["gpus"] = replace(found["gpus"], count=found["gpus"].count * tasks)


def from_script(message: str, origins: dict[str, str]) -> str:
    """A refusal of a submit, with the script line its option came from where it names one
    (``--gpus 3 is more than any node has (train.sh line 3)``): the server knows options, not lines."""
    for name, where in origins.items():
        option = "--" + name.replace("_", "-")
        if message.startswith(option + " ") or message.startswith(option + ":"):
            return f"{message} ({where})"
    return message
