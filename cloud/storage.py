"""The object store: graph blobs and compiled artifacts, by key.

One small interface; the embedded default is a local directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from cloud.errors import NotFound
from cloud.settings import Settings
from compiler import Artifact
from compiler.pipeline import COMPILER_VERSION


class ObjectStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> None: ...


class LocalObjectStore:
    """Objects as files under a root folder; writes are atomic (temp file, then rename)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"object key {key!r} leaves the store")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"object {key!r} not found") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file():
            path.unlink()


def make_object_store(settings: Settings) -> ObjectStore:
    return LocalObjectStore(settings.objects_dir)


def graph_digest(graph_key: str) -> str:
    return graph_key.removeprefix("graphs/").removesuffix(".onnx")


def artifact_key(graph_key: str, target: str, options: Mapping[str, object] | None = None) -> str:
    """Artifacts are cached by (uploaded graph, target, compiler version, compile options): the
    options (candidates measured, search on or off, the CPU type a cpu program was built and
    measured on) enter as a digest, so that changing any of them compiles again."""
    digest = hashlib.sha256(json.dumps(dict(options or {}), sort_keys=True).encode()).hexdigest()[:16]
    return f"{artifacts_prefix(graph_key)}/{target}/{COMPILER_VERSION}/{digest}"


def artifacts_prefix(graph_key: str) -> str:
    """Every artifact compiled from one uploaded graph, for any target or compiler version."""
    return f"artifacts/{graph_digest(graph_key)}"


def save_artifact(store: ObjectStore, key: str, artifact: Artifact) -> None:
    """Each file under `key`, the manifest last: a crash midway leaves no manifest, or one whose
    hashes the partial files fail, and the artifact is compiled again."""
    for name, data in artifact.to_files().items():
        store.put(f"{key}/{name}", data)


def load_artifact(store: ObjectStore, key: str) -> Artifact:
    """The artifact under `key`; CorruptArtifact when its files are incomplete or altered."""

    def read(name: str) -> bytes:
        try:
            return store.get(f"{key}/{name}")
        except NotFound as exc:
            raise FileNotFoundError(str(exc)) from None

    return Artifact.from_files(read)
