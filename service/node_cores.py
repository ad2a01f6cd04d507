"""A node's CPU cores as jobs reserve them: a job's `--cpus` is its cores' ceiling (its cgroup's
quota, where the worker may make one) and a reservation on its node, as SLURM's consumable cores
(select/cons_tres) are. Jobs that together ask more cores than a node offers do not start there
together; a job without `--cpus` reserves none, as before.

A node offers the cores its workers report (``GPUQ_NODE_CPUS``, else the cores the worker may run
on). A node that reports none (its workers older than this) holds no job back. Pure data and
arithmetic over the policy's view, no database: service/queue_read.py fills it from SQL, and one
pass (service/placing.py) or the forecast (service/forecast.py) counts on it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

# Slack for sums of fractional cores (`--cpus 0.5`) against a node's cores (floating point).
SLACK = 1e-9


def offered(setting: int) -> int:
    """The cores this node offers jobs, as its workers report them: GPUQ_NODE_CPUS (``setting``), else
    the cores the worker may run on (its CPU affinity: a container's or a cpuset's, not the machine's)."""
    return setting or len(os.sched_getaffinity(0))


@dataclass
class NodeCores:
    """Each node's cores for jobs, and the jobs that reserve some of them."""

    # The cores each node offers its jobs (a node missing here: not counted).
    cores: dict[str, float] = field(default_factory=dict)
    # Per node, each job reserving cores there: job id -> (expected end, epoch s, inf: no time limit; cores).
    holds: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)

    def copy(self) -> NodeCores:
        """Another to place on, this one left as it is (a pass's own count)."""
        return NodeCores(dict(self.cores), {node: dict(held) for node, held in self.holds.items()})

    def counts(self, cpus: float | None, node: str) -> bool:
        """Whether a job asking ``cpus`` cores is held to ``node``'s: it asked for some, and the node says how many."""
        return bool(cpus) and node in self.cores

    def free_at(self, node: str, t: float) -> float:
        """The cores of ``node`` no job holds at ``t`` (what those expected to end by then leave)."""
        return self.cores.get(node, math.inf) - sum(c for end, c in self.holds.get(node, {}).values() if end > t)

    def fit(self, cpus: float | None, node: str, t: float, also: float = 0.0) -> bool:
        """Whether a job asking ``cpus`` cores (None: none) fits ``node`` at ``t``, with ``also`` more
        cores kept free there."""
        if not self.counts(cpus, node):
            return True
        assert cpus is not None
        return self.free_at(node, t) - cpus >= also - SLACK

    def ready_at(self, cpus: float | None, node: str, t: float) -> float:
        """The first moment from ``t`` that ``node`` has ``cpus`` cores free (inf: never, as its jobs
        without a time limit hold them). Holds only end: the free cores grow with time."""
        if self.fit(cpus, node, t):
            return t
        for end in sorted({end for end, _ in self.holds.get(node, {}).values() if end > t}):
            if self.fit(cpus, node, end):
                return end
        return math.inf

    def ever_fits(self, cpus: float | None, node: str) -> bool:
        """Whether ``node`` has that many cores at all."""
        return not self.counts(cpus, node) or (cpus or 0.0) <= self.cores[node] + SLACK

    def hold(self, node: str, job_id: int, end: float, cpus: float | None) -> None:
        """``job_id`` holds ``cpus`` of ``node``'s cores until ``end``."""
        if self.counts(cpus, node):
            assert cpus is not None
            self.holds.setdefault(node, {})[job_id] = (end, cpus)

    def release(self, node: str, job_ids: tuple[int, ...] | list[int]) -> float:
        """Let ``job_ids``' cores on ``node`` go (preempted jobs); the cores freed."""
        held = self.holds.get(node, {})
        return sum(held.pop(j)[1] for j in list(job_ids) if j in held)

    def held_by(self, node: str, job_ids: tuple[int, ...] | list[int]) -> float:
        """The cores ``job_ids`` hold on ``node``."""
        held = self.holds.get(node, {})
        return sum(held[j][1] for j in job_ids if j in held)
