"""What differs between SQLite and PostgreSQL, in one place: every other module asks here.

gpuq runs on both: SQLite for one box (the embedded default), PostgreSQL for a cluster. They
differ in how a transaction takes the write lock (service/db.py), in which statements a worker's
take can use (service/next_up.py), in whether a failed statement aborts its transaction, and in
their SQL for dates."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from sqlalchemy import Connection, Engine, Integer, cast, func
from sqlalchemy.orm import Session

SQLITE = "sqlite"


def is_sqlite_url(url: str) -> bool:
    return url.startswith(SQLITE)


def is_sqlite(bind: Connection | Engine | Session) -> bool:
    """Whether a connection, an engine or a session's connection is SQLite's."""
    if isinstance(bind, Session):
        bind = bind.connection()
    return bind.dialect.name == SQLITE


def sqlite_file(url: str) -> str | None:
    """The file of a sqlite:/// URL; None for another database, one in memory, or a file: URI."""
    if not is_sqlite_url(url):
        return None
    path = url.split("///", 1)[-1]
    return None if not path or path == ":memory:" or path.startswith("file:") else path


def savepoint(session: Session) -> AbstractContextManager[Any]:
    """A savepoint where a failed statement would abort the whole transaction (PostgreSQL); on
    SQLite, where only the failed statement is undone, none (two statements fewer). So only for
    a block whose earlier statements may stand when a later one fails, or whose later ones cannot
    fail on SQLite: nothing before the failed statement is undone there (``allocate`` needs a
    real savepoint, ``take_next`` does not)."""
    if is_sqlite(session):
        return nullcontext()
    return session.begin_nested()


def epoch_seconds(column: Any, bind: Connection | Engine | Session) -> Any:
    """Whole seconds since 1970 of a UTC timestamp column, in the database's own SQL."""
    if is_sqlite(bind):
        return cast(func.strftime("%s", column), Integer)
    return cast(func.floor(func.extract("epoch", column)), Integer)
