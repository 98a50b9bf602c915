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
# a merged decoder's branch check (check_merged_branches): a prompt of this many tokens, batch 1,
# run through both branches; the with-past branch's outputs may differ from the no-past branch's
# by BRANCH_ATOL plus BRANCH_RTOL of the no-past output's largest magnitude (float16 exports too)
BRANCH_CHECK_TOKENS = 5
BRANCH_ATOL = 1e-3
BRANCH_RTOL = 1e-2
LOGITS_OUTPUT = "logits"
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
    kept: dict[str, Any] = {
        "context_length": bundle.context_length(),
        "layout": layout.to_json(),
        "chat": codec.has_chat_template,
    }
    if layout.cache_branch_input:
        kept["cache_branch_check"] = check_merged_branches(
            model, layout, min(codec.vocab_size, layout.vocab), graph_path
        )
    return kept


class _Unrunnable(Exception):
    """A runner could not run one of the branches (not: the branches disagree)."""


def check_merged_branches(
    model, layout, vocab: int | None = None, path: Path | None = None
) -> dict[str, Any]:
    """A merged decoder (layout.cache_branch_input) is served by its with-past branch alone, the
    prompt's first step included with zero-length past tensors (compiler.kv_layout.bind_cache_branch).
    That is only right when the branch was traced for prompts of any length: optimum 1.x's merged
    export with legacy=True traces it at one new token, and with transformers 4.46 it then has no
    causal mask for longer prompts, so it would generate wrong text for every prompt of 2+ tokens.
    Here a prompt of BRANCH_CHECK_TOKENS tokens (batch 1, attention mask of ones, positions 0..n-1)
    runs through both branches, the with-past one with zero-length past tensors; its logits and
    presents must equal the no-past branch's (the model's own prompt path, the reference) within
    BRANCH_ATOL + BRANCH_RTOL * the reference's largest magnitude. onnxruntime runs the graph as
    uploaded (one session, the branch fed; read from `path`, the model's file, when given); where
    it cannot, the compiler's reference interpreter runs each branch bound (bind_cache_branch).
    Token ids are below `vocab` (the tokenizer's). Returns what was measured; InvalidModelFile
    naming the problem and the way out when the branches disagree or neither runner can run them."""
    import time

    import numpy as np

    started = time.perf_counter()
    tokens = BRANCH_CHECK_TOKENS
    vocab = min(vocab or layout.vocab, layout.vocab)
    ids = ((np.arange(tokens, dtype=np.int64) * 7919 + 17) % max(vocab, 1))[None]
    feeds: dict[str, Any] = {"input_ids": ids}
    if layout.mask_input:
        feeds[layout.mask_input] = np.ones_like(ids)
    if layout.position_input:
        feeds[layout.position_input] = np.arange(tokens, dtype=np.int64)[None]
    names = [LOGITS_OUTPUT, *layout.present_keys, *layout.present_values]
    failures = []
    for runner in (_run_onnxruntime, _run_reference):
        try:
            with_past, without = runner(model, layout, feeds, names, path)
            break
        except _Unrunnable as exc:
            failures.append(str(exc))
    else:
        raise InvalidModelFile(
            f"this merged decoder ({layout.cache_branch_input!r}) could not be checked: its two branches must give "
            f"the same logits for a prompt of {tokens} tokens, and running them failed ({'; '.join(failures)})"
        )
    runner_name = "onnxruntime" if not failures else "reference"
    worst: dict[str, float] = {}
    for name in names:
        got, want = np.asarray(with_past[name], np.float64), np.asarray(without[name], np.float64)
        if got.shape != want.shape:
            raise InvalidModelFile(
                _disagree(layout, name, f"shape {list(got.shape)} against {list(want.shape)}")
            )
        difference = float(np.nan_to_num(np.abs(got - want), nan=np.inf).max(initial=0.0))
        allowed = BRANCH_ATOL + BRANCH_RTOL * float(np.abs(want).max(initial=0.0))
        worst[name] = difference
        if not difference <= allowed:
            raise InvalidModelFile(
                _disagree(layout, name, f"largest difference {difference:.3g}, allowed {allowed:.3g}")
            )
    return {
        "tokens": tokens,
        "runner": runner_name,
        "max_abs_logit_difference": worst[LOGITS_OUTPUT],
        "max_abs_present_difference": max((v for k, v in worst.items() if k != LOGITS_OUTPUT), default=0.0),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _disagree(layout, output: str, how: str) -> str:
    return (
        f"this merged decoder's with-past branch ({layout.cache_branch_input} = True, the branch this service runs "
        f"for every step, the prompt's included, with zero-length past tensors) gives a different {output!r} from its "
        f"no-past branch for a prompt of {BRANCH_CHECK_TOKENS} tokens ({how}): served, it would generate wrong text "
        "for any prompt of 2 or more tokens. optimum 1.x's merged export with --legacy (legacy=True) traces the "
        "with-past decoder at one new token, which leaves it without a causal mask for longer prompts. Export it "
        "again without --legacy (optimum 1.x's default or optimum-onnx's exporter: one model.onnx that takes the "
        "past, not merged), or merge a with-past decoder traced at the full sequence length (a custom ONNX config "
        "whose dummy inputs keep sequence_length above 1)"
    )


def _empty_past(layout, dtype) -> dict[str, Any]:
    import numpy as np

    empty = np.zeros((1, layout.kv_heads, 0, layout.head_dim), dtype)
    return {name: empty for name in (*layout.past_keys, *layout.past_values)}


def _run_onnxruntime(model, layout, feeds, names, path=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both branches in one onnxruntime session of the graph as uploaded, the branch fed."""
    import numpy as np

    dtypes = {"float32": np.float32, "float16": np.float16, "float64": np.float64}
    if layout.dtype not in dtypes:
        raise _Unrunnable(f"onnxruntime: the cache's {layout.dtype} has no NumPy type to feed it with")
    try:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 2
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
        session = onnxruntime.InferenceSession(
            str(path) if path is not None else model.SerializeToString(),
            options,
            providers=["CPUExecutionProvider"],
        )
        branch_shape = next(
            (list(v.shape) for v in session.get_inputs() if v.name == layout.cache_branch_input), [1]
        )
        base = {**feeds, **_empty_past(layout, dtypes[layout.dtype])}
        results = []
        for branch in (True, False):
            flag = np.array(branch).reshape([1] * len(branch_shape))
            outputs = session.run(names, {**base, layout.cache_branch_input: flag})
            results.append(dict(zip(names, outputs)))
    except Exception as exc:  # noqa: BLE001 - any failure of the runner: the reference interpreter tries
        raise _Unrunnable(f"onnxruntime: {type(exc).__name__}: {str(exc)[:300]}") from None
    return results[0], results[1]


def _run_reference(model, layout, feeds, names, path=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each branch bound (compiler.kv_layout.bind_cache_branch), parsed by the compiler's frontend
    and run by its reference interpreter (compiler.reference.run_graph)."""
    try:
        from compiler.dtypes import numpy_dtype
        from compiler.frontends.onnx import onnx_to_graph
        from compiler.kv_layout import bind_cache_branch, decoder_dims, onnx_specs
        from compiler.reference import run_graph

        base = {**feeds, **_empty_past(layout, numpy_dtype(layout.dtype))}
        results = []
        for branch in (True, False):
            bound = type(model)()
            bound.CopyFrom(model)
            bind_cache_branch(bound, branch)
            dims = decoder_dims(onnx_specs(bound)[0])  # {mask length: "past + seq"}
            if not branch:  # the no-past decoder's mask spans the new tokens alone
                dims = {total: relation.rsplit(" + ", 1)[-1] for total, relation in dims.items()}
            graph = onnx_to_graph(bound, dims=dims)
            given = {name: base[name] for name, _, _ in graph.input_specs() if name in base}
            outputs = run_graph(graph, given)
            results.append({name: outputs[name] for name in names})
    except Exception as exc:  # noqa: BLE001 - any failure of the runner
        raise _Unrunnable(f"the reference interpreter: {type(exc).__name__}: {str(exc)[:300]}") from None
    return results[0], results[1]


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
    "check_merged_branches",
    "check_task",
    "is_zip",
    "read_zip",
    "zip_bytes",
]
