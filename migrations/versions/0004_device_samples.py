"""Device samples, their 1-minute aggregates, and per-job usage summaries.

Revision ID: 0004
Revises: 0003
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC = gpuq.service.models.UTCDateTime(timezone=True)
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _owners(table: str) -> list:
    return [
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["gpu_id"], ["gpus.id"], name=op.f(f"fk_{table}_gpu_id_gpus"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f(f"fk_{table}_job_id_jobs"), ondelete="SET NULL"),
    ]


def upgrade() -> None:
    op.create_table(
        "device_samples",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        *_owners("device_samples"),
        sa.Column("sampled_at", UTC, nullable=False),
        sa.Column("interval_s", sa.Float(), nullable=False),
        sa.Column("utilization", sa.Integer(), nullable=True),
        sa.Column("memory_utilization", sa.Integer(), nullable=True),
        sa.Column("memory_used_mib", sa.Integer(), nullable=True),
        sa.Column("memory_total_mib", sa.Integer(), nullable=True),
        sa.Column("temperature_c", sa.Integer(), nullable=True),
        sa.Column("power_w", sa.Float(), nullable=True),
        sa.Column("sm_clock_mhz", sa.Integer(), nullable=True),
        sa.Column("energy_j", sa.Float(), nullable=True),
        sa.Column("processes", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_samples")),
    )
    op.create_index("ix_device_samples_gpu_id_sampled_at", "device_samples", ["gpu_id", "sampled_at"])
    op.create_index("ix_device_samples_job_id_sampled_at", "device_samples", ["job_id", "sampled_at"])
    op.create_index("ix_device_samples_sampled_at", "device_samples", ["sampled_at"])
    op.create_table(
        "device_minutes",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        *_owners("device_minutes"),
        sa.Column("minute", UTC, nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("utilization_seconds", sa.Float(), nullable=False),
        sa.Column("utilization_sum", sa.Float(), nullable=False),
        sa.Column("utilization_max", sa.Integer(), nullable=True),
        sa.Column("idle_seconds", sa.Float(), nullable=False),
        sa.Column("memory_seconds", sa.Float(), nullable=False),
        sa.Column("memory_used_sum", sa.Float(), nullable=False),
        sa.Column("memory_used_max", sa.Integer(), nullable=True),
        sa.Column("temperature_max", sa.Integer(), nullable=True),
        sa.Column("power_max", sa.Float(), nullable=True),
        sa.Column("energy_j", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_minutes")),
    )
    op.create_index("ix_device_minutes_gpu_id_minute", "device_minutes", ["gpu_id", "minute"])
    op.create_index("ix_device_minutes_job_id", "device_minutes", ["job_id"])
    op.create_index("ix_device_minutes_minute", "device_minutes", ["minute"])
    op.create_table(
        "job_usage",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("gpu_hours", sa.Float(), nullable=False),
        sa.Column("memory_peak_mib", sa.Integer(), nullable=True),
        sa.Column("memory_mean_mib", sa.Float(), nullable=True),
        sa.Column("utilization_mean", sa.Float(), nullable=True),
        sa.Column("energy_j", sa.Float(), nullable=True),
        sa.Column("idle_s", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("recorded_at", UTC, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_usage_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_usage")),
    )


def downgrade() -> None:
    op.drop_table("job_usage")
    op.drop_table("device_minutes")
    op.drop_table("device_samples")
