"""The GPUs a job ran on, kept in its usage summary (`gpuq show` of an ended job): its allocation
rows go when it ends.

Revision ID: 0015
Revises: 0014
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("job_usage", sa.Column("gpu_indices", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_usage") as batch:
        batch.drop_column("gpu_indices")
