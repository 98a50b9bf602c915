"""Model aliases (prod, canary) with the history of their moves; models remember the highest
version number given, so a deleted version's number is not given again.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("models", sa.Column("last_version", sa.Integer(), server_default="0", nullable=False))
    op.execute(
        "UPDATE models SET last_version = "
        "(SELECT COALESCE(MAX(number), 0) FROM model_versions WHERE model_versions.model_id = models.id)"
    )
    op.create_table(
        "model_aliases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["version_id"], ["model_versions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_id", "name"),
    )
    op.create_index(op.f("ix_model_aliases_model_id"), "model_aliases", ["model_id"], unique=False)
    op.create_index(op.f("ix_model_aliases_version_id"), "model_aliases", ["version_id"], unique=False)
    op.create_table(
        "model_alias_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("alias_id", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["alias_id"], ["model_aliases.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["version_id"], ["model_versions.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_model_alias_events_alias_id"), "model_alias_events", ["alias_id"], unique=False)
    op.create_index(op.f("ix_model_alias_events_version_id"), "model_alias_events", ["version_id"], unique=False)


def downgrade() -> None:
    op.drop_table("model_alias_events")
    op.drop_table("model_aliases")
    op.drop_column("models", "last_version")
