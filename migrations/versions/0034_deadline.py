"""A job's deadline (`--deadline`, sbatch's): a pending job that could no longer end by then is
cancelled.

Revision ID: 0034
Revises: 0033
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = "0034"
down_revision: str | None = "0033"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("deadline_at", gpuq.service.models.UTCDateTime(timezone=True), nullable=True))
    op.create_index(op.f("ix_jobs_deadline_at"), "jobs", ["deadline_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_deadline_at"), table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("deadline_at")
