"""Models as today's exporters write them, against onnxruntime.

tests/fixtures/export_torch_fixtures.py exports a BERT-style encoder, a GPT-2-style causal
decoder, a ResNet-style CNN and a float16 attention block with both torch exporters (TorchScript
at opset 17, dynamo at opset 20). Their graphs compute shapes at run time (Shape, Gather, Range,
Slice, Where, ...) over the symbolic batch and sequence dims. One compiled artifact must serve
several (batch, seq) sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import onnxruntime
import pytest

from compiler import Artifact, CompilerError, compile_onnx, executable
from tests.conftest import FIXTURES

VOCAB = 100
HIDDEN = 32
FP16_SEQ = 8
EXPORTERS = ("torchscript", "dynamo")


def token_ids(rng: np.random.Generator, batch: int, seq: int) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, VOCAB, (batch, seq), dtype=np.int64)}


def token_ids_and_mask(rng: np.random.Generator, batch: int, seq: int) -> dict[str, np.ndarray]:
    # row i has i % seq padded positions at the end; the first token is always attended
    lengths = seq - np.arange(batch) % seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return {**token_ids(rng, batch, seq), "attention_mask": mask}


def images(rng: np.random.Generator, batch: int, _seq: int) -> dict[str, np.ndarray]:
    return {"input": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}


def half_sequences(rng: np.random.Generator, batch: int, _seq: int) -> dict[str, np.ndarray]:
    return {"input": rng.standard_normal((batch, FP16_SEQ, HIDDEN)).astype(np.float16)}


@dataclass(frozen=True)
class Model:
    make_inputs: Callable[[np.random.Generator, int, int], dict[str, np.ndarray]]
    # the input specs the artifact's signature must show, symbolic dims by name
    signature: list[dict]
    output_shape: list
    # (batch, seq) sizes run through one compiled artifact; seq is unused by fixed-length models
    sizes: tuple[tuple[int, int], ...]
    tolerance: float = 1e-4


TOKENS = {"shape": ["batch", "seq"], "dtype": "int64"}
MODELS = {
    "bert": Model(
        token_ids_and_mask,
        [{"name": "input_ids", **TOKENS}, {"name": "attention_mask", **TOKENS}],
        ["batch", "seq", HIDDEN],
        ((1, 5), (3, 11), (2, 64)),
    ),
    # 64 is the longest sequence: the causal mask buffer is sliced to the run-time length
    "gpt2": Model(token_ids, [{"name": "input_ids", **TOKENS}], ["batch", "seq", VOCAB], ((1, 5), (3, 11), (2, 64))),
    "resnet": Model(
        images, [{"name": "input", "shape": ["batch", 3, 32, 32], "dtype": "float32"}], ["batch", 10], ((1, 0), (4, 0))
    ),
    "attention_fp16": Model(
        half_sequences,
        [{"name": "input", "shape": ["batch", FP16_SEQ, HIDDEN], "dtype": "float16"}],
        ["batch", FP16_SEQ, HIDDEN],
        ((1, 0), (5, 0)),
        tolerance=1e-2,
    ),
}
FILES = [f"{model}_{exporter}.onnx" for model in MODELS for exporter in EXPORTERS]


def model_of(file: str) -> Model:
    return MODELS[file.rsplit("_", 1)[0]]


@cache
def _compile(file: str) -> Artifact | CompilerError:
    try:
        return compile_onnx((FIXTURES / file).read_bytes(), "cpu")
    except CompilerError as error:  # kept, so the cases of one file compile it once
        return error


def compiled(file: str) -> Artifact:
    outcome = _compile(file)
    if isinstance(outcome, CompilerError):
        raise outcome
    return outcome


@cache
def onnxruntime_session(file: str) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(str(FIXTURES / file), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("file", FILES)
def test_fixture_is_self_contained_and_small(file: str) -> None:
    assert (FIXTURES / file).stat().st_size < 1_000_000


@pytest.mark.parametrize("file", FILES)
def test_signature_keeps_symbolic_dims(file: str) -> None:
    signature = compiled(file).signature
    assert [spec.to_json() for spec in signature.inputs] == model_of(file).signature
    assert [spec.to_json()["shape"] for spec in signature.outputs] == [model_of(file).output_shape]
    assert signature.batch_symbol == "batch"


@pytest.mark.parametrize("file", FILES)
def test_one_artifact_serves_every_size(file: str) -> None:
    model = model_of(file)
    program = executable(compiled(file))
    session = onnxruntime_session(file)
    rng = np.random.default_rng(0)
    for batch, seq in model.sizes:
        inputs = model.make_inputs(rng, batch, seq)
        (want,) = session.run(None, inputs)
        (got,) = program.run(inputs).values()
        assert got.shape == want.shape and got.dtype == want.dtype, (batch, seq)
        np.testing.assert_allclose(
            got.astype(np.float32), want.astype(np.float32), rtol=model.tolerance, atol=model.tolerance,
            err_msg=f"batch={batch} seq={seq}",
        )
