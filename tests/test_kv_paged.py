"""The decode program reads the paged KV cache in place (compiler.kv_layout.paged_decode_graph):
the rewritten graph, run by onnxruntime on pools and slots, gives what the graph as exported
gives on the gathered past; the worker compiles it for the CPU and the service runs it for
the one-token steps it measures faster on; a graph whose present is not a Concat of the past and the new tokens is
refused naming the output, and its versions decode through the program that takes the past
whole."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import helper

from cloud.storage import LocalObjectStore, load_artifact
from compiler import Artifact, compile_onnx, executable
from compiler.errors import UnsupportedModel
from compiler.kv_layout import (
    KV_SLOTS,
    decode_step_graph,
    decoder_dims,
    find_cache_layout,
    onnx_specs,
    paged_decode_graph,
    pool_input,
)
from compiler.targets import EXPORTED
from runtime.kv_cache import HostKVStorage
from runtime.sampling import SamplingParams
from scheduler.generator import GenerationRequest, Generator, GeneratorLimits, TokenEvent
from tests.test_generation_core import DTYPES, LAYOUT, FakeCodec, toy_decoder, toy_paged_decoder
from tests.test_generation_models import CaseEvents, codec_of
from worker.compile import _decode_phase, compile_here

FIXTURES = Path(__file__).parent / "fixtures" / "generation"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
GRAPHS = [
    "gpt2/model_torchscript.onnx",
    "gpt2/model_dynamo.onnx",
    "llama/model_torchscript.onnx",
    "llama/model_dynamo.onnx",
    "qwen2/model_torchscript.onnx",
    "gpt2/optimum/model.onnx",
    "gpt2/optimum_merged/model.onnx",
]


def decode_graphs(path: str):
    """The decode step's graph as exported, its paged form, and the cache layout."""
    exported = onnx.load(str(FIXTURES / path))
    decode_step_graph(exported)
    layout = find_cache_layout(*onnx_specs(exported))
    paged = onnx.load(str(FIXTURES / path))
    decode_step_graph(paged)
    paged_decode_graph(paged, layout)
    return exported, paged, layout


@pytest.mark.parametrize("path", GRAPHS)
def test_the_paged_graph_gives_the_logits_and_new_keys_and_values_of_the_exported_one(path: str) -> None:
    import onnxruntime

    exported, paged, layout = decode_graphs(path)
    onnx.checker.check_model(paged)
    rng = np.random.default_rng(3)
    batch, width, pool_slots = 3, 6, 40
    pools = {
        pool_input(layer, part): rng.standard_normal((pool_slots, layout.kv_heads, layout.head_dim)).astype(
            np.float32
        )
        for layer in range(layout.layers)
        for part in ("key", "value")
    }
    lengths = [6, 2, 4]  # rows of different pasts: left padding, masked, at slot 0
    slots = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width + 1), np.int64)
    for row, length in enumerate(lengths):
        slots[row, width - length :] = rng.choice(pool_slots, length, replace=False)
        mask[row, width - length :] = 1
    tokens = {
        "input_ids": rng.integers(0, layout.vocab, (batch, 1)),
        "attention_mask": mask,
        "position_ids": np.array(lengths, np.int64)[:, None],
    }
    declared = {value.name for value in exported.graph.input}
    tokens = {name: value for name, value in tokens.items() if name in declared}
    gathered = dict(tokens)
    for layer in range(layout.layers):
        gathered[layout.past_keys[layer]] = pools[pool_input(layer, "key")][slots].transpose(0, 2, 1, 3)
        gathered[layout.past_values[layer]] = pools[pool_input(layer, "value")][slots].transpose(0, 2, 1, 3)

    def run(model, inputs):
        session = onnxruntime.InferenceSession(model.SerializeToString())
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))

    expected = run(exported, gathered)
    got = run(paged, {**tokens, **pools, KV_SLOTS: slots})
    assert {value.name for value in paged.graph.input} == set(tokens) | set(pools) | {KV_SLOTS}
    np.testing.assert_allclose(got["logits"], expected["logits"], rtol=1e-5, atol=1e-5)
    for name in (*layout.present_keys, *layout.present_values):
        assert got[name].shape == (batch, layout.kv_heads, 1, layout.head_dim)
        np.testing.assert_allclose(got[name], expected[name][:, :, -1:], rtol=1e-5, atol=1e-5)


