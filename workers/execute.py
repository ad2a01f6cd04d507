"""Running a job's body on this worker: a command (as its user, in its cgroup), a built-in workload
in the warm worker (with its other ranks on their own GPUs' workers), or a workload on several GPUs
in a child process; each returns the end it came to."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from typing import Any, cast

from gpuq.service import constants as c
from gpuq.service import failures, output_files, simulated_memory, slurm_bin, slurm_names, usage
from gpuq.service.constants import State
from gpuq.service.db import read_scope, write_scope
from gpuq.service.errors import JobCancelled
from gpuq.service.job_cpus import CORES_VARIABLE, cpu_variables, not_held
from gpuq.service.job_output import record_metric
from gpuq.service.jobs import possible_mps_clients
from gpuq.service.settings import Settings
from gpuq.service.workloads import get_workload
from gpuq.workers import mps
from gpuq.workers.cgroup import JobCgroup
from gpuq.workers.command import Ahead, CannotStart, run_command
from gpuq.workers.core_binding import Binding, bound, held_to_cpus
from gpuq.workers.end import HOST_USE, drain_if_left, stopped_end
from gpuq.workers.gpu_fault import blamed_on_gpu, drain_faulty, fault_under
from gpuq.workers.identity import Identity, UnknownUser, run_as
from gpuq.workers.input_feed import feeder
from gpuq.workers.job import JobRun
from gpuq.workers.job_processes import cgroup_prefix, worker_mark
from gpuq.workers.output import OutputSink
from gpuq.workers.output_copy import OutputFiles
from gpuq.workers.owner_files import OwnerFiles, umask_of
from gpuq.workers.ranks import Peer, lost_peers, mark_lost, start_ranks
from gpuq.workers.state import WorkerState
from gpuq.workers.watch import StopWatcher


def end_of(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher,
           body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The end a job's ``body`` came to: its own, the stopped end when it was told to stop, or
    failed with its exception's class (its traceback on the job's stderr); a failure its GPU
    explains is the GPU's (workers/gpu_fault.py), said in its output. The job's watch and output
    are closed either way."""
    health_at_start = state.gpu_health
    try:
        end = _own_end(state, job, sink, watcher, body)
        fault = fault_under(state, job, end, health_at_start)
        if fault is None:
            return end
        drain_faulty(state, job, fault)
        end = blamed_on_gpu(state, job, end, fault)
        sink.note(f"[gpuq: {fault.said(state.node)}: this failure is the GPU's ({end['failure']}), and the GPU is "
                  "drained]")
        return end
    finally:
        watcher.done.set()
        sink.stop()


