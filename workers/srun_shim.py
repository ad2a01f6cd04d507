"""The ``srun`` a SLURM script's job finds first on its PATH (gpuq.cli.srun runs its command as the
job's one task): a two-line script in gpuq's home that names this worker's Python, written by the
first worker that needs it, and again whenever its text is not what this worker would write (a
new install, another Python). Readable and runnable by every user, as the jobs of all of them
need it; the directory holds nothing else."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

log = logging.getLogger("gpuq.worker")

# The directory in gpuq's home, put first on a SLURM script's job's PATH.
DIRECTORY = "slurm-bin"


def directory(home: Path) -> str | None:
    """The directory holding ``srun``, made (or made right) where it is not; None where it cannot
    be (a home it may not write: logged, and the job runs without it, as it would have)."""
    try:
        return _made(home)
    except OSError as exc:
        log.warning("no srun for SLURM scripts' jobs: %s", exc)
        return None


def _made(home: Path) -> str:
    where = home / DIRECTORY
    text = ("#!/bin/sh\n# srun inside a gpuq job from a SLURM script: its command, as the job's one task.\n"
            f'exec {shlex.quote(sys.executable)} -m gpuq.cli.srun "$@"\n')
    shim = where / "srun"
    try:
        if shim.read_text() == text and os.access(shim, os.X_OK):
            return str(where)
    except OSError:
        pass
    where.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(where, 0o755)  # past the umask: every user's job runs it
    partial = where / f".srun.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)
    os.replace(partial, shim)  # whole, for a job of another worker starting meanwhile
    return str(where)
