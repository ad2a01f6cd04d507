"""SLURM's names for a job's own facts, for a job submitted from a SLURM script (its ``#SBATCH``
lines read: cli/sbatch_lines.py), whose body reads ``$SLURM_JOB_ID`` or ``$SLURM_ARRAY_TASK_ID`` as
it did under sbatch: without them it would run on, silently, with empty values.

Such a job carries ``SLURM_SUBMIT_DIR`` from its submit, as sbatch sets it, and where its script
asked for more than one task (``--ntasks-per-node=4``) ``SLURM_NTASKS`` and
``SLURM_NTASKS_PER_NODE``, as sbatch gives a batch script; where a job does, its worker gives it the
rest (``variables``). Only the job's own facts: the variables of each task (``SLURM_PROCID``,
``SLURM_LOCALID``), whose presence libraries (PyTorch Lightning) take for srun having launched the
job's ranks, are set by its srun alone (cli/srun.py), in the tasks it starts; and a job of one
task is given no ``SLURM_NTASKS``, which those libraries read the same way."""

from __future__ import annotations

import math
from collections.abc import Mapping

# The variable a job from a SLURM script is submitted with, which marks it as one.
MARK = "SLURM_SUBMIT_DIR"
# Its tasks, where more than one: all on its one node.
TASKS = "SLURM_NTASKS"
TASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
# Each task's GPUs, where they were asked per task (--gpus-per-task): its srun binds each to its own.
GPUS_PER_TASK = "SLURM_GPUS_PER_TASK"
# The most a job may ask for.
MAX_TASKS = 1024


def tasks_of(env: Mapping[str, str]) -> int:
    """The tasks a job's (or a step's) environment says it has: 1 where it says none, or nothing
    that is a count (a user may set the variable to anything)."""
    value = env.get(TASKS, "")
    return int(value) if value.isdigit() and 0 < int(value) <= MAX_TASKS else 1


def variables(job_id: int, name: str, node: str, gpus: int, cpus: float | None = None,
              array_id: int | None = None, array_index: int | None = None, tasks: int = 1) -> dict[str, str]:
    """SLURM's variables for a job of one node and ``tasks`` tasks, as sbatch gives a batch script."""
    out = {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": name,
           "SLURM_JOB_NODELIST": node, "SLURM_NODELIST": node, "SLURMD_NODENAME": node, "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": str(gpus)}
    if array_id is not None and array_index is not None:
        out.update(SLURM_ARRAY_JOB_ID=str(array_id), SLURM_ARRAY_TASK_ID=str(array_index))
    if cpus:  # the job's cores shared by its tasks; SLURM's is a whole number of CPUs
        out["SLURM_CPUS_PER_TASK"] = str(max(1, math.ceil(cpus / tasks - 1e-9)))
    if tasks > 1:
        out.update({TASKS: str(tasks), TASKS_PER_NODE: str(tasks), "SLURM_TASKS_PER_NODE": str(tasks)})
    return out
