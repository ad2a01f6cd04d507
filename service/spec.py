"""A job spec: what a user asked to run, checked before anything is written."""

from __future__ import annotations

import itertools
import json
import math
import os
import pwd
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from gpuq.service import constants as c
from gpuq.service.errors import InvalidSpec
from gpuq.service.job_variables import has_surrogate as _has_surrogate
from gpuq.service.job_variables import job_env
from gpuq.service.launchable import check_command
from gpuq.service.units import (
    AFTER_OK,
    MAX_ARRAY_TASKS,
    JobSignal,
    Waits,
    dependency_of,
    parse_array,
    parse_cpus,
    parse_duration,
    parse_mail_address,
    parse_mail_events,
    parse_mem,
    parse_sweep,
)
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
    mem_mib: int | None = None
    on_node: str | None = None
    exclude_nodes: list[str] | None = None  # `--exclude`: nodes it may not run on
    time_limit_s: int | None = None
    max_retries: int = 0
    held: bool = False
    after: list[int] | None = None
    after_kind: str = AFTER_OK  # how it waits for them (units.AFTER_KINDS)
    # sbatch's `-d singleton`: one job of its user and name at a time (units.Waits).
    singleton: bool = False
    env: dict[str, str] | None = None
    array_index: int | None = None
    # How many of its array's tasks may run at once (`--array 0-99%4`); None: as many as fit.
    array_limit: int | None = None
    host_mem_mib: int | None = None
    # CPU cores its processes may use together (`--cpus`, a cgroup's quota); None: no limit.
    cpus: float | None = None
    # Not started before this moment (`--begin`); None: as soon as it can.
    begin_at: datetime | None = None
    # Cancelled while pending once it could no longer end by then (`--deadline`); None: no deadline.
    deadline_at: datetime | None = None
    # Its stdin is forwarded by the `gpuq run` that submits it (service/job_input.py); else /dev/null.
    stdin: bool = False
    # It lives while its client says it is alive (service/kept_jobs.py): an allocation, a `gpuq run`'s job.
    kept: bool = False
    # A command's output copied to these files of the user's as well (service/output_files.py).
    output_file: str | None = None
    error_file: str | None = None
    # Sent ahead of its time limit (`--signal`, units.JobSignal's text); None: none.
    signal: str | None = None
    # Only GPUs of this type (`--gpu-type a100`, policy.is_model); None: any.
    gpu_type: str | None = None
    # May share its GPUs with other shared jobs, held to mem_mib on each (`--shared`).
    shared: bool = False
    # Runs on GPUs no other job waits for, and is requeued when one does (`--preemptible`).
    preemptible: bool = False
    # Requeued after a failure of the machinery (`--requeue`, `--no-requeue`); None: if it asked for retries.
    requeue: bool | None = None
    # Mail about it (`--mail-type`, `--mail-user`; service/mail.py): its events ("BEGIN,END"), None
    # for none, and the address, None for its owner.
    mail_events: str | None = None
    mail_address: str | None = None
    # The code at submit (service/snapshot.py): recorded by submitting.submit_all, copied by a resubmit.
    git_commit: str | None = None
    git_dirty: bool | None = None
    git_diff: str | None = None
    git_diff_cut: bool | None = None
    snapshot: str | None = None