def not_a_concat() -> onnx.ModelProto:
    """The tiny GPT-2 with layer 1's present value made by a Mul by one after its Concat: the
    same values, a graph paged_decode_graph cannot page."""
    model = onnx.load(str(FIXTURES / "gpt2/model_torchscript.onnx"))
    graph = model.graph
    for node in graph.node:  # the Concat and its readers under another name
        node.input[:] = ["present.1.value/concat" if n == "present.1.value" else n for n in node.input]
        node.output[:] = ["present.1.value/concat" if n == "present.1.value" else n for n in node.output]
    graph.initializer.append(helper.make_tensor("one", onnx.TensorProto.FLOAT, [], [1.0]))
    graph.node.append(helper.make_node("Mul", ["present.1.value/concat", "one"], ["present.1.value"]))
    return model


def test_a_present_that_is_not_a_concat_of_the_past_is_refused_naming_it() -> None:
    model = not_a_concat()
    decode_step_graph(model)
    layout = find_cache_layout(*onnx_specs(model))
    with pytest.raises(UnsupportedModel, match="output 'present.1.value' is made by a Mul"):
        paged_decode_graph(model, layout)
    swapped = onnx.load(str(FIXTURES / "gpt2/model_torchscript.onnx"))
    concat = next(node for node in swapped.graph.node if "present.0.value" in node.output)
    concat.input[:] = [concat.input[1], concat.input[0]]
    with pytest.raises(UnsupportedModel, match="output 'present.0.value' is a Concat whose first operand"):
        paged_decode_graph(swapped, layout)


def generate(
    model: onnx.ModelProto, run_step, paged_step, limits: GeneratorLimits, cases: list[dict]
) -> tuple[dict[int, list[int]], Generator]:
    """Each case's greedy tokens from a Generator over the programs, all submitted at once."""
    generator = Generator(
        find_cache_layout(*onnx_specs(model)),
        run_step,
        codec_of("gpt2"),
        {spec.name: spec.dtype for spec in onnx_specs(model)[0]},
        limits,
        paged_step=paged_step,
    )
    collected = CaseEvents(len(cases))

    params = SamplingParams(max_tokens=32, temperature=0, min_tokens=32)
    try:
        for i, case in enumerate(cases):
            generator.submit(GenerationRequest(f"r{i}", case["prompt_ids"], params), collected.sink(i))
        collected.wait(120)
    finally:
        generator.close()
    return {i: collected.tokens(i) for i in range(len(cases))}, generator


@pytest.mark.parametrize("pageable", [True, False], ids=["paged", "refused"])
def test_the_worker_compiles_a_paged_decode_program_or_keeps_the_gathered_one(
    tmp_path, pageable: bool
) -> None:
    model = onnx.load(str(FIXTURES / "gpt2/model_torchscript.onnx")) if pageable else not_a_concat()
    store = LocalObjectStore(tmp_path)
    store.put("graph", model.SerializeToString())
    version = SimpleNamespace(id=1, target="cpu", bundle={}, graph_key="graph", precision=EXPORTED)
    keys, report = _decode_phase(version, store, "program", compile_here)
    assert report["chosen"], report
    assert keys["decode_artifact_key"] == "program-decode"  # the gathered one, always
    assert keys["decode_one_key"] == "program-decode-one" and report["one_sequence"]["chosen"]
    if pageable:
        assert keys["decode_paged_key"] == "program-decode-paged" and report["paged"]["chosen"]
        assert "paged_refused" not in report
    else:
        assert "decode_paged_key" not in keys and report["paged"] is False
        assert "'present.1.value'" in report["paged_refused"]
    decode_key = keys.get("decode_paged_key", keys["decode_artifact_key"])
    decode = executable(load_artifact(store, decode_key, Artifact.from_files))
    prefill = executable(
        compile_onnx(model.SerializeToString(), "cpu", dims=decoder_dims(onnx_specs(model)[0]))
    )
    decode_steps: list[int] = []

    def run_step(inputs):
        # as the service runs an unpaged decode program: one-token steps on it, prompts on the first
        one_token = inputs["input_ids"].shape[1] == 1
        if one_token:
            decode_steps.append(1)
        return (decode if one_token else prefill).run(inputs), 0.0

    def paged_step(inputs):
        pool = inputs[pool_input(0, "key")]
        assert pool.base is not None  # a view of the cache, not a copy
        return decode.run(inputs), 0.0

    limits = GeneratorLimits(
        num_blocks=64, block_size=4, max_step_tokens=24, prefill_chunk=8, context_length=128
    )
    cases = MANIFEST["models"]["gpt2"]["greedy"]
    tokens, generator = generate(model, run_step, paged_step if pageable else None, limits, cases)
    for i, case in enumerate(cases):
        assert tokens[i] == case["generated_ids"], f"prompt {case['prompt_ids']}"
    assert (generator.decoder.paged_steps > 0) == pageable
    assert bool(decode_steps) != pageable  # a paged program serves every one-token step
    assert generator.free_blocks == limits.num_blocks  # every block back in the pool
    # the one-sequence program: its inputs' batch is 1, and a stream alone decodes on it
    one = load_artifact(store, keys["decode_one_key"], Artifact.from_files)
    assert [spec.shape[0] for spec in one.signature.inputs] == [1] * len(one.signature.inputs)
    one_sequence = executable(one)

    def run_one(inputs):
        return (one_sequence if inputs["input_ids"].shape[1] == 1 else prefill).run(inputs), 0.0

    alone, generator = generate(model, run_one, None, limits, cases[:1])
    assert alone[0] == cases[0]["generated_ids"]


