"""GPU limits per user: ``GPUQ_USER_GPU_LIMIT`` holds every user's jobs to so many GPUs at once,
and ``GPUQ_USER_GPU_LIMITS`` ("alice=1,pi=0") gives some users their own in its place (SLURM's
MaxTRESPerUser=gres/gpu=N on a user's association); 0 is no limit. The policy reads them through
``QueueState.limit_of``; the worker that takes a listed job, the submit checks and `gpuq why`
through ``Settings.gpu_limit_of``: both ``limit_of`` here."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpuq.service.errors import ConfigError

# A login name as useradd takes it (and SLURM's): letters, digits, '.', '_', '-', a '$' at the end.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\$?", re.ASCII)
MOST = 100_000  # GPUs: past any lab's, and a mistyped "alice=20000000000" is caught


def limit_of(user: str, default: int, own: Mapping[str, int]) -> int:
    """The GPUs ``user``'s jobs may hold at once: their own limit, else everyone's; 0: no limit."""
    return own.get(user, default)


def any_limit(default: int, own: Mapping[str, int]) -> bool:
    """Whether any user is held to a GPU limit."""
    return bool(default) or any(own.values())


def parse(text: str) -> dict[str, int]:
    """``user_gpu_limits``' text as {user: GPUs}; ConfigError naming the part that is wrong."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        user, sep, gpus = (s.strip() for s in part.partition("="))
        if not sep or not _NAME.fullmatch(user) or not gpus.isascii() or not gpus.isdigit() or int(gpus) > MOST:
            raise ConfigError(f"user_gpu_limits takes USER=GPUS pairs separated by commas, e.g. alice=1,pi=0 (0: no "
                              f"limit), got {part!r}")
        if user in out:
            raise ConfigError(f"user_gpu_limits gives {user} twice")
        out[user] = int(gpus)
    return out
