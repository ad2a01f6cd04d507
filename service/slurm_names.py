"""SLURM's names for a job's own facts, for a job submitted from a SLURM script (its ``#SBATCH``
lines read: cli/sbatch_lines.py), whose body reads ``$SLURM_JOB_ID`` or ``$SLURM_ARRAY_TASK_ID`` as
it did under sbatch: without them it would run on, silently, with empty values.

Such a job carries ``SLURM_SUBMIT_DIR`` from its submit, as sbatch sets it; where a job does, its
worker gives it the rest (``variables``). Only the job's own facts: none of srun's task variables
(``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``), whose presence libraries (PyTorch
Lightning) take for srun having launched the job's ranks, which it did not."""

from __future__ import annotations

import math

# The variable a job from a SLURM script is submitted with, which marks it as one.
MARK = "SLURM_SUBMIT_DIR"


def variables(job_id: int, name: str, node: str, gpus: int, cpus: float | None = None,
              array_id: int | None = None, array_index: int | None = None) -> dict[str, str]:
    """SLURM's variables for a job of one node and one task, as sbatch gives a batch script."""
    out = {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": name,
           "SLURM_JOB_NODELIST": node, "SLURMD_NODENAME": node, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
           "SLURM_GPUS_ON_NODE": str(gpus)}
    if array_id is not None and array_index is not None:
        out.update(SLURM_ARRAY_JOB_ID=str(array_id), SLURM_ARRAY_TASK_ID=str(array_index))
    if cpus:
        out["SLURM_CPUS_PER_TASK"] = str(math.ceil(cpus))  # SLURM's is a whole number of CPUs
    return out
