"""The code as it was at submit: a command job's git commit, dirtiness, diff, and snapshot.

Revision ID: 0005
Revises: 0004
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("git_commit", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("git_dirty", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("git_diff", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("git_diff_cut", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("snapshot", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("snapshot")
        batch_op.drop_column("git_diff_cut")
        batch_op.drop_column("git_diff")
        batch_op.drop_column("git_dirty")
        batch_op.drop_column("git_commit")
