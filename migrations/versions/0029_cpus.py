"""A command job's CPU limit (`gpuq submit --cpus`, as docker --cpus; SLURM's DefCpuPerGPU as the
GPUQ_CPUS_PER_GPU default): the cores its processes may use together, a cgroup's CPU quota.

Revision ID: 0029
Revises: 0028
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("cpus", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("cpus")
    # SQLite's batch copy loses the queue-order index's DESC (see 0010): made again as 0008 made it.
    if op.get_bind().dialect.name == "sqlite":
        op.drop_index("ix_jobs_queue_order", table_name="jobs")
        op.create_index("ix_jobs_queue_order", "jobs",
                        ["state", "held", "user", sa.text("priority DESC"), "submitted_at", "id"], unique=False)
