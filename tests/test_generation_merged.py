"""optimum's merged decoder (a bool input use_cache_branch choosing with an If between the with-past
and the no-past decoders) served as text generation: the cache layout takes the input,
kv_layout.bind_cache_branch makes the graph its with-past branch before it is compiled (the first
step runs with zero-length past tensors), and the compiled programs, the prompts' and the decode
step's, generate transformers' greedy tokens; uploaded through the HTTP API it answers completions.
The fixture was written by tests/fixtures/generation/export_optimum_merged_gpt2.py."""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tests.test_generation_models as models
from compiler import compile_onnx, executable
from compiler.errors import UnsupportedModel
from compiler.kv_layout import (
    bind_cache_branch,
    decode_step_graph,
    decoder_dims,
    find_cache_layout,
    onnx_specs,
)
from registry.bundle import zip_bytes
from tests.test_generation_api import GREEDY, Live, live  # noqa: F401  (live: the module's server fixture)

MERGED = models.FIXTURES / "gpt2" / "optimum_merged"
CASES = models.MANIFEST["models"]["gpt2"]["greedy"]


def merged_model() -> onnx.ModelProto:
    return onnx.load(str(MERGED / "model.onnx"))


def test_the_cache_layout_takes_use_cache_branch_and_binding_it_leaves_the_with_past_decoder() -> None:
    model = merged_model()
    assert [node.op_type for node in model.graph.node] == ["If"]
    layout = find_cache_layout(*onnx_specs(model))
    assert layout.cache_branch_input == "use_cache_branch"
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.vocab) == (2, 4, 8, 320)
    assert (layout.mask_input, layout.position_input) == ("attention_mask", "position_ids")
    assert layout.to_json()["cache_branch_input"] == "use_cache_branch"

    assert bind_cache_branch(model)
    onnx.checker.check_model(model)
    inputs, outputs = onnx_specs(model)
    assert "use_cache_branch" not in {spec.name for spec in inputs}
    assert "If" not in {node.op_type for node in model.graph.node}
    bound = find_cache_layout(inputs, outputs)
    assert bound.cache_branch_input is None and bound.past_keys == layout.past_keys
    assert not bind_cache_branch(model)  # nothing left to bind


def _graph_reading_the_branch(op: str, dtype: int = TensorProto.BOOL) -> onnx.ModelProto:
    """input_ids and use_cache_branch in, `op` reading use_cache_branch."""
    one = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["chosen"])],
        "branch",
        [],
        [helper.make_tensor_value_info("chosen", TensorProto.INT64, None)],
    )
    if op == "If":
        node = helper.make_node("If", ["use_cache_branch"], ["out"], then_branch=one, else_branch=one)
    else:
        node = helper.make_node("Cast", ["use_cache_branch"], ["out"], to=TensorProto.INT64)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("use_cache_branch", dtype, [1]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.INT64, None)],
    )
    return helper.make_model(graph)


def test_a_use_cache_branch_that_is_no_bool_or_no_if_condition_is_refused_naming_it() -> None:
    with pytest.raises(UnsupportedModel, match="'use_cache_branch' .* must be a bool of shape \\[1\\]"):
        bind_cache_branch(_graph_reading_the_branch("If", TensorProto.INT64))
    with pytest.raises(UnsupportedModel, match="'use_cache_branch' is the condition of no If node"):
        bind_cache_branch(_graph_reading_the_branch("Cast"))
    model = _graph_reading_the_branch("If")
    assert bind_cache_branch(model)
    assert [node.op_type for node in model.graph.node] == ["Identity", "Identity"]
    # the decode step's graph binds it too
    model = _graph_reading_the_branch("If")
    assert decode_step_graph(model) and "use_cache_branch" not in {v.name for v in model.graph.input}


class _Phases:
    """The two programs the service compiles for a generative version: prompt chunks run the
    graph with its symbolic length, one-token steps the decode step's (both branch-bound)."""

    def __init__(self, prefill, decode) -> None:
        self.prefill, self.decode = prefill, decode
        self.decode_steps = 0

    def run(self, inputs):
        if inputs["input_ids"].shape[1] == 1:
            self.decode_steps += 1
            return self.decode.run(inputs)
        return self.prefill.run(inputs)


@cache
def compiled_merged():
    prefill_model, decode_model = merged_model(), merged_model()
    assert bind_cache_branch(prefill_model) and decode_step_graph(decode_model)
    programs = []
    for model in (prefill_model, decode_model):
        artifact = compile_onnx(model.SerializeToString(), "cpu", dims=decoder_dims(onnx_specs(model)[0]))
        assert "use_cache_branch" not in {spec.name for spec in artifact.signature.inputs}
        programs.append((executable(artifact), artifact.signature))
    (prefill, signature), (decode, _) = programs
    layout = find_cache_layout(signature.inputs, signature.outputs)
    return _Phases(prefill, decode), layout, {spec.name: spec.dtype for spec in signature.inputs}


def test_the_compiled_merged_decoder_generates_transformers_greedy_tokens(monkeypatch) -> None:
    program, _, _ = compiled_merged()
    # the prompt's first chunk runs the with-past branch with past tensors of length 0
    ids = np.array([CASES[2]["prompt_ids"]], np.int64)
    empty = np.zeros((1, 4, 0, 8), np.float32)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
        **{f"past_key_values.{i}.{part}": empty for i in range(2) for part in ("key", "value")},
    }
    logits = program.prefill.run(feeds)["logits"]
    assert int(np.argmax(logits[0, -1])) == CASES[2]["generated_ids"][0]
    # the batched, block-paged greedy test of the other exports, with this decoder's two programs
    before = program.decode_steps
    monkeypatch.setattr(models, "compiled", lambda arch, exporter: compiled_merged())
    models.test_greedy_generation_matches_transformers_token_for_token("gpt2", "optimum_merged")
    assert program.decode_steps > before


def test_an_uploaded_merged_decoder_answers_completions(live: Live) -> None:  # noqa: F811
    files = {path.name: path.read_bytes() for path in MERGED.iterdir() if path.is_file()}
    reply = live.upload(
        "merged-gpt2", {"file": ("merged.zip", zip_bytes(files), "application/zip")}, {"task": "text-generation"}
    )
    assert reply.status_code == 202, reply.text
    version = live.wait_ready("merged-gpt2")
    assert version["status"] == "ready", version
    assert version["report"]["decode_phase"]["chosen"], version["report"].get("decode_phase")
    for case in CASES[1:3]:
        answer = live.ai.completions.create(model="merged-gpt2", prompt=case["prompt_text"], **GREEDY)
        assert answer.choices[0].text == models.codec_of("gpt2").decode(case["generated_ids"])
        assert answer.usage.completion_tokens == 32
