"""What the session scopes cost a database server in round trips: reads outside any transaction on
PostgreSQL (each statement sees its own snapshot there either way), writes in one, a pooled
connection pinged only after it sat idle; and what a submit asks of the node's GPUs."""

import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.pool import NullPool

from gpuq.service import db, spec, submit_checks, submitting
from gpuq.service.dialect import is_sqlite_url
from gpuq.service.models import Job

pytestmark = pytest.mark.timeout(60)


def _driver_in_transaction(session) -> bool:
    raw = session.connection().connection.driver_connection
    if hasattr(raw, "info"):  # psycopg: the server's own word on the connection's state
        import psycopg

        return raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    return raw.in_transaction  # sqlite3


def test_a_read_scope_opens_a_transaction_only_on_sqlite_and_a_write_scope_always_does(settings):
    with db.read_scope(settings) as session:
        assert session.scalars(select(Job.id)).all() == []
        # SQLite: BEGIN (deferred, no lock) so the reads see one state of the file; PostgreSQL: no
        # BEGIN and no ROLLBACK, two round trips that would change nothing at READ COMMITTED.
        assert _driver_in_transaction(session) == is_sqlite_url(settings.database)
    with db.write_scope(settings) as session:
        session.scalars(select(Job.id)).all()
        assert _driver_in_transaction(session)


def test_a_read_scope_leaves_its_pooled_connection_in_a_transaction_for_the_next_write(settings):
    # The read scope's autocommit must not outlive it: the next write scope on the same pooled
    # connection is one transaction, rolled back whole when it fails.
    with db.read_scope(settings) as session:
        session.scalars(select(Job.id)).all()
    with pytest.raises(RuntimeError), db.write_scope(settings) as session:
        session.add(Job(name="x", user="u", kind="command", argv=["true"], cwd="/", params={}, gpus=1, priority=0,
                        state="pending", submitted_at=submitting.utcnow(), attempts=[]))
        session.flush()
        raise RuntimeError("the write fails after its insert")
    with db.read_scope(settings) as session:
        assert session.scalars(select(Job.id)).all() == []


def test_a_submit_asks_this_nodes_devices_for_its_gpus_once_a_minute_not_every_time(settings, monkeypatch):
    opened = []
    real = submit_checks.open_devices
    monkeypatch.setattr(submit_checks, "open_devices", lambda s: opened.append(s) or real(s))
    monkeypatch.setattr(submit_checks, "_local_gpus", {})
    first = submit_checks.local_gpus(settings)
    assert [g.index for g in first] == [0, 1] and len(opened) == 1
    assert submit_checks.local_gpus(settings) == first and len(opened) == 1
    # A minute on (the entry made as long ago), they are asked for again.
    submit_checks._local_gpus[settings] = (time.monotonic() - submit_checks._LOCAL_GPUS_TTL_S - 1, first)
    assert submit_checks.local_gpus(settings) == first and len(opened) == 2


def _backend_pid(session) -> int:
    return session.connection().connection.driver_connection.info.backend_pid