@dataclass(frozen=True)
class Scheduling:
    """What a job asks of the scheduler beyond its GPU count (`gpuq submit` options)."""

    priority: int = 0
    mem: str | None = None
    node: str | None = None
    exclude: str | None = None  # `--exclude a,b` (sbatch's -x): nodes it may not run on
    time: str | None = None
    retries: int = 0
    hold: bool = False
    after: str | None = None
    after_any: str | None = None
    dependency: str | None = None  # sbatch's -d afterok:12:13 or afterany:12: --after's or --after-any's
    host_mem: str | None = None
    cpus: str | None = None  # `--cpus 4`
    shared: bool = False
    begin: str | None = None  # an ISO date and time with its zone (the client reads the user's --begin)
    deadline: str | None = None  # the same for --deadline
    signal: str | None = None  # `--signal [B:]SIG[@SECONDS]`
    gpu_type: str | None = None  # `--gpu-type a100`
    preemptible: bool = False  # `--preemptible`
    requeue: bool | None = None  # `--requeue` (True), `--no-requeue` (False)
    mail_type: str | None = None  # `--mail-type END,FAIL`
    mail_user: str | None = None  # `--mail-user alice@lab.example`

    def fields(self) -> dict[str, Any]:
        """The JobSpec fields these options set; InvalidSpec for a malformed one."""
        if self.shared and self.mem is None:
            raise InvalidSpec("--shared needs --mem: the GPU memory the job may use on each GPU (its share)")
        if not -ADMIN_MAX_PRIORITY <= self.priority <= ADMIN_MAX_PRIORITY:
            raise InvalidSpec(f"--priority must be between -{ADMIN_MAX_PRIORITY} and {ADMIN_MAX_PRIORITY}")
        if not 0 <= self.retries <= MAX_RETRIES:
            raise InvalidSpec(f"--retries must be between 0 and {MAX_RETRIES}; got {self.retries}")
        if self.node is not None and not self.node.strip():
            raise InvalidSpec("--node must not be empty")
        if self.mail_user is not None and self.mail_type is None:
            raise InvalidSpec("--mail-user needs --mail-type: what to mail about (BEGIN, END, FAIL, REQUEUE or ALL)")
        waits = dependency_of(self.after, self.after_any, self.dependency) or Waits()
        return {
            "priority": self.priority,
            "mem_mib": parse_mem(self.mem) if self.mem is not None else None,
            "on_node": self.node,
            "exclude_nodes": exclude_nodes(self.exclude) if self.exclude is not None else None,
            "time_limit_s": parse_duration(self.time) if self.time is not None else None,
            "max_retries": self.retries,
            "held": self.hold,
            "after": list(waits.after) or None,
            "after_kind": waits.kind,
            "singleton": waits.singleton,
            "host_mem_mib": parse_mem(self.host_mem, "--host-mem") if self.host_mem is not None else None,
            "cpus": parse_cpus(self.cpus) if self.cpus is not None else None,
            "shared": self.shared,
            "begin_at": begin_of(self.begin) if self.begin is not None else None,
            "deadline_at": begin_of(self.deadline, "deadline") if self.deadline is not None else None,
            "signal": JobSignal.parse(self.signal).text if self.signal is not None else None,
            "gpu_type": check_gpu_type(self.gpu_type) if self.gpu_type is not None else None,
            "preemptible": self.preemptible,
            "requeue": self.requeue,
            "mail_events": parse_mail_events(self.mail_type) if self.mail_type is not None else None,
            "mail_address": parse_mail_address(self.mail_user) if self.mail_user is not None else None,
        }


ADMIN_MAX_PRIORITY = 1000
MAX_RETRIES = 100


def begin_of(text: str, field: str = "begin") -> datetime:
    """A submit's ``begin`` or ``deadline`` (``field``: what the client made of the user's --begin or
    --deadline): an ISO date and time with its zone, at most MAX_TIME_S ahead of now; InvalidSpec
    otherwise."""
    from gpuq.service.units import MAX_TIME_S

    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidSpec(f"submit field '{field}' must be an ISO date and time; got {text[:40]!r}") from None
    if when.tzinfo is None:
        raise InvalidSpec(f"submit field '{field}' must name its time zone (the client sends UTC)")
    if (when - datetime.now(UTC)).total_seconds() > MAX_TIME_S + 60:
        raise InvalidSpec(f"--{field} is more than {MAX_TIME_S // 86400} days ahead")
    return when.astimezone(UTC)


def sweep_variable(name: str) -> str:
    """The variable a command's job finds a sweep's value in: GPUQ_SWEEP_BATCH_SIZE for batch-size."""
    return f"GPUQ_SWEEP_{name.upper().replace('-', '_')}"


