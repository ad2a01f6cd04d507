"""Running gpuq itself: `gpuq up`, `gpuq down`, `gpuq server`, `gpuq worker`, `gpuq scheduler`, `gpuq db`.

These are the admin commands that use the database and the broker directly; each imports what it
runs inside its own body, so the users' commands never load it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Annotated

import typer

from gpuq.service.settings import get_settings, mask_url

app = typer.Typer()
db_app = typer.Typer(name="db", help="The database schema.", no_args_is_help=True, add_completion=False)


@app.command()
def up(timeout: Annotated[float, typer.Option(help="Seconds to wait for the workers.")] = 120.0) -> None:
    """Start the local stack in the background: Redis if needed, the server, the scheduler, one
    worker per GPU. Run as root, it serves every user of the machine: its state is root's alone
    (the home 0711, the database 0600) and the Redis it starts needs a password it generates."""
    if timeout <= 0:
        raise typer.BadParameter(f"{timeout:g} is not a number of seconds above 0", param_hint="'--timeout'")
    from gpuq.service import stack

    settings = get_settings()
    st = stack.up(settings, timeout=timeout)
    redis = "a Redis of its own" if st.managed_redis else "its Redis"
    # st.broker, not settings.broker: a root stack's broker has the password `up` just generated.
    url = mask_url(st.broker or settings.broker)
    typer.echo(f"gpuq is up: {st.workers} worker(s), the scheduler, {redis} at {url} and "
               f"the server on {settings.server_socket} (supervisor pid {st.supervisor_pid}; logs in {st.log_dir})")
    for index, why in sorted(st.left_out.items()):
        # Up, with the other GPUs: one GPU that fails must not keep a node's others from the queue.
        typer.echo(f"gpuq: GPU {index} left out, drained: {why}; fix it, then `gpuq resume {settings.node}` "
                   f"starts its worker again (log: {st.log_dir / f'worker-gpu{index}.log'})", err=True)


@app.command()
def down(grace: Annotated[float, typer.Option(min=0, help="Seconds running jobs get to finish before they are "
                                                    "interrupted.")] = 30.0) -> None:
    """Stop the local stack; no process of it is left behind."""
    from gpuq.service import stack

    if stack.down(get_settings(), grace=grace):
        typer.echo("gpuq is down")
    else:
        typer.echo("gpuq was not up")


@app.command()
def worker(gpu: Annotated[int, typer.Option("--gpu", min=0, help="The GPU to serve (NVML index).")],
           loglevel: Annotated[str, typer.Option()] = "INFO") -> None:
    """Run one GPU's worker in the foreground, pinned with CUDA_VISIBLE_DEVICES."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    sys.stdout.flush()
    # exec, not import: the worker's machinery (torch) stays out of the CLI, and the worker
    # process gets the signals sent to this one.
    os.execv(sys.executable, [sys.executable, "-m", "gpuq.workers", "--gpu", str(gpu), "--loglevel", loglevel])


@app.command()
def server() -> None:
    """Run the server in the foreground: the API every user's `gpuq` talks to, on its Unix socket
    (and on GPUQ_LISTEN with MUNGE)."""
    from gpuq.server.app import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(get_settings())


@app.command()
def scheduler() -> None:
    """Run the scheduler in the foreground."""
    from gpuq.service.scheduler import Scheduler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Scheduler(get_settings()).run(stop)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the migrations: bring the database to this gpuq's schema."""
    from gpuq.service import db

    settings = get_settings()
    db.upgrade(settings)
    typer.echo(f"database at {mask_url(settings.database)} is at revision {db.current_revision(settings)}")


@db_app.command("current")
def db_current() -> None:
    """The database's schema revision."""
    from gpuq.service import db

    settings = get_settings()
    typer.echo(db.current_revision(settings) or "none (run `gpuq db upgrade`)")
