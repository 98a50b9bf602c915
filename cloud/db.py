"""The metadata database and usage ledger (SQLAlchemy: SQLite embedded, PostgreSQL distributed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    make_url,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from cloud.errors import Unreachable
from cloud.settings import Settings


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # sha256 of the key; the key itself is shown once and never stored
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # the first characters, so an operator can tell keys apart
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    tenant: Mapped[Tenant] = relationship()


class AdminKey(Base):
    """An operator's key: reads across tenants (/v1/admin) and belongs to none, so a tenant's
    key can never be one and an operator's key never acts as a tenant."""

    __tablename__ = "admin_keys"
    id: Mapped[int] = mapped_column(primary_key=True)
    # who holds it, for the operators' own records
    name: Mapped[str] = mapped_column(String(128))
    # sha256 of the key, as for tenant keys
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the highest version number ever given: a deleted version's number is never given again, so
    # an alias's history and the bill never mistake a new version for a deleted one
    last_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    versions: Mapped[list[ModelVersion]] = relationship(
        back_populates="model", cascade="all, delete-orphan", order_by="ModelVersion.number"
    )
    aliases: Mapped[list[ModelAlias]] = relationship(cascade="all, delete-orphan", order_by="ModelAlias.name")


class ModelVersion(Base):
    __tablename__ = "model_versions"
    # a deleted version's id is never given again on SQLite either (PostgreSQL's sequences never
    # do): a compile or cancel still under way for it can never reach a new version
    __table_args__ = (UniqueConstraint("model_id", "number"), {"sqlite_autoincrement": True})
    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    # queued -> compiling -> ready | failed
    status: Mapped[str] = mapped_column(String(16), default="queued")
    target: Mapped[str] = mapped_column(String(32))
    # the float the model runs in: "exported" (its declared dtypes) or a narrower one on a GPU
    # type (compiler.targets.PRECISIONS); the default is compiler.targets.EXPORTED, spelled out as
    # migration 0004 does, since the database's schema must not import the compiler
    precision: Mapped[str] = mapped_column(String(16), default="exported", server_default="exported")
    # what it serves: "inference" (inputs to outputs) or "text-generation" (a decoder with its
    # KV cache and tokenizer, served token by token)
    task: Mapped[str] = mapped_column(String(32), default="inference", server_default="inference")
    # object-store key of the uploaded graph (content addressed)
    graph_key: Mapped[str] = mapped_column(String(256))
    # a generative model's tokenizer bundle: {"key": store prefix, "files": [...], "context_length": n}
    bundle: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    graph_bytes: Mapped[int] = mapped_column(Integer)
    # object-store prefix of the compiled artifact, once ready
    artifact_key: Mapped[str | None] = mapped_column(String(256), default=None)
    signature: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    model: Mapped[Model] = relationship(back_populates="versions")