def expand(make: Callable[[list[str]], JobSpec], sched: Scheduling, array: str | None,
           sweeps: list[str]) -> list[JobSpec]:
    """The jobs one submission makes: one, or an array (``--array``) and/or the cross product of
    ``--sweep`` values, each task with its index in GPUQ_ARRAY_INDEX. An ``--array`` with ``%N``
    gives each task that limit: at most N of the submission's tasks run at once.

    ``make(extra_args)`` builds one spec; a sweep passes ``--name value`` to a workload and, for a
    command, sets GPUQ_SWEEP_NAME and replaces ``{name}`` in its arguments.
    """
    extra = sched.fields()
    axes = [parse_sweep(s) for s in sweeps]
    names = [n for n, _ in axes]
    if len(set(names)) != len(names):
        raise InvalidSpec("a --sweep name is given twice")
    if len({sweep_variable(n) for n in names}) != len(names):  # lr and LR, a-b and a_b
        raise InvalidSpec(f"--sweep names {', '.join(names)} set the same GPUQ_SWEEP_ variable: name them apart")
    indices, limit = parse_array(array) if array is not None else (None, None)
    if extra["singleton"] and (indices is not None or axes):
        # Each task has a name of its own (train[3]): one at a time is the array's %1.
        raise InvalidSpec("--dependency singleton is for one job of a name; an array's tasks run one at a time "
                          "with --array 0-9%1")
    if indices is None and not axes:
        return [replace(make([]), **extra)]
    # Counted before it is built: ten sweeps of ten values are 10^10 jobs, which the server would
    # otherwise try to hold in memory before refusing them.
    count = math.prod([len(indices) if indices is not None else 1, *(len(vals) for _, vals in axes)])
    if count > MAX_ARRAY_TASKS:
        raise InvalidSpec(f"this submission makes {count:,} jobs; at most {MAX_ARRAY_TASKS:,}")
    combos = list(itertools.product(*[[(n, v) for v in vals] for n, vals in axes]))
    tasks = list(itertools.product(indices if indices is not None else [None], combos))
    out = []
    for position, (index, combo) in enumerate(tasks):
        task = index if index is not None else position
        spec = make([a for n, v in combo for a in (f"--{n}", v)])
        env = {**(spec.env or {}), "GPUQ_ARRAY_INDEX": str(task)}
        argv = spec.argv
        if spec.kind == c.KIND_COMMAND and spec.argv is not None:
            if combo:
                env.update({sweep_variable(n): v for n, v in combo})
                argv = [_fill(a, dict(combo)) for a in spec.argv]
            if indices is not None:
                argv = [a.replace("{index}", str(task)) for a in argv or []]
        # An array swept: each of its indices with each combination, named by both (train[3,lr=0.1]).
        label = ",".join([*([str(task)] if indices is not None or not combo else []),
                          *(f"{n}={v}" for n, v in combo)])
        out.append(replace(spec, **extra, env=env, array_index=task, array_limit=limit, argv=argv,
                           name=check_name(f"{spec.name}[{label}]"[: c.MAX_NAME_LENGTH])))
    return out


