"""Scheduling: memory, node, time limit, retries, holds, dependencies, arrays; foreign GPU use; nodes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 21:09:22.458594
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import gpuq.service.models

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Server defaults fill the new NOT NULL columns of jobs that already exist.
    op.create_table('nodes',
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('drained', sa.Boolean(), nullable=False),
    sa.Column('drain_reason', sa.Text(), nullable=True),
    sa.Column('drained_at', gpuq.service.models.UTCDateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_nodes'))
    )
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('foreign_mib', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('foreign', sa.JSON(), nullable=True))

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('mem_mib', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('on_node', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('time_limit_s', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_retries', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('attempts', sa.JSON(), nullable=False, server_default='[]'))
        batch_op.add_column(sa.Column('held', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('after', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('after_any', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('array_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('array_index', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('env', sa.JSON(), nullable=True))
        batch_op.create_index(batch_op.f('ix_jobs_array_id'), ['array_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_array_id'))
        batch_op.drop_column('env')
        batch_op.drop_column('array_index')
        batch_op.drop_column('array_id')
        batch_op.drop_column('after_any')
        batch_op.drop_column('after')
        batch_op.drop_column('held')
        batch_op.drop_column('attempts')
        batch_op.drop_column('max_retries')
        batch_op.drop_column('time_limit_s')
        batch_op.drop_column('on_node')
        batch_op.drop_column('mem_mib')

    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_column('foreign')
        batch_op.drop_column('foreign_mib')

    op.drop_table('nodes')
