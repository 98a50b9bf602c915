"""Greedy generation with the compiled decoders of tiny random-weight GPT-2, Llama and Qwen2
(tests/fixtures/generation, exported with a KV cache by torch.onnx.export both ways) matches
transformers' `generate` token for token in float32, with prompts of mixed lengths joining the
running batch mid-run and the cache in small blocks, so that blocks, padding and batching all
bite; the one-token steps run the decode program that reads the paged cache in place. The
references were written by tests/fixtures/generation/export_generation_fixtures.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from compiler import compile_onnx, executable
from compiler.kv_layout import (
    decode_step_graph,
    decoder_dims,
    find_cache_layout,
    onnx_specs,
    paged_decode_graph,
)
from runtime.sampling import SamplingParams
from runtime.tokenizer import BUNDLE_FILES, TextCodec
from scheduler.generator import GenerationRequest, Generator, GeneratorLimits, TokenEvent

FIXTURES = Path(__file__).parent / "fixtures" / "generation"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())


class CaseEvents:
    """Each case's generator events as their sinks receive them; `wait` until every case finished."""

    def __init__(self, count: int) -> None:
        self.events: dict[int, list[TokenEvent]] = {i: [] for i in range(count)}
        self._finished = threading.Semaphore(0)

    def sink(self, i: int) -> Callable[[TokenEvent], None]:
        def take(event: TokenEvent) -> None:
            self.events[i].append(event)
            if event.finish_reason:
                self._finished.release()

        return take

    def wait(self, timeout: float) -> None:
        for _ in self.events:
            assert self._finished.acquire(timeout=timeout)

    def tokens(self, i: int) -> list[int]:
        return [e.token_id for e in self.events[i] if e.token_id is not None]


@cache
def compiled(arch: str, exporter: str):
    import onnx

    data = (
        FIXTURES / arch / ("optimum/model.onnx" if exporter == "optimum" else f"model_{exporter}.onnx")
    ).read_bytes()
    inputs, _ = onnx_specs(onnx.load_from_string(data))
    artifact = compile_onnx(data, "cpu", dims=decoder_dims(inputs))
    signature = artifact.signature
    layout = find_cache_layout(signature.inputs, signature.outputs)
    return executable(artifact), layout, {spec.name: spec.dtype for spec in signature.inputs}


@cache
def paged_decoder(arch: str, exporter: str):
    """The decode step's program reading the paged KV cache, as the worker compiles it for the
    CPU (worker.compile._as_paged_decode_step)."""
    import onnx

    model = onnx.load(
        str(FIXTURES / arch / ("optimum/model.onnx" if exporter == "optimum" else f"model_{exporter}.onnx"))
    )
    decode_step_graph(model)
    paged_decode_graph(model, find_cache_layout(*onnx_specs(model)))
    return executable(compile_onnx(model.SerializeToString(), "cpu"))


def codec_of(arch: str) -> TextCodec:
    return TextCodec.from_files(
        {
            name: (FIXTURES / arch / name).read_bytes()
            for name in BUNDLE_FILES
            if (FIXTURES / arch / name).exists()
        }
    )


# the exports whose one-token graph compiles paged (paged_decoder); llama's dynamo export does
# not compile at one token, paged or not (a Reshape of the repeated kv heads divides
# 32*batch*(past+1) by 8*(past+1), which the compiler cannot prove exact): the worker leaves
# its first program serving every step
PAGED = {("gpt2", "torchscript"), ("llama", "torchscript"), ("qwen2", "torchscript"), ("gpt2", "optimum")}


