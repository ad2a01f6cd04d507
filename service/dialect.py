"""What differs between SQLite and PostgreSQL, in one place: every other module asks here.

gpuq runs on both: SQLite for one box (the embedded default), PostgreSQL for a cluster. They
differ in how a transaction takes the write lock (service/db.py), in which statements a worker's
take can use (service/next_up.py), in whether a failed statement aborts its transaction, and in
their SQL for dates."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def savepoint(session: Session, *, on_sqlite: bool = False) -> Iterator[None]:
    """A savepoint around a block whose failed statement must not take the rest of the transaction
    with it. PostgreSQL aborts the whole transaction on a failed statement, so it needs one there.
    SQLite undoes just the failed statement: there it is needed only where an earlier statement of
    the block must be undone too (``on_sqlite``: ``allocate``'s dispatch when its GPU's allocation
    is refused); without one, two statements fewer (``take_next``, a usage summary)."""
    if is_sqlite(session) and not on_sqlite:
        yield
        return
    with session.begin_nested():
        # SQLAlchemy sends the SAVEPOINT only once the nested transaction asks the session for its
        # connection. A Prepared statement (service/prepared.py) runs on the driver's cursor and
        # never does: its failure then rolled back to no savepoint. On SQLite the block's earlier
        # statements stood; on PostgreSQL the whole transaction was aborted, unseen until its
        # COMMIT, which PostgreSQL answers with a silent ROLLBACK (a submit's jobs were lost).
        session.connection()
        yield


def epoch_seconds(column: Any, bind: Connection | Engine | Session) -> Any:
    """Whole seconds since 1970 of a UTC timestamp column, in the database's own SQL."""
    if is_sqlite(bind):
        return cast(func.strftime("%s", column), Integer)
    return cast(func.floor(func.extract("epoch", column)), Integer)
