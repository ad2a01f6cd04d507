"""What differs between SQLite and PostgreSQL, in one place: every other module asks here.

gpuq runs on both: SQLite for one box (the embedded default), PostgreSQL for a cluster. They
differ in how a transaction takes the write lock (service/db.py), in which statements a worker's
take can use (service/next_up.py), in whether a failed statement aborts its transaction, and in
their SQL for dates."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import Connection, Engine, Integer, func, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql import operators
from sqlalchemy.sql.elements import UnaryExpression

SQLITE = "sqlite"


def is_sqlite_url(url: str) -> bool:
    return url.startswith(SQLITE)


def is_sqlite(bind: Connection | Engine | Session) -> bool:
    """Whether a connection, an engine or a session's connection is SQLite's."""
    if isinstance(bind, Session):
        bind = bind.connection()
    return bind.dialect.name == SQLITE


def on_psycopg(bind: Connection | Engine | Session) -> bool:
    """Whether a connection, an engine or a session's connection is PostgreSQL's through psycopg:
    where ``Prepared`` statements run on the driver's own cursor and its pipeline mode serves."""
    if isinstance(bind, Session):
        bind = bind.connection()
    return bind.dialect.driver == "psycopg"


def sqlite_file(url: str) -> str | None:
    """The file of a sqlite:/// URL; None for another database, one in memory, or a file: URI."""
    if not is_sqlite_url(url):
        return None
    path = url.split("///", 1)[-1]
    return None if not path or path == ":memory:" or path.startswith("file:") else path


# Where ``savepoint`` keeps the psycopg pipeline it opened, in the connection's ``info``: the
# statements of service/prepared.py ride it.
PIPELINE = "gpuq_pipeline"
_savepoint_names = itertools.count(1)


@contextmanager
def savepoint(session: Session, *, on_sqlite: bool = False) -> Iterator[None]:
    """A savepoint around a block whose failed statement must not take the rest of the transaction
    with it. PostgreSQL aborts the whole transaction on a failed statement, so it needs one there.
    SQLite undoes just the failed statement: there it is needed only where an earlier statement of
    the block must be undone too (``on_sqlite``: ``allocate``'s dispatch when its GPU's allocation
    is refused); without one, two statements fewer (``take_next``, a usage summary).

    On PostgreSQL through psycopg the block runs in the driver's pipeline mode: the SAVEPOINT goes
    out with the block's first statement that waits for its result, and the RELEASE with its last
    ones, so a block whose results are read once costs two round trips instead of four (see
    ``_pipelined``)."""
    conn = session.connection()
    if is_sqlite(conn) and not on_sqlite:
        yield
        return
    if not on_psycopg(conn) or PIPELINE in conn.info:
        with session.begin_nested():
            # SQLAlchemy sends the SAVEPOINT only once the nested transaction asks the session for
            # its connection. A Prepared statement (service/prepared.py) runs on the driver's cursor
            # and never does: its failure then rolled back to no savepoint. On SQLite the block's
            # earlier statements stood; on PostgreSQL the whole transaction was aborted, unseen until
            # its COMMIT, which PostgreSQL answers with a silent ROLLBACK (a submit's jobs were lost).
            session.connection()
            yield
        return
    with _pipelined(conn):
        yield


def results_in_pipeline(conn: Connection, cursor: Any, *_: Any) -> None:
    """The engine's ``after_cursor_execute`` hook on PostgreSQL: a statement SQLAlchemy runs in a
    savepoint's pipeline (``_pipelined``) waits for its result there, as it would outside one, since
    SQLAlchemy reads a result (its rows, or how many rows changed) as soon as it is sent."""
    pipeline = conn.info.get(PIPELINE)
    if pipeline is not None:
        pipeline.sync()


@contextmanager
def _pipelined(conn: Connection) -> Iterator[None]:
    """A savepoint on psycopg's connection, its block in the driver's pipeline mode.

    SQLAlchemy's own savepoint (``begin_nested``) is a round trip for its SAVEPOINT and one for its
    RELEASE, each job's end has two of them (its usage summary, the next job's take), and their
    bookkeeping was a quarter of a worker's CPU there. Here nothing waits for the SAVEPOINT, nor
    for a statement sent with ``Prepared.send``; ``Prepared.run`` waits for its own result, and the
    pipeline's end waits for the rest; a statement run through SQLAlchemy waits for its own
    (``results_in_pipeline``). A statement that fails, whenever it is found to have failed,
    is raised as SQLAlchemy raises it (IntegrityError...), and the block is rolled back to the
    savepoint, the transaction's earlier statements kept."""
    driver = cast(Any, conn.connection.driver_connection)
    dbapi_error = conn.dialect.loaded_dbapi.Error
    name = f"gpuq_savepoint_{next(_savepoint_names)}"
    cursor = driver.cursor()
    try:
        try:
            with driver.pipeline() as pipeline:
                conn.info[PIPELINE] = pipeline
                cursor.execute(f"SAVEPOINT {name}")
                yield
                cursor.execute(f"RELEASE SAVEPOINT {name}")
        finally:
            conn.info.pop(PIPELINE, None)
    except BaseException as failed:
        if not driver.broken:
            try:
                cursor.execute(f"ROLLBACK TO SAVEPOINT {name}")
            except dbapi_error:
                pass  # the transaction stays aborted, and its next statement says so
        if isinstance(failed, dbapi_error):  # found at the pipeline's end: no statement of ours raised it
            raise DBAPIError.instance(f"RELEASE SAVEPOINT {name}", (), failed, dbapi_error) from None
        raise
    finally:
        cursor.close()


