"""`gpuq resubmit`: the same job again, as a new job of its owner's.

The copy is the old job's owner's whoever asks (as SLURM's requeue keeps a job's user): a command
one user chose, from a directory and with a PATH they control, never runs as another. Root's
resubmit of a user's job ran it as root, and an admin's of root's job as the admin."""

from __future__ import annotations

import os
from dataclasses import replace

from gpuq.service import constants as c
from gpuq.service import jobs, mail, output_files, reach, submitting
from gpuq.service.db import read_scope, require_schema
from gpuq.service.errors import InvalidSpec
from gpuq.service.launchable import check_command
from gpuq.service.models import Job
from gpuq.service.rights import Caller, check_change
from gpuq.service.settings import Settings
from gpuq.service.spec import JobSpec


def spec_of(job: Job) -> JobSpec:
    """A spec for running ``job`` again: its command or workload and parameters, scheduling options,
    environment, directory (its snapshot, if it had one) and recorded git state, and its owner.
    An array or sweep task comes back as a job of its own, with the same index in its environment
    and the same --output and --error files (their %A and %a filled in as the task's)."""
    return JobSpec(kind=job.kind, name=job.name, user=job.user, gpus=job.gpus, cwd=job.cwd or "/",
                   workload=job.workload,
                   params=dict(job.params or {}), argv=list(job.argv) if job.argv is not None else None,
                   priority=job.priority, mem_mib=job.mem_mib, on_node=job.on_node,
                   exclude_nodes=list(job.exclude_nodes) if job.exclude_nodes else None, time_limit_s=job.time_limit_s,
                   max_retries=job.max_retries, held=job.held, after=job.after, after_kind=job.after_kind,
                   singleton=job.singleton, preemptible=job.preemptible, requeue=job.requeue,
                   env=dict(job.env) if job.env is not None else None, git_commit=job.git_commit,
                   git_dirty=job.git_dirty, git_diff=job.git_diff, git_diff_cut=job.git_diff_cut,
                   snapshot=job.snapshot, host_mem_mib=job.host_mem_mib, cpus=job.cpus, shared=job.shared,
                   output_file=output_files.fill_array(job.output_file, job.array_id, job.array_index),
                   error_file=output_files.fill_array(job.error_file, job.array_id, job.array_index),
                   signal=job.signal, gpu_type=job.gpu_type)


def resubmit(settings: Settings, job_id: int, user: Caller | str | None = None) -> Job:
    """Queue job ``job_id`` again, as its owner's (see ``spec_of``). Only its owner or an admin may,
    since the new job inherits the old one's environment. JobNotFound, NotAllowed, or submit's errors."""
    require_schema(settings)
    caller = Caller.of(user)
    with read_scope(settings) as session:
        job = jobs.get_job(session, job_id)
        check_change(settings, job_id, job.user, caller)
        if job.kind == c.KIND_INTERACTIVE:
            raise InvalidSpec(f"job {job_id} is an allocation: its shell ran in its client's terminal; "
                              "run gpuq alloc again")
        spec = spec_of(job)
        asked = mail.asked(session, job_id)
        if asked is not None:  # its mail too, as it asked for it
            spec = replace(spec, mail_events=asked[0], mail_address=asked[1])
        removed = job.snapshot_removed_at
    if removed is not None:
        raise InvalidSpec(f"job {job_id}'s snapshot was removed on {removed:%Y-%m-%d}, past its retention "
                          "(GPUQ_SNAPSHOT_RETENTION_DAYS); it cannot run as it was")
    if spec.snapshot and not os.path.isdir(spec.cwd):
        raise InvalidSpec(f"job {job_id}'s snapshot {spec.snapshot} is gone; it cannot run as it was")
    if spec.kind == c.KIND_COMMAND and not spec.snapshot and spec.argv:
        # A submit's checks, as its owner meets them: its script or directory may be gone since.
        with reach.as_owner(spec.user):
            try:
                check_command(spec.argv, spec.cwd, (spec.env or {}).get("PATH", os.defpath))
            except InvalidSpec as exc:
                raise InvalidSpec(f"job {job_id} cannot run again: {exc}") from None
    # The code is the one recorded with the old job (and its snapshot, reused): not asked of git again.
    return submitting.submit_all(settings, [spec], record_code=False)[0]
