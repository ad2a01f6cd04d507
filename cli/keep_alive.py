"""`gpuq run`'s word that it still follows its job (service/kept_jobs.py): a thread that says so to
the server every ``keepalive_s`` it is told (a third of GPUQ_ALLOC_KEEPALIVE) until the job ends.

A `gpuq run` that dies without a word (`kill -9`, its node down, a network cut that ssh does not
notice) falls silent, and its job ends as client_lost within that setting, as SLURM ends a job
whose srun stopped answering; Ctrl-C, a closed terminal and SIGTERM cancel it at once as before.
`gpuq run --detach` asks for a job that outlives its client, and that one is not kept."""

from __future__ import annotations

import threading
import time

from gpuq.service.errors import GpuqError


def start(job_id: int) -> threading.Thread:
    """Keep job ``job_id`` alive from a daemon thread: it ends with the job, or with this process."""
    thread = threading.Thread(target=_keep_alive, args=(job_id,), name="keepalive", daemon=True)
    thread.start()
    return thread


def _keep_alive(job_id: int) -> None:
    from gpuq.cli.client import Client, Refused
    from gpuq.service import constants as c

    client = Client()
    every = 1.0  # until the server says how often
    while True:
        try:
            # A server restarting meanwhile is waited for: saying it again is safe.
            held = client.post(f"/jobs/{job_id}/keepalive", ride_out=True)
        except Refused as refused:
            if refused.exit_code in (c.EXIT_NOT_FOUND, c.EXIT_CONFLICT, c.EXIT_NOT_ALLOWED):
                return  # not a job this client keeps: the follower says what became of it
        except (GpuqError, OSError):
            pass  # a blip: said again at the next turn; the follower reports a server gone for good
        else:
            if held["state"] in c.END_STATES:
                return
            every = max(float(held["keepalive_s"]), 0.1)
        time.sleep(every)
