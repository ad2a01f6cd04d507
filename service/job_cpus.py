"""A job's CPU cores (`--cpus`) as its processes see them: ``GPUQ_CPUS`` (SLURM's
SLURM_CPUS_PER_TASK), and ``OMP_NUM_THREADS`` where the job's own environment does not set it.

A CPU quota is not a cpuset: inside it ``os.cpu_count()`` still counts every core of the node, so
OpenMP (and torch's intra-op pool, which reads OMP_NUM_THREADS) starts a thread per core of the
node. Under `--cpus 2` on a 64-core node those 64 threads share 200 ms of CPU in every 100 ms
period and spend most periods throttled; one thread per core asked for keeps them running. The job's
own setting wins (`--env OMP_NUM_THREADS=8`, or the submitter's with `--env ALL`)."""

from __future__ import annotations

from collections.abc import Mapping

CPUS_VARIABLE = "GPUQ_CPUS"
THREADS_VARIABLE = "OMP_NUM_THREADS"
# The cores a job is bound to (workers/core_binding.py), as ``taskset -c`` writes them: ``0-3,8``.
CORES_VARIABLE = "GPUQ_CORES"


def threads_for(cpus: float) -> int:
    """OpenMP threads for ``cpus`` cores: the whole cores, at least one (0.5 of a core: one thread)."""
    return max(1, int(cpus))


def not_held(cpus: str, node: str) -> str:
    """What a job (or an allocation's shell) is told where its worker could not hold it to its
    ``cpus`` cores (as ``CPUS_VARIABLE`` gives them): no CPU cgroup on ``node`` (a user's own
    stack, a cgroup tree not delegated)."""
    return f"--cpus {cpus} is not held to on {node}: its worker may make no CPU cgroup"


def cpu_variables(cpus: float | None, env: Mapping[str, str]) -> dict[str, str]:
    """What a job of ``cpus`` cores (None: it asked for none) gets beside ``env``, its own variables."""
    if cpus is None:
        return {}
    out = {CPUS_VARIABLE: f"{cpus:g}"}
    if THREADS_VARIABLE not in env:
        out[THREADS_VARIABLE] = str(threads_for(cpus))
    return out
