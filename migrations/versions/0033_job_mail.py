"""Mail about a job's start and end (`gpuq submit --mail-type`, service/mail.py): what about, to
whom, and what is still to be sent.

Revision ID: 0033
Revises: 0032
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0033"
down_revision: str | None = "0032"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_mail",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("events", sa.String(length=32), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=True),
        sa.Column("due", sa.String(length=32), nullable=True),
        sa.Column("reruns_mailed", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_mail_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_mail")),
    )
    op.create_index(op.f("ix_job_mail_due"), "job_mail", ["due"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_job_mail_due"), table_name="job_mail")
    op.drop_table("job_mail")