class ToyRuntime:
    """A runtime stand-in: the key "decode" runs the toy paged decoder, any other the toy decoder
    with the past gathered; each run's key and new-token count is noted in `ran`.
    `exec_seconds(key)`, when given, is the device time it reports."""

    def __init__(self, exec_seconds: Callable[[str], float] | None = None) -> None:
        self.ran: list[tuple[str, int]] = []
        self.exec_seconds = exec_seconds

    def signature(self, key):
        return SimpleNamespace(
            inputs=[SimpleNamespace(name=name, dtype=dtype) for name, dtype in DTYPES.items()]
        )

    def kv_storage(self, layout, pool_slots):
        return HostKVStorage(layout, pool_slots)

    def run_batch(self, key, requests, rows):
        inputs = requests[0]
        assert (key == "decode") == (KV_SLOTS in inputs), key
        self.ran.append((key, inputs["input_ids"].shape[1]))
        outputs, seconds = (toy_paged_decoder if key == "decode" else toy_decoder)(inputs)
        return SimpleNamespace(
            outputs=[outputs], exec_seconds=self.exec_seconds(key) if self.exec_seconds else seconds
        )


def toy_service(runtime: ToyRuntime):
    """A GenerationService on `runtime` with a cache of 64 blocks of 4 tokens."""
    from scheduler.generating import GenerationService, GenerationSettings
    from scheduler.observer import NO_OBSERVER

    settings = GenerationSettings(kv_cache_bytes=64 * LAYOUT.block_bytes(4), block_tokens=4)
    return GenerationService(
        {"cpu": runtime}, lambda bundle: FakeCodec(), None, {"cpu": 1.0}, settings, NO_OBSERVER
    )


def toy_route(**programs: str) -> SimpleNamespace:
    """A version whose general program is "prefill", with the bundle's decode programs `programs`."""
    return SimpleNamespace(
        version_id=1,
        target="cpu",
        artifact_key="prefill",
        model_name="m",
        version=1,
        tenant_id=7,
        tenant_name="t",
        bundle={"layout": LAYOUT.to_json(), "context_length": 512, **programs},
    )


