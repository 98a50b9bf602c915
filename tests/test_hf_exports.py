"""Real transformers models as users export them, against onnxruntime.

Every architecture of tests/fixtures/hf (BERT, DistilBERT, RoBERTa, ALBERT, ELECTRA, T5 encoder,
CLIP text; GPT-2, GPT-NeoX, OPT, Llama, Mistral, Qwen2; ViT, ConvNeXt, ResNet, MobileNetV2; the
Whisper encoder), exported by both torch exporters with dynamic batch and sequence, compiles to
one artifact whose signature keeps the symbolic dims, and that artifact matches onnxruntime at
every (batch, seq) size the fixture script checked against torch.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnxruntime
import pytest

from compiler import Artifact, compile_onnx, executable
from tests.hf_corpus import CORPUS, REQUIRED, exported, make_inputs, manifest

ENTRIES = {entry["file"]: entry for entry in exported()}


@cache
def compiled(file: str) -> Artifact:
    return compile_onnx((CORPUS / file).read_bytes(), "cpu")


def test_every_required_architecture_is_exported_by_both_exporters_or_says_why_not() -> None:
    by_name: dict[str, dict[str, dict]] = {}
    for entry in manifest():
        by_name.setdefault(entry["architecture"], {})[entry["exporter"]] = entry
    for required in REQUIRED:
        present = [name for name in required.split("|") if name in by_name]
        assert present, f"no fixture for {required}"
        for name in present:
            exporters = by_name[name]
            assert set(exporters) == {"torchscript", "dynamo"}, (name, sorted(exporters))
            assert any(e["file"] for e in exporters.values()), f"{name}: both exporters failed"
            for exporter, entry in exporters.items():
                assert entry["file"] or entry["error"], f"{name} {exporter}: no file and no reason"


@pytest.mark.parametrize("file", sorted(ENTRIES))
def test_fixture_is_small(file: str) -> None:
    assert (CORPUS / file).stat().st_size < 1_000_000


@pytest.mark.parametrize("file", sorted(ENTRIES))
def test_signature_keeps_symbolic_dims(file: str) -> None:
    entry = ENTRIES[file]
    signature = compiled(file).signature
    assert {s.name: s.to_json()["shape"] for s in signature.inputs} == {
        name: spec["shape"] for name, spec in entry["inputs"].items()
    }
    (output,) = signature.outputs
    assert output.to_json()["shape"] == entry["output"]["shape"]
    assert signature.batch_symbol == "batch"


@pytest.mark.parametrize("file", sorted(ENTRIES))
def test_one_artifact_matches_onnxruntime_at_every_size(file: str) -> None:
    entry = ENTRIES[file]
    program = executable(compiled(file))
    session = onnxruntime.InferenceSession(str(CORPUS / file), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, seq in entry["checks"]:
        feeds = make_inputs(entry, batch, seq, rng)
        (want,) = session.run(None, feeds)
        if batch > 1:  # a model whose output ignores its input would make this comparison empty
            assert np.abs(want[0] - want[1]).max() > 1e-3, "the fixture's output does not depend on its input"
        (got,) = program.run(feeds).values()
        assert got.shape == want.shape and got.dtype == want.dtype, (batch, seq)
        np.testing.assert_allclose(
            got, want, rtol=entry["tolerance"], atol=entry["tolerance"], err_msg=f"batch={batch} seq={seq}"
        )
