"""The GPU time of a job's earlier attempts (retried or requeued), charged to its user by fair
share and `gpuq stats`: the job's own start and end are its last attempt's.

Revision ID: 0014
Revises: 0013
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpuq.service.models import UTCDateTime

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "earlier_attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("charged", sa.Float(), nullable=False),
        sa.Column("started_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("ended_at", UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_earlier_attempts_job_id", "earlier_attempts", ["job_id"], unique=False)
    op.create_index("ix_earlier_attempts_ended_at", "earlier_attempts", ["ended_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_earlier_attempts_ended_at", table_name="earlier_attempts")
    op.drop_index("ix_earlier_attempts_job_id", table_name="earlier_attempts")
    op.drop_table("earlier_attempts")
