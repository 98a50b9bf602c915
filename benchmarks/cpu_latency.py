"""Median latency of compiled programs against onnxruntime (and PyTorch, if installed).

    .venv/bin/python benchmarks/cpu_latency.py [--repeats 50]

Prints one row per (model, batch): medians in ms and the ratio luminal / onnxruntime.
Times are of the program alone (no HTTP), all measured in this run on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.demo import sample_mlp  # noqa: E402
from compiler import compile_onnx, executable  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def torch_runner(data: bytes):
    try:
        import torch  # noqa: F401
        from onnx2torch import convert  # type: ignore[import-not-found]
    except ImportError:
        return None
    import onnx

    module = convert(onnx.load_from_string(data)).eval()
    return lambda x: module(torch.from_numpy(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    models = {
        "demo-mlp": (sample_mlp().SerializeToString(), "features", (16,)),
        "torch-mlp": ((FIXTURES / "torch_mlp.onnx").read_bytes(), "input", (20,)),
        "torch-cnn": ((FIXTURES / "torch_cnn.onnx").read_bytes(), "input", (1, 12, 12)),
    }
    print(f"{'model':<11}{'batch':>6}{'luminal ms':>12}{'ort ms':>10}{'ratio':>8}{'torch ms':>10}")
    for name, (data, input_name, shape) in models.items():
        program = executable(compile_onnx(data))
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        session = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        torch_run = torch_runner(data)
        for batch in (1, 32):
            x = np.random.default_rng(0).standard_normal((batch, *shape)).astype(np.float32)
            ours = median_ms(lambda: program.run({input_name: x}), args.repeats)
            theirs = median_ms(lambda: session.run(None, {input_name: x}), args.repeats)
            torch_ms = f"{median_ms(lambda: torch_run(x), args.repeats):.3f}" if torch_run else "n/a"
            print(f"{name:<11}{batch:>6}{ours:>12.3f}{theirs:>10.3f}{ours / theirs:>8.2f}{torch_ms:>10}")


if __name__ == "__main__":
    main()
