"""Shared GPUs: a job may share its GPUs with other shared jobs, each held to its memory share.
Allocations of shares sit beside each other on one GPU; whole allocations stay one per GPU (the
unique key on gpu_id becomes a unique index over whole allocations only).

Revision ID: 0011
Revises: 0010
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ADD COLUMN: SQLite's batch mode would copy the jobs table, and its copy of
    # the queue-order index would lose ``priority DESC`` (see 0010).
    op.add_column("jobs", sa.Column("shared", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("jobs", sa.Column("gpu_share", sa.Float(), nullable=True))
    with op.batch_alter_table("allocations") as batch_op:
        batch_op.add_column(sa.Column("share_mib", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("used_mib", sa.Integer(), nullable=True))
        batch_op.drop_constraint(op.f("uq_allocations_gpu_id"), type_="unique")
    op.create_index("uq_allocations_gpu_id", "allocations", ["gpu_id"], unique=True,
                    sqlite_where=sa.text("share_mib IS NULL"), postgresql_where=sa.text("share_mib IS NULL"))
    op.create_index("ix_allocations_gpu_id", "allocations", ["gpu_id"])


def downgrade() -> None:
    op.drop_index("ix_allocations_gpu_id", table_name="allocations")
    op.drop_index("uq_allocations_gpu_id", table_name="allocations")
    with op.batch_alter_table("allocations") as batch_op:
        batch_op.drop_column("used_mib")
        batch_op.drop_column("share_mib")
        batch_op.create_unique_constraint(op.f("uq_allocations_gpu_id"), ["gpu_id"])
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("gpu_share")
        batch_op.drop_column("shared")
