"""The initial schema: jobs, GPUs, allocations, job output and metrics.

Revision ID: 0001
Revises:
Create Date: 2026-11-21 20:30:06.843947
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('gpus',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('node', sa.String(length=255), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('uuid', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('memory_total_mib', sa.Integer(), nullable=False),
    sa.Column('memory_used_mib', sa.Integer(), nullable=True),
    sa.Column('utilization', sa.Integer(), nullable=True),
    sa.Column('simulated', sa.Boolean(), nullable=False),
    sa.Column('queue', sa.String(length=255), nullable=False),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('worker_pid', sa.Integer(), nullable=True),
    sa.Column('heartbeat_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gpus')),
    sa.UniqueConstraint('node', 'index', name=op.f('uq_gpus_node_index'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('user', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('workload', sa.String(length=64), nullable=True),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('argv', sa.JSON(), nullable=True),
    sa.Column('cwd', sa.Text(), nullable=True),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('node', sa.String(length=255), nullable=True),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('submitted_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=False),
    sa.Column('dispatched_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('started_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('ended_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('cancel_requested_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.CheckConstraint("kind IN ('workload', 'command')", name=op.f('ck_jobs_kind')),
    sa.CheckConstraint("state IN ('pending', 'dispatched', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out')",
                       name=op.f('ck_jobs_state')),
    sa.CheckConstraint('gpus >= 1', name=op.f('ck_jobs_gpus_positive')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ix_jobs_state_priority', ['state', 'priority', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_user'), ['user'], unique=False)

    op.create_table('allocations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('gpu_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['gpu_id'], ['gpus.id'], name=op.f('fk_allocations_gpu_id_gpus'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_allocations_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_allocations')),
    sa.UniqueConstraint('gpu_id', name=op.f('uq_allocations_gpu_id')),
    sa.UniqueConstraint('job_id', 'rank', name=op.f('uq_allocations_job_id_rank'))
    )
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_allocations_job_id'), ['job_id'], unique=False)

    op.create_table('job_metrics',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('values', sa.JSON(), nullable=False),
    sa.Column('recorded_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_metrics_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_metrics')),
    sa.UniqueConstraint('job_id', 'seq', name=op.f('uq_job_metrics_job_id_seq'))
    )
    op.create_table('job_output',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('data', sa.Text(), nullable=False),
    sa.Column('written_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_output_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_output')),
    sa.UniqueConstraint('job_id', 'seq', name=op.f('uq_job_output_job_id_seq'))
    )


def downgrade() -> None:
    op.drop_table('job_output')
    op.drop_table('job_metrics')
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_allocations_job_id'))

    op.drop_table('allocations')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_user'))
        batch_op.drop_index('ix_jobs_state_priority')

    op.drop_table('jobs')
    op.drop_table('gpus')
