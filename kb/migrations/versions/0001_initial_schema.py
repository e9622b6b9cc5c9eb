"""initial schema

Revision ID: 0001
Revises: 
"""
from alembic import op
import sqlalchemy as sa
import sqlmodel
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('hypothesis',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('title', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('rationale', sa.Text(), nullable=False),
    sa.Column('baseline_run', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('change', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('evidence', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('predicted', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('risks', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('result', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('hypothesis', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_hypothesis_status'), ['status'], unique=False)

    op.create_table('indexpending',
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('ref_id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('queued_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint('kind', 'ref_id')
    )
    op.create_table('job',
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('hypothesis_id', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('backend', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('run_id', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('error', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('spec', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.Column('updated_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_hypothesis_id'), ['hypothesis_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_job_status'), ['status'], unique=False)

    op.create_table('note',
    sa.Column('source_kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('source_uri', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('ingested_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.Column('content_hash', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('project', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('title', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('chunk', sa.Integer(), nullable=False),
    sa.Column('mentions', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('note', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_note_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_note_source_kind'), ['source_kind'], unique=False)

    op.create_table('run',
    sa.Column('source_kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('source_uri', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('ingested_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.Column('content_hash', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('project', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('config', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('scale', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('summary', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('stats', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('tags', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('notes', sa.Text(), nullable=False),
    sa.Column('parent', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('hypothesis_id', sqlmodel.sql.sqltypes.AutoString(), nullable=True),
    sa.Column('started_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
    sa.Column('ended_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
    sa.Column('code', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('meta', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('lr', sa.Float(), nullable=True),
    sa.Column('batch_size', sa.BigInteger(), nullable=True),
    sa.Column('params', sa.BigInteger(), nullable=True),
    sa.Column('tokens', sa.BigInteger(), nullable=True),
    sa.Column('flops', sa.Float(), nullable=True),
    sa.Column('card', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_batch_size'), ['batch_size'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_flops'), ['flops'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_hypothesis_id'), ['hypothesis_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_lr'), ['lr'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_params'), ['params'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_parent'), ['parent'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_source_kind'), ['source_kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_tokens'), ['tokens'], unique=False)

    op.create_table('ablation',
    sa.Column('source_kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('source_uri', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('ingested_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.Column('content_hash', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('project', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('factor', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('metric', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('baseline_run', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('variants', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('effect', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.ForeignKeyConstraint(['baseline_run'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('ablation', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ablation_factor'), ['factor'], unique=False)
        batch_op.create_index(batch_op.f('ix_ablation_project'), ['project'], unique=False)
        batch_op.create_index(batch_op.f('ix_ablation_source_kind'), ['source_kind'], unique=False)

    op.create_table('anomaly',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('key', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=True),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('score', sa.Float(), nullable=True),
    sa.Column('evidence', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('anomaly', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_anomaly_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_anomaly_run_id'), ['run_id'], unique=False)

    op.create_table('failure',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=True),
    sa.Column('message', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('evidence', sa.Text(), nullable=False),
    sa.Column('origin', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('failure', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_failure_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_failure_run_id'), ['run_id'], unique=False)

    op.create_table('metricpoint',
    sa.Column('run_id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('key', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('wall_time', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'key', 'seq'),
    sqlite_with_rowid=False,
    )

    op.create_table('runfield',
    sa.Column('run_id', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('key', sqlmodel.sql.sqltypes.AutoString(), nullable=False),
    sa.Column('vtype', sqlmodel.sql.sqltypes.AutoString(length=1), nullable=False),
    sa.Column('num', sa.Float(), nullable=True),
    sa.Column('text', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'key')
    )
    with op.batch_alter_table('runfield', schema=None) as batch_op:
        batch_op.create_index('ix_runfield_key_num', ['key', 'vtype', 'num'], unique=False)
        batch_op.create_index('ix_runfield_key_text', ['key', 'vtype', 'text'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('runfield', schema=None) as batch_op:
        batch_op.drop_index('ix_runfield_key_text')
        batch_op.drop_index('ix_runfield_key_num')

    op.drop_table('runfield')
    op.drop_table('metricpoint')
    with op.batch_alter_table('failure', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_failure_run_id'))
        batch_op.drop_index(batch_op.f('ix_failure_kind'))

    op.drop_table('failure')
    with op.batch_alter_table('anomaly', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_anomaly_run_id'))
        batch_op.drop_index(batch_op.f('ix_anomaly_kind'))

    op.drop_table('anomaly')
    with op.batch_alter_table('ablation', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ablation_source_kind'))
        batch_op.drop_index(batch_op.f('ix_ablation_project'))
        batch_op.drop_index(batch_op.f('ix_ablation_factor'))

    op.drop_table('ablation')
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_tokens'))
        batch_op.drop_index(batch_op.f('ix_run_status'))
        batch_op.drop_index(batch_op.f('ix_run_source_kind'))
        batch_op.drop_index(batch_op.f('ix_run_project'))
        batch_op.drop_index(batch_op.f('ix_run_parent'))
        batch_op.drop_index(batch_op.f('ix_run_params'))
        batch_op.drop_index(batch_op.f('ix_run_lr'))
        batch_op.drop_index(batch_op.f('ix_run_hypothesis_id'))
        batch_op.drop_index(batch_op.f('ix_run_flops'))
        batch_op.drop_index(batch_op.f('ix_run_batch_size'))

    op.drop_table('run')
    with op.batch_alter_table('note', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_note_source_kind'))
        batch_op.drop_index(batch_op.f('ix_note_project'))

    op.drop_table('note')
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_status'))
        batch_op.drop_index(batch_op.f('ix_job_hypothesis_id'))

    op.drop_table('job')
    op.drop_table('indexpending')
    with op.batch_alter_table('hypothesis', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_hypothesis_status'))

    op.drop_table('hypothesis')
