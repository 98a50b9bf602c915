"""Artifacts are published atomically: a crash while saving one never fails a version, for the
uploader or for anyone who later uploads the same bytes; it is compiled again."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from api.services import build_services
from cloud.auth import authenticate, create_key
from cloud.storage import load_artifact
from compiler import Artifact, CorruptArtifact, compile_onnx, executable
from tests.conftest import make_settings
from tests.onnx_models import mlp
from worker.compile import cache_key, compile_options, compile_version

MLP = mlp().SerializeToString()


def test_files_missing_or_altered_are_reported_as_corrupt() -> None:
    files = compile_onnx(MLP).to_files()
    assert list(files)[-1] == "manifest.json"  # written last: its presence publishes the rest
    without_weights = {k: v for k, v in files.items() if k != "weights.npz"}

    def reader(available: dict[str, bytes]):
        def read(name: str) -> bytes:
            if name not in available:
                raise FileNotFoundError(name)
            return available[name]

        return read

    with pytest.raises(CorruptArtifact, match="weights.npz is missing"):
        Artifact.from_files(reader(without_weights))
    truncated = {**files, "weights.npz": files["weights.npz"][: len(files["weights.npz"]) // 2]}
    with pytest.raises(CorruptArtifact, match="weights.npz does not match"):
        Artifact.from_files(reader(truncated))


@pytest.mark.parametrize("left_behind", ["manifest only", "truncated weights"])
def test_a_crash_while_saving_an_artifact_is_recompiled_for_every_tenant(tmp_path: Path, left_behind: str) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry, store = services.registry, services.store
        alice, bob = (authenticate(services.db, f"Bearer {create_key(services.db, name)}").id for name in ("alice", "bob"))
        first = registry.create_version(alice, "mlp", io.BytesIO(MLP), "cpu")
        key = cache_key(first.graph_key, "cpu", compile_options())
        # what a kill -9 between the writes of an older, manifest-first save left in the store
        files = compile_onnx(MLP).to_files()
        store.put(f"{key}/manifest.json", files["manifest.json"])
        if left_behind == "truncated weights":
            store.put(f"{key}/program.json", files["program.json"])
            store.put(f"{key}/weights.npz", files["weights.npz"][:100])
        assert compile_version(first.id, registry) == "ready"
        again = registry.create_version(bob, "mlp", io.BytesIO(MLP), "cpu")
        assert compile_version(again.id, registry) == "ready"
        x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        np.testing.assert_allclose(
            executable(load_artifact(store, key, Artifact.from_files)).run({"x": x})["y"],
            executable(compile_onnx(MLP)).run({"x": x})["y"],
            rtol=1e-5,
            atol=1e-6,
        )
    finally:
        services.close()


def test_a_compiler_crash_fails_the_version_without_revealing_paths(tmp_path: Path, monkeypatch) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        version = registry.create_version(tenant, "mlp", io.BytesIO(MLP), "cpu")

        def crash(data: bytes, target: str, progress=None, precision="exported") -> Artifact:
            raise RuntimeError(f"cannot open {tmp_path}/data/objects/artifacts/abc/weights.npz")

        monkeypatch.setattr("worker.compile.compile_onnx", crash)
        assert compile_version(version.id, registry) == "failed"
        error = registry.get_version(version.id).error
        assert error.startswith("internal compiler error (RuntimeError)")
        assert str(tmp_path) not in error and "artifacts/" not in error
    finally:
        services.close()


def test_the_cache_reuses_an_artifact_only_for_the_same_options_and_cpu(tmp_path: Path, monkeypatch) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    compiled: list[tuple[int, str]] = []

    def counting(version_id: int, graph: Path, target: str, progress=None, precision="exported") -> Artifact:
        compiled.append((version_id, target))
        return compile_onnx(graph.read_bytes(), target, candidates=("native-blas",), progress=progress)

    try:
        registry, store = services.registry, services.store
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        blas_only = compile_options(("native-blas",), True)
        first = registry.create_version(tenant, "mlp", io.BytesIO(MLP), "cpu")
        assert compile_version(first.id, registry, counting, blas_only) == "ready"
        again = registry.create_version(tenant, "mlp", io.BytesIO(MLP), "cpu")
        assert compile_version(again.id, registry, counting, blas_only) == "ready"
        assert compiled == [(first.id, "cpu")]  # the same bytes and options: no second compile
        assert registry.get_version(again.id).artifact_key == registry.get_version(first.id).artifact_key

        # other options (the search off) or another CPU type: compiled again, stored beside it
        other = registry.create_version(tenant, "mlp", io.BytesIO(MLP), "cpu")
        assert compile_version(other.id, registry, counting, compile_options(("native-blas",), False)) == "ready"
        monkeypatch.setattr("worker.compile.cpu_fingerprint", lambda: "another cpu type")
        elsewhere = registry.create_version(tenant, "mlp", io.BytesIO(MLP), "cpu")
        assert compile_version(elsewhere.id, registry, counting, blas_only) == "ready"
        assert compiled == [(first.id, "cpu"), (other.id, "cpu"), (elsewhere.id, "cpu")]
        keys = {registry.get_version(v.id).artifact_key for v in (first, other, elsewhere)}
        assert len(keys) == 3 and all(store.exists(f"{key}/manifest.json") for key in keys)
    finally:
        services.close()


def test_weights_are_read_in_place_and_a_loaded_program_keeps_only_its_own() -> None:
    """An artifact's weights are views of its checked weights.npz (no copy, no zip CRC pass: the
    manifest's hash covers the file); the native program copies what its code reads, so the file
    is not kept with it. Weights the manifest has no hash for, or compressed, go through np.load."""
    import json
    import zipfile

    from compiler.artifact import _read_npz

    artifact = compile_onnx(MLP)
    files = artifact.to_files()
    loaded = Artifact.from_files(files.__getitem__)
    data = files["weights.npz"]
    for key, array in artifact.all_weights().items():
        read = loaded.all_weights()[key]
        assert read.dtype == array.dtype and read.shape == array.shape
        np.testing.assert_array_equal(read, array)
        assert not read.flags.writeable and read.base is not None  # a view of the file's bytes
    program = executable(loaded)
    assert artifact.kernels[0].get("kind") == "native"
    file_bytes = np.frombuffer(data, np.uint8)
    assert program._weights and not any(np.shares_memory(w, file_bytes) for w in program._weights)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(program.run({"x": x})["y"], executable(artifact).run({"x": x})["y"], rtol=1e-6)

    # no hash in the manifest: np.load, the zip's CRC checked
    manifest = json.loads(files["manifest.json"])
    del manifest["sha256"]
    unhashed = Artifact.from_files({**files, "manifest.json": json.dumps(manifest).encode()}.__getitem__)
    assert all(w.flags.writeable for w in unhashed.all_weights().values())
    # compressed, Fortran order, 0-d and empty arrays: each read as np.load reads it
    arrays = {"s": np.float32(3), "e": np.zeros((0, 4), np.int64), "f": np.asfortranarray(np.arange(6.0).reshape(2, 3))}
    for save in (np.savez, np.savez_compressed):
        buffer = io.BytesIO()
        save(buffer, **arrays)
        read = _read_npz(buffer.getvalue(), checked=True)
        assert read.keys() == arrays.keys()
        for key, array in arrays.items():
            assert read[key].dtype == array.dtype and read[key].shape == np.shape(array)
            np.testing.assert_array_equal(read[key], array)
    assert zipfile.is_zipfile(io.BytesIO(data))
