"""Prepared statements (the worker's per-job statements, run on the driver's own cursor: sqlite3's or
psycopg's) store and return exactly what SQLAlchemy's execution of the same statement does, and
fail as it fails."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event, exc, text

from gpuq.service import samples
from gpuq.service.constants import State
from gpuq.service.db import write_scope
from gpuq.service.devices import GpuProcess, GpuReading
from gpuq.service.lifecycle import _SUCCEED
from gpuq.service.models import Job, utcnow
from gpuq.service.next_up import _ALLOCATE_HERE, _TAKE
from tests.test_usage import add_gpu, add_job

NOW = utcnow()


def raw(session, table: str, key: str, value: int) -> tuple:
    """A row as the database holds it (the driver's values, no SQLAlchemy type applied)."""
    return tuple(session.execute(text(f"SELECT * FROM {table} WHERE {key} = :v"), {"v": value}).one())


def running_job(session) -> int:
    job = add_job(session, "ann", "n", NOW, None)
    session.get(Job, job).lease_token = "t"
    session.flush()
    return job


def test_an_update_writes_what_sqlalchemy_writes_nulls_and_json_alike(settings):
    with write_scope(settings) as s:
        jobs = [running_job(s) for _ in range(4)]
    for result in ({"loss": 0.25, "memory": {"peak_rss_mib": 12.5}}, None):
        mine, theirs = jobs.pop(), jobs.pop()
        values = {"token": "t", "now": NOW, "result": result, "exit_code": None, "reason": None}
        with write_scope(settings) as s:
            assert _SUCCEED.run(s.connection(), {**values, "job_id": mine}) == 1
            assert s.connection().execute(_SUCCEED.statement, {**values, "job_id": theirs}).rowcount == 1
            assert _SUCCEED.run(s.connection(), {**values, "job_id": mine}) == 0  # ended already
        with write_scope(settings) as s:
            assert raw(s, "jobs", "id", mine)[1:] == raw(s, "jobs", "id", theirs)[1:]
            assert s.get(Job, mine).result == result and s.get(Job, mine).ended_at == NOW


def test_a_batch_insert_stores_what_sqlalchemy_stores(settings):
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
        job = add_job(s, "ann", "n", NOW, None)
    reading = GpuReading(utilization=40, memory_used_mib=100, power_w=55.5, temperature_c=41,
                         processes=(GpuProcess(pid=7, memory_mib=100, name="python", gpuq=True),))
    rows = [samples.sample_row(gpu, job if i % 2 else None, NOW + timedelta(seconds=i), 1.0,
                               reading if i % 3 else GpuReading(), None if i % 2 else 3.5) for i in range(6)]
    with write_scope(settings) as s:
        samples._INSERT.run(s.connection(), rows)
        s.connection().execute(samples._INSERT.statement, rows)
    with write_scope(settings) as s:
        stored = [tuple(r)[1:] for r in s.execute(text("SELECT * FROM device_samples ORDER BY id"))]
    assert stored[:6] == stored[6:] and len(stored) == 12


def test_returned_rows_come_typed_as_sqlalchemy_returns_them(settings):
    with write_scope(settings) as s:
        add_gpu(s, "n", 0)
        waiting = [add_job(s, "ann", "n", NOW, None) for _ in range(2)]
        for job_id in waiting:
            row = s.get(Job, job_id)
            row.state, row.started_at, row.params, row.env = State.PENDING, None, {"lr": 0.1}, {"A": "1"}
    values = {"now": NOW, "node": "n", "worker": "w", "token": "t", "expires": NOW + timedelta(seconds=60)}
    with write_scope(settings) as s:
        mine = _TAKE.run(s.connection(), {**values, "job_id": waiting[0]})
        theirs = s.connection().execute(_TAKE.statement, {**values, "job_id": waiting[1]}).all()
        assert len(mine) == len(theirs) == 1
        assert mine[0]._asdict() == {**theirs[0]._asdict(), "id": waiting[0]}
        assert mine[0].started_at == NOW and mine[0].params == {"lr": 0.1}
        assert _TAKE.run(s.connection(), {**values, "job_id": waiting[0]}) == []  # running now


def test_a_refused_row_raises_sqlalchemys_integrity_error_and_the_transaction_goes_on(settings):
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
        first, second = running_job(s), running_job(s)
    with write_scope(settings) as s:
        _ALLOCATE_HERE.run(s.connection(), {"job_id": first, "gpu_id": gpu})
        with pytest.raises(exc.IntegrityError):
            with s.begin_nested():
                _ALLOCATE_HERE.run(s.connection(), {"job_id": second, "gpu_id": gpu})  # one job per GPU
    with write_scope(settings) as s:
        held = s.execute(text("SELECT job_id FROM allocations WHERE gpu_id = :g"), {"g": gpu}).scalars().all()
        assert held == [first]


def test_a_prepared_statement_skips_sqlalchemys_execution_on_either_database(settings):
    with write_scope(settings) as s:
        gpu = add_gpu(s, "n", 0)
        job = running_job(s)
    executed = []

    def seen(conn, cursor, statement, *rest):
        executed.append(statement)

    with write_scope(settings) as s:
        conn = s.connection()
        event.listen(conn.engine, "before_cursor_execute", seen)
        try:
            assert _ALLOCATE_HERE.run(conn, {"job_id": job, "gpu_id": gpu}) == 1
            conn.execute(text("SELECT 1"))  # what SQLAlchemy executes is seen
        finally:
            event.remove(conn.engine, "before_cursor_execute", seen)
        assert s.execute(text("SELECT job_id FROM allocations WHERE gpu_id = :g"), {"g": gpu}).scalars().all() == [job]
    assert executed == ["SELECT 1"]
