"""Running gpuq itself: `gpuq up`, `gpuq down`, `gpuq server`, `gpuq worker`, `gpuq scheduler`, `gpuq db`.

These are the admin commands that use the database and the broker directly; each imports what it
runs inside its own body, so the users' commands never load it. Every admin command (`gpuq drain`
and `resume` too) takes its settings from ``admin_settings``, which refuses, in one line, a user
who cannot use the database the command would open."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from gpuq.cli import numbers
from gpuq.service.errors import NotAllowed
from gpuq.service.logs import configure as configure_logging
from gpuq.service.settings import Settings, get_settings, mask_url

app = typer.Typer()
db_app = typer.Typer(name="db", help="The database schema.", no_args_is_help=True, add_completion=False)

# What an admin command does with gpuq's database, for the line that refuses it; the rest open it.
_DOES = {"down": "stops the stack that keeps gpuq's database",
         "reconfigure": "restarts the stack that keeps gpuq's database"}
# The admin commands that start and stop a user's own stack: one beside root's is theirs to run.
_OWN_STACK = ("up", "down")
# The admin commands that steer the queue the client uses (a stack of the user's own, if one runs).
_STEERS = ("drain", "resume", "retire", "reconfigure")


def admin_settings(command: str) -> Settings:
    """The settings of admin command ``command`` (`gpuq drain`, `gpuq db upgrade`, ...), which opens
    gpuq's database itself rather than asking a server. NotAllowed (77), before anything is opened
    or written, where this user (not root) cannot use the SQLite database it would open:

    - its file, or the folder it would be made in, is another user's and closed to this one (root's
      /var/lib/gpuq/gpuq.db, named by GPUQ_HOME or a copied config file);
    - this user has no database at all, and the server this client talks to is another user's
      (root's machine stack): the command would make an empty database of this user's, and steer
      nothing of the queue they use. `gpuq up` and `gpuq down` are not refused that way: they
      start and stop a user's own stack, which may run beside root's.

    A database server (PostgreSQL) says itself, in one line, whom it lets in."""
    settings = get_settings()
    if os.geteuid() == 0:
        return settings
    from gpuq.service.dialect import sqlite_file

    path = sqlite_file(settings.database)
    if path is None:
        return settings
    database = Path(path).absolute()
    found, owner = _nearest(database)
    rights = os.R_OK | os.W_OK if found == database else os.W_OK | os.X_OK
    if owner != os.geteuid() and not os.access(found, rights):
        does = _DOES.get(command, "opens gpuq's database")
        raise NotAllowed(f"gpuq {command} is an admin command: it {does}, which only {_whom(owner)} can read "
                         f"({database})")
    # The queue's steering commands (drain, resume) check whose queue the client talks to even for
    # a user with a database of their own, unless a stack of theirs runs on it: one left by a
    # stack of theirs that is down was drained, "drained" said, and root's queue, which their
    # `gpuq status` shows, ran on.
    steers = command in _STEERS and not _own_stack_up(settings)
    served = None if (found == database and not steers) or command in _OWN_STACK else _server_owner()
    if served is not None and served[1] != os.geteuid():
        does = _DOES.get(command, "opens gpuq's database")
        raise NotAllowed(f"gpuq {command} is an admin command: it {does}, and the queue you use (the "
                         f"server at {served[0]}) is {_name(served[1])}'s, whose database only {_whom(served[1])} "
                         "can read")
    return settings


def _own_stack_up(settings: Settings) -> bool:
    from gpuq.service.stack import running_supervisor

    return running_supervisor(settings) is not None


def _nearest(path: Path) -> tuple[Path, int]:
    """``path`` if this user can see it, else the nearest folder above it they can (where it would
    be made), with its owner's uid."""
    for candidate in (path, *path.parents):
        try:
            return candidate, os.stat(candidate).st_uid
        except OSError:  # not there, or behind a folder closed to this user
            continue
    return Path("/"), 0


def _server_owner() -> tuple[str, int] | None:
    """The Unix socket of the server this client talks to and the uid that made it (the server's
    own); None for a server over TCP, or no socket there."""
    from gpuq.cli.client import server_address

    address = server_address()
    if address.startswith(("http://", "https://")):
        return None
    try:
        return address, os.stat(address.removeprefix("unix:")).st_uid
    except OSError:
        return None


def _name(uid: int) -> str:
    from gpuq.service.rights import Caller

    return Caller.of_uid(uid).user


def _whom(uid: int) -> str:
    return "root and gpuq's own services" if uid == 0 else _name(uid)


@app.command()
def up(timeout: Annotated[float, typer.Option(help="Seconds to wait for the workers.")] = 120.0) -> None:
    """Start the local stack in the background: Redis if needed, the server, the scheduler, one
    worker per GPU. Run as root, it serves every user of the machine: its state is root's alone
    (the home 0711, the database 0600) and the Redis it starts needs a password it generates."""
    if timeout <= 0:
        raise typer.BadParameter(f"{timeout:g} is not a number of seconds above 0", param_hint="'--timeout'")
    from gpuq.service import stack

    settings = admin_settings("up")
    st = stack.up(settings, timeout=timeout)
    redis = "a Redis of its own" if st.managed_redis else "its Redis"
    # st.broker, not settings.broker: a root stack's broker has the password `up` just generated.
    url = mask_url(st.broker or settings.broker)
    typer.echo(f"gpuq is up: {st.workers} worker(s), the scheduler, {redis} at {url} and "
               f"the server on {settings.server_socket} (supervisor pid {st.supervisor_pid}; logs in {st.log_dir})")
    if st.new_database is not None:
        typer.echo(f"gpuq: a new, empty queue at {st.new_database} (no database was there)")
    if st.retired:
        gone = ", ".join(map(str, st.retired))
        typer.echo(f"gpuq: GPU {gone} of node {settings.node} is no longer here: no longer listed nor given out "
                   "(it comes back if its worker registers it again)")
    if st.upgraded_from is not None:
        from gpuq.migrations.versions import HEAD

        typer.echo(f"gpuq: upgraded the database at {mask_url(settings.database)} from schema revision "
                   f"{st.upgraded_from} to {HEAD} (every node's gpuq must be this version now)")
    for index, why in sorted(st.left_out.items()):
        # Up, with the other GPUs: one GPU that fails must not keep a node's others from the queue.
        typer.echo(f"gpuq: GPU {index} left out, drained: {why}; fix it, then `gpuq resume {settings.node}` "
                   f"starts its worker again (log: {st.log_dir / f'worker-gpu{index}.log'})", err=True)


@app.command()
def down(grace: Annotated[float, typer.Option(min=0, help="Seconds running jobs get to finish before they are "
                                                    "interrupted.")] = 30.0) -> None:
    """Stop the local stack; no process of it is left behind."""
    from gpuq.service import stack

    if stack.down(admin_settings("down"), grace=grace, say=typer.echo):
        typer.echo("gpuq is down")
        return
    # Nothing of this user's was up: say whose stack the queue they use is, if another user's
    # (root's machine stack stays up; "was not up" alone read as if it had stopped).
    served = _server_owner() if os.geteuid() != 0 else None
    if served is not None and served[1] != os.geteuid():
        typer.echo(f"gpuq was not up (no stack of yours; the server at {served[0]} is {_name(served[1])}'s "
                   "and stays up)")
    else:
        typer.echo("gpuq was not up")


@app.command()
def unit(grace: Annotated[float, typer.Option(min=0, help="Seconds running jobs get to finish when the service "
                                                    "stops (its `gpuq down --grace`).")] = 30.0) -> None:
    """Print a systemd unit that runs this stack as a service: up at boot (root's: a system service;
    a user's own stack: a user service), restarted if its supervisor dies, stopped at shutdown.

    Install it as its first lines say. It runs this gpuq's `up` and `down` with the config file's
    settings alone: put in that file what this shell sets by GPUQ_* variables.
    """
    from gpuq.service import boot_unit
    from gpuq.service.settings import setting_sources

    settings, config, sources = setting_sources()
    typer.echo(boot_unit.unit(settings, config.absolute(), boot_unit.gpuq_executable(), grace,
                              system=os.geteuid() == 0), nl=False)
    # Said, not refused: the unit is right for the file; these are what its start would meet.
    for said in boot_unit.before_install(settings, config, sources):
        typer.echo(f"gpuq: {said}", err=True)


@app.command()
def reconfigure(wait: Annotated[float, typer.Option(min=0, help="Seconds to wait for the server to answer again.")]
                = 30.0) -> None:
    """Have the running stack take up an edited config file, as `scontrol reconfigure` (an admin
    command): the server and the scheduler restart on it at once, each worker once its running job
    has ended; no job is stopped."""
    from gpuq.service import reconfigure as reconfiguring
    from gpuq.service.errors import ConfigError, StackError

    settings = admin_settings("reconfigure")
    before = _server_pid(settings.server_socket)
    outcome = reconfiguring.ask(settings)
    if not outcome.taken:
        raise ConfigError(f"reconfigure refused: {outcome.said}")
    typer.echo(f"gpuq reconfigured: {outcome.said}")
    # The server restarting answers again: said, so an edit its start refuses (a port taken) shows now.
    deadline = time.monotonic() + wait
    while (now := _server_pid(settings.server_socket)) in (None, before):
        if time.monotonic() > deadline:
            raise StackError(f"the server has not answered again within {wait:g} s: see "
                             f"{settings.log_dir / 'server.log'}")
        time.sleep(0.1)
    typer.echo(f"the server answers again on the new settings (pid {now})")


def _server_pid(path: str | Path) -> int | None:
    """The pid of the server listening on the Unix socket ``path`` (the kernel's SO_PEERCRED of a
    connection to it), None where none listens there."""
    import socket

    from gpuq.service.peer import peer_of

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(str(path))
            return peer_of(conn).pid
    except OSError:
        return None


@app.command()
def worker(gpu: Annotated[int, typer.Option("--gpu", help="The GPU to serve (NVML index).",
                                            parser=numbers.whole(0, name="index"))],
           loglevel: Annotated[str, typer.Option()] = "INFO") -> None:
    """Run one GPU's worker in the foreground, pinned with CUDA_VISIBLE_DEVICES."""
    admin_settings("worker")  # the worker reads its settings itself
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

    configure_logging(logging.INFO)
    run(admin_settings("server"))


@app.command()
def scheduler() -> None:
    """Run the scheduler in the foreground."""
    from gpuq.service.db import require_schema
    from gpuq.service.scheduler import Scheduler

    settings = admin_settings("scheduler")
    require_schema(settings)  # one line and 78, as the server and a worker say it, not a traceback a second
    configure_logging(logging.INFO)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Scheduler(settings).run(stop)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the migrations: bring the database to this gpuq's schema."""
    from gpuq.service import db

    settings = admin_settings("db upgrade")
    db.upgrade(settings)
    typer.echo(f"database at {mask_url(settings.database)} is at revision {db.current_revision(settings)}")


@db_app.command("current")
def db_current() -> None:
    """The database's schema revision."""
    from gpuq.service import db

    settings = admin_settings("db current")
    if db.new_sqlite_file(settings):
        db.require_schema(settings)  # names the missing file in one line (78), as every other command does
    typer.echo(db.current_revision(settings) or "none (run `gpuq db upgrade`)")
