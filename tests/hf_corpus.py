"""The Hugging Face export corpus (tests/fixtures/hf): its manifest, and inputs for each model.

tests/fixtures/export_hf_fixtures.py writes the ONNX files and manifest.json; the test suite and
benchmarks/hf_corpus.py read them here, without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).parent / "fixtures" / "hf"
# the architectures users deploy most, as the fixture script names them; "a|b" means either
REQUIRED = (
    "bert", "distilbert", "roberta", "albert", "electra", "t5_encoder", "clip_text",
    "gpt2", "gpt_neox|opt", "llama", "mistral|qwen2",
    "vit", "convnext", "resnet", "mobilenet_v2", "whisper_encoder",
)


def manifest() -> list[dict]:
    return json.loads((CORPUS / "manifest.json").read_text())


def exported() -> list[dict]:
    """Entries whose export succeeded, in manifest order."""
    return [entry for entry in manifest() if entry["file"]]


def make_inputs(entry: dict, batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random token ids below the vocabulary size, masks where row i has i % seq trailing zeros
    (the first token always attended), and standard normal floats."""
    sizes = {"batch": batch, "seq": seq}
    feeds = {}
    for name, spec in entry["inputs"].items():
        shape = [sizes.get(d, d) for d in spec["shape"]]
        if spec["kind"] == "ids":
            feeds[name] = rng.integers(0, spec["high"], shape, dtype=np.int64)
        elif spec["kind"] == "mask":
            lengths = seq - np.arange(batch) % seq
            feeds[name] = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        else:
            feeds[name] = rng.standard_normal(shape).astype(spec["dtype"])
    return feeds
