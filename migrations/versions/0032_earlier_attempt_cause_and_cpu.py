"""An earlier attempt's cause (why the job ran again: preempted, requeued, or the failure that
retried it) and its command's CPU seconds, which the job's usage summary (its last attempt's)
does not keep.

Revision ID: 0032
Revises: 0031
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0032"
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("earlier_attempts", sa.Column("cause", sa.String(length=32), nullable=True))
    op.add_column("earlier_attempts", sa.Column("cpu_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("earlier_attempts") as batch:
        batch.drop_column("cpu_s")
        batch.drop_column("cause")
