"""A signal sent to a job ahead of its time limit (`--signal USR1@120`, sbatch's), so that it can
save a checkpoint before the limit stops it.

Revision ID: 0022
Revises: 0021
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("signal", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("signal")
