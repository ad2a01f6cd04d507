"""Engines and sessions, and the Alembic upgrade that is the only way the schema changes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from gpuq.service.errors import SchemaOutOfDate, Unreachable
from gpuq.service.settings import Settings, mask_url

def _migrations_dir() -> Path:
    import gpuq.migrations

    return Path(gpuq.migrations.__file__).resolve().parent


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets `gpuq status` read while workers write; busy_timeout makes writers queue, not fail.
    dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(conn) -> None:
    # BEGIN IMMEDIATE takes the write lock up front, so a read-then-write transaction (a claim)
    # waits for the lock instead of failing with "database is locked" when it upgrades. A
    # read-only scope (``read_scope``) takes no lock: in WAL mode it reads beside the writers.
    if conn.get_execution_options().get(_READ_ONLY):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


_READ_ONLY = "gpuq_read_only"


_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker[Session]] = {}
# Databases this process has seen at the head revision: checked once, not on every command.
_schema_ok: set[str] = set()


def _engine(url: str) -> Engine:
    if url not in _engines:
        _engines[url] = _create_engine(url)
    return _engines[url]


def _create_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4)


def get_engine(settings: Settings) -> Engine:
    """The engine for the settings' database (one per URL per process; never shared over a fork)."""
    return _engine(settings.database)


def dispose_engines() -> None:
    """Forget every engine and its pooled connections (tests, and a child process after fork)."""
    for engine in _engines.values():
        engine.dispose(close=False)
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


os.register_at_fork(after_in_child=_forget_after_fork)


def _sessionmaker(url: str) -> sessionmaker[Session]:
    if url not in _sessionmakers:
        _sessionmakers[url] = sessionmaker(bind=_engine(url), expire_on_commit=False)
    return _sessionmakers[url]


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on error.

    A database that cannot be reached raises Unreachable naming the URL (password masked).
    """
    with _scope(settings, read_only=False) as session:
        yield session


@contextmanager
def read_scope(settings: Settings) -> Iterator[Session]:
    """A session for reading only, in one transaction that sees one state of the database.

    On SQLite it takes no write lock, so a long read (the scheduler's snapshot, a watcher's poll)
    never makes the workers' claims and ends wait; writing in it is an error there.
    """
    with _scope(settings, read_only=True) as session:
        yield session


@contextmanager
def _scope(settings: Settings, read_only: bool) -> Iterator[Session]:
    session = _sessionmaker(settings.database)()
    try:
        if read_only:
            session.connection(execution_options={_READ_ONLY: True})
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
        session.close()


def _unreachable_message(settings: Settings, exc: SQLAlchemyError) -> str:
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = detail[0] if detail else type(exc).__name__
    return f"cannot use the database at {mask_url(settings.database)}: {first}"


def alembic_config(settings: Settings):
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
    try:
        with get_engine(settings).connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return None
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except OperationalError as exc:
        raise Unreachable(_unreachable_message(settings, exc)) from None


def require_schema(settings: Settings) -> None:
    """Raise SchemaOutOfDate unless the database is at this gpuq's head revision (checked once)."""
    if settings.database in _schema_ok:
        return
    current = current_revision(settings)
    head = _head_without_alembic_import()
    if current != head:
        where = mask_url(settings.database)
        if current is None:
            raise SchemaOutOfDate(f"the database at {where} has no gpuq schema yet: run `gpuq db upgrade`")
        raise SchemaOutOfDate(f"the database at {where} is at revision {current}, not {head}: run `gpuq db upgrade`")
    _schema_ok.add(settings.database)


def _head_without_alembic_import() -> str:
    # The CLI must start fast: read the head revision from the newest migration file's name
    # instead of loading Alembic's script machinery.
    from gpuq.migrations.versions import HEAD

    return HEAD
