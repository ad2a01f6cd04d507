"""A command's output copied to files of the user's (`--output`, `--error`, as sbatch's -o and -e):
their paths as given, patterns (%j, %a, ...) still in them.

Revision ID: 0020
Revises: 0019
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("output_file", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("error_file", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("error_file")
        batch.drop_column("output_file")
