"""optimum's merged decoder (a bool input use_cache_branch choosing with an If between the with-past
and the no-past decoders) served as text generation: the cache layout takes the input,
kv_layout.bind_cache_branch makes the graph its with-past branch before it is compiled (the first
step runs with zero-length past tensors), and the compiled programs, the prompts' and the decode
step's, generate transformers' greedy tokens; uploaded through the HTTP API it answers completions.
A merged decoder whose with-past branch disagrees with its no-past branch on a prompt of several
tokens (optimum 1.x's default --legacy merge: the with-past branch traced at one new token, no
causal mask) is refused at upload (registry.bundle.check_merged_branches), naming the problem.
The fixtures were written by tests/fixtures/generation/export_optimum_merged_gpt2.py (the broken
one with --optimum-defaults)."""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import tests.test_generation_models as models
from cloud.errors import InvalidModelFile
from compiler import compile_onnx, executable
from compiler.errors import UnsupportedModel
from compiler.kv_layout import (
    bind_cache_branch,
    decode_step_graph,
    decoder_dims,
    find_cache_layout,
    onnx_specs,
)
from registry import bundle as bundles
from registry.bundle import Bundle, check_generative, check_merged_branches, zip_bytes
from tests.test_generation_api import GREEDY, Live, live  # noqa: F401  (live: the module's server fixture)

MERGED = models.FIXTURES / "gpt2" / "optimum_merged"
# optimum 1.x's default merged export: its with-past branch has no causal mask past one new token
ONE_TOKEN = models.FIXTURES / "gpt2" / "optimum_merged_one_token"
REFUSAL = "with-past branch .* gives a different 'logits' from its no-past branch for a prompt of 5 tokens"
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
        "merged-gpt2",
        {"file": ("merged.zip", zip_bytes(files), "application/zip")},
        {"task": "text-generation"},
    )
    assert reply.status_code == 202, reply.text
    version = live.wait_ready("merged-gpt2")
    assert version["status"] == "ready", version
    assert version["report"]["decode_phase"]["chosen"], version["report"].get("decode_phase")
    for case in CASES[1:3]:
        answer = live.ai.completions.create(model="merged-gpt2", prompt=case["prompt_text"], **GREEDY)
        assert answer.choices[0].text == models.codec_of("gpt2").decode(case["generated_ids"])
        assert answer.usage.completion_tokens == 32


def one_token_model() -> onnx.ModelProto:
    return onnx.load(str(ONE_TOKEN / "model.onnx"))


def _bundle_files(graph: bytes) -> dict[str, bytes]:
    """optimum_merged's bundle (tokenizer, configs) with `graph` as its model.onnx."""
    files = {path.name: path.read_bytes() for path in MERGED.iterdir() if path.is_file()}
    return {**files, "model.onnx": graph}


def test_binding_use_cache_branch_to_false_leaves_the_no_past_decoder() -> None:
    model = merged_model()
    branch = next(node for node in model.graph.node if node.op_type == "If")
    else_ops = [node.op_type for node in next(a.g for a in branch.attribute if a.name == "else_branch").node]
    assert bind_cache_branch(model, False)
    onnx.checker.check_model(model)
    assert [node.op_type for node in model.graph.node] == else_ops
    flag = next(t for t in model.graph.initializer if t.name == "use_cache_branch")
    assert onnx.numpy_helper.to_array(flag).tolist() == [False]
    assert "use_cache_branch" not in {v.name for v in model.graph.input}


def test_the_good_merged_decoders_branches_agree_on_a_prompt() -> None:
    model = merged_model()
    measured = check_merged_branches(model, find_cache_layout(*onnx_specs(model)))
    assert measured["runner"] == "onnxruntime" and measured["tokens"] == 5
    assert measured["max_abs_logit_difference"] < 1e-4 and measured["max_abs_present_difference"] < 1e-4
    files = _bundle_files((MERGED / "model.onnx").read_bytes())
    kept = check_generative(
        MERGED / "model.onnx", Bundle({k: v for k, v in files.items() if k != "model.onnx"})
    )
    assert kept["layout"]["cache_branch_input"] == "use_cache_branch"
    assert kept["cache_branch_check"]["max_abs_logit_difference"] < 1e-4


def test_a_merged_decoder_traced_at_one_new_token_is_refused_naming_the_problem() -> None:
    model = one_token_model()
    layout = find_cache_layout(*onnx_specs(model))
    assert layout.cache_branch_input == "use_cache_branch" and layout.position_input is None
    with pytest.raises(InvalidModelFile, match=REFUSAL) as refused:
        check_merged_branches(model, layout)
    message = str(refused.value)
    for words in (
        "wrong text for any prompt of 2 or more tokens",
        "traces the with-past decoder at one new token",
        "without a causal mask",
        "without --legacy",
        "traced at the full sequence length",
    ):
        assert words in message, message
    bundle = Bundle({k: v for k, v in _bundle_files(b"").items() if k != "model.onnx"})
    with pytest.raises(InvalidModelFile, match=REFUSAL):
        check_generative(ONE_TOKEN / "model.onnx", bundle)


def test_without_onnxruntime_the_reference_interpreter_runs_the_bound_branches(monkeypatch) -> None:
    def unrunnable(*args):
        raise bundles._Unrunnable("onnxruntime: not here")

    monkeypatch.setattr(bundles, "_run_onnxruntime", unrunnable)
    model = merged_model()
    measured = check_merged_branches(model, find_cache_layout(*onnx_specs(model)))
    assert measured["runner"] == "reference" and measured["max_abs_logit_difference"] < 1e-4
    model = one_token_model()
    with pytest.raises(InvalidModelFile, match=REFUSAL):
        check_merged_branches(model, find_cache_layout(*onnx_specs(model)))
    # neither runner: refused, never served unchecked
    monkeypatch.setattr(bundles, "_run_reference", unrunnable)
    with pytest.raises(InvalidModelFile, match="could not be checked: .* onnxruntime: not here"):
        check_merged_branches(model, find_cache_layout(*onnx_specs(model)))


def test_an_uploaded_merged_decoder_traced_at_one_new_token_is_refused(live: Live) -> None:  # noqa: F811
    files = _bundle_files((ONE_TOKEN / "model.onnx").read_bytes())
    reply = live.upload(
        "merged-one-token",
        {"file": ("merged.zip", zip_bytes(files), "application/zip")},
        {"task": "text-generation"},
    )
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "gives a different 'logits' from its no-past branch" in message and "--legacy" in message, message
    assert live.http.get("/v1/models/merged-one-token").status_code == 404


def test_the_gateways_checker_child_runs_the_generative_checks() -> None:
    """The branch check runs the uploaded graph: it runs in the gateway's checker child (memory and
    time limits; a runner that dies takes the child down, not the gateway), which answers what the
    version keeps, or the refusal."""
    from registry.checks import CheckInChild

    check = CheckInChild(memory_bytes=4 * 1024**3)
    bundle = Bundle({k: v for k, v in _bundle_files(b"").items() if k != "model.onnx"})
    kept = check(MERGED / "model.onnx", bundle)
    assert kept["layout"]["cache_branch_input"] == "use_cache_branch"
    assert kept["cache_branch_check"]["max_abs_logit_difference"] < 1e-4
    with pytest.raises(InvalidModelFile, match=REFUSAL):
        check(ONE_TOKEN / "model.onnx", bundle)
    assert check(MERGED / "model.onnx") is None  # an inference upload: the graph's check alone
