"""A command's host memory peak in its usage summary (seff's Memory Utilized): the most anonymous
and shared memory its processes were seen to hold, MiB.

Revision ID: 0031
Revises: 0030
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("job_usage", sa.Column("host_mem_peak_mib", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_usage") as batch:
        batch.drop_column("host_mem_peak_mib")
