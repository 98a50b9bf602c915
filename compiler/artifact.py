"""The artifact: what a compile produces and a runtime loads.

An artifact is three or four files under one prefix of the object store:

    manifest.json   format version, target, graph hash, signature (with symbolic dims by
                    name), the batch symbol, and the compile report
    program.json    the IR graph and the kernels generated for the target
    program.so      only for the native CPU backend: the shared object built from the C source
                    that program.json carries, with the CPU fingerprint it was built for
    weights.npz     every constant, by key (loaded with allow_pickle=False); constants in the
                    ml_dtypes formats NumPy cannot name are stored as unsigned ints of the same
                    width, with their dtype in the manifest's weight_dtypes

The compiler only turns an Artifact into named byte strings and back; where they are stored
is the caller's business.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler.dtypes import STANDARD, numpy_dtype
from compiler.errors import CorruptArtifact, InvalidModel
from compiler.ir import Graph
from compiler.shape import Shape, SymDim, shape_from_json, shape_to_json

FORMAT_VERSION = 1
FILES = ("manifest.json", "program.json", "weights.npz")
# built code an artifact may carry besides: the native CPU backend's shared object, a CUDA
# program's PTX (forward compatible: the driver compiles it for a newer GPU) and its cubin
BINARIES = ("program.so", "program.ptx", "program.cubin")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    # dims are ints or symbols such as "batch"
    shape: Shape
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": shape_to_json(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(data: dict[str, Any]) -> TensorSpec:
        return TensorSpec(data["name"], shape_from_json(data["shape"]), data["dtype"])


@dataclass(frozen=True)
class Signature:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # the symbol that leads every input and output: requests may be concatenated along it
    batch_symbol: str | None
    # symbol -> the largest size the model itself allows (below the service's own limits)
    size_limits: dict[str, int] = field(default_factory=dict)
    # the program's working memory in bytes is the largest of these at a request's sizes
    # (compiler.memory); empty for artifacts compiled before it was recorded
    memory_terms: list[str] = field(default_factory=list)

    @staticmethod
    def of(graph: Graph, memory_terms: list[str] | None = None) -> Signature:
        inputs = [TensorSpec(*spec) for spec in graph.input_specs()]
        outputs = [TensorSpec(*spec) for spec in graph.output_specs()]
        return Signature(
            inputs, outputs, _batch_symbol(inputs, outputs), dict(graph.size_limits), list(memory_terms or [])
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "batch_symbol": self.batch_symbol,
            "size_limits": dict(sorted(self.size_limits.items())),
            "memory_terms": self.memory_terms,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Signature:
        return Signature(
            [TensorSpec.from_json(t) for t in data["inputs"]],
            [TensorSpec.from_json(t) for t in data["outputs"]],
            data.get("batch_symbol"),
            dict(data.get("size_limits", {})),
            list(data.get("memory_terms", [])),
        )


def _batch_symbol(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> str | None:
    leads = {spec.shape[0] if spec.shape else None for spec in inputs + outputs}
    if len(leads) != 1:
        return None
    lead = leads.pop()
    if isinstance(lead, SymDim):
        return lead.as_symbol()
    return None


@dataclass
class Artifact:
    target: str
    graph_hash: str
    signature: Signature
    graph: Graph
    kernels: list[dict[str, Any]]
    report: dict[str, Any] = field(default_factory=dict)
    # built code by file name (the native backend's shared object), stored beside the program
    binaries: dict[str, bytes] = field(default_factory=dict)
    # constants the program made from the graph's (weights repacked for a library call)
    program_weights: dict[str, np.ndarray] = field(default_factory=dict)

    def all_weights(self) -> dict[str, np.ndarray]:
        return {**self.graph.weights, **self.program_weights}

    def manifest(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "target": self.target,
            "graph_hash": self.graph_hash,
            "signature": self.signature.to_json(),
            "report": self.report,
            "files": list(FILES) + sorted(self.binaries),
            "weight_dtypes": {
                key: array.dtype.name for key, array in self.all_weights().items() if array.dtype.name not in STANDARD
            },
            "program_weights": sorted(self.program_weights),
        }

    def to_files(self) -> dict[str, bytes]:
        """The files in the order to write them: the manifest, which carries the others' hashes,
        comes last, so its presence means every other file was written completely."""
        weights = io.BytesIO()
        np.savez(weights, **{key: _storable(array) for key, array in self.all_weights().items()})
        program = {"graph": self.graph.to_json(), "kernels": self.kernels}
        files = {"program.json": json.dumps(program).encode(), "weights.npz": weights.getvalue(), **self.binaries}
        manifest = {**self.manifest(), "sha256": {name: _sha256(data) for name, data in files.items()}}
        return {**files, "manifest.json": json.dumps(manifest, indent=1).encode()}

    @staticmethod
    def from_files(read: Callable[[str], bytes]) -> Artifact:
        """Raises CorruptArtifact when a file is missing or differs from the manifest's hash;
        `read` raises FileNotFoundError (or another OSError) for a missing file."""
        manifest = json.loads(read("manifest.json"))
        if manifest.get("format_version") != FORMAT_VERSION:
            raise InvalidModel(f"artifact format {manifest.get('format_version')} is not {FORMAT_VERSION}")
        listed = manifest.get("files", FILES)
        names = [name for name in (*FILES, *BINARIES) if name in listed and name != "manifest.json"]
        files = {name: _read_checked(read, name, manifest.get("sha256", {})) for name in names}
        program = json.loads(files["program.json"])
        # checked against the manifest's hash: read in place, without the zip's own checks
        weights = _read_npz(files["weights.npz"], checked="weights.npz" in manifest.get("sha256", {}))
        for key, name in manifest.get("weight_dtypes", {}).items():
            weights[key] = weights[key].view(numpy_dtype(name))
        program_weights = {key: weights.pop(key) for key in manifest.get("program_weights", []) if key in weights}
        return Artifact(
            target=manifest["target"],
            graph_hash=manifest["graph_hash"],
            signature=Signature.from_json(manifest["signature"]),
            graph=Graph.from_json(program["graph"], weights),
            kernels=program["kernels"],
            report=manifest["report"],
            binaries={name: data for name, data in files.items() if name not in FILES},
            program_weights=program_weights,
        )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_checked(read: Callable[[str], bytes], name: str, hashes: dict[str, str]) -> bytes:
    try:
        data = read(name)
    except OSError as exc:
        raise CorruptArtifact(f"artifact file {name} is missing ({exc})") from None
    if name in hashes and _sha256(data) != hashes[name]:
        raise CorruptArtifact(f"artifact file {name} does not match its manifest")
    return data


def _read_npz(data: bytes, checked: bool) -> dict[str, np.ndarray]:
    """The arrays of an .npz file (np.savez's: a zip of .npy files), by key. Where its bytes were
    checked against the manifest's hash and every member is stored uncompressed (what np.savez
    writes), the arrays are read-only views of `data`, found through the zip's directory, without
    a copy and without the zip's CRC check (the hash covers it): an artifact's weights are most of
    a cold start's bytes. Anything else is read by np.load (copied, CRC-checked)."""
    if checked:
        try:
            return _npz_views(data)
        except _NotInPlace:
            pass
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


