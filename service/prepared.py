"""Statements run many times a second (a job's end and the next one's start, a scheduler's quick
pass, a submit's placement), compiled once and run on SQLite's own cursor.

On SQLite every job's end and the next job's start hold the database's one write lock, and under a
flood of short jobs the lock, not the CPU, sets the pace. SQLAlchemy's execution machinery costs
about 30 microseconds a statement on top of SQLite's own 5 to 20 (measured on this project's end
of a job: 53 against 21 for its UPDATE), a third of the time the lock is held. A ``Prepared``
statement is compiled by SQLAlchemy, once per set of inserted columns, and its values
go through the same type processors SQLAlchemy would apply; only the per-call bookkeeping is left
out. Elsewhere (PostgreSQL, whose writers do not queue on one lock) it runs through SQLAlchemy as
any statement does.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, cast

from sqlalchemy import Connection, exc

from gpuq.service.dialect import is_sqlite


class Prepared:
    """A Core statement run straight on the driver's cursor where the database is SQLite.

    ``run`` returns the rows of a statement that returns any (a SELECT, or RETURNING), as named
    tuples with the columns' types applied, else the number of rows an UPDATE or DELETE changed
    (of an INSERT, whatever the driver says). Driver errors are raised as SQLAlchemy raises them
    (IntegrityError, OperationalError...)."""

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self.returns = bool(statement.is_select or (statement.is_dml and statement.returning_column_descriptions))
        # {inserted columns (none for anything but an INSERT): compiled form}, for SQLite
        self._compiled: dict[tuple[str, ...], _Compiled] = {}

    def run(self, conn: Connection, params: dict[str, Any] | list[dict[str, Any]]) -> Any:
        if not is_sqlite(conn):
            result = conn.execute(self.statement, params)
            return result.all() if self.returns else result.rowcount
        first: dict[str, Any] = params[0] if isinstance(params, list) else params
        # An INSERT names the columns it is given (as SQLAlchemy compiles it), anything else its binds.
        key = tuple(first) if self.statement.is_insert else ()
        compiled = self._compiled.get(key) or self._compile(conn, key)
        cursor = cast(Any, conn.connection.driver_connection).cursor()
        try:
            if isinstance(params, list):
                cursor.executemany(compiled.sql, [compiled.values(p) for p in params])
            else:
                cursor.execute(compiled.sql, compiled.values(params))
            if not self.returns:
                return cursor.rowcount
            return [compiled.row(r) for r in cursor.fetchall()]
        except conn.dialect.loaded_dbapi.Error as error:
            raise exc.DBAPIError.instance(compiled.sql, params, error, conn.dialect.loaded_dbapi.Error) from None
        finally:
            cursor.close()

    def _compile(self, conn: Connection, key: tuple[str, ...]) -> _Compiled:
        dialect = conn.dialect
        compiled = self.statement.compile(dialect=dialect, column_keys=list(key) or None)
        if not compiled.positional:
            raise TypeError(f"{dialect.name}: a prepared statement needs a positional driver")
        names = list(compiled.positiontup or ())
        processors = [compiled.binds[n].type.dialect_impl(dialect).bind_processor(dialect) for n in names]
        columns = []
        if self.returns:
            described = (self.statement.returning_column_descriptions if self.statement.is_dml
                         else self.statement.column_descriptions)
            columns = [(d["name"], d["type"].dialect_impl(dialect).result_processor(dialect, None))
                       for d in described]
        made = _Compiled(str(compiled), names, compiled.construct_params(_check=False), processors, columns)
        self._compiled[key] = made
        return made


class _Compiled:
    """One compiled form: its SQL, its binds in order with their processors, its result columns."""

    def __init__(self, sql: str, names: list[str], defaults: dict[str, Any], processors: list[Any],
                 columns: list[tuple[str, Any]]) -> None:
        self.sql, self.defaults = sql, defaults
        self.binds = list(zip(names, processors, strict=True))
        self.row_type = namedtuple("Row", [name for name, _ in columns], rename=True) if columns else None
        self.result_processors = [p for _, p in columns]

    def values(self, params: dict[str, Any]) -> list[Any]:
        out = []
        for name, process in self.binds:
            value = params[name] if name in params else self.defaults[name]
            out.append(process(value) if process is not None else value)  # None too: JSON's is 'null'
        return out

    def row(self, raw: tuple[Any, ...]) -> Any:
        assert self.row_type is not None  # rows come only of a statement with result columns
        processed = (p(v) if p is not None else v for p, v in zip(self.result_processors, raw, strict=True))
        return self.row_type(*processed)
