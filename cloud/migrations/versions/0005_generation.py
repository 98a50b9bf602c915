"""Language models: a version's task ("inference" for every existing one, or "text-generation")
and its tokenizer bundle; usage records count the tokens of a generation.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_versions", sa.Column("task", sa.String(length=32), server_default="inference", nullable=False))
    op.add_column("model_versions", sa.Column("bundle", sa.JSON(), nullable=True))
    op.add_column("usage_records", sa.Column("prompt_tokens", sa.Integer(), nullable=True))
    op.add_column("usage_records", sa.Column("completion_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("usage_records", "completion_tokens")
    op.drop_column("usage_records", "prompt_tokens")
    op.drop_column("model_versions", "bundle")
    op.drop_column("model_versions", "task")
