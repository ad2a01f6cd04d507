"""The CPU cores a running command with `--cpus` is bound to (workers/core_binding.py), on its
first GPU's allocation row, for `gpuq show` (as SLURM's CPU_IDs).

Revision ID: 0040
Revises: 0039
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0040"
down_revision: str | None = "0039"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("cores", sa.String(4000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("cores")
