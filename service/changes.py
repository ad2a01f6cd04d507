"""What `gpuq update` asks to change (``Changes``), read from a request's body as the CLI and the API
send it: each value checked as a submit checks it, and the words that ask for none (``any``,
``none``). service/update.py decides where each change may go and makes it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpuq.service import constants as c
from gpuq.service import spec
from gpuq.service.errors import InvalidSpec
from gpuq.service.units import MAX_ARRAY_TASKS, Waits, dependency_of, parse_cpus, parse_duration, parse_mem

# The columns a change names, as the API and the answer name them.
FIELDS = ("priority", "time_limit_s", "name", "max_retries", "array_limit", "begin_at", "gpus", "gpu_type",
          "mem_mib", "on_node", "shared", "preemptible", "cpus", "host_mem_mib", "deadline_at", "requeue")
# `--gpu-type any`, `--node any`: no type (node) any more, any will do.
ANY_TYPE = "any"
# `--mem none`: no GPU memory asked (a whole-GPU job's; a shared job needs its share); `--cpus
# none`: no CPU limit; `--host-mem none`: no host memory limit; `--deadline none`: no deadline.
NO_MEM = "none"
# `--deadline none`: no deadline any more (a moment no deadline could be).
NO_DEADLINE = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Changes:
    """What `gpuq update` changes; None leaves a value as it is."""

    priority: int | None = None
    time_limit_s: int | None = None
    name: str | None = None
    max_retries: int | None = None
    array_limit: int | None = None  # 0: no limit
    begin_at: datetime | None = None
    gpus: int | None = None
    gpu_type: str | None = None  # "": any model
    mem_mib: int | None = None  # 0: none asked
    on_node: str | None = None  # "": any node
    shared: bool | None = None  # True: packed by its memory beside other shared jobs; False: whole GPUs
    preemptible: bool | None = None  # `--preemptible` / `--no-preemptible`
    cpus: float | None = None  # `--cpus`; 0: no limit
    host_mem_mib: int | None = None  # `--host-mem`; 0: no limit
    deadline_at: datetime | None = None  # `--deadline`; NO_DEADLINE: none
    requeue: bool | None = None  # `--requeue` / `--no-requeue`
    # What it waits for, in place of what it waited for; Waits(): nothing any more.
    dependency: Waits | None = None
    exclude_nodes: list[str] | None = None  # nodes it may not run on; []: none any more

    @classmethod
    def of(cls, body: dict[str, Any]) -> Changes:
        """The changes of a request's body (``priority``, ``time`` as `--time` takes it, ``name``,
        ``retries``, ``array_limit``, ``begin``, ``deadline`` (``none`` for none), ``gpus``, ``gpu_type``,
        ``mem``, ``node``, ``shared``, ``cpus``, ``host_mem``, and
        ``after``, ``after_any`` or ``dependency`` as a submit takes them, ``dependency`` ``none`` for
        none, ``exclude`` as a submit takes it, ``none`` for none, ``preemptible``); InvalidSpec for
        anything malformed or for no change at all."""
        unknown = set(body) - {"ids", "priority", "time", "name", "retries", "array_limit", "begin", "gpus",
                               "gpu_type", "mem", "node", "shared", "after", "after_any", "dependency", "exclude",
                               "preemptible", "cpus", "host_mem", "deadline", "requeue"}
        if unknown:
            raise InvalidSpec(f"no such change: {sorted(unknown)[0][:40]!r} (priority, time, name, retries, "
                              "array_limit, begin, gpus, gpu_type, mem, node, shared, after, after_any, "
                              "dependency, exclude, preemptible, cpus, host_mem, deadline, requeue)")
        shared = body.get("shared")
        if shared is not None and type(shared) is not bool:
            raise InvalidSpec("--shared must be true or false (--whole)")
        preemptible, requeue = body.get("preemptible"), body.get("requeue")
        if preemptible is not None and type(preemptible) is not bool:
            raise InvalidSpec("--preemptible must be true or false (--no-preemptible)")
        if requeue is not None and type(requeue) is not bool:
            raise InvalidSpec("--requeue must be true or false (--no-requeue)")
        priority, time, name, retries, at_once, gpus, gpu_type, mem, node, cpus = (
            body.get(k) for k in ("priority", "time", "name", "retries", "array_limit", "gpus", "gpu_type", "mem",
                                  "node", "cpus"))
        for option, value in (("--priority", priority), ("--retries", retries), ("--array-limit", at_once),
                              ("--gpus", gpus)):
            if value is not None and (type(value) is not int):
                raise InvalidSpec(f"{option} must be a whole number")
        after, after_any, dependency, exclude, begin, deadline_at, host_mem = (
            body.get(k) for k in ("after", "after_any", "dependency", "exclude", "begin", "deadline", "host_mem"))
        for option, value in (("--begin", begin), ("--deadline", deadline_at),
                              ("--time", time), ("--name", name), ("--gpu-type", gpu_type), ("--mem", mem),
                              ("--node", node), ("--after", after), ("--after-any", after_any),
                              ("--dependency", dependency), ("--exclude", exclude), ("--cpus", cpus),
                              ("--host-mem", host_mem)):
            if value is not None and not isinstance(value, str):
                raise InvalidSpec(f"{option} must be text")
        if priority is not None and not -spec.ADMIN_MAX_PRIORITY <= priority <= spec.ADMIN_MAX_PRIORITY:
            raise InvalidSpec(f"--priority must be between -{spec.ADMIN_MAX_PRIORITY} and {spec.ADMIN_MAX_PRIORITY}")
        if retries is not None and not 0 <= retries <= spec.MAX_RETRIES:
            raise InvalidSpec(f"--retries must be between 0 and {spec.MAX_RETRIES}; got {retries}")
        if at_once is not None and not 0 <= at_once <= MAX_ARRAY_TASKS:
            raise InvalidSpec(f"--array-limit must be between 1 and {MAX_ARRAY_TASKS:,} tasks at once, "
                              f"or 0 for no limit; got {at_once}")
        changes = cls(priority=priority, time_limit_s=parse_duration(time) if time is not None else None,
                      name=spec.check_name(name) if name is not None else None, max_retries=retries,
                      array_limit=at_once, begin_at=spec.begin_of(begin) if begin is not None else None,
                      gpus=spec.check_gpus(gpus) if gpus is not None else None,
                      gpu_type=None if gpu_type is None else "" if gpu_type.strip().lower() == ANY_TYPE
                      else spec.check_gpu_type(gpu_type),
                      mem_mib=None if mem is None else 0 if mem.strip().lower() == NO_MEM else parse_mem(mem),
                      on_node=None if node is None else "" if node.strip().lower() == ANY_TYPE
                      else _node(node), shared=shared, preemptible=preemptible, requeue=requeue,
                      cpus=None if cpus is None else 0.0 if cpus.strip().lower() == NO_MEM else parse_cpus(cpus),
                      host_mem_mib=None if host_mem is None else 0 if host_mem.strip().lower() == NO_MEM
                      else parse_mem(host_mem, "--host-mem"),
                      deadline_at=None if deadline_at is None else NO_DEADLINE if deadline_at.strip().lower() == NO_MEM
                      else spec.begin_of(deadline_at, "deadline"),
                      dependency=dependency_of(after, after_any, dependency, clears=True),
                      exclude_nodes=None if exclude is None else [] if exclude.strip().lower() in ("", "none")
                      else spec.exclude_nodes(exclude))
        if changes.empty:
            raise InvalidSpec(c.UPDATE_ASK)
        return changes

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in FIELDS) and self.dependency is None and self.exclude_nodes is None


def _node(text: str) -> str:
    """A node's name as `--node` gives it; InvalidSpec for none."""
    if not text.strip():
        raise InvalidSpec("--node must not be empty (any: no node asked)")
    return text.strip()
