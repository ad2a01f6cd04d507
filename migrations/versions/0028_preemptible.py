"""Preemptible jobs (`gpuq submit --preemptible`, SLURM's scavenger QOS): they run on GPUs no other
job waits for and are requeued when one does.

Revision ID: 0028
Revises: 0027
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("preemptible", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("preemptible")
    # SQLite's batch copy loses the queue-order index's DESC (see 0010): made again as 0008 made it.
    if op.get_bind().dialect.name == "sqlite":
        op.drop_index("ix_jobs_queue_order", table_name="jobs")
        op.create_index("ix_jobs_queue_order", "jobs",
                        ["state", "held", "user", sa.text("priority DESC"), "submitted_at", "id"], unique=False)
