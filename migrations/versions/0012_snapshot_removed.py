"""Snapshots past their retention: when gpuq removed a job's copy of its work tree
(``GPUQ_SNAPSHOT_RETENTION_DAYS``), so that `gpuq show` and `gpuq resubmit` can say so and the
pruning reads only the copies still there.

Revision ID: 0012
Revises: 0011
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpuq.service.models import UTCDateTime

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ADD COLUMN (as 0011): SQLite's batch mode would copy the jobs table.
    op.add_column("jobs", sa.Column("snapshot_removed_at", UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("snapshot_removed_at")