class _NotInPlace(Exception):
    """An .npz member that cannot be viewed in place (compressed, encrypted, an odd header)."""


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip member's local header: signature, name and extra lengths


def _npz_views(data: bytes) -> dict[str, np.ndarray]:
    view = memoryview(data)
    arrays = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or not info.filename.endswith(".npy"):
                raise _NotInPlace(info.filename)
            signature, name_length, extra_length = _LOCAL_HEADER.unpack_from(view, info.header_offset)
            if signature != b"PK\x03\x04":
                raise _NotInPlace(info.filename)
            start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            member = io.BytesIO(view[start : start + min(info.file_size, _NPY_HEADER_MAX)])
            try:
                version = np.lib.format.read_magic(member)
                if version == (1, 0):
                    shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(member)
                elif version == (2, 0):
                    shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(member)
                else:
                    raise _NotInPlace(info.filename)
            except ValueError:
                raise _NotInPlace(info.filename) from None
            if dtype.hasobject:
                raise ValueError(f"weights.npz member {info.filename} holds Python objects, which are not loaded")
            count = math.prod(shape)
            offset = start + member.tell()
            if member.tell() + count * dtype.itemsize != info.file_size:
                raise _NotInPlace(info.filename)
            array = np.frombuffer(data, dtype, count, offset)
            arrays[info.filename.removesuffix(".npy")] = array.reshape(shape, order="F" if fortran_order else "C")
    return arrays


# a .npy header (magic, length, the dict) is at most this long in what np.save writes
_NPY_HEADER_MAX = 1 << 16


def _storable(array: np.ndarray) -> np.ndarray:
    """The array as NumPy can save it without pickling: narrow formats as raw unsigned ints."""
    if array.dtype.name in STANDARD:
        return array
    return np.asarray(array, order="C").view(f"u{array.dtype.itemsize}")
