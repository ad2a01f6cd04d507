"""A GPU no longer on its node (taken out, or left out of GPUQ_FAKE_GPUS): retired by the node's
next `gpuq up`, so that it is no longer listed offline for ever, nor counted among the node's GPUs
at submit. Its row stays, with its device samples.

Revision ID: 0018
Revises: 0017
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("gpus", sa.Column("retired_at", gpuq.service.models.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("retired_at")
