"""A command's CPU time in its usage summary (sacct's TotalCPU): the CPU seconds of its processes,
as its worker reaped it.

Revision ID: 0030
Revises: 0029
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("job_usage", sa.Column("cpu_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_usage") as batch:
        batch.drop_column("cpu_s")
