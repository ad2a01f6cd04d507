"""How a job waits for its ``after`` jobs, as sbatch's kinds: ``afterok`` (all succeeded),
``afterany`` (all ended), ``afternotok`` (all ended other than succeeded) or ``after`` (all
started), in place of the ``after_any`` flag, which told the first two apart.

Revision ID: 0026
Revises: 0025
"""
import sqlite3
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("after_kind", sa.String(16), nullable=False, server_default="afterok"))
    op.execute("UPDATE jobs SET after_kind = 'afterany' WHERE after_any")
    _drop_jobs_column("after_any")


def downgrade() -> None:
    op.add_column("jobs", sa.Column("after_any", sa.Boolean(), nullable=False, server_default=sa.false()))
    # The kinds the flag cannot tell apart become the nearer of its two: any end.
    op.execute("UPDATE jobs SET after_any = (after_kind <> 'afterok')")
    _drop_jobs_column("after_kind")


def _drop_jobs_column(name: str) -> None:
    """Drop a column of ``jobs`` in place. SQLite's batch mode would copy the table (every job ever
    run) and the copy's queue-order index would lose ``priority DESC`` (see 0010), turning each
    user's queue head from an index seek into a sort; SQLite drops a plain column itself since
    3.35. An older SQLite copies it, and the index is made again as 0008 made it."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        op.drop_column("jobs", name)
    elif sqlite3.sqlite_version_info >= (3, 35):
        op.execute(f"ALTER TABLE jobs DROP COLUMN {name}")
    else:
        with op.batch_alter_table("jobs") as batch:
            batch.drop_column(name)
        op.drop_index("ix_jobs_queue_order", table_name="jobs")
        op.create_index("ix_jobs_queue_order", "jobs",
                        ["state", "held", "user", sa.text("priority DESC"), "submitted_at", "id"], unique=False)
