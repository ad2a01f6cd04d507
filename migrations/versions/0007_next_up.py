"""Next-up lists (a worker ending a job takes the next one itself) and an index for fair share.

Revision ID: 0007
Revises: 0006
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "next_up",
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"], name=op.f("fk_next_up_gpu_id_gpus"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_next_up_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("gpu_id", "job_id", name=op.f("pk_next_up")),
    )
    op.create_index(op.f("ix_next_up_job_id"), "next_up", ["job_id"], unique=False)
    op.create_index("ix_jobs_ended_at", "jobs", ["ended_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_ended_at", table_name="jobs")
    op.drop_index(op.f("ix_next_up_job_id"), table_name="next_up")
    op.drop_table("next_up")
