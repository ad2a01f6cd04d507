"""A stack's home, made safe before anything starts. A root stack's is shared: every user of the
machine can use the stack and none can read its state. A user's own stack's is theirs alone.

A root stack's home is traversable but not listable (0711: a user reaches their job's snapshot by
name); a user's own is 0700. Either way its logs, pid files and Redis data are its owner's alone
(0700), the SQLite database is 0600, and the Redis that `gpuq up` starts requires a password
generated once into ``home/redis.secret`` (0600), so no other user can reach the broker. The
password is given to Redis in a 0600 config file, never on its command line (which every user can
read in /proc)."""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from gpuq.service.dialect import sqlite_file
from gpuq.service.rights import Caller
from gpuq.service.settings import SYSTEM_SOCKET, Settings

# Modes of a stack's state: a root stack's home traversable only, a user's own stack's closed, the
# private folders and files their owner's.
SYSTEM_HOME_MODE = 0o711
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# The folder of the machine's server socket: everyone reaches the socket (0666) through it.
SOCKET_DIR_MODE = 0o755


def prepare(settings: Settings, redis_password: bool = True) -> Settings:
    """A stack's home made safe (to share, run by root), and the settings to run it with.

    The home is 0711 for root's stack, 0700 for a user's own; its logs/, run/ and redis/ 0700;
    with no broker configured (and ``redis_password``), a Redis password is generated once into
    ``redis.secret`` (0600).
    The settings returned are read afresh, so their broker URL carries that password
    (``Settings.broker`` is computed once per object); the supervisor and its children read the
    same file when they load their settings."""
    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, SYSTEM_HOME_MODE if os.geteuid() == 0 else PRIVATE_DIR_MODE)
    for d in (settings.log_dir, settings.run_dir, home / "redis"):
        d.mkdir(exist_ok=True)
        os.chmod(d, PRIVATE_DIR_MODE)
    socket_folder(settings.server_socket)
    # A new SQLite database is made 0600 by the engine that opens it first (service/db.py);
    # ``private_database`` closes one made before.
    if settings.broker_is_managed and redis_password:
        _ensure_secret(settings.redis_secret)
    return dataclasses.replace(settings)


def socket_folder(socket: Path) -> None:
    """The folder of the server's socket, made safe: each folder made for it 0755 whatever the
    umask (a root shell's 000 made them 0777: anyone could replace the socket and pose as the
    server), the machine's /run/gpuq 0755 always, and one that every user may write without the
    sticky bit refused (/tmp's 1777 is fine: only its owner removes the socket)."""
    from gpuq.service.errors import StackError

    folder = socket.parent
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        made.mkdir(exist_ok=True)
        os.chmod(made, SOCKET_DIR_MODE)
    if str(socket) == SYSTEM_SOCKET:
        os.chmod(socket.parent, SOCKET_DIR_MODE)
    # Every folder on the way, not only the socket's: one that another user may rename (a folder
    # they own, or one every user may write without the sticky bit) lets them put a folder and a
    # socket of their own where every client looks.
    me = os.geteuid()
    for folder in [socket.parent, *socket.parent.parents]:
        st = folder.stat()
        if st.st_uid not in (0, me):
            who = Caller.of_uid(st.st_uid).user
            raise StackError(f"the server's socket {socket} is under {folder}, which {who} owns: they could replace "
                             "the socket and pose as the server; set GPUQ_SOCKET to a path under folders of root's "
                             "(or yours)")
        if st.st_mode & 0o002 and not st.st_mode & 0o1000:
            raise StackError(f"the server's socket {socket} is under {folder}, which every user may write (mode "
                             f"{st.st_mode & 0o7777:04o}): anyone could replace the socket and pose as the server; "
                             "make it 0755 or set GPUQ_SOCKET to a path in another folder")


def _ensure_secret(path: Path) -> None:
    """The Redis password at ``path``, made once (mode 0600 from its creation, never wider)."""
    try:
        if path.read_text().strip():
            os.chmod(path, PRIVATE_FILE_MODE)
            return
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _sqlite_file(settings: Settings) -> Path | None:
    """The SQLite database's file, if the database is one."""
    path = sqlite_file(settings.database)
    return None if path is None else Path(path)


def private_database(settings: Settings) -> None:
    """The SQLite database and its -wal/-shm files its owner's alone (SQLite gives the files it creates
    later the database file's mode)."""
    path = _sqlite_file(settings)
    if path is None:
        return
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"),
              path.with_name(path.name + "-journal")):
        try:
            os.chmod(f, PRIVATE_FILE_MODE)
        except FileNotFoundError:
            pass
