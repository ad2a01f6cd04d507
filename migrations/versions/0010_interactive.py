"""Interactive use: allocations (kind interactive) with their client's keepalive and exit code, and
each chunk of output's stream (stdout or stderr), so `gpuq run` gives each back to its own file.

Revision ID: 0010
Revises: 0009
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpuq.service.models import UTCDateTime

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("keepalive_at", UTCDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("client_exit_code", sa.Integer(), nullable=True))
        batch_op.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch_op.create_check_constraint(op.f("ck_jobs_kind"), "kind IN ('workload', 'command', 'interactive')")
    _queue_order_index()
    with op.batch_alter_table("job_output") as batch_op:
        batch_op.add_column(sa.Column("stream", sa.SmallInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("job_output") as batch_op:
        batch_op.drop_column("stream")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch_op.create_check_constraint(op.f("ck_jobs_kind"), "kind IN ('workload', 'command')")
        batch_op.drop_column("client_exit_code")
        batch_op.drop_column("keepalive_at")
    _queue_order_index()


def _queue_order_index() -> None:
    """The queue-order index as 0008 made it: SQLite's batch mode copies the table to change a
    CHECK constraint, and the copy's index loses ``priority DESC`` (Alembic reflects it as a plain
    column), which turns each user's queue head from an index seek into a sort."""
    op.drop_index("ix_jobs_queue_order", table_name="jobs")
    op.create_index("ix_jobs_queue_order", "jobs",
                    ["state", "held", "user", sa.text("priority DESC"), "submitted_at", "id"], unique=False)