def _last_query(url: str, pid: int) -> str:
    """What PostgreSQL says the backend ``pid`` ran last, asked on a connection of its own."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.scalar(text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid})
    finally:
        engine.dispose()


def test_a_pooled_postgresql_connection_is_pinged_only_once_it_sat_idle(settings, monkeypatch):
    if is_sqlite_url(settings.database):
        pytest.skip("SQLite has no server to ping")
    marker = f"SELECT 'marker {time.monotonic()}'"
    with db.read_scope(settings) as session:
        session.execute(text(marker))
    # Back in use at once: the connection goes out as it came back, its last statement still ours.
    with db.read_scope(settings) as session:
        assert _last_query(settings.database, _backend_pid(session)) == marker
    # Idle past the limit: pinged on its way out.
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 0.05)
    with db.read_scope(settings) as session:
        session.execute(text(marker))
    time.sleep(0.1)
    with db.read_scope(settings) as session:
        assert _last_query(settings.database, _backend_pid(session)) != marker


def test_a_pooled_connection_whose_postgresql_backend_ended_is_replaced_unseen_even_just_back(settings):
    # Within the second that spares a connection its ping: its server said it was ending the session
    # (as a restart says it to every session) and closed it, which the socket shows with no round trip.
    if is_sqlite_url(settings.database):
        pytest.skip("SQLite has no server to lose")
    with db.read_scope(settings) as session:
        dead = _backend_pid(session)
    engine = create_engine(settings.database, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": dead})
            for _ in range(100):  # until it has gone (it ends as soon as it reads the signal)
                if not conn.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": dead}):
                    break
                time.sleep(0.01)
    finally:
        engine.dispose()
    # The pool hands out a new connection: the scope never sees an error.
    with db.read_scope(settings) as session:
        assert session.scalars(select(Job.id)).all() == []
        assert _backend_pid(session) != dead


@pytest.mark.parametrize("how", ["run", "send"])
@pytest.mark.parametrize("on_sqlite", [False, True])
def test_a_statement_on_the_drivers_cursor_that_fails_in_a_savepoint_undoes_only_the_savepoint(settings, on_sqlite,
                                                                                                 how):
    # What a worker's take and a placement rely on: a Prepared statement runs on the driver's own
    # cursor, past SQLAlchemy, and its savepoint must still be sent. Without it PostgreSQL aborted
    # the whole transaction and answered its COMMIT with a silent ROLLBACK. A statement sent
    # (``Prepared.send``) rides the savepoint's pipeline on PostgreSQL: its failure is found at the
    # savepoint's end, and must undo the savepoint all the same.
    from sqlalchemy import update
    from sqlalchemy.exc import IntegrityError

    from gpuq.service.dialect import savepoint
    from gpuq.service.models import Submission, table, utcnow
    from gpuq.service.prepared import Prepared

    insert = Prepared(table(Submission).insert())
    with db.write_scope(settings) as session:
        insert.run(session.connection(), {"key": "k1", "user": "ann", "job_ids": [1], "submitted_at": utcnow()})
    with db.write_scope(settings) as session:
        conn = session.connection()  # taken before the savepoint, as a take and a placement do
        session.execute(update(table(Submission)).values(job_ids=[2]))
        reached = []
        with pytest.raises(IntegrityError), savepoint(session, on_sqlite=on_sqlite):
            insert.run(conn, {"key": "k2", "user": "ann", "job_ids": [3], "submitted_at": utcnow()})
            getattr(insert, how)(conn, {"key": "k1", "user": "ann", "job_ids": [4], "submitted_at": utcnow()})
            reached.append(True)
        # On PostgreSQL a sent statement waits for nothing, its failure included; anywhere else it runs.
        assert reached == ([True] if how == "send" and not is_sqlite_url(settings.database) else [])
        # The transaction goes on, and commits what came before the savepoint.
        session.execute(update(table(Submission)).where(table(Submission).c.key == "k1").values(user="bob"))
    with db.read_scope(settings) as session:
        rows = session.execute(select(table(Submission).c.key, table(Submission).c.user,
                                      table(Submission).c.job_ids)).all()
    # Where a savepoint is sent, the statement before the failed one in it is undone too.
    undone = on_sqlite or not is_sqlite_url(settings.database)
    assert sorted(map(tuple, rows)) == ([("k1", "bob", [2])] if undone else [("k1", "bob", [2]), ("k2", "ann", [3])])


def test_a_gpuq_process_stopped_inside_a_postgresql_transaction_lets_go_of_its_locks(settings):
    # A worker stopped (SIGSTOP) holding its job's row lock kept the reaper from requeueing the job
    # for as long as it stayed stopped. PostgreSQL now ends such a session (IDLE_IN_TRANSACTION_S,
    # 2 s here) and its locks with it.
    if is_sqlite_url(settings.database):
        pytest.skip("SQLite has no server to end a session: a stopped writer holds the file")
    job_id = submitting.submit_all(settings, [spec.command_spec(["true"], user="ann")])[0].id
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from sqlalchemy import text
from gpuq.service import db
db.IDLE_IN_TRANSACTION_S = 2
with db._engine({settings.database!r}).connect() as conn:
    conn.execute(text("UPDATE jobs SET priority = 5 WHERE id = {job_id}"))
    print("locked", flush=True)
    time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGSTOP)  # stopped inside its transaction, its row lock held
        engine = create_engine(settings.database, poolclass=NullPool)
        start = time.monotonic()
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '20s'"))
            conn.execute(text("UPDATE jobs SET priority = 7 WHERE id = :id"), {"id": job_id})
        waited = time.monotonic() - start
        assert 1 < waited < 15, waited  # waited for the lock until the session was ended
        with engine.connect() as conn:
            assert conn.execute(text("SELECT priority FROM jobs WHERE id = :id"), {"id": job_id}).scalar() == 7
        engine.dispose()
    finally:
        holder.kill()
        holder.wait()


def test_a_postgresql_urls_own_session_options_are_kept_beside_gpuqs():
    url = "postgresql+psycopg://gpuq@db/gpuq?options=-c%20statement_timeout%3D5000"
    assert db._session_options(url) == "-c statement_timeout=5000 -c idle_in_transaction_session_timeout=30000"
    assert db._session_options("postgresql+psycopg://gpuq@db/gpuq") == "-c idle_in_transaction_session_timeout=30000"


def _descriptors() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_a_stopped_in_process_server_and_disposed_engines_leave_no_descriptor_behind(settings):
    # Each left its loop's, its pool's and its writers' lock's descriptors open: the suite's
    # process passed 1,024 of them, where select() refuses one (the terminal tests failed so).
    from gpuq.cli.client import Client
    from tests.conftest import ThreadServer

    db.dispose_engines()
    before = _descriptors()
    for _ in range(3):
        server = ThreadServer(settings)
        assert Client(str(settings.server_socket)).get("/jobs")["jobs"] == []
        with db.write_scope(settings) as session:  # a write: on SQLite, the writers' lock file too
            session.execute(text("SELECT 1"))
        server.stop()
        db.dispose_engines()
    assert _descriptors() <= before
