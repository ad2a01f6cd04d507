"""One worker process per GPU: ``python -m gpuq.workers --gpu I`` (what `gpuq worker` runs).

It pins itself to its GPU before torch is imported, registers the GPU in SQL, keeps torch and the
CUDA context warm, beats its heart, and serves its GPU's own Celery queue with the solo pool:
concurrency 1, prefetch 1, late acks, and no fork (CUDA cannot be initialised again in a forked
child, so Celery's prefork pool is wrong for a process that keeps a CUDA context).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

from gpuq.service import broker, inventory, node_use
from gpuq.service.celery_app import make_app, queue_name
from gpuq.service.db import require_schema, write_scope
from gpuq.service.devices import open_devices
from gpuq.service.errors import GpuqError
from gpuq.service.leases import reap_predecessor
from gpuq.service.logs import configure as configure_logging
from gpuq.service.settings import get_settings
from gpuq.workers import mps

if TYPE_CHECKING:
    from gpuq.workers.state import WorkerState

log = logging.getLogger("gpuq.worker")


def pin_to_gpu(index: int) -> None:
    """Make GPU ``index`` (NVML's numbering) the only one this process, and torch, can see."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    mps.keep_out()  # its warm CUDA context must not hold an MPS server for its user (workers/mps.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuq-worker", description="Serve one GPU's job queue.")
    parser.add_argument("--gpu", type=int, required=True, help="GPU index (NVML/PCI bus order)")
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    pin_to_gpu(args.gpu)
    configure_logging(args.loglevel.upper())
    try:
        return serve(args.gpu, args.loglevel)
    except GpuqError as exc:
        print(f"gpuq worker: {exc}", file=sys.stderr)
        return exc.exit_code


def serve(index: int, loglevel: str) -> int:
    settings = get_settings()
    devices = open_devices(settings)
    gpus = {g.index: g for g in devices.list()}
    if index not in gpus:
        have = f"GPUs {', '.join(map(str, sorted(gpus)))}" if gpus else f"no GPU ({devices.why_none})"
        raise GpuqError(f"there is no GPU {index} on node {settings.node}: it has {have}")
    require_schema(settings)
    broker.check(settings)
    name, queue = f"gpu{index}@{settings.node}", queue_name(settings, settings.node, index)

    from gpuq.workers import tasks
    from gpuq.workers.heartbeat import Heartbeat
    from gpuq.workers.probe import GpuProbe
    from gpuq.workers.sampler import Sampler
    from gpuq.workers.state import WorkerState

    if settings.warm_start:
        from gpuq.workers.builtin import warm_up

        log.info("%s: warm on %s", name, warm_up())
    from gpuq.workers.cgroup import remove_leftovers
    from gpuq.workers.guard import Guard
    from gpuq.workers.job_processes import cgroup_prefix, kill_leftovers, worker_mark

    left = kill_leftovers(worker_mark(settings, name))
    if left:
        log.warning("%s: killed %d processes an earlier run of this worker left: %s", name, len(left), left)
    # Then their jobs' cgroups, now empty (a cgroup outlives its processes until it is removed).
    gone = remove_leftovers(cgroup_prefix(settings, name))
    if gone:
        log.warning("%s: removed %d cgroups an earlier run of this worker left: %s", name, len(gone), gone)
    probe = GpuProbe(devices, index)
    first = probe.read()
    with write_scope(settings) as session:
        gpu_id = inventory.register(session, settings.node, gpus[index], queue, name, os.getpid(),
                                    node_use.offered_cores(settings.node_cpus),
                                    node_use.offered_host_mem_mib(settings.node_host_mem_mib))
        # With its first reading in the same transaction: the GPU is never live to the scheduler
        # without its foreign processes known (it could go to a job that does not fit beside them).
        inventory.beat(session, gpu_id, first)
        reap_predecessor(session, settings, name)
    app = make_app(settings)
    state = WorkerState(settings=settings, node=settings.node, gpu_index=index, gpu_id=gpu_id, name=name, queue=queue,
                        app=app, devices=devices, guard=Guard(settings.lease_timeout),
                        gpu_cores={i: g.cores for i, g in gpus.items()})
    heartbeat = Heartbeat(settings, gpu_id, probe, state)
    heartbeat.start()
    if settings.sample_interval > 0:
        state.sampler = Sampler(settings, gpu_id, probe, lambda: state.job_id)
        state.sampler.start()
    tasks.register(app, state)
    _interrupt_on_second_shutdown(state)
    broker.wake_scheduler(settings)  # a new GPU may be what a waiting job needs
    if logging.getLevelName(loglevel.upper()) != logging.DEBUG:
        # Celery's own two lines a task ("Task ... received", "... succeeded in ...") say what the
        # worker's "job N started" and "job N succeeded" say, and cost a tenth of a no-op job's CPU.
        for chatty in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
    if os.geteuid() == 0:
        # Root by design on a machine's stack: it starts each job as its owner (workers/identity.py),
        # and takes only JSON (no pickle). Celery's warning, "absolutely not recommended! Please
        # specify a different user using the --uid option", topped every worker's log, and --uid
        # would run every job as that one user.
        from celery.exceptions import SecurityWarning

        warnings.filterwarnings("ignore", message="You're running the worker with superuser privileges",
                                category=SecurityWarning)
    try:
        app.worker_main(["worker", "--pool=solo", "--concurrency=1", f"--queues={queue}", f"--hostname={name}",
                         "--without-gossip", "--without-mingle", "--without-heartbeat",
                         f"--loglevel={loglevel}"])
    finally:
        _let_shared_jobs_end(state)
        heartbeat.stop()
        if state.guard is not None:
            state.guard.close()
        if state.sampler is not None:
            state.sampler.stop()
            state.sampler.join(5)
        with write_scope(settings) as session:
            inventory.sign_off(session, gpu_id)
        log.info("%s: stopped", name)
    return 0


def _let_shared_jobs_end(state: WorkerState) -> None:
    """Celery has stopped taking messages; the shared jobs running here finish as the whole-GPU job
    did (their leases still renewed), unless another SIGTERM or SIGINT asks to stop them now."""
    import signal

    from gpuq.workers.shared import wait_for_shared

    if not state.shared:
        return
    log.info("%s: waiting for %d shared jobs to end", state.name, len(state.shared))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: state.interrupt.set())
    wait_for_shared(state)


def _interrupt_on_second_shutdown(state: WorkerState) -> None:
    """First SIGTERM: warm shutdown, the running job finishes (and no next one starts here),
    within GPUQ_SHUTDOWN_GRACE where one is set. First SIGINT (Ctrl-C at a foreground worker, and
    `gpuq reconfigure`'s restart, which must stop no job): the same with no grace, the job runs to
    its end. Second: the running job is stopped."""
    from celery.signals import worker_shutting_down

    requests = []

    @worker_shutting_down.connect(weak=False)
    def _on_shutdown(sig: Any = None, how: Any = None, **_: Any) -> None:
        requests.append(how)
        state.stopping.set()
        if len(requests) >= 2 or how == "Cold":
            state.interrupt.set()
        elif state.settings.shutdown_grace > 0 and sig != "SIGINT":
            # Warm, but not forever: past the grace period the job is stopped and requeued.
            timer = threading.Timer(state.settings.shutdown_grace, state.interrupt.set)
            timer.daemon = True
            timer.start()
