"""Statements run many times a second (a job's end and the next one's start, a scheduler's quick
pass, a submit's placement), compiled once and run on the driver's own cursor.

On SQLite every job's end and the next job's start hold the database's one write lock, and under a
flood of short jobs the lock, not the CPU, sets the pace. SQLAlchemy's execution machinery costs
about 30 microseconds a statement on top of SQLite's own 5 to 20 (measured on this project's end
of a job: 53 against 21 for its UPDATE), a third of the time the lock is held. On PostgreSQL
through psycopg it cost 86 microseconds a statement beside the driver's own 111 (a count, on this
2-core machine), the CPU that every job's claim, end and submit pay a dozen times over on both
sides of the socket. A ``Prepared`` statement is compiled by SQLAlchemy, once per dialect and set
of inserted columns, and its values go through the same type processors SQLAlchemy would apply;
only the per-call bookkeeping is left out. With another driver, and for a batch that returns rows
on PostgreSQL, it runs through SQLAlchemy as any statement does.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, cast

from sqlalchemy import Connection, exc

from gpuq.service.dialect import PIPELINE, is_sqlite, on_psycopg


class Prepared:
    """A Core statement run straight on the driver's cursor (sqlite3, psycopg).

    ``run`` returns the rows of a statement that returns any (a SELECT, or RETURNING), as named
    tuples with the columns' types applied, else the number of rows an UPDATE or DELETE changed
    (of an INSERT, whatever the driver says). Driver errors are raised as SQLAlchemy raises them
    (IntegrityError, OperationalError...)."""

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self.returns = bool(statement.is_select or (statement.is_dml and statement.returning_column_descriptions))
        # {(dialect, inserted columns (none for anything but an INSERT)): compiled form}
        self._compiled: dict[tuple[str, tuple[str, ...]], _Compiled] = {}

    def run(self, conn: Connection, params: dict[str, Any] | list[dict[str, Any]]) -> Any:
        return self._execute(conn, params, wait=True)

    def send(self, conn: Connection, params: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Run a statement whose result nobody reads. In a savepoint's pipeline on PostgreSQL
        (``dialect.savepoint``) it goes out with the next statement that waits for its own result,
        or with the savepoint's release, a round trip fewer, and a failure is raised there;
        anywhere else it is ``run``."""
        self._execute(conn, params, wait=False)

    def _execute(self, conn: Connection, params: dict[str, Any] | list[dict[str, Any]], wait: bool) -> Any:
        if isinstance(params, list) and len(params) == 1:
            # One row: psycopg runs a batch in a pipeline of its own, with a sync, even for one.
            params = params[0]
        batch = isinstance(params, list)
        if not (is_sqlite(conn) or (on_psycopg(conn) and not (batch and self.returns))):
            result = conn.execute(self.statement, params)
            return result.all() if self.returns else result.rowcount
        first: dict[str, Any] = params[0] if isinstance(params, list) else params
        # An INSERT names the columns it is given (as SQLAlchemy compiles it), anything else its binds.
        key = (conn.dialect.name, tuple(first) if self.statement.is_insert else ())
        compiled = self._compiled.get(key) or self._compile(conn, key)
        pipeline = conn.info.get(PIPELINE)
        cursor = cast(Any, conn.connection.driver_connection).cursor()
        try:
            if isinstance(params, list):
                cursor.executemany(compiled.sql, [compiled.values(p) for p in params])
            else:
                cursor.execute(compiled.sql, compiled.values(params))
            if self.returns:
                return compiled.rows(cursor)  # in a pipeline, fetching the rows waits for them
            if pipeline is not None and wait:
                pipeline.sync()  # the count comes with the statement's result
            return cursor.rowcount
        except conn.dialect.loaded_dbapi.Error as error:
            raise exc.DBAPIError.instance(compiled.sql, params, error, conn.dialect.loaded_dbapi.Error) from None
        finally:
            cursor.close()

    def _compile(self, conn: Connection, key: tuple[str, tuple[str, ...]]) -> _Compiled:
        dialect = conn.dialect
        compiled = self.statement.compile(dialect=dialect, column_keys=list(key[1]) or None)
        # sqlite3's binds are positional (?), psycopg's named (%(name)s).
        names = list(compiled.positiontup or ()) if compiled.positional else sorted(set(compiled.bind_names.values()))
        processors = [compiled.binds[n].type.dialect_impl(dialect).bind_processor(dialect) for n in names]
        columns = []
        if self.returns:
            described = (self.statement.returning_column_descriptions if self.statement.is_dml
                         else self.statement.column_descriptions)
            columns = [(d["name"], d["type"].dialect_impl(dialect)) for d in described]
        made = _Compiled(dialect, str(compiled), names, compiled.construct_params(_check=False), processors, columns,
                         named=not compiled.positional)
        self._compiled[key] = made
        return made


class _Compiled:
    """One compiled form: its SQL, its binds in order with their processors, its result columns."""

    def __init__(self, dialect: Any, sql: str, names: list[str], defaults: dict[str, Any], processors: list[Any],
                 columns: list[tuple[str, Any]], named: bool) -> None:
        self.dialect, self.sql, self.defaults, self.named = dialect, sql, defaults, named
        self.binds = list(zip(names, processors, strict=True))
        self.names = names
        self.row_type = namedtuple("Row", [name for name, _ in columns], rename=True) if columns else None
        self.column_types = [t for _, t in columns]
        # Made at the first rows: psycopg's processors depend on the type the server sent.
        self.result_processors: list[Any] | None = None

    def values(self, params: dict[str, Any]) -> list[Any] | dict[str, Any]:
        out = []
        for name, process in self.binds:
            value = params[name] if name in params else self.defaults[name]
            out.append(process(value) if process is not None else value)  # None too: JSON's is 'null'
        return dict(zip(self.names, out, strict=True)) if self.named else out

    def rows(self, cursor: Any) -> list[Any]:
        assert self.row_type is not None  # rows come only of a statement with result columns
        fetched = cursor.fetchall()  # first: in a pipeline, the description comes with the rows
        if self.result_processors is None:
            self.result_processors = [t.result_processor(self.dialect, d[1])
                                      for t, d in zip(self.column_types, cursor.description, strict=True)]
        row_type, processors = self.row_type, self.result_processors
        return [row_type(*(p(v) if p is not None else v for p, v in zip(processors, raw, strict=True)))
                for raw in fetched]