def _fill(arg: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        arg = arg.replace("{" + name + "}", value)
    return arg


def current_user() -> str:
    """The OS user running this process, from its uid: never from $USER or $LOGNAME, which anyone
    can set (``getpass.getuser`` reads those first)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        from gpuq.service.rights import unnamed

        return unnamed(os.getuid())


_GPU_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}", re.ASCII)


def check_gpu_type(text: str) -> str:
    """``--gpu-type`` as given, trimmed; InvalidSpec unless a GPU's model could be written so."""
    gpu_type = text.strip()
    if not _GPU_TYPE.fullmatch(gpu_type):
        raise InvalidSpec(f"--gpu-type takes a GPU model as `gpuq devices` names it, e.g. a100, h100 or rtx3090 "
                          f"(letters, digits, spaces, . _ -, at most 64); got {text[:64]!r}")
    return gpu_type


def check_gpus(gpus: int) -> int:
    if gpus < 1:
        raise InvalidSpec(f"--gpus must be at least 1; got {gpus}")
    if gpus > MAX_GPUS_PER_JOB:
        raise InvalidSpec(f"--gpus {gpus} is more than any node has")
    return gpus


def exclude_nodes(text: str) -> list[str]:
    """``--exclude a,b`` as node names, each once; InvalidSpec for an empty one or a control character."""
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise InvalidSpec(f"--exclude takes node names like a or a,b; got {text[:80]!r}")
    if any(not ch.isprintable() for n in names for ch in n):
        raise InvalidSpec("--exclude: a node name holds a control character")
    return list(dict.fromkeys(names))


def check_name(name: str) -> str:
    if not name.strip():
        raise InvalidSpec("--name must not be empty")
    if len(name) > c.MAX_NAME_LENGTH:
        raise InvalidSpec(f"--name is {len(name)} characters; at most {c.MAX_NAME_LENGTH}")
    if any(ch in name for ch in "\x00\n\r"):
        raise InvalidSpec("--name must be one line of text")
    if any(_is_control(ch) for ch in name):
        raise InvalidSpec("--name must not contain control characters (escape sequences, tabs)")
    if any(ch in _BIDI for ch in name):
        # They reorder what follows them on a page or a terminal: a name could show as another.
        raise InvalidSpec("--name must not contain bidirectional formatting characters (U+202A-U+202E, "
                          "U+2066-U+2069, U+200E, U+200F, U+061C)")
    return name


# Unicode's explicit bidirectional formatting characters (the "Trojan Source" set).
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")


def _is_control(ch: str) -> bool:
    return ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0


def _printable(text: str) -> str:
    """``text`` with control and bidirectional formatting characters written as escapes, for a
    default job name (a command may hold them, as Hebrew or Arabic text does; a name may not)."""
    return "".join(repr(ch)[1:-1] if _is_control(ch) else f"\\u{ord(ch):04x}" if ch in _BIDI else ch
                   for ch in text)


def workload_spec(workload: str, args: list[str], *, gpus: int = 1, name: str | None = None,
                  cwd: str | None = None, user: str | None = None, umask: int | None = None) -> JobSpec:
    """A spec for the built-in workload ``workload`` with its ``--param value`` arguments.

    Its paths are the job's, as a command's would be: a relative one from its working directory
    ``cwd`` (default: here), ``~`` its owner's home (``workloads.job_path``), never the server's.
    ``umask`` is the submitter's, which the files it writes (a checkpoint) are made with, kept in
    its environment as a command's is (``c.UMASK_VARIABLE``)."""
    check_gpus(gpus)
    if len(json.dumps(args, ensure_ascii=False).encode("utf-8", "surrogateescape")) > c.MAX_ARGV_BYTES:
        raise InvalidSpec(f"the parameters are longer than {c.MAX_ARGV_BYTES // 1024} KiB")
    if any("\x00" in a or _has_surrogate(a) for a in args):
        raise InvalidSpec("the parameters must be UTF-8 text without NUL bytes")
    w = get_workload(workload)
    owner, workdir = user or current_user(), cwd or os.getcwd()
    params = w.validate(parse_args(w, args), gpus, cwd=workdir, owner=owner)
    return JobSpec(kind=c.KIND_WORKLOAD, name=check_name(w.name if name is None else name), user=owner,
                   gpus=gpus, cwd=workdir, workload=w.name, params=params,
                   env={} if umask is None else {c.UMASK_VARIABLE: f"{umask:04o}"})


def command_spec(argv: list[str], *, gpus: int = 1, name: str | None = None, cwd: str | None = None,
                 user: str | None = None, path: str | None = None, env: dict[str, str] | None = None) -> JobSpec:
    """A spec for the user's own command, run without a shell in ``cwd`` (default: here), with the
    environment ``env`` (default: ``job_env([])``, the default set from this process's)."""
    check_gpus(gpus)
    if not argv or not argv[0]:
        raise InvalidSpec("no command given after --")
    if any("\x00" in a for a in argv):
        raise InvalidSpec("the command contains a NUL byte")
    if len(json.dumps(argv, ensure_ascii=False).encode("utf-8", "surrogateescape")) > c.MAX_ARGV_BYTES:
        raise InvalidSpec(f"the command line is longer than {c.MAX_ARGV_BYTES // 1024} KiB")
    env = job_env([]) if env is None else env  # the job looks its program up on this PATH
    workdir = os.path.abspath(cwd or os.getcwd())
    check_command(argv, workdir, path if path is not None else env.get("PATH", os.defpath))
    program = argv[0]
    if any(_has_surrogate(a) for a in argv):
        raise InvalidSpec("the command is not valid UTF-8 text")
    default_name = _printable(" ".join([os.path.basename(program), *argv[1:]]).replace("\n", " ").replace("\r", " "))
    return JobSpec(kind=c.KIND_COMMAND, name=check_name(default_name[: c.MAX_NAME_LENGTH] if name is None else name),
                   user=user or current_user(), gpus=gpus, cwd=workdir, argv=list(argv),
                   env=env)


def interactive_spec(argv: list[str] | None, *, node: str, gpus: int = 1, name: str | None = None,
                     cwd: str | None = None, user: str | None = None, run_id: str) -> JobSpec:
    """A spec for an allocation (`gpuq alloc`) on ``node``, the node its client runs on: GPUs held for
    a shell or ``argv``, which the client runs itself, as the user. The command is kept to show it
    (it is not run by the worker); ``run_id`` marks every process of the allocation."""
    check_gpus(gpus)
    if argv is not None:
        if not argv or not argv[0] or any("\x00" in a or _has_surrogate(a) for a in argv):
            raise InvalidSpec("the command after -- must be UTF-8 text without NUL bytes")
        if len(json.dumps(argv, ensure_ascii=False).encode("utf-8")) > c.MAX_ARGV_BYTES:
            raise InvalidSpec(f"the command line is longer than {c.MAX_ARGV_BYTES // 1024} KiB")
    if not node.strip():
        raise InvalidSpec("an allocation needs the node its client runs on")
    shown = _printable(" ".join(argv)) if argv else "shell"
    return JobSpec(kind=c.KIND_INTERACTIVE, name=check_name(f"alloc: {shown}"[: c.MAX_NAME_LENGTH] if name is None
                                                            else name),
                   user=user or current_user(), gpus=gpus, cwd=os.path.abspath(cwd or os.getcwd()), argv=argv,
                   on_node=node, env={"GPUQ_RUN_ID": run_id}, kept=True)
