"""The SLURM commands that a SLURM script's job, and an allocation's shell, find first on their
PATH: ``srun`` (gpuq.cli.srun runs a step's command as the job's tasks), ``scontrol`` (its ``show
hostnames`` and ``requeue``, gpuq.cli.scontrol) and ``sbatch`` (gpuq submit, gpuq.cli.sbatch).
Each is a two-line script that names this process's Python, in a directory holding nothing else,
written by the first process that needs it and again whenever its text is not what this one would
write (a new install, another Python).

A worker keeps them in gpuq's home for the jobs of every user (``directory``): readable and
runnable by all. `gpuq alloc` keeps them in the user's own cache directory (``for_user``) for its
shell, where a user used to salloc runs each step with srun."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("gpuq.worker")

# The directory in gpuq's home (and in a user's cache), put first on a SLURM script's job's PATH.
DIRECTORY = "slurm-bin"


def directory(home: Path) -> str | None:
    """The directory in gpuq's ``home`` holding the commands, made (or made right) where it is not;
    None where it cannot be (a home it may not write: logged, and the job runs without it, as it
    would have)."""
    try:
        return made(home / DIRECTORY)
    except OSError as exc:
        log.warning("no srun, scontrol or sbatch for SLURM scripts' jobs: %s", exc)
        return None


def for_user(environ: Mapping[str, str]) -> str | None:
    """The directory holding this user's commands (in ``$XDG_CACHE_HOME/gpuq``, ``~/.cache/gpuq``
    without it), made where it is not; None where it cannot be (a home that cannot be written,
    none at all): the shell runs without it."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    if not os.path.isabs(cache):
        return None
    try:
        return made(Path(cache) / "gpuq" / DIRECTORY)
    except OSError:
        return None


# Each command, and gpuq's module that runs it.
COMMANDS = {"srun": "gpuq.cli.srun", "scontrol": "gpuq.cli.scontrol", "sbatch": "gpuq.cli.sbatch"}


def made(where: Path) -> str:
    """``where``, holding each of ``COMMANDS`` as this process would write it (OSError where it cannot)."""
    texts = {name: (f"#!/bin/sh\n# {name} inside a gpuq job (or an allocation's shell): gpuq's own, {module}.\n"
                    f'exec {shlex.quote(sys.executable)} -m {module} "$@"\n') for name, module in COMMANDS.items()}
    try:
        if all((where / name).read_text() == text and os.access(where / name, os.X_OK)
               for name, text in texts.items()):
            return str(where)
    except OSError:
        pass
    where.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(where, 0o755)  # past the umask: every user's job runs them
    for name, text in texts.items():
        partial = where / f".{name}.{os.getpid()}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755)
        try:
            os.write(fd, text.encode())
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        os.replace(partial, where / name)  # whole, for a job of another worker starting meanwhile
    return str(where)
