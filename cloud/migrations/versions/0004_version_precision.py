"""Model versions remember the precision they run in: "exported" (the dtypes the graph declares,
what every existing version runs in) or a narrower float on a GPU type.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "model_versions", sa.Column("precision", sa.String(length=16), server_default="exported", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("model_versions", "precision")
