"""A job spec: what a user asked to run, checked before anything is written."""

from __future__ import annotations

import getpass
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec
from gpuq.service.workloads import get_workload, parse_args

MAX_GPUS_PER_JOB = 1024  # a sanity bound, far above any node; the real bound is the largest node


@dataclass(frozen=True)
class JobSpec:
    """A validated job, ready to become a ``jobs`` row."""

    kind: str
    name: str
    user: str
    gpus: int
    cwd: str
    workload: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    argv: list[str] | None = None
    priority: int = 0


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid{os.getuid()}"


def check_gpus(gpus: int) -> int:
    if gpus < 1:
        raise InvalidSpec(f"--gpus must be at least 1; got {gpus}")
    if gpus > MAX_GPUS_PER_JOB:
        raise InvalidSpec(f"--gpus {gpus} is more than any node has")
    return gpus


def check_name(name: str) -> str:
    if not name.strip():
        raise InvalidSpec("--name must not be empty")
    if len(name) > c.MAX_NAME_LENGTH:
        raise InvalidSpec(f"--name is {len(name)} characters; at most {c.MAX_NAME_LENGTH}")
    if any(ch in name for ch in "\x00\n\r"):
        raise InvalidSpec("--name must be one line of text")
    return name


def workload_spec(workload: str, args: list[str], *, gpus: int = 1, name: str | None = None,
                  cwd: str | None = None, user: str | None = None) -> JobSpec:
    """A spec for the built-in workload ``workload`` with its ``--param value`` arguments."""
    check_gpus(gpus)
    w = get_workload(workload)
    params = w.validate(parse_args(w, args), gpus)
    return JobSpec(kind=c.KIND_WORKLOAD, name=check_name(w.name if name is None else name), user=user or current_user(),
                   gpus=gpus, cwd=cwd or os.getcwd(), workload=w.name, params=params)


def command_spec(argv: list[str], *, gpus: int = 1, name: str | None = None, cwd: str | None = None,
                 user: str | None = None, path: str | None = None) -> JobSpec:
    """A spec for the user's own command, run without a shell in ``cwd`` (default: here)."""
    check_gpus(gpus)
    if not argv or not argv[0]:
        raise InvalidSpec("no command given after --")
    if any("\x00" in a for a in argv):
        raise InvalidSpec("the command contains a NUL byte")
    if len(json.dumps(argv).encode()) > c.MAX_ARGV_BYTES:
        raise InvalidSpec(f"the command line is longer than {c.MAX_ARGV_BYTES // 1024} KiB")
    workdir = os.path.abspath(cwd or os.getcwd())
    if not os.path.isdir(workdir):
        raise InvalidSpec(f"working directory {workdir} does not exist")
    program = argv[0]
    if os.sep in program:
        target = program if os.path.isabs(program) else os.path.join(workdir, program)
        if not (os.path.isfile(target) and os.access(target, os.X_OK)):
            raise InvalidSpec(f"{program} is not an executable file (from {workdir})")
    elif shutil.which(program, path=path if path is not None else os.environ.get("PATH")) is None:
        raise InvalidSpec(f"command not found: {program} (not on PATH)")
    default_name = " ".join([os.path.basename(program), *argv[1:]]).replace("\n", " ").replace("\r", " ")
    return JobSpec(kind=c.KIND_COMMAND, name=check_name(default_name[: c.MAX_NAME_LENGTH] if name is None else name),
                   user=user or current_user(), gpus=gpus, cwd=workdir, argv=list(argv))
