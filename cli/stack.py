"""Running gpuq itself: `gpuq up`, `gpuq down`, `gpuq worker`, `gpuq scheduler`, `gpuq db`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Annotated

import typer

from gpuq.service import db, stack
from gpuq.service.settings import get_settings, mask_url

app = typer.Typer()
db_app = typer.Typer(help="The database schema.", no_args_is_help=True)


@app.command()
def up(timeout: Annotated[float, typer.Option(help="Seconds to wait for the workers.")] = 120.0) -> None:
    """Start the local stack in the background: Redis if needed, the scheduler, one worker per GPU."""
    settings = get_settings()
    st = stack.up(settings, timeout=timeout)
    redis = "a Redis of its own" if st.managed_redis else "its Redis"
    typer.echo(f"gpuq is up: {st.workers} worker(s), the scheduler and {redis} at {mask_url(settings.broker)} "
               f"(supervisor pid {st.supervisor_pid}; logs in {st.log_dir})")


@app.command()
def down(grace: Annotated[float, typer.Option(help="Seconds running jobs get to finish before they are "
                                                    "interrupted.")] = 30.0) -> None:
    """Stop the local stack; no process of it is left behind."""
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
    settings = get_settings()
    db.upgrade(settings)
    typer.echo(f"database at {mask_url(settings.database)} is at revision {db.current_revision(settings)}")


@db_app.command("current")
def db_current() -> None:
    """The database's schema revision."""
    settings = get_settings()
    typer.echo(db.current_revision(settings) or "none (run `gpuq db upgrade`)")
