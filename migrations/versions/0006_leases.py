"""Leases, infrastructure requeues, failure classes, host memory limits, per-GPU drains.

Revision ID: 0006
Revises: 0005
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC = gpuq.service.models.UTCDateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("lease_token", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", UTC, nullable=True))
        batch.add_column(sa.Column("requeues", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("failure", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("host_mem_mib", sa.Integer(), nullable=True))
    with op.batch_alter_table("gpus") as batch:
        batch.add_column(sa.Column("drain_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("drain_reason")
    with op.batch_alter_table("jobs") as batch:
        for name in ("host_mem_mib", "failure", "requeues", "lease_expires_at", "lease_token"):
            batch.drop_column(name)
