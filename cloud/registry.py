"""Models and their versions: upload, list, resolve for inference, status transitions.

The API and the compile worker both go through here; neither touches the tables directly.
"""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from cloud.db import Database, Model, ModelVersion
from cloud.errors import InvalidModelFile, InvalidRequest, NotFound, NotReady
from cloud.storage import ObjectStore, artifacts_prefix, graph_key, spool
from compiler import InvalidModel, UnsupportedModel
from compiler.frontends.onnx import parse_model

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STATUSES = ("queued", "compiling", "ready", "failed")
# the note on a version whose compile a server stop interrupted once
INTERRUPTED = "the compile was interrupted by a server stop and resumed"


_INSERT_ATTEMPTS = 6
# how long a resolved version is served from memory before the database is asked again
RESOLVE_CACHE_S = 1.0


class ServedVersion(NamedTuple):
    """What serving a version needs, fixed once it is ready."""

    id: int
    number: int
    target: str
    artifact_key: str
    signature: dict[str, Any]
    graph_bytes: int


def _check_model(path: Path) -> None:
    """InvalidModelFile unless the file parses as an ONNX model this service can take."""
    try:
        parse_model(path.read_bytes())  # the bytes are dropped before the blob is stored
    except (InvalidModel, UnsupportedModel) as exc:
        raise InvalidModelFile(f"the uploaded file is not a usable ONNX model: {exc}") from None


