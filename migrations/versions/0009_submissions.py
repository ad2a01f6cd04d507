"""Submissions: each submit's idempotency key and the jobs it made (the server honours a retried key).

Revision ID: 0009
Revises: 0008
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpuq.service.models import UTCDateTime

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "submissions",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("user", sa.String(length=64), nullable=False),
        sa.Column("job_ids", sa.JSON(), nullable=False),
        sa.Column("submitted_at", UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_submissions")),
    )


def downgrade() -> None:
    op.drop_table("submissions")
