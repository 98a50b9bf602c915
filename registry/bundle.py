"""A generative model's upload: the decoder graph and its tokenizer files, as one zip or as
separate parts. Read, checked (the cache layout from the graph, the tokenizer and its chat
template, the vocabulary against the logits) and stored content-addressed beside the graph.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from cloud.errors import InvalidModelFile, InvalidRequest

TASKS = ("inference", "text-generation")
GENERATION = "text-generation"
TOKENIZER_PARTS = {  # multipart field -> bundle file name
    "tokenizer": "tokenizer.json",
    "tokenizer_config": "tokenizer_config.json",
    "generation_config": "generation_config.json",
    "config": "config.json",
    "chat_template": "chat_template.jinja",
}
BUNDLE_NAMES = frozenset(TOKENIZER_PARTS.values())
# a tokenizer file past this is not a tokenizer (Llama 3's tokenizer.json is 9 MB)
MAX_BUNDLE_FILE_BYTES = 64 * 1024 * 1024
# the context when neither config.json nor tokenizer_config.json says it
DEFAULT_CONTEXT = 2048
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Bundle:
    """The tokenizer side of a generative upload, by file name."""

    files: dict[str, bytes]

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return digest.hexdigest()

    def context_length(self) -> int:
        """The model's positions: config.json's, else the tokenizer's model_max_length."""
        config = _json(self.files.get("config.json"))
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if isinstance(config.get(key), int) and config[key] > 0:
                return int(config[key])
        limit = _json(self.files.get("tokenizer_config.json")).get("model_max_length")
        if isinstance(limit, int) and 0 < limit < 10**7:  # transformers writes 1e30 for "no limit"
            return limit
        return DEFAULT_CONTEXT


def _json(data: bytes | None) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def is_zip(head: bytes, filename: str | None) -> bool:
    return head.startswith(_ZIP_MAGIC) or (filename or "").lower().endswith(".zip")


def read_zip(source: BinaryIO, max_graph_bytes: int | None, spool_dir: Path) -> tuple[Path, Bundle]:
    """The zip's one .onnx file (extracted to `spool_dir`) and its tokenizer files, at its top
    level or in one folder; InvalidModelFile naming what is missing, duplicated or too large."""
    try:
        archive = zipfile.ZipFile(source)
    except zipfile.BadZipFile as exc:
        raise InvalidModelFile(f"the uploaded bundle is not a readable zip file: {exc}") from None
    with archive:
        members = [
            m
            for m in archive.infolist()
            if not m.is_dir() and not PurePosixPath(m.filename).name.startswith(".")
        ]
        graphs = [m for m in members if m.filename.lower().endswith(".onnx")]
        if len(graphs) != 1:
            found = ", ".join(m.filename for m in graphs) or "none"
            raise InvalidModelFile(f"the bundle must hold exactly one .onnx file (found: {found})")
        graph = graphs[0]
        if max_graph_bytes is not None and graph.file_size > max_graph_bytes:
            raise InvalidModelFile(
                f"{graph.filename} is {graph.file_size} bytes, past the upload limit of {max_graph_bytes}"
            )
        if any(
            m.filename.lower().endswith(".onnx_data") or m.filename.lower().endswith(".data") for m in members
        ):
            raise InvalidModelFile(
                "the bundle's graph keeps its weights in an external data file: export them inside the .onnx"
            )
        files: dict[str, bytes] = {}
        for member in members:
            name = PurePosixPath(member.filename).name
            if name not in BUNDLE_NAMES:
                continue
            if name in files:
                raise InvalidModelFile(f"the bundle holds {name} twice")
            if member.file_size > MAX_BUNDLE_FILE_BYTES:
                raise InvalidModelFile(
                    f"{member.filename} is {member.file_size} bytes, past {MAX_BUNDLE_FILE_BYTES}"
                )
            files[name] = archive.read(member)
        path = spool_dir / "graph.onnx"
        with archive.open(graph) as data, path.open("wb") as out:
            while chunk := data.read(1 << 20):
                out.write(chunk)
    return path, Bundle(files)


def bundle_from_parts(parts: Mapping[str, bytes]) -> Bundle:
    """The tokenizer files sent as multipart parts (field name -> bytes)."""
    files = {}
    for field, data in parts.items():
        if len(data) > MAX_BUNDLE_FILE_BYTES:
            raise InvalidModelFile(f"{field} is {len(data)} bytes, past {MAX_BUNDLE_FILE_BYTES}")
        files[TOKENIZER_PARTS[field]] = data
    return Bundle(files)


def check_task(task: str) -> str:
    if task not in TASKS:
        raise InvalidRequest(f"unknown task {task!r}; available: {', '.join(TASKS)}")
    return task


def check_generative(graph_path: Path, bundle: Bundle) -> dict[str, Any]:
    """The checks a generative upload passes before it is stored: the graph carries a KV cache
    the runtime can map, the tokenizer loads (its chat template parses), and its vocabulary fits
    the logits. Returns what the version keeps of the bundle (besides its key): the context
    length and the cache layout. InvalidModelFile naming the problem."""
    import onnx
    from google.protobuf.message import DecodeError

    from compiler.errors import UnsupportedModel
    from compiler.kv_layout import find_cache_layout, onnx_specs
    from runtime.tokenizer import TextCodec, TokenizerError

    try:
        model = onnx.load(str(graph_path), load_external_data=False)
        inputs, outputs = onnx_specs(model)
    except (DecodeError, ValueError, OSError) as exc:  # the graph check passed: onnx cannot reread it
        raise InvalidModelFile(f"the decoder graph could not be read: {exc}") from None
    try:
        layout = find_cache_layout(inputs, outputs)
    except UnsupportedModel as exc:
        raise InvalidModelFile("; ".join(exc.missing)) from None
    if "tokenizer.json" not in bundle.files:
        raise InvalidModelFile(
            "a text-generation upload needs its tokenizer: send tokenizer.json (part 'tokenizer', or inside a zip "
            "bundle), with tokenizer_config.json and generation_config.json"
        )
    try:
        codec = TextCodec.from_files(bundle.files)
    except TokenizerError as exc:
        raise InvalidModelFile(str(exc)) from None
    if codec.vocab_size > layout.vocab:
        raise InvalidModelFile(
            f"the tokenizer has {codec.vocab_size} tokens but the graph's logits cover {layout.vocab}: "
            "they are not the same model's"
        )
    return {
        "context_length": bundle.context_length(),
        "layout": layout.to_json(),
        "chat": codec.has_chat_template,
    }


def zip_bytes(files: Mapping[str, bytes]) -> bytes:
    """A zip of `files` (tests and the SDK build bundles with it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


__all__ = [
    "GENERATION",
    "TASKS",
    "TOKENIZER_PARTS",
    "Bundle",
    "bundle_from_parts",
    "check_generative",
    "check_task",
    "is_zip",
    "read_zip",
    "zip_bytes",
]
