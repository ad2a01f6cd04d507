"""Alembic environment: the URL comes from gpuq's settings, the target schema from its models."""

from alembic import context
from sqlalchemy import create_engine, pool

from gpuq.service.models import Base
from gpuq.service.settings import get_settings

config = context.config
settings = config.attributes.get("gpuq_settings") or get_settings()
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=settings.database, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(settings.database, poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things in place; batch mode copies the table.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
