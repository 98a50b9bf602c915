"""Models and their versions: upload, list, resolve for inference, status transitions.

The API and the compile worker both go through here; neither touches the tables directly.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.exc import StaleDataError

from cloud.db import AliasEvent, Database, Model, ModelAlias, ModelVersion, Tenant
from cloud.errors import Conflict, InvalidModelFile, InvalidRequest, NotFound, NotReady, QuotaExceeded
from cloud.storage import ObjectStore, artifacts_prefix, bundle_key, graph_key, spool
from compiler.targets import EXPORTED, check_precision
from registry.bundle import GENERATION, Bundle, check_task
from registry.checks import ModelCheck, check_here

# checked with fullmatch: `$` would also match before a final newline ("prod\n")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
STATUSES = ("queued", "compiling", "ready", "failed")
# an alias starts with a letter, so it never reads as a version number
ALIAS_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")
# the note on a version whose compile a server stop interrupted once
INTERRUPTED = "the compile was interrupted by a server stop and resumed"
# while a version compiles, its report column holds {PROGRESS: the latest progress event and the
# compile's start (epoch seconds) as "started_at"}; the final report (which never has this key)
# or a failure replaces it
PROGRESS = "progress"
# the key of a ready version's report saying it was compiled without its target's GPU (what the
# report says of it: worker/devices.py); such a version is compiled again where that GPU is
UNMEASURED = "unmeasured"


_INSERT_ATTEMPTS = 6
# how long a resolved version is served from memory before the database is asked again
RESOLVE_CACHE_S = 1.0


def version_ref(text: str) -> int | str:
    """What a request's `version` names: a number (1, 2, ...) or an alias (prod, canary)."""
    if text.isascii() and text.isdigit():
        if int(text) < 1:
            raise InvalidRequest(f"version {text!r} is invalid: versions are numbered from 1")
        return int(text)
    if not ALIAS_PATTERN.fullmatch(text):
        raise InvalidRequest(f"version {text!r} is neither a version number nor an alias name")
    return text


def _check_alias_name(alias: str) -> None:
    if not ALIAS_PATTERN.fullmatch(alias):
        raise InvalidRequest(
            f"alias {alias!r} is invalid: use a lowercase ASCII letter (a-z), then up to 63 lowercase ASCII "
            "letters, digits, '_' or '-'"
        )


def alias_stack(history: list[AliasEvent]) -> list[AliasEvent]:
    """The alias's moves still in force, oldest first: a set pushes, a rollback pops (the last
    entry is where the alias points; the one before it, where a rollback takes it)."""
    stack: list[AliasEvent] = []
    for event in history:
        if event.action == "rollback":
            if stack:  # a history written before moves were serialised may hold extra rollbacks
                stack.pop()
        else:
            stack.append(event)
    return stack


class ServedVersion(NamedTuple):
    """What serving a version needs, fixed once it is ready."""

    id: int
    number: int
    target: str
    artifact_key: str
    signature: dict[str, Any]
    graph_bytes: int
    task: str
    # a generative version's tokenizer bundle (registry.bundle), else None
    bundle: dict[str, Any] | None


