"""The object store: graph blobs and compiled artifacts, by key.

One small interface with two adapters, picked by `make_object_store`: a local directory (the
embedded default) and an S3 bucket (`cloud/s3.py`). It stores bytes under keys: an artifact is
its files (compiler.Artifact's to_files and from_files, called by whoever holds the artifact).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from cloud.errors import NotFound, PayloadTooLarge
from cloud.settings import Settings

# uploads are read, hashed and stored this much at a time
_CHUNK = 1 << 20


class ObjectStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    # streamed from the file: a large upload never sits whole in memory
    def put_file(self, key: str, path: Path) -> None: ...
    def get(self, key: str) -> bytes: ...
    # streamed to the file (created or replaced): a large graph never sits whole in memory
    def get_file(self, key: str, path: Path) -> None: ...
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
        with self._replacing(key) as f:
            f.write(data)

    def put_file(self, key: str, path: Path) -> None:
        with self._replacing(key) as f, path.open("rb") as source:
            shutil.copyfileobj(source, f, _CHUNK)

    @contextmanager
    def _replacing(self, key: str) -> Iterator[BinaryIO]:
        """A temporary file beside the object, renamed over it once written whole."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"object {key!r} not found") from None

    def get_file(self, key: str, path: Path) -> None:
        try:
            source = self._path(key).open("rb")
        except FileNotFoundError:
            raise NotFound(f"object {key!r} not found") from None
        with source, path.open("wb") as f:
            shutil.copyfileobj(source, f, _CHUNK)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file():
            path.unlink()


def make_object_store(settings: Settings) -> ObjectStore:
    """The adapter the settings name; an S3 store checks its bucket now (Unreachable if not)."""
    if settings.object_store == "s3":
        from cloud.s3 import S3ObjectStore  # boto3 is imported only by servers that use it

        return S3ObjectStore.from_settings(settings)
    return LocalObjectStore(settings.objects_dir)


@dataclass(frozen=True)
class SpooledFile:
    """An upload written to a temporary file, hashed on the way."""

    path: Path
    # hex digest of the contents: the key graphs are stored under
    sha256: str
    size: int


@contextmanager
def spool(source: BinaryIO, max_bytes: int | None = None) -> Iterator[SpooledFile]:
    """Copies `source` into a temporary file (removed on exit), hashing as it reads;
    PayloadTooLarge as soon as it passes `max_bytes`."""
    digest, size = hashlib.sha256(), 0
    with tempfile.NamedTemporaryFile(prefix="luminal-upload-") as f:
        while chunk := source.read(_CHUNK):
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise PayloadTooLarge(f"the upload is larger than the limit of {max_bytes} bytes")
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        yield SpooledFile(Path(f.name), digest.hexdigest(), size)


def graph_key(tenant_id: int, sha256: str) -> str:
    """Where a tenant's uploaded graph is stored: by tenant and the hex digest of its bytes. Per
    tenant, so are the artifacts compiled from it: a second tenant uploading the same bytes
    compiles them anew, and can learn from no timing or report that another tenant has them."""
    return f"graphs/t{tenant_id}/{sha256}.onnx"


def graph_digest(graph_key: str) -> str:
    return graph_key.removeprefix("graphs/").removesuffix(".onnx")


def artifact_key(
    graph_key: str, target: str, options: Mapping[str, object] | None = None, *, compiler_version: str
) -> str:
    """Artifacts are cached by (uploaded graph, target, compiler version, compile options): the
    compiler's version is its caller's to give (compiler.pipeline.COMPILER_VERSION); the
    options (candidates measured, search on or off, the CPU type a cpu program was built and
    measured on, a narrow precision) enter as a digest, so that changing any of them compiles again."""
    digest = hashlib.sha256(json.dumps(dict(options or {}), sort_keys=True).encode()).hexdigest()[:16]
    return f"{artifacts_prefix(graph_key)}/{target}/{compiler_version}/{digest}"


def bundle_key(tenant_id: int, sha256: str) -> str:
    """Where a tenant's tokenizer bundle is stored (a prefix; one object per file), by the digest
    of its files: per tenant, as graphs are."""
    return f"bundles/t{tenant_id}/{sha256}"


def artifacts_prefix(graph_key: str) -> str:
    """Every artifact compiled from one uploaded graph, for any target or compiler version."""
    return f"artifacts/{graph_digest(graph_key)}"


class StoredArtifact(Protocol):
    """What the store needs of an artifact (compiler.Artifact): its files in the order to write
    them, the manifest last."""

    def to_files(self) -> Mapping[str, bytes]: ...


def save_artifact(store: ObjectStore, key: str, artifact: StoredArtifact) -> None:
    """Each file under `key`, the manifest last: a crash midway leaves no manifest, or one whose
    hashes the partial files fail, and the artifact is compiled again."""
    for name, data in artifact.to_files().items():
        store.put(f"{key}/{name}", data)


def load_artifact[A](store: ObjectStore, key: str, from_files: Callable[[Callable[[str], bytes]], A]) -> A:
    """The artifact under `key`, as `from_files` (compiler.Artifact.from_files) builds it from a
    reader of its files, which raises FileNotFoundError for a missing one; CorruptArtifact (from
    `from_files`) when its files are incomplete or altered."""

    def read(name: str) -> bytes:
        try:
            return store.get(f"{key}/{name}")
        except NotFound as exc:
            raise FileNotFoundError(str(exc)) from None

    return from_files(read)
