"""The nodes a job may not run on (`--exclude`, sbatch's -x): a flaky GPU's node, another group's.

Revision ID: 0027
Revises: 0026
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("exclude_nodes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("exclude_nodes")
    # SQLite's batch copy loses the queue-order index's DESC (see 0010): made again as 0008 made it.
    if op.get_bind().dialect.name == "sqlite":
        op.drop_index("ix_jobs_queue_order", table_name="jobs")
        op.create_index("ix_jobs_queue_order", "jobs",
                        ["state", "held", "user", sa.text("priority DESC"), "submitted_at", "id"], unique=False)