class ModelAlias(Base):
    """A name (prod, canary) that inference resolves to one ready version of the model."""

    __tablename__ = "model_aliases"
    __table_args__ = (UniqueConstraint("model_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    # the registry refuses to delete a version an alias points at; the cascade is for the model's own deletion
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    version: Mapped[ModelVersion] = relationship()
    history: Mapped[list[AliasEvent]] = relationship(cascade="all, delete-orphan", order_by="AliasEvent.id")


class AliasEvent(Base):
    """One move of an alias, kept so that a rollback knows where the alias was before."""

    __tablename__ = "model_alias_events"
    id: Mapped[int] = mapped_column(primary_key=True)
    alias_id: Mapped[int] = mapped_column(ForeignKey("model_aliases.id", ondelete="CASCADE"), index=True)
    # "set" (a promote) or "rollback" (back to the version before the last set)
    action: Mapped[str] = mapped_column(String(16))
    # the version moved to; NULL once that version is deleted (its number stays, for the record)
    version_id: Mapped[int | None] = mapped_column(
        ForeignKey("model_versions.id", ondelete="SET NULL"), index=True, default=None
    )
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UsageRecord(Base):
    """One row per inference request, written once (request_id is unique)."""

    __tablename__ = "usage_records"
    id: Mapped[int] = mapped_column(primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[int] = mapped_column(Integer, index=True)
    # names, not foreign keys: the bill outlives a deleted model
    model_name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    target: Mapped[str] = mapped_column(String(32))
    rows: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    batch_rows: Mapped[int] = mapped_column(Integer)
    batch_exec_seconds: Mapped[float] = mapped_column(Float)
    billed_seconds: Mapped[float] = mapped_column(Float)
    price_per_second: Mapped[float] = mapped_column(Float)
    cost: Mapped[float] = mapped_column(Float)
    # generation only: the tokens of the prompt and those generated (null for inference)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class UsageVoid(Base):
    """A request its gateway answered with an error after a runtime may have run it: it is never
    billed, whether its usage record came before the void (deleted then) or comes after (never
    written). Kept apart from usage_records, so that every reader of those reads billed usage."""

    __tablename__ = "usage_voids"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    voided_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# seconds to wait for a PostgreSQL connection: a dead host fails the start instead of hanging it
_CONNECT_TIMEOUT_S = 10


class Database:
    def __init__(self, url: str) -> None:
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            connect_args: dict[str, Any] = {"check_same_thread": False, "timeout": 30}
        else:
            connect_args = {"connect_timeout": _CONNECT_TIMEOUT_S}
        self.engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def create_all(self) -> None:
        """The tables, and on SQLite the columns a table made by an earlier version lacks."""
        Base.metadata.create_all(self.engine)
        if self.is_sqlite:
            _add_missing_columns(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: commits on success, rolls back on any error. A database that cannot be
        reached (down, restarting, a connection cut) is Unreachable, naming it: a 503 the client
        may retry, never an unexpected 500."""
        session = self._sessions()
        with unreachable_as_ours(self.engine.url):
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise
            finally:
                session.close()

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A connection in a transaction, for bulk statements (the ledger's inserts); Unreachable
        as session() says."""
        with unreachable_as_ours(self.engine.url), self.engine.begin() as connection:
            yield connection

    @contextmanager
    def serialized(self) -> Iterator[Session]:
        """A unit of work for a read-modify-write: on SQLite it takes the database's write lock
        before its first read (BEGIN IMMEDIATE), so two such units never interleave, across
        threads and processes; on PostgreSQL the caller locks the rows it reads FOR UPDATE."""
        with self.session() as session:
            if self.is_sqlite:
                session.connection().exec_driver_sql("BEGIN IMMEDIATE")
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


def _add_missing_columns(engine: Any) -> None:
    """An embedded database made by an earlier version gets the columns added since (its
    upgrade path: it has no migrations); each new column has a default its old rows take."""
    from sqlalchemy import inspect
    from sqlalchemy.schema import CreateColumn

    inspector = inspect(engine)
    with engine.begin() as connection:
        for table in Base.metadata.sorted_tables:
            present = {column["name"] for column in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in present:
                    continue
                if column.server_default is None and not column.nullable:
                    raise RuntimeError(f"the embedded database's {table.name} lacks {column.name}, which has no default to fill")
                ddl = CreateColumn(column).compile(dialect=engine.dialect)
                connection.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {ddl}")


@contextmanager
def unreachable_as_ours(url: Any) -> Iterator[None]:
    """The driver's errors for a database that cannot be used now (connection refused or cut,
    the server shutting down or still recovering) as Unreachable, naming the database."""
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise Unreachable(f"the database at {masked_url(str(url))} is unavailable: {reason}") from exc


def masked_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    # a commit survives a crash of the process without waiting for the disk (5 ms a usage record
    # here); only a crash of the machine may lose the last ones
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def open_database(settings: Settings) -> Database:
    """The metadata database at the current schema: the embedded SQLite by create_all (nothing
    to migrate from), any other by the Alembic migrations. Unreachable, naming the URL with its
    password masked, when the database cannot be reached or the URL is not one."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    try:
        db = Database(url)
    except ArgumentError as exc:
        raise Unreachable(f"LUMINAL_DATABASE_URL is not a database URL SQLAlchemy can use: {exc}") from None
    try:
        if db.is_sqlite:
            db.create_all()
        else:
            from cloud.migrations import upgrade_to_head  # Alembic only where it runs

            upgrade_to_head(db.engine)
    except OperationalError as exc:
        db.dispose()
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise Unreachable(f"cannot reach the database at {masked_url(url)}: {reason}") from None
    return db
