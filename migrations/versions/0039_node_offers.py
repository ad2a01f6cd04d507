"""The CPU cores and host memory a GPU's node offers jobs, as its worker reports them (`--cpus` and
`--host-mem` reserve them).

Revision ID: 0039
Revises: 0038
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0039"
down_revision: str | None = "0038"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Null until each GPU's worker registers again: until then its node holds no job to its cores.
    op.add_column("gpus", sa.Column("node_cpus", sa.Integer(), nullable=True))
    op.add_column("gpus", sa.Column("node_host_mem_mib", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("node_host_mem_mib")
        batch.drop_column("node_cpus")
