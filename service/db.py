"""Engines and sessions, and the Alembic upgrade that is the only way the schema changes."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Connection, CursorResult, Engine, Result, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from gpuq.service import constants as c
from gpuq.service import writer_lock
from gpuq.service.dialect import is_sqlite_url, results_in_pipeline, sqlite_file
from gpuq.service.errors import SchemaOutOfDate, Unreachable
from gpuq.service.settings import Settings, mask_url


def _migrations_dir() -> Path:
    import gpuq.migrations

    return Path(gpuq.migrations.__file__).resolve().parent


def _create_private(path: str) -> None:
    """A new SQLite database file, made 0600 before SQLite opens it (its -wal and -shm files take
    its mode): it holds every job's output and environment, whichever gpuq command made it (`gpuq
    up` also closes one made before; an admin's `gpuq db upgrade` or `gpuq server` did not)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets `gpuq status` read while workers write; busy_timeout makes writers queue, not fail.
    dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    # SQLite's default, 1,000 pages, had every fiftieth job end copy the WAL back into the
    # database file (and sync it) after its commit, inside the write lock; the scheduler does it
    # in the background (``checkpoint``), and this is the backstop for when none runs.
    cursor.execute(f"PRAGMA wal_autocheckpoint={c.WAL_BACKSTOP_PAGES}")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # BEGIN IMMEDIATE takes the write lock up front, so a read-then-write transaction (a claim)
    # waits for the lock instead of failing with "database is locked" when it upgrades. A
    # read-only scope (``read_scope``) takes no lock: in WAL mode it reads beside the writers.
    # On the driver's connection: SQLAlchemy's execution cost 20 us of every job's end.
    if conn.get_execution_options().get(_READ_ONLY):
        _driver_begin(conn, "BEGIN")
        return
    engine, lock = getattr(_scopes, "writer", (None, None))
    if lock is not None and engine is conn.engine and not lock.held_here():
        # A write scope's writers' queue (``writer_lock.WriterLock``) is joined here, at its first statement,
        # not when the scope opens: making the session and checking out its connection need no lock.
        lock.acquire()
    _driver_begin(conn, "BEGIN IMMEDIATE")


def _driver_begin(conn: Connection, sql: str) -> None:
    try:
        cast(Any, conn.connection.driver_connection).execute(sql)
    except conn.dialect.loaded_dbapi.Error as error:
        raise DBAPIError.instance(sql, (), error, conn.dialect.loaded_dbapi.Error) from None


_READ_ONLY = "gpuq_read_only"
# The write scope open on this thread, as (its engine, its writers' queue): its first statement joins it.
_scopes = threading.local()


_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker[Session]] = {}
# Databases this process has seen at the head revision: checked once, not on every command.
_schema_ok: set[str] = set()


def _engine(url: str) -> Engine:
    if url not in _engines:
        _engines[url] = _create_engine(url)
    return _engines[url]


def _create_engine(url: str) -> Engine:
    if is_sqlite_url(url):
        path = sqlite_file(url)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _create_private(path)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    engine = create_engine(url, pool_size=2, max_overflow=4, connect_args={"options": _session_options(url)})
    event.listen(engine, "checkin", _returned)
    event.listen(engine, "checkout", _ping_if_idle(engine.dialect))
    event.listen(engine, "after_cursor_execute", results_in_pipeline)
    return engine


# A gpuq process stopped inside a transaction (SIGSTOP, a paused VM, a hung mount) held its row
# locks until it went on: a stopped worker's lock on its job's row kept the reaper from requeueing
# the job (a fault test's run waited past a minute for it). gpuq's transactions never wait this
# long between their statements, so PostgreSQL ends such a session and its locks go with it.
# SQLite has no such end: there a process stopped inside a write holds the whole database.
IDLE_IN_TRANSACTION_S = 30


def _session_options(url: str) -> str:
    """libpq's ``options`` for gpuq's PostgreSQL sessions: the URL's own, then gpuq's."""
    own = make_url(url).query.get("options") or ()
    return " ".join([*([own] if isinstance(own, str) else own),
                     f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}"])


# A pooled connection back in use within this many seconds goes without a ping, unless its socket
# has something to read (a server that restarts or ends a session says so and closes it: then
# it is pinged at once); one idle longer is pinged first. Either way one whose server is gone is
# replaced before use, so no request fails for it. SQLAlchemy's pool_pre_ping pinged before every
# transaction: under load, a round trip for each (one of the six of a job's claim, one of the
# eleven of its end).
PING_AFTER_IDLE_S = 1.0


def _returned(_dbapi_connection: Any, record: Any) -> None:
    record.info["returned_at"] = time.monotonic()


def _ping_if_idle(dialect: Any) -> Callable[[Any, Any, Any], None]:
    """The pool's checkout hook for ``dialect``'s connections."""

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        returned = record.info.get("returned_at")
        if returned is None:
            return  # new
        if time.monotonic() - returned < PING_AFTER_IDLE_S and not _heard_while_idle(dbapi_connection):
            return  # just back, and nothing came from its server meanwhile
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            # The pool's own way out: it drops this connection and hands out a new one.
            raise DisconnectionError(f"a pooled connection's server is gone: {error}") from error

    return checkout


def _heard_while_idle(dbapi_connection: Any) -> bool:
    """Whether an idle connection's socket can be read: its server wrote to it unasked (the
    notice of a shutdown or of its session's end) or closed it. True where that cannot be told."""
    try:
        poller = select.poll()
        poller.register(dbapi_connection.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def get_engine(settings: Settings) -> Engine:
    """The engine for the settings' database (one per URL per process; never shared over a fork)."""
    return _engine(settings.database)


def dispose_engines() -> None:
    """Close every engine's pooled connections and every writers' lock file, and forget them (the
    tests, between databases: a session opens hundreds)."""
    for engine in _engines.values():
        engine.dispose()
    writer_lock.close_all()
    _engines.clear()
    _sessionmakers.clear()
    _schema_ok.clear()


def _forget_after_fork() -> None:
    # A pooled connection is a socket; used from two processes it corrupts both sides' protocol
    # state. A forked child starts with no engines and opens its own.
    for engine in _engines.values():
        engine.dispose(close=False)
    _engines.clear()
    _sessionmakers.clear()
    writer_lock.forget()  # its thread lock may have been held by a thread the child lacks


os.register_at_fork(after_in_child=_forget_after_fork)


def _sessionmaker(url: str) -> sessionmaker[Session]:
    if url not in _sessionmakers:
        _sessionmakers[url] = sessionmaker(bind=_engine(url), expire_on_commit=False)
    return _sessionmakers[url]



def rows_changed(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed (``Session.execute`` types any result as a Result)."""
    return cast(CursorResult[Any], result).rowcount


@contextmanager
def write_scope(settings: Settings) -> Iterator[Session]:
    """A session for writing, in one transaction: committed on success, rolled back on error. On
    SQLite its first statement queues for the writers' lock (``writer_lock.WriterLock``) and takes the
    database's write lock (BEGIN IMMEDIATE): reads belong in ``read_scope``, which takes neither.

    A database that cannot be reached raises Unreachable naming the URL (password masked).
    """
    with _scope(settings, read_only=False) as session:
        yield session


@contextmanager
def read_scope(settings: Settings) -> Iterator[Session]:
    """A session for reading only, in one transaction that sees one state of the database.

    On SQLite it takes no write lock, so a long read (the scheduler's read of the queue, a watcher's poll)
    never makes the workers' claims and ends wait; writing in it is an error there.
    """
    with _scope(settings, read_only=True) as session:
        yield session


@contextmanager
def _scope(settings: Settings, read_only: bool) -> Iterator[Session]:
    lock = None if read_only else writer_lock.of_database(settings.database)
    if lock is not None and lock.held_here():
        lock = None  # a scope inside another one on this thread: SQLite's own lock decides, as before
    outer = getattr(_scopes, "writer", (None, None))
    # Joined by the transaction's BEGIN (``_sqlite_begin``), if it writes at all.
    _scopes.writer = (_engine(settings.database), lock)
    session = _sessionmaker(settings.database)()
    try:
        if read_only:
            session.connection(execution_options=_read_options(settings.database))
        yield session
        if read_only:
            session.rollback()
        else:
            session.commit()
    except OperationalError as exc:
        session.rollback()
        raise Unreachable(_unreachable_message(settings, exc)) from None
    except BaseException:
        session.rollback()
        raise
    finally:
        # Let go as the transaction ends, before the session closes and its connection goes back.
        if lock is not None and lock.held_here():
            lock.release()
        _scopes.writer = outer
        session.close()


def _read_options(url: str) -> dict[str, Any]:
    """A read scope's connection: on SQLite a plain BEGIN (no write lock); on a database server, no
    transaction at all. There, at its READ COMMITTED, each statement sees the database as of its own
    start whether in a transaction or not, so BEGIN and ROLLBACK would be two round trips that
    change nothing of what the reads see."""
    if is_sqlite_url(url):
        return {_READ_ONLY: True}
    return {_READ_ONLY: True, "isolation_level": "AUTOCOMMIT"}


def checkpoint(settings: Settings) -> None:
    """Copy what the SQLite WAL holds back into the database file (PASSIVE: it waits for no reader
    or writer, and leaves what they still use for next time); nothing for another database."""
    if writer_lock.of_database(settings.database) is None:
        return
    raw = _engine(settings.database).raw_connection()
    try:
        # On the driver's connection: outside a transaction (the engine would BEGIN IMMEDIATE).
        cast(Any, raw.driver_connection).execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    finally:
        raw.close()


def _unreachable_message(settings: Settings, exc: SQLAlchemyError) -> str:
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = detail[0] if detail else type(exc).__name__
    return f"cannot use the database at {mask_url(settings.database)}: {first}"


def alembic_config(settings: Settings) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", settings.database.replace("%", "%%"))
    cfg.attributes["gpuq_settings"] = settings
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Bring the database to ``revision`` through the migrations."""
    from alembic import command

    cfg = alembic_config(settings)
    try:
        with get_engine(settings).connect() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
    except OperationalError as exc:
        raise Unreachable(_unreachable_message(settings, exc)) from None


def current_revision(settings: Settings) -> str | None:
    """The database's revision; None where it has no gpuq schema, or is a SQLite file not made yet
    (looked at without making it: a mistyped path must not leave an empty database behind)."""
    if new_sqlite_file(settings):
        return None
    try:
        with get_engine(settings).connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return None
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except OperationalError as exc:
        raise Unreachable(_unreachable_message(settings, exc)) from None


def new_sqlite_file(settings: Settings) -> bool:
    """Whether the database is a SQLite file that does not exist yet (the first `gpuq up` makes it)."""
    path = sqlite_file(settings.database)
    return path is not None and not os.path.exists(path)


def require_schema(settings: Settings) -> None:
    """Raise SchemaOutOfDate unless the database is at this gpuq's head revision (checked once)."""
    if settings.database in _schema_ok:
        return
    current = current_revision(settings)
    head = _head_without_alembic_import()
    if current != head:
        where = mask_url(settings.database)
        if new_sqlite_file(settings):
            raise SchemaOutOfDate(f"there is no gpuq database at {where}: check GPUQ_DATABASE_URL, or make it with "
                                  "`gpuq up` or `gpuq db upgrade`")
        if current is None:
            raise SchemaOutOfDate(f"the database at {where} has no gpuq schema yet: run `gpuq db upgrade`")
        raise SchemaOutOfDate(f"the database at {where} is at revision {current}, not {head}: run `gpuq db upgrade`")
    _schema_ok.add(settings.database)


def _head_without_alembic_import() -> str:
    # The CLI must start fast: read the head revision from the newest migration file's name
    # instead of loading Alembic's script machinery.
    from gpuq.migrations.versions import HEAD

    return HEAD
