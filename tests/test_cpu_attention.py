"""Attention as one C kernel with online softmax (compiler.render.c, CRenderer.attention): the
program with its attention fused by the rules, rendered, built and run natively, computes what the
reference interpreter does; a compile offers it to the race beside the unfused program, and the
report says so."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from compiler import compile_onnx, executable
from compiler.backends import native_cpu
from compiler.frontends.onnx import load_graph
from compiler.kernels.attention import attention_count, fuse_attention
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import AttentionCall
from compiler.kernels.lower import lower
from compiler.reference import run_graph
from compiler.render.c import ATTENTION_HEAD_MAX, ATTENTION_ROWS, render
from compiler.search.cpu_schedules import NAME, NAME_ATTENTION
from compiler.search.extract import search_graph
from tests.hf_corpus import CORPUS, exported, make_inputs
from tests.test_cuda_attention import _attention, _inputs, grouped_attention


def _fused_native(data: bytes):
    """(the graph, its program with the attention fused, built and loaded natively)."""
    graph = load_graph(data)
    fused = fuse_attention(fuse(lower(graph, use_gemm=True)), ATTENTION_HEAD_MAX)
    assert attention_count(fused) == 1
    library = native_cpu.build(render(fused))
    return graph, native_cpu.NativeProgram(native_cpu.describe(fused, graph.size_limits), fused.weights, library)


@pytest.mark.parametrize(
    ("head", "width", "mask", "sizes"),
    [
        # ragged tiles of keys (64 a tile) and blocks of query rows, a last block of fewer rows
        (64, 64, "additive", [(1, 45), (2, 70), (1, ATTENTION_ROWS * 2 + 35)]),
        (8, 40, "additive", [(2, 33)]),  # V's rows not whole vectors: staged
        (24, 16, "additive", [(3, 100)]),  # a head that is not a whole vector
        (ATTENTION_HEAD_MAX, 96, "none", [(1, 40)]),  # the widest head the kernel holds
        (32, 32, "causal", [(1, 50), (2, 7)]),  # the masking loop folded into the score
    ],
)
def test_fused_attention_in_c_computes_what_the_reference_does(head: int, width: int, mask: str, sizes) -> None:
    data = _attention(head, width, mask=mask)
    graph, program = _fused_native(data)
    for seed, (batch, seq) in enumerate(sizes):
        inputs = _inputs(graph, batch, seq, seed)
        want = run_graph(graph, inputs)["y"]
        np.testing.assert_allclose(program.run(inputs)["y"], want, rtol=1e-4, atol=1e-5, err_msg=f"batch={batch} seq={seq}")


def test_rows_whose_keys_are_masked_out_first_or_entirely_are_what_the_reference_makes_them() -> None:
    # batch 0's first key tile holds only -inf: the running max starts past it and the row stays
    # finite; batch 1 is masked entirely: NaN, as the unfused softmax (0/0) and the reference give
    batch, seq = 2, 150
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[0, ..., :100] = -np.inf
    mask[1] = -np.inf
    graph, program = _fused_native(_attention(16))
    inputs = _inputs(graph, batch, seq, mask=mask)
    want = run_graph(graph, inputs)["y"]
    got = program.run(inputs)["y"]
    assert np.isfinite(got[0]).all() and np.isnan(want[1]).all() and np.isnan(got[1]).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def safe_softmax_attention(head: int) -> bytes:
    """_attention's additive-mask graph with the softmax torch exports (its dynamo exporter's
    safe softmax): where(isnan(p), 0, p), normalized before the product with V, so that a row
    masked out entirely is zeros rather than NaN."""
    model = onnx.load_from_string(_attention(head))
    nodes = []
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[0] == "p":
            node.input[0] = "p_safe"
            nodes += [
                helper.make_node("IsNaN", ["p"], ["p_nan"]),
                helper.make_node("Where", ["p_nan", "zero", "p"], ["p_safe"]),
            ]
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_torch_s_safe_softmax_is_found_and_a_row_masked_out_entirely_is_zeros() -> None:
    data = safe_softmax_attention(16)
    graph = load_graph(data)
    fused = fuse_attention(fuse(lower(graph, use_gemm=True)), ATTENTION_HEAD_MAX)
    (call,) = [k for k in fused.kernels if isinstance(k, AttentionCall)]
    assert call.empty_rows_zero
    batch, seq = 3, 150
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[0, ..., :100] = -np.inf  # its first tile of keys all masked out
    mask[1] = -np.inf  # every key masked out: zeros, not NaN
    mask[2, ..., 1::3] = -1e4
    _, program = _fused_native(data)
    inputs = _inputs(graph, batch, seq, seed=5, mask=mask)
    want = run_graph(graph, inputs)["y"]
    got = program.run(inputs)["y"]
    assert (want[1] == 0).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 3), (4, 1)])
def test_grouped_kv_heads_run_fused_in_c_as_the_reference_does(heads: int, kv_heads: int) -> None:
    graph, program = _fused_native(grouped_attention(16, heads, kv_heads))
    for seed, (batch, seq) in enumerate([(1, 40), (3, 70)]):
        inputs = _inputs(graph, batch, seq, seed)
        np.testing.assert_allclose(program.run(inputs)["y"], run_graph(graph, inputs)["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["llama_dynamo", "qwen2_dynamo", "mistral_dynamo"])
def test_an_exported_grouped_kv_decoder_has_each_layer_s_attention_fused(model: str) -> None:
    # as the compile lowers it (the searched graph); masks with trailing zeros, rows of padding
    import onnxruntime

    (entry,) = [e for e in exported() if e["file"] == f"{model}.onnx"]
    data = (CORPUS / entry["file"]).read_bytes()
    graph, _ = search_graph(load_graph(data), True)
    fused = fuse_attention(fuse(lower(graph)), ATTENTION_HEAD_MAX)
    assert attention_count(fused) == 2  # the fixtures have two layers
    program = native_cpu.NativeProgram(native_cpu.describe(fused, graph.size_limits), fused.weights, native_cpu.build(render(fused)))
    inputs = make_inputs(entry, 3, 37, np.random.default_rng(0))
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))
    got = program.run(inputs)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_head_wider_than_the_c_kernel_holds_is_refused_by_its_renderer() -> None:
    graph = load_graph(_attention(ATTENTION_HEAD_MAX + 16))
    fused = fuse_attention(fuse(lower(graph, use_gemm=True)), ATTENTION_HEAD_MAX + 16)
    with pytest.raises(ValueError, match="at most"):
        render(fused)


def test_the_searched_program_pinned_alone_still_races_its_fused_attention_form() -> None:
    # (the race used to need two candidates asked for: the fused form was built, verified, never timed)
    artifact = compile_onnx(_attention(32, mask="causal"), "cpu", candidates=[NAME])
    measured = {c["name"]: c.get("ms_by_size", {}) for c in artifact.report["candidates"]}
    assert set(measured) == {NAME, NAME_ATTENTION}, measured
    sizes = {name: set(by_size) for name, by_size in measured.items()}
    assert sizes[NAME] == sizes[NAME_ATTENTION] != set(), sizes  # both timed, at the same sizes
    assert artifact.report["chosen"] in measured


def test_a_compile_races_the_fused_attention_against_the_unfused_program() -> None:
    data = _attention(32, mask="causal")
    events: list[dict] = []
    artifact = compile_onnx(data, "cpu", candidates=[NAME, "numpy"], progress=events.append)
    report = artifact.report
    names = [c["name"] for c in report["candidates"]]
    assert NAME in names and NAME_ATTENTION in names, names
    assert report["search"]["schedule"]["attention"] == {"fused": 1}
    # the progress counts the form the search added to the race, and the search's rounds apart
    assert all(e["candidates_measured"] <= e["candidates_total"] for e in events), events
    assert (events[-1]["candidates_measured"], events[-1]["candidates_total"]) == (3, 3)  # and numpy
    assert events[-1]["search_rounds"] == len(report["search"]["schedule"]["rounds"]) >= 1
    graph = load_graph(data)
    inputs = _inputs(graph, 2, 40, seed=3)
    np.testing.assert_allclose(executable(artifact).run(inputs)["y"], run_graph(graph, inputs)["y"], rtol=1e-4, atol=1e-5)
