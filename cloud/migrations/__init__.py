"""Schema migrations (Alembic) of the metadata database and usage ledger.

Every database but the embedded SQLite default is brought to the newest revision at start by
`upgrade_to_head`; the revisions are in versions/, a file each. A change to the models in
cloud/db.py needs a new revision, written against a database already at head:

    .venv/bin/python -c "from alembic import command; from cloud.migrations import alembic_config;
    command.revision(alembic_config('postgresql+psycopg://postgres@127.0.0.1/luminal'),
    'what changed', autogenerate=True)"

tests/test_postgres.py fails while the models and the revisions disagree.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

# any fixed 64-bit number ("LUMINAL"): the advisory lock under which one process upgrades
_UPGRADE_LOCK = 0x4C554D494E414C


def alembic_config(url: str | None = None) -> Config:
    """Alembic's configuration without an alembic.ini: the revisions are read from this package,
    wherever it is installed."""
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser interpolates %
    return config


def upgrade_to_head(engine: Engine) -> None:
    """Applies the revisions the database lacks, in one transaction. Processes that start
    together take turns on a PostgreSQL advisory lock: the first upgrades, the others find the
    database at head."""
    with engine.begin() as connection:
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _UPGRADE_LOCK})
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