def _own_end(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher,
             body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return body()
    except JobCancelled:
        return stopped_end(state, job, watcher)
    except Exception as exc:  # noqa: BLE001 - any failure of the job is the job's result
        sink.write(traceback.format_exc(), c.STDERR)
        return {"state": State.FAILED, "failure": failures.from_exception(exc),
                "reason": f"{type(exc).__name__}: {exc}"[:2000]}


def execute(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher,
            on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the job's body to its end, or until ``watcher`` says it must stop; returns its end
    (what ``lifecycle.end_attempt`` writes). A workload's exception is raised. A shared job's body
    always runs in a process of its own (its built-in workload too, held to its share there), whose
    pid goes to ``on_start``; a shared allocation's processes go there as its worker finds them."""
    if job.kind == c.KIND_COMMAND:
        return _execute_command(state, job, sink, watcher, on_start)
    if job.shared and job.kind == c.KIND_WORKLOAD:
        return execute_in_child(state, job, sink, watcher, on_start)
    if job.kind == c.KIND_INTERACTIVE:
        from gpuq.workers.allocation import host

        return host(state, job, watcher, on_start)
    return _execute_workload(state, job, sink, watcher)


def _ahead(job: JobRun, watcher: StopWatcher) -> Ahead | None:
    """The job's `--signal`, sent once its watch finds the time limit near; None: it has none."""
    return Ahead(job.signal, watcher.signal_due, lambda: watcher.deadline) if job.signal is not None else None


def output_files_of(job: JobRun, node: str) -> OutputFiles | None:
    """The user's files the command's output is copied to, their patterns filled in; None: none."""
    if job.output_file is None and job.error_file is None:
        return None

    def filled(path: str | None) -> str | None:
        return None if path is None else output_files.fill(
            path, job_id=job.id, array_id=job.array_id, array_index=job.array_index, name=job.name, user=job.user,
            node=node)

    return OutputFiles(filled(job.output_file), filled(job.error_file), truncate=not job.ran_before)


def _execute_command(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher,
                     on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    assert job.argv is not None and job.cwd is not None
    try:
        identity = run_as(job.user, state.node)
    except UnknownUser as exc:  # nothing of the job can run here: its line, not a traceback
        sink.note(f"gpuq: {exc}")
        return {"state": State.FAILED, "failure": c.FAILURE_ERROR, "reason": str(exc)}
    with bound(state.settings, state.node, job.id, job.cpus, state.cores_near(job.gpu_indices)) as binding:
        return _command_on(state, job, sink, watcher, identity, binding, on_start)


def _command_on(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher, identity: Identity | None,
                binding: Binding | None, on_start: Callable[[int], None] | None) -> dict[str, Any]:
    """Run the command, bound to ``binding``'s cores (None: to none), to its end."""
    assert job.argv is not None and job.cwd is not None
    cgroup = JobCgroup.create(f"{cgroup_prefix(state.settings, state.name)}job{job.id}-{uuid.uuid4().hex[:6]}",
                              job.host_mem_mib, job.cpus, binding.cores if binding is not None else ())
    if not held_to_cpus(job.cpus, cgroup, binding):
        # Said where the user reads the job's output: it was not held to what it asked for.
        sink.note(f"[gpuq: {not_held(format(job.cpus, 'g'), state.node)}]")
    try:
        env = job_env(job, state.node, identity, state.settings)
        env.update(mps_env(job, os.geteuid() if identity is None else identity.uid, state, sink))
        # A restarted worker finds what an earlier run left by it.
        env["GPUQ_WORKER"] = worker_mark(state.settings, state.name)
        if binding is not None:
            env[CORES_VARIABLE] = binding.text
        with state.guarding(watcher.lease, on_start) as started:
            # The grace as the watch found the stop: a preemption's is GPUQ_PREEMPT_GRACE.
            outcome = run_command(job.argv, job.cwd, env, sink, watcher.stopped, lambda: watcher.grace, cgroup,
                                  run_as=identity, on_start=started, limit_mib=job.host_mem_mib,
                                  files=output_files_of(job, state.node), ahead=_ahead(job, watcher),
                                  asked=watcher.asked, feed=feeder(state.settings, job.id) if job.stdin else None,
                                  cores=binding.cores if binding is not None else ())
    except CannotStart as exc:
        # As a shell says it, with its exit code (`gpuq run` exits with it): the worker's traceback
        # told the user nothing, and an exit of 1 read as the command's own.
        sink.note(f"gpuq: cannot start the command: {exc.why}")
        return {"state": State.FAILED, "failure": c.FAILURE_EXIT, "exit_code": exc.exit_code,
                "reason": f"cannot start: {exc.why}"}
    finally:
        if cgroup is not None:
            note_throttled(cgroup, sink)
            cgroup.remove()
    drain_if_left(state, job, outcome.leftover)
    used = {HOST_USE: usage.HostUse(outcome.cpu_s, outcome.host_mem_peak_mib)}
    if outcome.cancelled:
        return stopped_end(state, job, watcher) | used
    if outcome.exit_code == 0:
        return {"state": State.SUCCEEDED, "exit_code": 0, **used}
    failure = failures.from_exit(outcome.exit_code, outcome.oom_killed, sink.tail)
    return {"state": State.FAILED, "failure": failure, "exit_code": outcome.exit_code,
            "reason": failures.explain(failure, outcome.exit_code, job.host_mem_mib, outcome.over_limit_mib), **used}


# The share of its quota's periods past which a job hears that it wanted more CPU than --cpus gave.
THROTTLED_NOTE_SHARE = 0.2


def note_throttled(cgroup: JobCgroup, sink: OutputSink) -> None:
    """Tell the job's output, at its end, that its CPU quota held it back often (as seff tells a
    SLURM job's CPU efficiency): a slow job's first question is whether it was starved of CPU."""
    periods_throttled = cgroup.throttled()
    if periods_throttled is None or cgroup.cpus is None:
        return
    periods, throttled = periods_throttled
    if periods and throttled >= THROTTLED_NOTE_SHARE * periods:
        sink.note(f"[gpuq: held to --cpus {cgroup.cpus:g}: it wanted more CPU in {100 * throttled / periods:.0f}% "
                  f"of its {periods / 10:.0f} s of running; a larger --cpus may make it faster]")


def _peer_lost(state: WorkerState, sink: OutputSink, lost: list[Peer], when: str) -> dict[str, Any]:
    """The end of a job whose peer ranks' workers were lost: the workers' failure, not the job's
    (requeued without using a retry, as for its own worker's loss), and their GPUs offline until
    those workers are back, so it is not placed there again meanwhile."""
    mark_lost(state.settings, lost)
    peer = lost[0]
    sink.note(f"gpuq: rank {peer.rank}'s worker {peer.worker} was lost {when}")
    return {"state": State.FAILED, "failure": c.FAILURE_WORKER_LOST,
            "reason": f"rank {peer.rank}'s worker {peer.worker} was lost"}


def _execute_workload(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher) -> dict[str, Any]:
    from gpuq.workers.builtin import run_workload  # torch: imported where it runs

    settings = state.settings

    def on_metric(values: dict[str, Any]) -> None:
        with write_scope(settings) as session:
            record_metric(session, job.id, values)

    gpus = len(job.gpu_indices)
    workload = cast(str, job.workload)  # a workload job names one (service/spec.py)
    try:
        files = OwnerFiles(run_as(job.user, state.node), umask=umask_of(job.env))
    except UnknownUser as exc:
        sink.note(f"gpuq: {exc}")
        return {"state": State.FAILED, "failure": c.FAILURE_ERROR, "reason": str(exc)}
    if gpus == 1:
        result = run_workload(job.id, workload, job.params, 1, sink.line, watcher.stopped, on_metric, files=files)
    elif get_workload(workload).runs_rank_per_gpu(job.params, gpus):
        rank0, peers = start_ranks(state, job)
        # A peer's worker already gone (killed before its heartbeat went stale, so the job was
        # placed on its GPU): rank 0 would wait out the meeting's timeout for a rank nobody runs.
        if lost := lost_peers(peers, within=0):
            return _peer_lost(state, sink, lost, "before the ranks met")
        try:
            result = run_workload(job.id, workload, job.params, gpus, sink.line, watcher.stopped, on_metric, rank0,
                                  files=files)
        except JobCancelled:
            raise
        except Exception as exc:
            if not (lost := lost_peers(peers)):
                raise
            return _peer_lost(state, sink, lost, f"mid-job (rank 0: {type(exc).__name__}: {str(exc)[:200]})")
    else:
        return execute_in_child(state, job, sink, watcher)
    return {"state": State.SUCCEEDED, "result": result}


def execute_in_child(state: WorkerState, job: JobRun, sink: OutputSink, watcher: StopWatcher,
                     on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """A workload on several GPUs runs in a child that sees all of them (this worker sees one); a
    shared one runs in a child held to its share of the GPU's memory."""
    with tempfile.TemporaryDirectory(prefix=f"gpuq-job{job.id}-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env = dict(os.environ)  # gpuq's own code: it keeps the worker's settings
        env.update(job_env(job, state.node, settings=state.settings))
        env["GPUQ_WORKER"] = worker_mark(state.settings, state.name)
        if job.shared and job.mem_mib is not None and job.memory_total_mib:
            env[c.MEMORY_FRACTION_VARIABLE] = f"{job.mem_mib / job.memory_total_mib:.6f}"
        argv = [sys.executable, "-m", "gpuq.workers.child", str(job.id), result_path]
        with state.guarding(watcher.lease, on_start) as started:
            outcome = run_command(argv, job.cwd or tmp, env, sink, watcher.stopped, lambda: watcher.grace,
                                  on_start=started)
        if outcome.cancelled:
            return stopped_end(state, job, watcher)
        drain_if_left(state, job, outcome.leftover)
        if outcome.exit_code != 0 or not os.path.exists(result_path):
            failure = failures.from_exit(outcome.exit_code, outcome.oom_killed, sink.tail)
            if failure == c.FAILURE_EXIT and outcome.exit_code and outcome.exit_code > 0:
                failure = c.FAILURE_ERROR  # the child printed the workload's traceback
            return {"state": State.FAILED, "failure": failure, "exit_code": outcome.exit_code,
                    "reason": failures.explain(failure, outcome.exit_code)}
        with open(result_path) as f:
            return {"state": State.SUCCEEDED, "result": json.load(f)}


def job_env(job: JobRun, node: str, identity: Identity | None = None,
            settings: Settings | None = None) -> dict[str, str]:
    """The environment a job runs with: the variables recorded at submit (the submitter's chosen
    ones, array and sweep values) and gpuq's own, nothing of the worker's (no database or broker
    URL, no password); its CPU cores' (service/job_cpus.py); HOME, USER, LOGNAME and SHELL from
    ``identity``'s passwd entry if given; with ``settings``, where its stack's server is and, on
    simulated GPUs, where it may declare simulated GPU memory."""
    env = dict(job.env)
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(str(i) for i in job.gpu_indices),
        # NVML numbers GPUs in PCI bus order; without this CUDA may number them differently.
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        GPUQ_JOB_ID=str(job.id),
        GPUQ_JOB_NAME=job.name,
        GPUQ_GPUS=str(len(job.gpu_indices)),
        GPUQ_NODE=node,
    )
    env.update(cpu_variables(job.cpus, job.env))
    if settings is not None:
        # Its own stack's server, for a `gpuq` the job runs (its scontrol requeue too): without it,
        # a job of a user's own stack on a machine that has root's reached root's server.
        if settings.server:
            env["GPUQ_SERVER"] = settings.server
        else:
            env["GPUQ_SOCKET"] = str(settings.server_socket)
    if slurm_names.MARK in job.env:  # submitted from a SLURM script: its variables under SLURM's names
        env.update(slurm_names.variables(job.id, job.name, node, len(job.gpu_indices), job.cpus, job.array_id,
                                         job.array_index, slurm_names.tasks_of(job.env)))
        shims = slurm_bin.directory(settings.home) if settings is not None else None
        if shims is not None:  # and its srun (a step's command as the job's tasks), scontrol and sbatch
            env["PATH"] = shims + os.pathsep + env.get("PATH", os.defpath)
    if identity is not None:
        env.update(identity.env())
    if settings is not None and settings.fake_gpus:
        # Simulated GPUs: where the job says what simulated GPU memory it holds (workers/simulated_memory.py).
        env[simulated_memory.ENV_VARIABLE] = str(simulated_memory.memory_dir(settings))
    return env


def mps_env(job: JobRun, uid: int, state: WorkerState, sink: OutputSink) -> dict[str, str]:
    """Where the node runs an MPS daemon: whether the command job's processes (running as ``uid``)
    join it, and a shared one's limit there (workers/mps.py)."""
    settings = state.settings
    if settings.fake_gpus:
        return {}
    # The room a shared job was placed with, its share and context reserve, as the watchdog counts.
    # The client's CUDA context counts against MPS's limit: pinned to the share alone, a 1 GiB job
    # on the lent H100 had 510 MiB left and failed to allocate 512.
    share = job.mem_mib + settings.shared_context_mib if job.shared and job.mem_mib is not None else None

    def others() -> set[str]:
        with read_scope(settings) as session:
            return possible_mps_clients(session, state.node, job.id) - {job.user}

    placed = mps.placement(uid, len(job.gpu_indices), share, others)
    if placed.note:
        sink.note(placed.note)
    return placed.env