class Registry:
    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        targets: tuple[str, ...],
        check_model: ModelCheck = check_here,
        max_models_per_tenant: int | None = None,
        max_versions_per_model: int | None = None,
        refused_targets: Mapping[str, str] | None = None,
    ) -> None:
        self.db = db
        self.store = store
        self.targets = targets
        self.check_model = check_model
        # quotas (None: unlimited): a tenant's models, and the versions one model keeps
        self.max_models_per_tenant = max_models_per_tenant
        self.max_versions_per_model = max_versions_per_model
        # target -> why uploads for it are refused: offered, but nothing here may compile it
        self.refused_targets = dict(refused_targets or {})
        self._insert_lock = threading.Lock()
        # (tenant id, model name, version number, alias or None) -> (expires at, the version to serve)
        self._served: dict[tuple[int, str, int | str | None], tuple[float, ServedVersion]] = {}

    # -- uploads --
    def create_version(
        self,
        tenant_id: int,
        name: str,
        source: BinaryIO,
        target: str,
        max_bytes: int | None = None,
        precision: str = EXPORTED,
        task: str = "inference",
        bundle: Bundle | None = None,
    ) -> ModelVersion:
        """A new version from the ONNX file read from `source`, spooled to disk (at most
        `max_bytes`, else PayloadTooLarge), checked by `check_model` (the gateway's checks in a
        child process) and streamed to the store: never whole in this process's memory. It
        compiles for `target` in `precision` (a narrow float on a GPU type only, else
        InvalidRequest). QuotaExceeded past the tenant's model or the model's version quota. A
        "text-generation" version comes with its tokenizer `bundle`, checked with the graph
        (registry.bundle.check_generative) and stored content-addressed beside it."""
        check_task(task)
        if task != GENERATION and bundle is not None and bundle.files:
            raise InvalidRequest(f"tokenizer files come with task {GENERATION!r} only, not {task!r}")
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidRequest(
                f"model name {name!r} is invalid: use 1-128 ASCII letters (A-Z, a-z), digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if target not in self.targets:
            raise InvalidRequest(f"unknown target {target!r}; available: {', '.join(self.targets)}")
        if target in self.refused_targets:
            raise InvalidRequest(f"cannot compile for {target} here: {self.refused_targets[target]}", target=target)
        try:
            check_precision(target, precision)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        with spool(source, max_bytes) as graph:
            if graph.size == 0:
                raise InvalidModelFile("the uploaded file is empty")
            kept: dict[str, Any] | None = None
            if task == GENERATION:
                bundle = bundle or Bundle({})
                checked = self.check_model(graph.path, bundle)
                kept = {**checked, "key": bundle_key(tenant_id, bundle.sha256), "files": sorted(bundle.files)}
            else:
                self.check_model(graph.path)
            key = graph_key(tenant_id, graph.sha256)
            # uploads racing on a new name or the next number: within this process they take turns
            # (SQLite ignores FOR UPDATE); across processes the loser retries after a jittered
            # pause. The blob is stored under the same lock, so a delete cannot free it in between.
            for attempt in range(_INSERT_ATTEMPTS):
                try:
                    with self._insert_lock:
                        if not self.store.exists(key):
                            self.store.put_file(key, graph.path)
                        if kept is not None and bundle is not None:
                            for file_name, data in bundle.files.items():
                                if not self.store.exists(f"{kept['key']}/{file_name}"):
                                    self.store.put(f"{kept['key']}/{file_name}", data)
                        return self._insert_version(tenant_id, name, key, graph.size, target, precision, task, kept)
                except IntegrityError:
                    if attempt == _INSERT_ATTEMPTS - 1:
                        raise
                    time.sleep(random.uniform(0, 0.01 * (attempt + 1)))
        raise AssertionError("unreachable")

    def _insert_version(
        self,
        tenant_id: int,
        name: str,
        key: str,
        size: int,
        target: str,
        precision: str,
        task: str = "inference",
        bundle: dict[str, Any] | None = None,
    ) -> ModelVersion:
        with self.db.serialized() as session:
            model = session.scalar(
                select(Model).where(Model.tenant_id == tenant_id, Model.name == name).with_for_update()
            )
            if model is None:
                self._check_model_quota(session, tenant_id, name)
                model = Model(tenant_id=tenant_id, name=name)
                session.add(model)
                session.flush()
            else:
                self._check_version_quota(session, model)
            last = session.scalar(select(func.max(ModelVersion.number)).where(ModelVersion.model_id == model.id))
            model.last_version = max(model.last_version or 0, last or 0) + 1
            version = ModelVersion(
                model_id=model.id,
                number=model.last_version,
                status="queued",
                target=target,
                precision=precision,
                graph_key=key,
                graph_bytes=size,
                task=task,
                bundle=bundle,
            )
            session.add(version)
            session.flush()
            session.refresh(version, ["model"])
            return version

    def _check_model_quota(self, session: Session, tenant_id: int, name: str) -> None:
        if self.max_models_per_tenant is None:
            return
        # PostgreSQL: the tenant's row serialises its model creations, so the count stays true
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
        count = session.scalar(select(func.count(Model.id)).where(Model.tenant_id == tenant_id))
        if count >= self.max_models_per_tenant:
            raise QuotaExceeded(
                f"model {name!r} would be this tenant's model number {count + 1}, past its quota of "
                f"{self.max_models_per_tenant}: delete a model first",
                quota="models",
                limit=self.max_models_per_tenant,
            )

    def _check_version_quota(self, session: Session, model: Model) -> None:
        if self.max_versions_per_model is None:
            return
        count = session.scalar(select(func.count(ModelVersion.id)).where(ModelVersion.model_id == model.id))
        if count >= self.max_versions_per_model:
            raise QuotaExceeded(
                f"model {model.name!r} already keeps {count} versions, its quota: delete an old version first",
                quota="versions",
                limit=self.max_versions_per_model,
            )

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

    def resolve(self, tenant_id: int, name: str, ref: int | str | None) -> ServedVersion:
        """The version to serve: the one asked for (by number, or the one an alias points at),
        else the newest ready one. Every inference request asks, so a ready answer is kept for
        RESOLVE_CACHE_S (a version's served fields never change once ready; a new or deleted
        version, or an alias moved by another process, shows within that time; a change made
        through this registry clears the model's answers at once)."""
        served = self.resolve_cached(tenant_id, name, ref)
        if served is not None:
            return served
        number = ref if isinstance(ref, int) else None
        with self.db.session() as session:
            rows = session.execute(
                select(*(getattr(ModelVersion, f) for f in ServedVersion._fields), ModelVersion.status, ModelVersion.error)
                .join(Model, ModelVersion.model_id == Model.id)
                .where(Model.tenant_id == tenant_id, Model.name == name)
                .order_by(ModelVersion.number)
            ).all()
            if rows and isinstance(ref, str):
                number = session.scalar(
                    select(ModelVersion.number)
                    .join(ModelAlias, ModelAlias.version_id == ModelVersion.id)
                    .join(Model, ModelAlias.model_id == Model.id)
                    .where(Model.tenant_id == tenant_id, Model.name == name, ModelAlias.name == ref)
                )
                if number is None:
                    raise NotFound(f"model {name!r} has no alias {ref!r}")
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
            through = f" (alias {ref!r})" if isinstance(ref, str) else ""
            raise NotReady(
                f"model {name!r} version {row.number}{through} is {row.status}{detail}",
                version_status=row.status,
                version=row.number,
            )
        served = ServedVersion(*row[: len(ServedVersion._fields)])
        self._served[(tenant_id, name, ref)] = (time.monotonic() + RESOLVE_CACHE_S, served)
        return served

    def resolve_cached(self, tenant_id: int, name: str, ref: int | str | None) -> ServedVersion | None:
        """resolve()'s recent answer, if any; no I/O, safe on the event loop."""
        cached = self._served.get((tenant_id, name, ref))
        return cached[1] if cached is not None and cached[0] > time.monotonic() else None

    def _forget_served(self, tenant_id: int, name: str) -> None:
        # a copy of the keys: request threads add entries while this runs
        for key in [k for k in tuple(self._served) if k[:2] == (tenant_id, name)]:
            self._served.pop(key, None)

    def delete_model(self, tenant_id: int, name: str) -> list[int]:
        """Deletes the model and its versions, and the stored graphs and artifacts no other
        version (of any tenant) still uses; returns the deleted version ids."""
        with self._insert_lock:
            with self.db.serialized() as session:
                model = self._locked_model(session, tenant_id, name)
                self._forget_served(tenant_id, name)
                ids = [v.id for v in model.versions]
                keys = {v.graph_key for v in model.versions}
                bundles = {v.bundle["key"] for v in model.versions if v.bundle}
                session.delete(model)
            self._free_unreferenced(keys, bundles)
        return ids

    def delete_version(self, tenant_id: int, name: str, number: int) -> int:
        """Deletes one version (and the model with its last one), and its stored graph and
        artifact when no other version uses them; returns the version's id. Conflict while an
        alias points at it: move or delete the alias first."""
        with self._insert_lock:
            with self.db.serialized() as session:
                model = self._locked_model(session, tenant_id, name)
                version = self._version(model, number)
                pointing = sorted(a.name for a in model.aliases if a.version_id == version.id)
                if pointing:
                    raise Conflict(
                        f"version {number} of model {name!r} is what alias {', '.join(map(repr, pointing))} "
                        f"points at: move or delete the alias first",
                        version=number,
                        aliases=pointing,
                    )
                self._forget_served(tenant_id, name)
                version_id, key = version.id, version.graph_key
                bundles = {version.bundle["key"]} if version.bundle else set()
                session.delete(model if len(model.versions) == 1 else version)
            self._free_unreferenced({key}, bundles)
        return version_id

    # -- aliases --
    def model_with_aliases(self, tenant_id: int, name: str) -> Model:
        """The model, its versions, and its aliases with their histories."""
        with self.db.session() as session:
            model = session.scalar(
                select(Model)
                .where(Model.tenant_id == tenant_id, Model.name == name)
                .options(
                    selectinload(Model.versions),
                    selectinload(Model.aliases).selectinload(ModelAlias.version),
                    selectinload(Model.aliases).selectinload(ModelAlias.history),
                )
            )
            if model is None:
                raise NotFound(f"model {name!r} not found")
            return model

    def set_alias(self, tenant_id: int, name: str, alias: str, number: int) -> ModelAlias:
        """Points `alias` at version `number` (a promote), noting the move in its history.
        Only a ready version takes an alias: one still compiling might yet fail (Conflict)."""
        _check_alias_name(alias)
        with self.db.serialized() as session:
            model = self._locked_model(session, tenant_id, name)
            version = self._version(model, number)
            _check_aliasable(name, version, alias)
            found = next((a for a in model.aliases if a.name == alias), None)
            if found is None:
                found = ModelAlias(name=alias, version_id=version.id)
                model.aliases.append(found)
            elif found.version_id == version.id:
                return self._loaded_alias(session, found)
            found.version_id = version.id
            found.history.append(AliasEvent(action="set", version_id=version.id, version=version.number))
            self._forget_served(tenant_id, name)
            return self._loaded_alias(session, found)

    def rollback_alias(self, tenant_id: int, name: str, alias: str) -> ModelAlias:
        """Moves `alias` back to the version it pointed at before its last promote (the history
        is kept: the rollback is one more event). Conflict when there is none, or that version
        was deleted or is no longer ready."""
        with self.db.serialized() as session:
            model = self._locked_model(session, tenant_id, name)
            found = self._alias(model, alias)
            stack = alias_stack(found.history)
            if len(stack) < 2:
                raise Conflict(f"alias {alias!r} of model {name!r} has no earlier version to roll back to")
            previous = stack[-2]
            version = next((v for v in model.versions if v.id == previous.version_id), None)
            if version is None:
                raise Conflict(
                    f"alias {alias!r} of model {name!r} pointed at version {previous.version} before, "
                    f"which was deleted",
                    version=previous.version,
                )
            _check_aliasable(name, version, alias)
            found.version_id = version.id
            found.history.append(AliasEvent(action="rollback", version_id=version.id, version=version.number))
            self._forget_served(tenant_id, name)
            return self._loaded_alias(session, found)

    def delete_alias(self, tenant_id: int, name: str, alias: str) -> None:
        with self.db.serialized() as session:
            model = self._locked_model(session, tenant_id, name)
            session.delete(self._alias(model, alias))
            self._forget_served(tenant_id, name)

    def _locked_model(self, session: Session, tenant_id: int, name: str) -> Model:
        """The model, locked against concurrent alias moves and deletions until the session ends
        (PostgreSQL: FOR UPDATE; SQLite: the session must be Database.serialized)."""
        model = session.scalar(
            select(Model)
            .where(Model.tenant_id == tenant_id, Model.name == name)
            .with_for_update()
        )
        if model is None:
            raise NotFound(f"model {name!r} not found")
        return model

    def _version(self, model: Model, number: int) -> ModelVersion:
        version = next((v for v in model.versions if v.number == number), None)
        if version is None:
            raise NotFound(f"model {model.name!r} has no version {number}")
        return version

    def _alias(self, model: Model, alias: str) -> ModelAlias:
        found = next((a for a in model.aliases if a.name == alias), None)
        if found is None:
            raise NotFound(f"model {model.name!r} has no alias {alias!r}")
        return found

    def _loaded_alias(self, session: Session, alias: ModelAlias) -> ModelAlias:
        """The alias with what a response shows of it, readable after the session closes."""
        session.flush()
        session.refresh(alias, ["version", "history"])
        return alias

    def _free_unreferenced(self, keys: set[str], bundles: set[str] = frozenset()) -> None:
        with self.db.session() as session:
            still_used = set(session.scalars(select(ModelVersion.graph_key).where(ModelVersion.graph_key.in_(keys))))
            if bundles:
                generative = session.scalars(select(ModelVersion.bundle).where(ModelVersion.task == GENERATION))
                bundles = bundles - {b["key"] for b in generative if b}
        for key in keys - still_used:
            self.store.delete_prefix(key)
            self.store.delete_prefix(artifacts_prefix(key))
        for key in bundles:
            self.store.delete_prefix(key)

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

    def unmeasured_versions(self, targets: Sequence[str]) -> list[int]:
        """Ids of the ready versions of `targets` whose report says UNMEASURED, oldest first."""
        with self.db.session() as session:
            query = (
                select(ModelVersion.id)
                .where(
                    ModelVersion.status == "ready",
                    ModelVersion.target.in_(targets),
                    # (as text: NULL where the key is absent, on SQLite as on PostgreSQL)
                    ModelVersion.report[UNMEASURED].as_string().is_not(None),
                )
                .order_by(ModelVersion.id)
            )
            return list(session.scalars(query))

    # -- status transitions (the compile worker) --
    def set_progress(self, version_id: int, progress: dict[str, Any]) -> None:
        """Stores a compile's progress on its version; one step, and only while the version is
        compiling, so a late write never covers the final report."""
        compiling = update(ModelVersion).where(ModelVersion.id == version_id, ModelVersion.status == "compiling")
        with self.db.session() as session:
            session.execute(compiling.values(report={PROGRESS: progress}))

    def set_status(self, version_id: int, status: str, **fields: Any) -> None:
        assert status in STATUSES
        try:
            with self.db.session() as session:
                version = session.get(ModelVersion, version_id)
                if version is None:
                    return  # deleted meanwhile
                version.status = status
                for name, value in fields.items():
                    setattr(version, name, value)
        except StaleDataError:
            return  # deleted between the read and the write: its compile's result goes nowhere

    def replace_artifact(
        self, version_id: int, replaced_key: str, artifact_key: str, signature: dict[str, Any], report: dict[str, Any]
    ) -> bool:
        """Swaps a ready version's artifact for one compiled again and already stored, with its
        signature and report, in one step: the version serves the old one until then. False,
        changing nothing, when the version is gone, is no longer ready, or no longer has the
        artifact `replaced_key` (another compile replaced it first)."""
        with self.db.serialized() as session:
            version = session.scalar(
                select(ModelVersion)
                .where(ModelVersion.id == version_id)
                .options(selectinload(ModelVersion.model))
                .with_for_update()
            )
            if version is None or version.status != "ready" or version.artifact_key != replaced_key:
                return False
            version.artifact_key, version.signature, version.report = artifact_key, signature, report
            self._forget_served(version.model.tenant_id, version.model.name)
        return True


type _Json = dict[str, Any]


def report_and_progress(version: ModelVersion) -> tuple[_Json | None, _Json | None]:
    """A version's compile report (None until ready) and its compile's progress (None unless it
    is compiling), with the seconds elapsed since the compile began in place of its start."""
    stored = version.report
    if stored is None or PROGRESS not in stored:
        return stored, None
    if version.status != "compiling":
        return None, None
    progress = dict(stored[PROGRESS])
    started_at = progress.pop("started_at", None)
    if started_at is not None:
        progress["elapsed_seconds"] = round(max(0.0, time.time() - started_at), 1)
    return None, progress


def _check_aliasable(name: str, version: ModelVersion, alias: str) -> None:
    """Conflict unless the version is ready: a failed version never takes traffic through an
    alias, and one still queued or compiling may yet fail."""
    if version.status != "ready":
        detail = f" ({version.error})" if version.status == "failed" and version.error else ""
        raise Conflict(
            f"alias {alias!r} cannot point at version {version.number} of model {name!r}: "
            f"it is {version.status}{detail}; only a ready version takes an alias",
            version=version.number,
            version_status=version.status,
        )