def test_the_service_runs_one_token_steps_on_the_paged_decode_program_or_a_gathered_one() -> None:
    """Each one-token step runs on whichever measures fastest (ProgramChooser tries each): the
    paged program with the pools and kv_slots, the gathered decode program and the general one
    with the past gathered."""
    runtime = ToyRuntime()
    service = toy_service(runtime)
    route = toy_route(decode_paged_key="decode", decode_artifact_key="gathered")
    finished = threading.Event()
    tokens: list[int] = []

    def sink(event: TokenEvent) -> None:
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason:
            finished.set()

    try:
        service.start(
            route, GenerationRequest("a", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0)), sink
        )
        assert finished.wait(10)
        prompt = [5, 6, 7]
        for token in tokens:  # toy_decoder's next token: the sum of the tokens and the position
            assert token == (sum(prompt) + len(prompt) - 1) % 97
            prompt.append(token)
        ran = runtime.ran
        # every one-token program is tried: the paged one, the gathered decode one, the general one
        assert (
            ("prefill", 3) in ran
            and ("decode", 1) in ran
            and ("prefill", 1) in ran
            and ("gathered", 1) in ran
        )
        assert all(tokens_fed == 1 for key, tokens_fed in ran if key == "decode")
        assert service.free_blocks(1) == 64
    finally:
        service.close()


def test_the_choice_counts_the_gather_that_only_the_gathered_programs_need(monkeypatch) -> None:
    """The general program runs faster than the paged one, but its step first gathers the past
    out of the pools (slow here): the paged program wins the one-token steps."""
    from runtime.kv_cache import PagedKVCache

    slow_gather = PagedKVCache.gather

    def gather(self, *args, **kwargs):
        time.sleep(0.01)
        return slow_gather(self, *args, **kwargs)

    monkeypatch.setattr(PagedKVCache, "gather", gather)
    runtime = ToyRuntime(lambda key: 0.003 if key == "decode" else 0.002)
    service = toy_service(runtime)
    finished = threading.Event()
    try:
        service.start(
            toy_route(decode_paged_key="decode"),
            GenerationRequest("a", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0)),
            lambda event: finished.set() if event.finish_reason else None,
        )
        assert finished.wait(10)
        ran = [key for key, tokens_fed in runtime.ran if tokens_fed == 1]
        assert ran[:6].count("decode") == 3 and ran[:6].count("prefill") == 3  # each tried
        assert set(ran[6:]) == {"decode"}, ran
    finally:
        service.close()


def test_a_bfloat16_cache_is_read_from_float32_pools_as_the_runtime_holds_it() -> None:
    """runtime.kv_cache holds a bfloat16 cache in float32: the pools are declared so, and cast."""
    bf16 = onnx.TensorProto.BFLOAT16
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["new"], to=bf16),
        helper.make_node("Unsqueeze", ["new", "axes"], ["new4"]),
        helper.make_node("Expand", ["new4", "shape"], ["new_kv"]),
        *(
            helper.make_node("Concat", [f"past_key_values.0.{part}", "new_kv"], [f"present.0.{part}"], axis=2)
            for part in ("key", "value")
        ),
        helper.make_node("Cast", ["input_ids"], ["ids_float"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_float", "last"], ["logits"]),
    ]
    past = ["batch", 1, "past", 2]
    graph = helper.make_graph(
        nodes,
        "bf16",
        [
            helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"]),
            *(helper.make_tensor_value_info(f"past_key_values.0.{p}", bf16, past) for p in ("key", "value")),
        ],
        [
            helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "seq", 1]),
            *(
                helper.make_tensor_value_info(f"present.0.{p}", bf16, ["batch", 1, "total", 2])
                for p in ("key", "value")
            ),
        ],
        [
            helper.make_tensor("axes", onnx.TensorProto.INT64, [2], [1, 3]),
            helper.make_tensor("shape", onnx.TensorProto.INT64, [4], [1, 1, 1, 2]),
            helper.make_tensor("last", onnx.TensorProto.INT64, [1], [2]),
        ],
    )
    model = helper.make_model(graph)
    decode_step_graph(model)
    paged_decode_graph(model, find_cache_layout(*onnx_specs(model)))
    inputs, outputs = onnx_specs(model)
    types = {spec.name: (spec.dtype, tuple(map(str, spec.shape))) for spec in (*inputs, *outputs)}
    assert types[pool_input(0, "key")] == ("float32", ("kv_pool_slots", "1", "2"))
    assert types[KV_SLOTS] == ("int64", ("batch", "past"))
    assert types["present.0.value"] == ("bfloat16", ("batch", "1", "1", "2"))
    casts = [
        node for node in model.graph.node if node.op_type == "Cast" and node.input[0].startswith("kv_pool.")
    ]
    assert len(casts) == 2 and all(node.attribute[0].i == bf16 for node in casts)
