"""A node's CPU cores and host memory as jobs reserve them: a job's `--cpus` and `--host-mem` are
its processes' ceilings (its cgroup's quota and limit, where the worker may make one) and a
reservation on its node, as SLURM's consumable cores and memory (select/cons_tres with
CR_Core_Memory) are. Jobs that together ask more of either than a node offers do not start there
together; a job that asks for none reserves none, as before.

A node offers what its workers report (``GPUQ_NODE_CPUS``, else the cores the worker may run on;
``GPUQ_NODE_HOST_MEM_MIB``, else the machine's memory). A node that reports none (its workers older
than this) holds no job back. Pure data and arithmetic over the policy's view, no database:
service/queue_read.py fills it from SQL, and one pass (service/placing.py) or the forecast
(service/forecast.py) counts on it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# What a node offers and a job reserves: each is a field of the policy's ``JobRequest`` and of a job
# row, and each node's offer is a column of its GPUs' rows (``OFFERED_BY``).
CPUS, HOST_MEM = "cpus", "host_mem_mib"
KINDS = (CPUS, HOST_MEM)
OFFERED_BY = {CPUS: "node_cpus", HOST_MEM: "node_host_mem_mib"}
# How each reads: the words for an amount, and the option that asks for it.
WORDS = {CPUS: ("CPU cores", "--cpus"), HOST_MEM: ("MiB of host memory", "--host-mem")}
# Slack for sums of fractional cores (`--cpus 0.5`) against a node's (floating point).
SLACK = 1e-9


def offered_cores(setting: int) -> int:
    """The cores this node offers jobs, as its workers report them: GPUQ_NODE_CPUS (``setting``), else
    the cores the worker may run on (its CPU affinity: a container's or a cpuset's, not the machine's)."""
    return setting or len(os.sched_getaffinity(0))


def offered_host_mem_mib(setting: int) -> int:
    """The host memory this node offers jobs, MiB: GPUQ_NODE_HOST_MEM_MIB (``setting``), else the
    machine's (MemTotal)."""
    if setting:
        return setting
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))


def offers_of(gpus: Iterable[Any]) -> dict[str, dict[str, int]]:
    """What each node of ``gpus`` (GPU rows: ``node`` and the ``OFFERED_BY`` columns) offers jobs, by
    kind: the least its GPUs' workers report, should they differ; a node none of them reports for is
    left out of that kind."""
    offers: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    for g in gpus:
        for kind, column in OFFERED_BY.items():
            offered = getattr(g, column)
            if offered is not None:
                offers[kind][g.node] = min(offers[kind].get(g.node, offered), offered)
    return offers


def needs(job: Any) -> dict[str, float]:
    """What ``job`` (a ``JobRequest``, or anything with its fields) reserves of its node, by kind."""
    return {kind: float(amount) for kind in KINDS if (amount := getattr(job, kind, None))}


@dataclass
class NodeUse:
    """Each node's offer of one kind (CPU cores, or MiB of host memory), and the jobs that reserve
    some of it."""

    # What each node offers its jobs (a node missing here: not counted).
    offer: dict[str, float] = field(default_factory=dict)
    # Per node, each job reserving some there: job id -> (expected end, epoch s, inf: no time limit; amount).
    holds: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)

    def copy(self) -> NodeUse:
        """Another to place on, this one left as it is (a pass's own count)."""
        return NodeUse(dict(self.offer), {node: dict(held) for node, held in self.holds.items()})

    def counts(self, amount: float | None, node: str) -> bool:
        """Whether a job asking ``amount`` is held to ``node``'s offer: it asked for some, and the node
        says how much it offers."""
        return bool(amount) and node in self.offer

    def free_at(self, node: str, t: float) -> float:
        """What of ``node``'s offer no job holds at ``t`` (what those expected to end by then leave)."""
        return self.offer.get(node, math.inf) - sum(a for end, a in self.holds.get(node, {}).values() if end > t)

    def fit(self, amount: float | None, node: str, t: float, also: float = 0.0) -> bool:
        """Whether a job asking ``amount`` (None: none) fits ``node`` at ``t``, with ``also`` more kept
        free there."""
        if not self.counts(amount, node):
            return True
        assert amount is not None
        return self.free_at(node, t) - amount >= also - SLACK

    def ready_at(self, amount: float | None, node: str, t: float) -> float:
        """The first moment from ``t`` that ``node`` has ``amount`` free (inf: never, as its jobs
        without a time limit hold it). Holds only end: what is free grows with time."""
        if self.fit(amount, node, t):
            return t
        for end in sorted({end for end, _ in self.holds.get(node, {}).values() if end > t}):
            if self.fit(amount, node, end):
                return end
        return math.inf

    def ever_fits(self, amount: float | None, node: str) -> bool:
        """Whether ``node`` offers that much at all."""
        return not self.counts(amount, node) or (amount or 0.0) <= self.offer[node] + SLACK

    def hold(self, node: str, job_id: int, end: float, amount: float | None) -> None:
        """``job_id`` holds ``amount`` of ``node``'s offer until ``end``."""
        if self.counts(amount, node):
            assert amount is not None
            self.holds.setdefault(node, {})[job_id] = (end, amount)

    def release(self, node: str, job_ids: tuple[int, ...] | list[int]) -> float:
        """Let ``job_ids``' holds on ``node`` go (preempted jobs); what they held."""
        held = self.holds.get(node, {})
        return sum(held.pop(j)[1] for j in list(job_ids) if j in held)

    def held_by(self, node: str, job_ids: tuple[int, ...] | list[int]) -> float:
        """What ``job_ids`` hold on ``node``."""
        held = self.holds.get(node, {})
        return sum(held[j][1] for j in job_ids if j in held)


def node_uses() -> dict[str, NodeUse]:
    """An empty count of each kind (no node counted)."""
    return {kind: NodeUse() for kind in KINDS}