def one_at_a_time(session: Session, name: str) -> None:
    """Make the transactions that call this with ``name`` run this part one at a time, until each
    ends. SQLite's write transactions already do (one write lock); PostgreSQL's take a transaction
    advisory lock keyed by ``name``."""
    conn = session.connection()
    if is_sqlite(conn):
        return
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    conn.execute(select(func.pg_advisory_xact_lock(key)))


def draws_ids(conn: Connection) -> bool:
    """Whether a batch of rows is best written with ids drawn beforehand (``draw_ids``): on
    PostgreSQL through psycopg, a batch that returns its ids goes through SQLAlchemy as one INSERT
    of a thousand rows' VALUES, whose tens of thousands of binds psycopg parses out of the query text
    (two thirds of an array submission's time there); drawn first, the rows go in as one prepared
    INSERT in the driver's pipeline. SQLite's ``RETURNING`` batch costs nothing of the kind."""
    return on_psycopg(conn)


def draw_ids(conn: Connection, table: Any, n: int) -> list[int]:
    """``n`` new ids of ``table``'s ``id`` column from its sequence, ascending (PostgreSQL)."""
    sequence = func.pg_get_serial_sequence(table.name, "id")
    rows = conn.execute(select(func.nextval(sequence)).select_from(func.generate_series(1, n)))
    return sorted(row[0] for row in rows)


def epoch_seconds(column: Any, bind: Connection | Engine | Session) -> Any:
    """Whole seconds since 1970 of a UTC timestamp column, in the database's own SQL."""
    if is_sqlite(bind):
        # The text cut to whole seconds first: SQLite reads fractions to the millisecond, rounding,
        # so "12:00:59.9996" would count as 12:01:00 (PostgreSQL's floor below does not).
        return sql_cast(func.strftime("%s", func.substr(column, 1, 19)), Integer)
    return sql_cast(func.floor(func.extract("epoch", column)), Integer)


def seconds_between(later: Any, earlier: Any, bind: Connection | Engine | Session) -> Any:
    """Seconds from ``earlier`` to ``later`` (UTC timestamp columns), fractions kept, in the
    database's own SQL: what a histogram over every job ever run is summed from, in the database
    rather than as a row a job in Python."""
    if is_sqlite(bind):
        # SQLite's date functions keep milliseconds: whole seconds from strftime (of the text cut
        # to seconds), and the microseconds from the stored text ("YYYY-MM-DD HH:MM:SS.ffffff"),
        # exact as Python's.
        def micro(t: Any) -> Any:
            return sql_cast(func.substr(t, 21, 6), Integer)

        return (epoch_seconds(later, bind) - epoch_seconds(earlier, bind)) + (micro(later) - micro(earlier)) / 1e6
    return func.extract("epoch", later - earlier)


def greatest(a: Any, b: Any, bind: Connection | Engine | Session) -> Any:
    """The greater of two values, timestamps or numbers (SQLite's two-argument max, PostgreSQL's GREATEST)."""
    return func.max(a, b) if is_sqlite(bind) else func.greatest(a, b)


def least(a: Any, b: Any, bind: Connection | Engine | Session) -> Any:
    """The lesser of two values (SQLite's two-argument min, PostgreSQL's LEAST)."""
    return func.min(a, b) if is_sqlite(bind) else func.least(a, b)


def matches_glob(column: Any, pattern: str, bind: Connection | Engine | Session) -> Any:
    """Whether ``column`` matches a shell-style ``pattern`` (``*`` any run of characters, ``?`` one;
    every other character only itself), case-sensitive on both: SQLite's LIKE ignores case, so
    there it is GLOB with ``[`` quoted (a task's name holds its index in brackets); PostgreSQL's
    LIKE, with its own wildcards escaped."""
    if is_sqlite(bind):
        return column.op("GLOB")("".join("[[]" if ch == "[" else ch for ch in pattern))
    like = "".join({"*": "%", "?": "_"}.get(ch, "\\" + ch if ch in "%_\\" else ch) for ch in pattern)
    return column.like(like, escape="\\")


def not_for_an_index(column: Any, bind: Connection | Engine | Session) -> Any:
    """``column``, on SQLite with its unary ``+``: the planner then will not pick an index for the
    condition on it (SQLite's own advice for steering its planner), and chooses among the others.
    SQLite keeps no statistics here (nothing runs ANALYZE) and guesses; PostgreSQL's planner has
    its statistics and is left to choose."""
    if is_sqlite(bind):
        return UnaryExpression(column.expression, operator=operators.custom_op("+"), type_=column.type)
    return column
