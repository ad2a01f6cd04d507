"""`gpuq run`'s word that it still follows its job (service/kept_jobs.py): a thread that says so to
the server every ``keepalive_s`` it is told (a third of GPUQ_ALLOC_KEEPALIVE) until the job ends.

A `gpuq run` that dies without a word (`kill -9`, its node down, a network cut that ssh does not
notice) falls silent, and its job ends as client_lost within that setting, as SLURM ends a job
whose srun stopped answering; Ctrl-C, a closed terminal and SIGTERM cancel it at once as before.
`gpuq run --detach` asks for a job that outlives its client, and that one is not kept.

A stopped process says nothing, so Ctrl-Z (SIGTSTP) first lets go of the job, which then goes on
as a detached one would while this process is stopped: a training run whose `gpuq run` was
stopped for an hour is not lost for it. `fg` or `bg` (SIGCONT) keeps it again."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from gpuq.service.errors import GpuqError


def start(job_id: int) -> None:
    """Keep job ``job_id`` alive from a daemon thread: it ends with the job, with this process, or
    once Ctrl-Z let go of the job. Called from the main thread, it takes SIGTSTP."""
    released = _keep(job_id)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTSTP, _letting_go(job_id, released))


def _keep(job_id: int, again: bool = False) -> threading.Event:
    """Start the thread (``again``: its first word keeps a job let go of); the event that stops it."""
    released = threading.Event()
    threading.Thread(target=_keep_alive, args=(job_id, released, again), name="keepalive", daemon=True).start()
    return released


def _keep_alive(job_id: int, released: threading.Event, again: bool) -> None:
    from gpuq.cli.client import Client, Refused
    from gpuq.service import constants as c

    client = Client()
    every = 1.0  # until the server says how often
    while not released.is_set():
        try:
            # A server restarting meanwhile is waited for: saying either again is safe.
            held = client.request("PUT" if again else "POST", f"/jobs/{job_id}/keepalive", ride_out=True)
            again = False
        except Refused as refused:
            if refused.exit_code in (c.EXIT_NOT_FOUND, c.EXIT_CONFLICT, c.EXIT_NOT_ALLOWED):
                return  # not a job this client keeps (any more): the follower says what became of it
        except (GpuqError, OSError):
            pass  # a blip: said again at the next turn; the follower reports a server gone for good
        else:
            if held["state"] in c.END_STATES:
                return
            every = max(float(held["keepalive_s"]), 0.1)
        released.wait(every)


def _letting_go(job_id: int, released: threading.Event) -> Callable[[int, FrameType | None], None]:
    """SIGTSTP's handler: let go of the job (the thread stops saying it is alive), say so, then stop
    as SIGTSTP would have stopped this process. Once it goes on (`fg`, `bg`: SIGCONT), it keeps the
    job again; where the server could not be told, the job was kept all along."""

    # Whether the stop below is still to come, and a SIGCONT that came before it (its handler runs
    # between two of stop's own steps): kept again once the stop has passed, not before it, where
    # the stop's own Ctrl-Z handling would let go of the job a second time.
    before_stop = early = False

    def stop(signum: int, frame: FrameType | None) -> None:
        from gpuq.cli.client import Client
        from gpuq.cli.follow import say

        nonlocal released, before_stop, early
        released.set()
        before_stop, early = True, False
        try:
            Client().request("DELETE", f"/jobs/{job_id}/keepalive")
            let_go = True
            said = f"gpuq: job {job_id} goes on without this gpuq run while it is stopped; fg follows it again\n"
        except (GpuqError, OSError) as exc:
            let_go = False
            said = f"gpuq: job {job_id}: could not let go of it ({exc}); stopped, it may end as client_lost\n"
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)  # until it goes on, Ctrl-Z only stops it
        if let_go:
            # Kept again on SIGCONT, not once the kill below returns: where the kernel drops the
            # stop (a process group without a shell to resume it), it returns at once. Before the
            # line is said: a SIGCONT sent by whoever read it (not a shell's fg, which waits for the
            # stop) was lost in between, and the job let go for good.
            signal.signal(signal.SIGCONT, going_on)
        # After the terminal's "^Z", on a line of its own.
        say(sys.stderr, ("\n" if sys.stderr.isatty() else "") + said)
        os.kill(os.getpid(), signal.SIGTSTP)  # stopped here until SIGCONT
        before_stop = False
        if not let_go or early:  # kept still, or went on already: kept alive again; the next Ctrl-Z tries again
            going_on(signal.SIGCONT, None)

    def going_on(signum: int, frame: FrameType | None) -> None:
        nonlocal released, early
        if before_stop:
            early = True  # stop() keeps it again once past its stop
            return
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        released = _keep(job_id, again=True)
        signal.signal(signal.SIGTSTP, stop)

    return stop
