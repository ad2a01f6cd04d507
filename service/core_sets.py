"""Which of a node's CPU cores a job's processes run on: a job with `--cpus N` is bound to N cores
of its own (whole cores: `--cpus 1.5` gets two), as SLURM's task/affinity binds a task to the
cores its allocation counted, and where it can, to cores near its GPUs (their NUMA node, as NVML's
CPU affinity gives it), as SLURM's ``--gres-flags=enforce-binding`` prefers.

The scheduler counts a node's cores (service/node_use.py); this picks which. Pure: the node's
worker keeps the record of who holds which (workers/core_binding.py) and calls ``choose``.

Lists are written as Linux writes them (``cpuset.cpus``, ``taskset -c``, ``nproc``'s cores):
``0-3,8,10-11``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection, Iterable

from gpuq.service.errors import InvalidSpec
from gpuq.service.node_use import SLACK


def cores_for(cpus: float) -> int:
    """The whole cores a job of ``cpus`` (`--cpus`) is bound to: at least one, a fraction rounded up
    (its cgroup's quota, where there is one, holds it to the fraction)."""
    return max(1, math.ceil(cpus - SLACK))


def choose(count: int, available: Iterable[int], held: Counter[int], near: Collection[int] = ()) -> tuple[int, ...]:
    """``count`` cores of ``available`` (the cores the node's worker may run on) for a new job, sorted:
    those held by the fewest other jobs first (``held``: each core's count of jobs bound to it), then
    those in ``near`` (its GPUs' own cores), then the lowest. A node's jobs ask at most the cores it
    offers (the scheduler counts them), so the first come from cores nobody holds; only where the
    offer says more cores than the worker may use, or fractions round up, do jobs share some. All of
    ``available`` where it has no more than ``count``."""
    cores = sorted(set(available))
    if count >= len(cores):
        return tuple(cores)
    ranked = sorted(cores, key=lambda core: (held[core], core not in near, core))
    return tuple(sorted(ranked[:count]))


def format_list(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` as ``0-3,8``."""
    out: list[str] = []
    run: list[int] = []
    for core in sorted(set(cores)):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            out.append(_run_text(run))
        run = [core]
    if run:
        out.append(_run_text(run))
    return ",".join(out)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def parse_list(text: str) -> frozenset[int]:
    """``0-3,8`` as its cores; InvalidSpec for anything else (a setting's value, a GPU's list)."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        found = _RANGE.fullmatch(part)
        if found is None or int(found[2] or found[1]) < int(found[1]):
            raise InvalidSpec(f"{text[:100]!r} is not a list of CPU cores (as 0-3,8)")
        cores.update(range(int(found[1]), int(found[2] or found[1]) + 1))
    return frozenset(cores)


_RANGE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")


def from_mask(words: Iterable[int], bits: int = 64) -> frozenset[int]:
    """The cores of a CPU mask given as words of ``bits`` bits, the lowest word first (NVML's
    ``nvmlDeviceGetCpuAffinity``: core 64·j + i is bit i of word j)."""
    return frozenset(j * bits + i for j, word in enumerate(words) for i in range(bits) if (int(word) >> i) & 1)