class Registry:
    def __init__(self, db: Database, store: ObjectStore, targets: tuple[str, ...]) -> None:
        self.db = db
        self.store = store
        self.targets = targets
        self._insert_lock = threading.Lock()
        # (tenant id, model name, version number or None) -> (expires at, the version to serve)
        self._served: dict[tuple[int, str, int | None], tuple[float, ServedVersion]] = {}

    # -- uploads --
    def create_version(
        self, tenant_id: int, name: str, source: BinaryIO, target: str, max_bytes: int | None = None
    ) -> ModelVersion:
        """A new version from the ONNX file read from `source`, spooled to disk (at most
        `max_bytes`, else PayloadTooLarge) and streamed to the store: never whole in memory
        but while the parser checks it."""
        if not NAME_PATTERN.match(name):
            raise InvalidRequest(
                f"model name {name!r} is invalid: use 1-128 letters, digits, '.', '_' or '-'"
            )
        if target not in self.targets:
            raise InvalidRequest(f"unknown target {target!r}; available: {', '.join(self.targets)}")
        with spool(source, max_bytes) as graph:
            if graph.size == 0:
                raise InvalidModelFile("the uploaded file is empty")
            _check_model(graph.path)
            key = graph_key(graph.sha256)
            # uploads racing on a new name or the next number: within this process they take turns
            # (SQLite ignores FOR UPDATE); across processes the loser retries after a jittered
            # pause. The blob is stored under the same lock, so a delete cannot free it in between.
            for attempt in range(_INSERT_ATTEMPTS):
                try:
                    with self._insert_lock:
                        if not self.store.exists(key):
                            self.store.put_file(key, graph.path)
                        return self._insert_version(tenant_id, name, key, graph.size, target)
                except IntegrityError:
                    if attempt == _INSERT_ATTEMPTS - 1:
                        raise
                    time.sleep(random.uniform(0, 0.01 * (attempt + 1)))
        raise AssertionError("unreachable")

    def _insert_version(self, tenant_id: int, name: str, key: str, size: int, target: str) -> ModelVersion:
        with self.db.session() as session:
            model = session.scalar(
                select(Model).where(Model.tenant_id == tenant_id, Model.name == name).with_for_update()
            )
            if model is None:
                model = Model(tenant_id=tenant_id, name=name)
                session.add(model)
                session.flush()
            last = session.scalar(select(func.max(ModelVersion.number)).where(ModelVersion.model_id == model.id))
            version = ModelVersion(
                model_id=model.id,
                number=(last or 0) + 1,
                status="queued",
                target=target,
                graph_key=key,
                graph_bytes=size,
            )
            session.add(version)
            session.flush()
            session.refresh(version, ["model"])
            return version

    # -- reads --
    def list_models(self, tenant_id: int) -> list[Model]:
        with self.db.session() as session:
            query = (
                select(Model)
                .where(Model.tenant_id == tenant_id)
                .options(selectinload(Model.versions))
                .order_by(Model.name)
            )
            return list(session.scalars(query))

    def get_model(self, tenant_id: int, name: str) -> Model:
        with self.db.session() as session:
            return self._model(session, tenant_id, name)

    def _model(self, session: Session, tenant_id: int, name: str) -> Model:
        model = session.scalar(
            select(Model)
            .where(Model.tenant_id == tenant_id, Model.name == name)
            .options(selectinload(Model.versions))
        )
        if model is None:
            raise NotFound(f"model {name!r} not found")
        return model

    def resolve(self, tenant_id: int, name: str, number: int | None) -> ServedVersion:
        """The version to serve: the one asked for, else the newest ready one. Every inference
        request asks, so a ready answer is kept for RESOLVE_CACHE_S (a version's served fields
        never change once ready; a new or deleted version shows within that time)."""
        served = self.resolve_cached(tenant_id, name, number)
        if served is not None:
            return served
        with self.db.session() as session:
            rows = session.execute(
                select(*(getattr(ModelVersion, f) for f in ServedVersion._fields), ModelVersion.status, ModelVersion.error)
                .join(Model, ModelVersion.model_id == Model.id)
                .where(Model.tenant_id == tenant_id, Model.name == name)
                .order_by(ModelVersion.number)
            ).all()
        if not rows:
            raise NotFound(f"model {name!r} not found")
        if number is not None:
            row = next((r for r in rows if r.number == number), None)
            if row is None:
                raise NotFound(f"model {name!r} has no version {number}")
        else:
            ready = [r for r in rows if r.status == "ready"]
            row = ready[-1] if ready else rows[-1]
        if row.status != "ready":
            detail = f": {row.error}" if row.error else ""
            raise NotReady(
                f"model {name!r} version {row.number} is {row.status}{detail}",
                version_status=row.status,
            )
        served = ServedVersion(*row[: len(ServedVersion._fields)])
        self._served[(tenant_id, name, number)] = (time.monotonic() + RESOLVE_CACHE_S, served)
        return served

    def resolve_cached(self, tenant_id: int, name: str, number: int | None) -> ServedVersion | None:
        """resolve()'s recent answer, if any; no I/O, safe on the event loop."""
        cached = self._served.get((tenant_id, name, number))
        return cached[1] if cached is not None and cached[0] > time.monotonic() else None

    def _forget_served(self, tenant_id: int, name: str) -> None:
        for key in [k for k in self._served if k[:2] == (tenant_id, name)]:
            self._served.pop(key, None)

    def delete_model(self, tenant_id: int, name: str) -> list[int]:
        """Deletes the model and its versions, and the stored graphs and artifacts no other
        version (of any tenant) still uses; returns the deleted version ids."""
        with self._insert_lock:
            with self.db.session() as session:
                model = self._model(session, tenant_id, name)
                self._forget_served(tenant_id, name)
                ids = [v.id for v in model.versions]
                keys = {v.graph_key for v in model.versions}
                session.delete(model)
            self._free_unreferenced(keys)
        return ids

    def _free_unreferenced(self, keys: set[str]) -> None:
        with self.db.session() as session:
            still_used = set(session.scalars(select(ModelVersion.graph_key).where(ModelVersion.graph_key.in_(keys))))
        for key in keys - still_used:
            self.store.delete_prefix(key)
            self.store.delete_prefix(artifacts_prefix(key))

    def get_version(self, version_id: int) -> ModelVersion | None:
        with self.db.session() as session:
            return session.get(ModelVersion, version_id)

    def resume_unfinished(self) -> list[tuple[int, int]]:
        """(version id, tenant id) of what a previous process left queued or compiling, to queue
        again. A compile interrupted a second time fails instead: it may be what stopped the server."""
        resumed = []
        with self.db.session() as session:
            query = (
                select(ModelVersion, Model.tenant_id)
                .join(Model, ModelVersion.model_id == Model.id)
                .where(ModelVersion.status.in_(("queued", "compiling")))
                .order_by(ModelVersion.id)
            )
            for version, tenant_id in session.execute(query):
                if version.status == "compiling" and version.error == INTERRUPTED:
                    version.status = "failed"
                    version.error = "the compile was interrupted twice by a server stop; upload the model again"
                    continue
                if version.status == "compiling":
                    version.status, version.error = "queued", INTERRUPTED
                resumed.append((version.id, tenant_id))
        return resumed

    def queued_versions(self) -> list[tuple[int, int]]:
        """(version id, tenant id) of every version waiting for a compile, oldest first."""
        with self.db.session() as session:
            query = (
                select(ModelVersion.id, Model.tenant_id)
                .join(Model, ModelVersion.model_id == Model.id)
                .where(ModelVersion.status == "queued")
                .order_by(ModelVersion.id)
            )
            return [(version_id, tenant_id) for version_id, tenant_id in session.execute(query)]

    # -- status transitions (the compile worker) --
    def set_status(self, version_id: int, status: str, **fields: Any) -> None:
        assert status in STATUSES
        with self.db.session() as session:
            version = session.get(ModelVersion, version_id)
            if version is None:
                return  # deleted meanwhile
            version.status = status
            for name, value in fields.items():
                setattr(version, name, value)
