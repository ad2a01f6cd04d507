"""The schema exists only through Alembic, and the migrations build exactly what the models say."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from gpuq.migrations.versions import HEAD
from gpuq.service import constants as c
from gpuq.service import db
from gpuq.service.errors import SchemaOutOfDate
from gpuq.service.models import Base
from tests.conftest import make_settings, run_cli


def test_migrations_upgrade_an_empty_database_to_exactly_the_models(database_url, tmp_path):
    settings = make_settings(tmp_path, database_url, "redis://127.0.0.1:6379/13")
    db.upgrade(settings)
    with db.get_engine(settings).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    assert db.current_revision(settings) == HEAD


def test_head_constant_matches_the_newest_migration(tmp_path):
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", "redis://127.0.0.1:6379/13")
    assert ScriptDirectory.from_config(db.alembic_config(settings)).get_current_head() == HEAD


def test_a_database_without_the_schema_is_refused_with_the_command_that_fixes_it(tmp_path):
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'empty.db'}", "redis://127.0.0.1:6379/13")
    with pytest.raises(SchemaOutOfDate, match="gpuq db upgrade"):
        db.require_schema(settings)


def test_a_mistyped_sqlite_path_is_named_and_no_empty_database_is_left_there(tmp_path):
    # `gpuq drain` on a typo made an empty file there, which the next `gpuq up` took for a new queue.
    typo = tmp_path / "gpuq.bd"
    settings = make_settings(tmp_path, f"sqlite:///{typo}", "redis://127.0.0.1:6379/13")
    for args in (["drain", "testnode"], ["db", "current"], ["scheduler"]):
        done = run_cli(args, settings, timeout=60)
        assert done.returncode == c.EXIT_CONFIG, done  # `db current` said "none (run `gpuq db upgrade`)", exit 0
        assert done.stderr == (f"gpuq: there is no gpuq database at sqlite:///{typo}: check GPUQ_DATABASE_URL, "
                               "or make it with `gpuq up` or `gpuq db upgrade`\n"), done.stderr
        assert not typo.exists(), args


def test_the_scheduler_on_a_database_without_the_schema_stops_in_one_line_with_exit_78(tmp_path):
    # It ran on, logging "no such table: jobs" with a traceback every second.
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'empty.db'}", "redis://127.0.0.1:6379/13")
    done = run_cli(["scheduler"], settings, timeout=60)
    assert done.returncode == c.EXIT_CONFIG, done.stderr
    assert done.stderr.count("\n") == 1 and "gpuq db upgrade" in done.stderr, done.stderr


def test_downgrade_to_base_removes_every_table(database_url, tmp_path):
    from alembic import command
    from sqlalchemy import inspect

    settings = make_settings(tmp_path, database_url, "redis://127.0.0.1:6379/13")
    db.upgrade(settings)
    cfg = db.alembic_config(settings)
    with db.get_engine(settings).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "base")
        conn.commit()
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}


def test_a_sqlite_database_made_by_gpuq_db_upgrade_is_its_makers_alone(tmp_path):
    # It holds every job's output and environment: 0600 from its creation, whatever the umask,
    # and SQLite gives its -wal and -shm files the same mode.
    import os
    import stat

    from tests.conftest import run_cli

    path = tmp_path / "by-hand" / "gpuq.db"
    settings = make_settings(tmp_path / "home", f"sqlite:///{path}", "redis://127.0.0.1:6379/15")
    done = run_cli(["db", "upgrade"], settings)
    assert done.returncode == 0, done.stderr
    made = [p for p in path.parent.iterdir() if p.name.startswith("gpuq.db")]
    assert path in made and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in made), made
