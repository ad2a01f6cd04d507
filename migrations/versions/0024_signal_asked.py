"""A signal asked of a running job's worker (`gpuq cancel --signal USR1`, scancel's --signal): the
signal, as units.JobSignal's text without a time, and when it was asked; the job's worker sends it
once for each asking it finds after the job's start.

Revision ID: 0024
Revises: 0023
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("signal_asked", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("signal_asked_at", gpuq.service.models.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("signal_asked_at")
        batch.drop_column("signal_asked")
