"""Median latency of compiled programs against onnxruntime (and PyTorch, if installed).

    .venv/bin/python benchmarks/cpu_latency.py [--repeats 50]

Prints one row per (model, batch): medians in ms and the ratio luminal / onnxruntime (its default
session options), the runtimes taking turns (interleaved_medians_ms). Times are of the program
alone (no HTTP), all measured in this run on this machine. Besides the
small MLPs and CNN, it runs transformers models of the export corpus (tests/fixtures/hf) at
sequence length 32, the models the search compiler measures itself on.
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

from api.demo import sample_mlp
from compiler import compile_onnx, executable
from tests.hf_corpus import CORPUS, exported, make_inputs

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
CORPUS_MODELS = ("bert_dynamo", "gpt2_dynamo", "llama_dynamo", "vit_dynamo", "resnet_dynamo", "whisper_encoder_dynamo")
CORPUS_SEQ = 32


def interleaved_rounds_ms(
    runners: dict, repeats: int, rounds: int = 5, settle_s: float = 0.25, min_seconds: float = 0.0
) -> dict[str, list[list[float]]]:
    """Each runner's times in ms, round by round: the runners take turns in blocks of
    repeats/rounds runs (the order rotating every round), so that a shared machine's slow spells
    fall on all of them alike; before each block, settle_s of idle (the other runtime's threads
    spin-wait for work a while after its last run) and one untimed run (its caches after the
    other's). Quick runners repeat more, until each runner's timed runs last about min_seconds."""
    slowest = 0.0
    for fn in runners.values():
        for _ in range(3):
            started = time.perf_counter()
            fn()
            slowest = max(slowest, time.perf_counter() - started)
    names = list(runners)
    per_round = max(1, -(-repeats // rounds), int(min_seconds / rounds / max(slowest, 1e-6)))
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for round_number in range(rounds):
        for name in names[round_number % len(names):] + names[: round_number % len(names)]:
            time.sleep(settle_s)
            runners[name]()
            block = []
            for _ in range(per_round):
                started = time.perf_counter()
                runners[name]()
                block.append((time.perf_counter() - started) * 1000)
            times[name].append(block)
    return times


def interleaved_medians_ms(
    runners: dict, repeats: int, rounds: int = 5, settle_s: float = 0.25, min_seconds: float = 0.0
) -> dict[str, float]:
    """Each runner's median time in ms over all its rounds (interleaved_rounds_ms)."""
    times = interleaved_rounds_ms(runners, repeats, rounds, settle_s, min_seconds)
    return {name: statistics.median(t for block in blocks for t in block) for name, blocks in times.items()}


def paired_ratio(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """The median over the rounds of the ratio of two runners' medians in that round: a slow spell
    that falls on one runner's block moves that round's ratio, not the whole comparison."""
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(ours, theirs, strict=True))


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
        import torch
        from onnx2torch import convert  # type: ignore[import-not-found]
    except ImportError:
        return None
    import onnx

    module = convert(onnx.load_from_string(data)).eval()
    return lambda x: module(torch.from_numpy(x))


def float_input(name: str, shape: tuple[int, ...]):
    def feeds(batch: int) -> dict[str, np.ndarray]:
        return {name: np.random.default_rng(0).standard_normal((batch, *shape)).astype(np.float32)}

    return feeds


def corpus_input(entry: dict):
    def feeds(batch: int) -> dict[str, np.ndarray]:
        return make_inputs(entry, batch, CORPUS_SEQ, np.random.default_rng(0))

    return feeds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    models = {
        "demo-mlp": (sample_mlp().SerializeToString(), float_input("features", (16,)), (1, 32)),
        "torch-mlp": ((FIXTURES / "torch_mlp.onnx").read_bytes(), float_input("input", (20,)), (1, 32)),
        "torch-cnn": ((FIXTURES / "torch_cnn.onnx").read_bytes(), float_input("input", (1, 12, 12)), (1, 32)),
    }
    for entry in exported():
        name = entry["file"].removesuffix(".onnx")
        if name in CORPUS_MODELS:
            models[name.removesuffix("_dynamo")] = ((CORPUS / entry["file"]).read_bytes(), corpus_input(entry), (1, 8))
    print(f"{'model':<16}{'batch':>6}{'luminal ms':>12}{'ort ms':>10}{'ratio':>8}{'torch ms':>10}")
    for name, (data, feeds_for, batches) in models.items():
        program = executable(compile_onnx(data))
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        torch_run = torch_runner(data)
        for batch in batches:
            feeds = feeds_for(batch)
            runners = {"ours": lambda p=program, f=feeds: p.run(f), "ort": lambda s=session, f=feeds: s.run(None, f)}
            if torch_run:
                runners["torch"] = lambda t=torch_run, f=feeds: t(*f.values())
            medians = interleaved_medians_ms(runners, args.repeats, settle_s=0.1, min_seconds=0.3)
            ours, theirs = medians["ours"], medians["ort"]
            torch_ms = f"{medians['torch']:.3f}" if "torch" in medians else "n/a"
            print(f"{name:<16}{batch:>6}{ours:>12.3f}{theirs:>10.3f}{ours / theirs:>8.2f}{torch_ms:>10}", flush=True)


if __name__ == "__main__":
    main()
