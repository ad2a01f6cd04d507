"""A submit as the server takes it: the client's request checked field by field, made into job
specs owned by the caller, queued once per idempotency key.

What the client measured in its own process travels in the request and is checked here like any
input: its working directory, the environment variables it passes on, and its work tree's git
state (git runs as the user, in the user's process). A snapshot is copied by a child process
running as the submitter, so a user can only copy files they can read themselves.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from gpuq.service import allocations, job_variables, jobs, output_files, reach, spec, submitting
from gpuq.service import constants as c
from gpuq.service.db import read_scope, require_schema
from gpuq.service.errors import DuplicateSubmission, InvalidSpec
from gpuq.service.models import Job, utcnow
from gpuq.service.rights import Caller, submitter
from gpuq.service.setting_checks import REQUEUE_DEFAULT
from gpuq.service.settings import Settings
from gpuq.service.snapshot import DIFF_CUT_NOTE, GitState, Staged, Stager
from gpuq.service.workloads import get_workload

_KEY = re.compile(r"[A-Za-z0-9_-]{8,64}")
_OPTIONS: dict[str, tuple[type, Any]] = {
    "workload": (str, None), "args": (list, []), "command": (list, None), "gpus": (int, None),
    "name": (str, None), "priority": (int, 0), "mem": (str, None), "node": (str, None), "exclude": (str, None),
    "preemptible": (bool, False), "requeue": (bool, None),
    "host_mem": (str, None), "cpus": (str, None), "time": (str, None), "retries": (int, 0), "hold": (bool, False),
    "after": (str, None), "after_any": (str, None), "dependency": (str, None), "array": (str, None),
    "sweep": (list, []),
    "snapshot": (bool, False), "env": (list, []), "environ": (dict, {}), "cwd": (str, None),
    "git": (dict, None), "user": (str, None), "key": (str, None), "interactive": (bool, False), "stdin": (bool, False),
    "keep_alive": (bool, False),
    "shared": (bool, False), "umask": (int, None), "output": (str, None), "error": (str, None),
    "begin": (str, None), "deadline": (str, None), "signal": (str, None), "gpu_type": (str, None),
    "mail_type": (str, None), "mail_user": (str, None)}


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    """The request's fields, each of its type (or its default when absent); InvalidSpec for an
    unknown field or a wrong type, so a client's mistake is named rather than ignored."""
    unknown = sorted(set(body) - set(_OPTIONS))
    if unknown:
        raise InvalidSpec(f"unknown submit field {unknown[0]!r}")
    out: dict[str, Any] = {}
    for name, (kind, default) in _OPTIONS.items():
        value = body.get(name, default)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise InvalidSpec(f"submit field {name!r} must be {kind.__name__}")
        out[name] = value
    for name in ("args", "command", "sweep", "env"):
        if out[name] is not None and not all(isinstance(v, str) for v in out[name]):
            raise InvalidSpec(f"submit field {name!r} must be a list of strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in out["environ"].items()):
        raise InvalidSpec("submit field 'environ' must map names to strings")
    if out["umask"] is not None and not 0 <= out["umask"] <= 0o777:
        raise InvalidSpec("submit field 'umask' must be a file mode creation mask, 0 to 0777")
    if out["key"] is not None and not _KEY.fullmatch(out["key"]):
        raise InvalidSpec("submit field 'key' must be 8 to 64 letters, digits, - or _")
    return out


def specs_of(settings: Settings, caller: Caller, f: dict[str, Any]) -> list[spec.JobSpec]:
    """The jobs the request asks for, owned by the caller (or, for root, the user it names), their
    paths checked with the owner's rights (service/reach.py)."""
    owner = submitter(caller, f["user"])
    if f["requeue"] is None and not f["interactive"]:
        # Its own word, else the site's (GPUQ_REQUEUE), kept on the job from now on.
        f = f | {"requeue": REQUEUE_DEFAULT[settings.requeue]}
    with reach.as_owner(owner):
        return _specs_of(f, owner)


def _specs_of(f: dict[str, Any], owner: str) -> list[spec.JobSpec]:
    command, workload = f["command"], f["workload"]
    cwd = f["cwd"]
    if cwd is None or not os.path.isabs(cwd):
        raise InvalidSpec("submit field 'cwd' must be an absolute path")
    if f["gpus"] is None:
        # Not asked for: one GPU, or as many as a built-in workload takes at least (multi-matmul's 2).
        f = f | {"gpus": get_workload(workload).min_gpus if workload is not None and command is None else 1}
    if f["interactive"]:
        return [_allocation(f, owner, command)]
    if command is not None:
        if workload is not None or f["args"]:
            raise InvalidSpec("give either a workload or a command after --, not both")
        variables = job_variables.job_env(f["env"], f["environ"])
        if f["umask"] is not None:
            # The submitter's umask, which the job's files are made with (SLURM's SLURM_UMASK): a
            # root worker's 022 made a user's 077 outputs readable by all on shared storage.
            variables[c.UMASK_VARIABLE] = f"{f['umask']:04o}"

        output, error = _output_file("--output", f["output"]), _output_file("--error", f["error"])

        if f["stdin"] and (f["array"] is not None or f["sweep"]):
            raise InvalidSpec("stdin goes to one job (gpuq run's); an array or a sweep reads none")

        def make(extra: list[str]) -> spec.JobSpec:
            made = spec.command_spec(command, gpus=f["gpus"], name=f["name"], user=owner, env=variables, cwd=cwd)
            return replace(made, output_file=output, error_file=error, stdin=f["stdin"])
    elif f["stdin"]:
        raise InvalidSpec("stdin is for a command (after --); a built-in workload reads none")
    elif f["snapshot"]:
        raise InvalidSpec("--snapshot is for a command after --; a built-in workload runs gpuq's own code")
    elif f["output"] is not None or f["error"] is not None:
        raise InvalidSpec("--output and --error are for a command (after --); a built-in workload's output is "
                          "in `gpuq logs`")
    elif workload is None:
        raise InvalidSpec("nothing to run: name a workload (`gpuq workloads`) or a command after --")
    elif f["env"]:
        raise InvalidSpec("--env is for a command (after --); a built-in workload runs in the worker")
    else:

        def make(extra: list[str]) -> spec.JobSpec:
            return spec.workload_spec(workload, list(f["args"]) + extra, gpus=f["gpus"], name=f["name"],
                                      user=owner, cwd=cwd, umask=f["umask"])

    sched = spec.Scheduling(priority=f["priority"], mem=f["mem"], node=f["node"], time=f["time"],
                            retries=f["retries"], hold=f["hold"], after=f["after"], after_any=f["after_any"],
                            dependency=f["dependency"], host_mem=f["host_mem"], cpus=f["cpus"], shared=f["shared"],
                            begin=f["begin"], deadline=f["deadline"], signal=f["signal"], gpu_type=f["gpu_type"],
                            exclude=f["exclude"],
                            preemptible=f["preemptible"], requeue=f["requeue"], mail_type=f["mail_type"],
                            mail_user=f["mail_user"])
    if f["keep_alive"]:
        # `gpuq run`'s job lives while its client follows it (service/kept_jobs.py).
        if f["array"] is not None or f["sweep"]:
            raise InvalidSpec("keep_alive keeps one job (gpuq run's); an array or a sweep is kept by nobody")
        return [replace(made, kept=True) for made in spec.expand(make, sched, None, [])]
    return spec.expand(make, sched, f["array"], f["sweep"])


def _output_file(option: str, path: str | None) -> str | None:
    """``--output``'s or ``--error``'s path, checked (service/output_files.py), its directory one the
    owner may write in (checked as them, where no pattern fills the directory in: a typo is a line
    now, not a job that fails at its start)."""
    path = output_files.check(option, path)
    if path is not None and "%" not in os.path.dirname(path) and not reach.is_writable_dir(os.path.dirname(path)):
        raise InvalidSpec(f"{option}: {os.path.dirname(path)} is not a directory you may write in")
    return path


# What an allocation (`gpuq alloc`) cannot ask for: it is one shell, now, in the client's terminal.
_NOT_FOR_ALLOCATIONS = {"workload": "a workload", "args": "workload arguments", "array": "--array",
                        "sweep": "--sweep", "snapshot": "--snapshot", "retries": "--retries", "hold": "--hold",
                        "after": "--after", "after_any": "--after-any", "dependency": "--dependency",
                        "host_mem": "--host-mem", "env": "--env", "output": "--output", "error": "--error",
                        "begin": "--begin", "deadline": "--deadline", "signal": "--signal", "exclude": "--exclude",
                        "preemptible": "--preemptible", "mail_type": "--mail-type", "mail_user": "--mail-user",
                        "requeue": "--requeue", "stdin": "forwarded stdin (its command reads your terminal)"}


def _allocation(f: dict[str, Any], owner: str, command: list[str] | None) -> spec.JobSpec:
    for name, what in _NOT_FOR_ALLOCATIONS.items():
        if f[name] not in (None, False, [], 0):
            raise InvalidSpec(f"an allocation (gpuq alloc) takes no {what}")
    if f["node"] is None:
        raise InvalidSpec("an allocation needs submit field 'node': the node its client runs on")
    made = spec.interactive_spec(command, node=f["node"], gpus=f["gpus"], name=f["name"], cwd=f["cwd"], user=owner,
                                 run_id=allocations.new_run_id())
    sched = spec.Scheduling(priority=f["priority"], mem=f["mem"], node=f["node"], time=f["time"], shared=f["shared"],
                            gpu_type=f["gpu_type"], cpus=f["cpus"])
    return replace(made, **sched.fields(), env=made.env)


def git_state(settings: Settings, data: dict[str, Any] | None) -> GitState | None:
    """The work tree's state as the client found it, its diff cut to this server's limit."""
    if data is None:
        return None
    try:
        top, commit, dirty = data["top"], data.get("commit"), bool(data.get("dirty"))
        diff, cut = str(data.get("diff") or ""), bool(data.get("diff_cut"))
    except (KeyError, TypeError):
        raise InvalidSpec("submit field 'git' must hold top, commit, dirty, diff and diff_cut") from None
    if not isinstance(top, str) or (commit is not None and not isinstance(commit, str)):
        raise InvalidSpec("submit field 'git' must hold top, commit, dirty, diff and diff_cut")
    limit = settings.git_diff_max_bytes
    raw = diff.encode("utf-8", "replace")
    if len(raw) > limit:
        diff, cut = raw[:limit].decode("utf-8", "replace") + DIFF_CUT_NOTE.format(limit=limit), True
    return GitState(top=top, commit=(commit or None) and commit[:64], dirty=dirty, diff=diff.replace("\x00", ""),
                    diff_cut=cut)


class Submitted(NamedTuple):
    """What a submit request did: its jobs, the messages of those placed at submit ((job id,
    queue) each, for ``dispatch.send`` once the client has its answer), and whether the request
    repeated a key already used (then nothing was written: the jobs are the first request's)."""

    jobs: list[Job]
    placed: list[tuple[int, str]]
    repeated: bool = False


def submit(settings: Settings, caller: Caller, body: dict[str, Any]) -> Submitted:
    """Queue what ``body`` asks for as the caller's jobs; with a key already used, the jobs that
    key made (a client asking again after a lost answer)."""
    require_schema(settings)
    f = _fields(body)
    specs = specs_of(settings, caller, f)
    git = git_state(settings, f["git"]) if specs[0].kind == "command" else None
    placed: list[tuple[int, str]] = []

    def keep(messages: list[tuple[int, str]]) -> list[tuple[int, str]]:
        placed.extend(messages)
        return []  # none is left for the scheduler: the server sends them all, after the answer

    try:
        made = submitting.submit_all(settings, specs, snapshot=f["snapshot"], git=git, stage=stager(caller),
                                     key=f["key"], send=keep)
        return Submitted(made, placed)
    except DuplicateSubmission as again:
        # Asked again (its answer was lost), or twice at once: the jobs the key made, once.
        with read_scope(settings) as session:
            ids = again.job_ids or submitting.submitted_with(session, f["key"], caller.user) or []
            rows = [jobs.get_job(session, i) for i in ids]
            session.expunge_all()
        if not rows:
            raise
        return Submitted(rows, [], repeated=True)  # their messages went with the first answer


def estimate(settings: Settings, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    """When the jobs ``body`` asks for would start if submitted now (`gpuq submit --test-only`),
    after a submit's checks; nothing is written, copied or sent. Each job's estimate, and the
    submission's in a line: its one job's, or an array's first and last task's."""
    from gpuq.service.estimate import estimate as estimate_of
    from gpuq.service.estimate import sentence

    require_schema(settings)
    f = _fields(body)
    specs = specs_of(settings, caller, f)
    now = utcnow()
    found = estimate_of(settings, specs)
    if len(found) == 1 and found[0].index is None:
        line = f"job {sentence(found[0], now)}"
    else:
        first, last = found[0], found[-1]
        line = f"array of {len(found)}: its first task {sentence(first, now)}"
        if len(found) > 1:
            line += f"; its last {sentence(last, now)}"
    jobs_out = [{"index": e.index, "start": None if e.start is None else e.start.isoformat(), "now": e.now,
                 "node": e.node, "gpus": e.gpus, "reason": e.reason} for e in found]
    return {"jobs": jobs_out, "line": line + "; nothing was queued"}


def stager(caller: Caller) -> Stager | None:
    """How a snapshot is copied for ``caller``: in this process when the server runs as the caller
    (or the caller is root), else by a child running as the caller."""
    if os.geteuid() != 0 or caller.is_root or os.geteuid() == caller.uid:
        return None
    return lambda settings, cwd, git: _stage_as(settings, cwd, git, caller)


def _stage_as(settings: Settings, cwd: str, git: GitState | None, caller: Caller) -> Staged:
    try:
        entry = pwd.getpwuid(caller.uid)
    except KeyError:
        raise InvalidSpec(f"--snapshot: user {caller.user} has no account on this node") from None
    root = settings.snapshots
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o711)  # users reach their own job's copy by name, and list nobody's
    except OSError as exc:
        raise InvalidSpec(f"--snapshot: cannot create {root}: {exc.strerror}") from None
    target = root / f".incoming-{uuid.uuid4().hex}"
    target.mkdir(mode=0o700)
    os.chown(target, entry.pw_uid, entry.pw_gid)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpuq.service.snapshot", str(target), cwd, str(settings.snapshot_max_bytes)],
            user=entry.pw_uid, group=entry.pw_gid, extra_groups=os.getgrouplist(entry.pw_name, entry.pw_gid),
            env={"PATH": os.environ.get("PATH", os.defpath), "HOME": entry.pw_dir, "LANG": "C.UTF-8"},
            capture_output=True, timeout=600, stdin=subprocess.DEVNULL, cwd="/")
        answer = json.loads(done.stdout or b"{}")
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(target, ignore_errors=True)
        raise InvalidSpec(f"--snapshot: the copy as {caller.user} failed: {exc}") from None
    if "error" in answer or "rel" not in answer:
        shutil.rmtree(target, ignore_errors=True)
        raise InvalidSpec(answer.get("error") or f"--snapshot: the copy as {caller.user} failed")
    return Staged(Path(target), answer["rel"])