@pytest.mark.parametrize(
    "arch,exporter",
    [
        ("gpt2", "torchscript"),
        ("llama", "torchscript"),
        ("qwen2", "torchscript"),
        ("llama", "dynamo"),
        ("gpt2", "optimum"),
    ],
)
def test_greedy_generation_matches_transformers_token_for_token(arch: str, exporter: str) -> None:
    paged = (arch, exporter) in PAGED
    program, layout, dtypes = compiled(arch, exporter)
    steps: list[int] = []

    def run_step(inputs):
        started = time.perf_counter()
        outputs = program.run(inputs)
        if not paged:
            steps.append(inputs["input_ids"].shape[0])
        return outputs, time.perf_counter() - started

    def paged_step(inputs):
        started = time.perf_counter()
        outputs = paged_decoder(arch, exporter).run(inputs)
        steps.append(inputs["input_ids"].shape[0])
        return outputs, time.perf_counter() - started

    limits = GeneratorLimits(
        num_blocks=64, block_size=4, max_step_tokens=24, prefill_chunk=8, context_length=128
    )
    generator = Generator(
        layout, run_step, codec_of(arch), dtypes, limits, paged_step=paged_step if paged else None
    )
    cases = MANIFEST["models"][arch]["greedy"]
    collected = CaseEvents(len(cases))
    events = collected.events

    params = SamplingParams(max_tokens=32, temperature=0, min_tokens=32)
    try:
        # the first half starts; the rest join once the first has generated a few tokens
        half = len(cases) // 2
        for i, case in enumerate(cases[:half]):
            generator.submit(GenerationRequest(f"r{i}", case["prompt_ids"], params), collected.sink(i))
        deadline = time.monotonic() + 60
        while len(events[0]) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        for i, case in enumerate(cases[half:], start=half):
            generator.submit(GenerationRequest(f"r{i}", case["prompt_ids"], params), collected.sink(i))
        collected.wait(120)
        for i, case in enumerate(cases):
            got = collected.tokens(i)
            assert got == case["generated_ids"], f"prompt {case['prompt_ids']}"
            assert events[i][-1].finish_reason == "length"
        assert max(steps) > 1  # decodes did run batched
        assert generator.decoder.paged_steps == (len(steps) if paged else 0)  # on the paged program
        assert generator.free_blocks == limits.num_blocks
    finally:
        generator.close()


def test_generated_text_is_the_tokenizers_decoding_of_the_tokens() -> None:
    program, layout, dtypes = compiled("gpt2", "torchscript")
    codec = codec_of("gpt2")
    generator = Generator(
        layout,
        lambda inputs: (program.run(inputs), 0.0),
        codec,
        dtypes,
        GeneratorLimits(num_blocks=32, block_size=8, context_length=128),
    )
    case = MANIFEST["models"]["gpt2"]["greedy"][2]
    got: list[TokenEvent] = []
    done = threading.Event()

    def sink(event: TokenEvent) -> None:
        got.append(event)
        if event.finish_reason:
            done.set()

    try:
        generator.submit(
            GenerationRequest(
                "t",
                codec.encode(case["prompt_text"]),
                SamplingParams(max_tokens=32, temperature=0, min_tokens=32),
            ),
            sink,
        )
        assert done.wait(60)
        assert [e.token_id for e in got if e.token_id is not None] == case["generated_ids"]
        assert "".join(e.text for e in got) == codec.decode(case["generated_ids"])
    finally:
        generator.close()


def test_sampling_with_a_seed_reproduces_and_a_stop_string_ends_it() -> None:
    program, layout, dtypes = compiled("gpt2", "torchscript")
    codec = codec_of("gpt2")

    def generate(params: SamplingParams) -> list[TokenEvent]:
        generator = Generator(
            layout,
            lambda inputs: (program.run(inputs), 0.0),
            codec,
            dtypes,
            GeneratorLimits(num_blocks=32, block_size=8, context_length=128),
        )
        got: list[TokenEvent] = []
        done = threading.Event()

        def sink(event: TokenEvent) -> None:
            got.append(event)
            if event.finish_reason:
                done.set()

        try:
            generator.submit(GenerationRequest("s", codec.encode("Once upon a time"), params), sink)
            assert done.wait(60)
            return got
        finally:
            generator.close()

    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    first, again = generate(sampled), generate(sampled)
    assert [e.token_id for e in first] == [e.token_id for e in again]
    text = "".join(e.text for e in first)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    stopped = generate(
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True, stop=(stop,))
    )
    stopped_text = "".join(e.text for e in stopped)
    assert stopped[-1].finish_reason == "stop"
    assert stop not in stopped_text and text.startswith(stopped_text) and len(stopped_text) < len(text)
    assert np.isfinite(stopped[-1].usage.billed_seconds)
