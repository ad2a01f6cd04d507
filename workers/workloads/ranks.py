"""The ranks of a ``train --strategy ddp`` job: one process per device, meeting in torch.distributed.

Two ways to run them:

- ``run_rank(ctx, rank, world_size, init_method)`` in each of ``world_size`` processes, all with
  the same params and ``init_method`` (``tcp://host:port`` or ``file:///shared/path``): how each
  GPU's own worker runs its rank of a multi-GPU job. Rank 0 logs, records metrics, writes the
  checkpoint, and its result is the job's.
- ``launch(ctx)``: from one process that holds all the job's devices, run rank 0 here and ranks
  1..k-1 as child processes (``python -m gpuq.workers.workloads.ranks RANK``, spec on stdin).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpuq.workers.context import WorkloadContext
from gpuq.workers.workloads import train

# How long a rank waits for the others (to meet, or in a collective) before it fails: long enough
# for a slow rank's checkpoint write, short enough that a crashed rank does not hold GPUs for long.
TIMEOUT_SECONDS = 300
# How long launch() waits for its child ranks to exit once rank 0 is done, before killing them.
CHILD_EXIT_SECONDS = 30
# Bytes of a failed child rank's stderr quoted in the error.
STDERR_TAIL = 2000


def run_rank(ctx: WorkloadContext, rank: int, world_size: int, init_method: str,
             timeout_s: float = TIMEOUT_SECONDS) -> dict[str, Any]:
    """Run rank ``rank`` of ``world_size`` of the DDP training job ``ctx`` describes; its result.

    ``ctx.devices`` is either all the job's devices in rank order (this rank takes
    ``devices[rank]``) or just this rank's own device. The backend is NCCL on CUDA, gloo on the
    CPU. The process group is torn down on return, so a warm worker can run the next job.
    """
    devices = list(ctx.devices)
    device = devices[rank] if len(devices) == world_size else devices[0]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = train.fit(ctx, "ddp", [device])
    except BaseException as exc:
        # A failed or cancelled rank's traceback holds fit's frames, the DDP model among them: let go
        # of it before its process group is destroyed. A DDP model freed after its gloo group hung a
        # test's process for good, joining the group's threads; a warm worker must not hang there.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        dist.destroy_process_group()
    result["devices"] = [str(d) for d in devices]
    result["rank"] = rank
    return result


def launch(ctx: WorkloadContext) -> dict[str, Any]:
    """Run every rank of the DDP job on ``ctx.devices``: rank 0 here, the others as children.

    Children hear of a cancel through the ranks' periodic agreement; a failing child fails the job
    with the tail of its stderr.
    """
    world = len(ctx.devices)
    with tempfile.TemporaryDirectory(prefix="gpuq-ddp-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        spec = json.dumps({"job_id": ctx.job_id, "params": ctx.params, "world_size": world,
                           "devices": [str(d) for d in ctx.devices], "init_method": init_method})
        children = []
        for rank in range(1, world):
            err = open(os.path.join(tmp, f"rank{rank}.err"), "w+b")
            child = subprocess.Popen([sys.executable, "-m", "gpuq.workers.workloads.ranks", str(rank)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
            assert child.stdin is not None  # stdin=PIPE
            child.stdin.write(spec.encode())
            child.stdin.close()
            children.append((rank, child, err))
        try:
            result = run_rank(ctx, 0, world, init_method)
        except BaseException:
            for _, child, _ in children:
                child.kill()
            raise
        finally:
            failures = _reap(children)
        if failures:
            raise RuntimeError("; ".join(failures))
        return result


def _reap(children: list) -> list[str]:
    """Wait for the child ranks; a line for each one that failed."""
    failures = []
    for rank, child, err in children:
        try:
            code = child.wait(timeout=CHILD_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            code = child.wait()
        if code != 0:
            err.seek(0)
            tail = err.read()[-STDERR_TAIL:].decode(errors="replace").strip()
            failures.append(f"ddp rank {rank} exited with {code}: {tail}")
        err.close()
    return failures


def main(argv: list[str]) -> int:
    """A child rank: ``python -m gpuq.workers.workloads.ranks RANK`` with launch()'s spec on stdin."""
    rank = int(argv[0])
    spec = json.load(sys.stdin)
    world = spec["world_size"]
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the CPU
    ctx = WorkloadContext(job_id=spec["job_id"], params=spec["params"],
                          devices=[torch.device(d) for d in spec["devices"]], log=lambda line: None)
    run_rank(ctx, rank, world, spec["init_method"])
    return 0


def _exit_now(code: int) -> None:
    """Leave without the interpreter's finalization.

    A child rank that has done its work and destroyed its process group still aborts now and then
    (SIGABRT, "terminate called without an active exception", about 1 exit in 30 here) while its
    static C++ objects are torn down, with a torch thread still joinable. Nothing is left to clean
    up by then, so skipping that teardown costs nothing and keeps a finished rank's exit at 0.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 - the traceback goes to stderr, which launch() quotes
        traceback.print_exc()
        status = 1
    _exit_now(status)
