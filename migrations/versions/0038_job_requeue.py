"""A job's own word on being requeued after a failure of the machinery (`--requeue`, `--no-requeue`).

Revision ID: 0038
Revises: 0037
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0038"
down_revision: str | None = "0037"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Null for every job there is: the rule they were submitted under (requeued if it asked for retries).
    op.add_column("jobs", sa.Column("requeue", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("requeue")
