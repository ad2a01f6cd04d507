"""The variables a command job is submitted with (`--env`, sbatch's --export): the default set
taken from the submitter's environment, those named, or all a job may be given (`--env ALL`);
never those that would make it run code it did not name, nor gpuq's own."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec
from gpuq.service.settings import secret_env_names

DEFAULT_ENV = c.DEFAULT_ENV
DEFAULT_ENV_PREFIXES = c.DEFAULT_ENV_PREFIXES
# Variables that make the loader, a shell or an interpreter run code the command did not name, and
# those gpuq owns (the GPUs a job sees are the ones it was given). Refused in --env.
_REFUSED_ENV = frozenset({"LD_PRELOAD", "LD_AUDIT", "LD_PROFILE", "LD_DEBUG", "LD_DEBUG_OUTPUT",
                          "LD_ORIGIN_PATH", "LD_SHOW_AUXV", "LD_DYNAMIC_WEAK", "LD_BIND_NOW", "LD_BIND_NOT",
                          "LD_USE_LOAD_BIAS", "GLIBC_TUNABLES", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS",
                          "PS4", "IFS", "PERL5OPT", "RUBYOPT", "NODE_OPTIONS", "PYTHONSTARTUP", "PYTHONINSPECT",
                          "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES",
                          "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                          # Set from the owner's account where the job runs (a root worker): accepted,
                          # they were silently replaced.
                          "HOME", "USER", "LOGNAME", "SHELL"})
_REFUSED_ENV_PREFIXES = ("GPUQ_", "LD_", "DYLD_", "BASH_FUNC_")
_ENV_ALLOWED_LD = frozenset({"LD_LIBRARY_PATH"})  # a conda or CUDA install may need it; a plain path list
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_ENV_VALUE_BYTES = 64 * 1024
MAX_ENV_BYTES = 256 * 1024


# What ``--env ALL`` leaves out besides: SLURM's names for a job's facts, which a SLURM script's job
# is given by its worker (service/slurm_names.py) and its srun; those of the job an sbatch ran in
# (SLURM_NTASKS, SLURM_JOB_ID...) are not the new job's.
_NOT_ALL_PREFIXES = ("SLURM_",)


def _may_pass(name: str, value: str) -> bool:
    """Whether ``--env ALL`` passes this variable on: one ``--env NAME`` would take, text without
    NUL, none of SLURM's names for a job."""
    if name.startswith(_NOT_ALL_PREFIXES):
        return False
    try:
        check_env_name(name)
    except InvalidSpec:
        return False
    return "\x00" not in value and len(value.encode("utf-8", "surrogateescape")) <= MAX_ENV_VALUE_BYTES


def check_env_name(name: str) -> str:
    if not _ENV_NAME.fullmatch(name):
        raise InvalidSpec(f"--env {name[:60]!r}: not a variable name (letters, digits, _)")
    if name not in _ENV_ALLOWED_LD and (name in _REFUSED_ENV or name.startswith(_REFUSED_ENV_PREFIXES)
                                        or name in secret_env_names()):
        raise InvalidSpec(f"--env {name}: this variable may not be set for a job (gpuq sets it, or it "
                          f"could make the job run code it did not name)")
    return name


def job_env(requests: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a command job is submitted with: the default set taken from ``environ`` (the
    submitter's environment) plus each ``--env NAME=VALUE`` or ``--env NAME`` (value from ``environ``).
    ``--env ALL`` (sbatch's ``--export=ALL``) takes every variable of ``environ`` that a job may be
    given, leaving out, as the default set does, those it may not be and those that are not text."""
    source = os.environ if environ is None else environ
    everything = c.ENV_ALL in requests
    # A default variable that is not UTF-8 text is left out; a named one is refused below.
    env = {k: v for k, v in source.items()
           if (k in DEFAULT_ENV or k.startswith(DEFAULT_ENV_PREFIXES) or (everything and _may_pass(k, v)))
           and not has_surrogate(v)}
    for item in requests:
        if item == c.ENV_ALL:
            continue
        name, eq, value = item.partition("=")
        check_env_name(name)
        if not eq:
            if name not in source:
                raise InvalidSpec(f"--env {name}: not set here; give --env {name}=VALUE")
            value = source[name]
        env[name] = value
    for name, value in env.items():
        if "\x00" in value:
            raise InvalidSpec(f"--env {name}: the value contains a NUL byte")
        if has_surrogate(value):
            raise InvalidSpec(f"--env {name}: the value is not valid UTF-8 text")
        if len(value.encode("utf-8", "surrogateescape")) > MAX_ENV_VALUE_BYTES:
            raise InvalidSpec(f"--env {name}: the value is longer than {MAX_ENV_VALUE_BYTES // 1024} KiB")
    if sum(len(k) + len(v.encode("utf-8", "surrogateescape")) + 2 for k, v in env.items()) > MAX_ENV_BYTES:
        raise InvalidSpec(f"the job's environment is larger than {MAX_ENV_BYTES // 1024} KiB"
                          + (" (--env ALL, a SLURM script's default: name what it needs instead, --env NAME or "
                             "#SBATCH --export=NAME,...)" if everything else ""))
    return env


def has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
