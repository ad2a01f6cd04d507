"""Each user's waiting jobs in queue order, for the scheduler's quick passes; it replaces the
(state, priority, id) index, whose reads it serves too. Allocations lose their job_id index,
which their unique (job_id, rank) key makes redundant: fewer index pages written per job.

Revision ID: 0008
Revises: 0007
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_queue_order", "jobs",
                    ["state", "held", "user", sa.text("priority DESC"), "submitted_at", "id"], unique=False)
    op.drop_index("ix_jobs_state_priority", table_name="jobs")
    op.drop_index("ix_allocations_job_id", table_name="allocations")


def downgrade() -> None:
    op.create_index("ix_allocations_job_id", "allocations", ["job_id"], unique=False)
    op.create_index("ix_jobs_state_priority", "jobs", ["state", "priority", "id"], unique=False)
    op.drop_index("ix_jobs_queue_order", table_name="jobs")
