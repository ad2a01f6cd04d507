"""The dashboard's database sessions: the CLI's session, with the transaction made read-only, so
that no page or scrape can write even by mistake."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.orm import Session

from gpuq.service.db import session_scope
from gpuq.service.settings import Settings


@contextmanager
def read_session(settings: Settings) -> Iterator[Session]:
    """A session whose transaction refuses writes (PostgreSQL: READ ONLY; SQLite: query_only)."""
    with session_scope(settings) as session:
        if session.get_bind().dialect.name != "sqlite":
            session.execute(text("SET TRANSACTION READ ONLY"))
            yield session
            return
        # query_only belongs to the connection, which goes back to the pool afterwards: set it on
        # this transaction's connection and clear it there before the transaction ends (whatever
        # SQLAlchemy's state then), or the pool's next user could not even begin a transaction.
        raw = session.connection().connection.driver_connection
        raw.execute("PRAGMA query_only = ON")
        try:
            yield session
        finally:
            raw.execute("PRAGMA query_only = OFF")
