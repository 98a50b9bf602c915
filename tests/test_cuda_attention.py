"""Attention as one CUDA kernel with online softmax: recognized in the lowered program, rendered,
built by NVRTC and run in the CPU emulation against the reference interpreter; chosen against the
unfused kernels by device time on a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.backends.cuda import compile_cuda
from compiler.backends.cuda_emulator import emulate
from compiler.frontends.onnx import load_graph
from compiler.kernels.attention import attention_count, fuse_attention
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import AttentionCall
from compiler.kernels.ir_walk import kernel_stores
from compiler.kernels.lower import lower
from compiler.reference import run_graph
from compiler.render.cuda import (
    ATTENTION_HEAD_MAX,
    ATTENTION_MMA_HEAD_MAX,
    DEFAULT_SCHEDULE,
    render_cuda,
    scheduled,
)
from compiler.shape import evaluate
from tests.conftest import FIXTURES
from tests.test_cuda import _gpu_driver, _in_precision, _narrow_close, _TimedEmulation


def _attention(
    head: int, width: int | None = None, heads: int = 2, mask: str = "additive", probabilities: bool = False
) -> bytes:
    """softmax(Q K^T / sqrt(head) + mask) V over inputs q, k [batch, heads, seq, head] and v
    [batch, heads, seq, width]: `mask` "additive" takes an input m [batch, 1, 1, seq] added to the
    scores, "causal" a Where over a lower-triangular constant (as GPT-2 exports it), "none" none;
    `probabilities` makes the softmax an output too."""
    width = width or head
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scaled"]),
    ]
    initializers = [numpy_helper.from_array(np.array(head**-0.5, np.float32), "scale")]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", heads, "seq", head]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", heads, "seq", head]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", heads, "seq", width]),
    ]
    scores = "scaled"
    if mask == "additive":
        inputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, ["batch", 1, 1, "seq"]))
        nodes.append(helper.make_node("Add", ["scaled", "m"], ["masked"]))
        scores = "masked"
    elif mask == "causal":
        limit = 256
        initializers += [
            numpy_helper.from_array(np.tril(np.ones((limit, limit), bool)), "tril"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([2], np.int64), "two"),
        ]
        nodes += [
            helper.make_node("Shape", ["q"], ["q_shape"]),
            helper.make_node("Gather", ["q_shape", "two"], ["seq_len"], axis=0),
            helper.make_node("Slice", ["tril", "zero", "seq_len", "zero"], ["rows"]),
            helper.make_node("Slice", ["rows", "zero", "seq_len", "one"], ["causal"]),
            helper.make_node("Where", ["causal", "scaled", "minus_inf"], ["masked"]),
        ]
        scores = "masked"
    nodes += [
        helper.make_node("Softmax", [scores], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", heads, "seq", width])]
    if probabilities:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", heads, "seq", "seq"]))
    graph = helper.make_graph(nodes, "attention", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def grouped_attention(head: int, heads: int, kv_heads: int) -> bytes:
    """Attention with grouped KV heads as Llama, Qwen2 and Mistral write it: k and v [batch,
    kv_heads, seq, head] repeated for each group of heads (Unsqueeze, Expand, Reshape), q and the
    repeated k each scaled by head^-1/4, an additive mask m [batch, 1, 1, seq]."""
    group = heads // kv_heads
    nodes = [
        helper.make_node("Shape", ["q"], ["q_shape"]),
        helper.make_node("Gather", ["q_shape", "at0"], ["b"], axis=0),
        helper.make_node("Gather", ["q_shape", "at2"], ["s"], axis=0),
        helper.make_node("Concat", ["b", "kv", "group", "s", "head"], ["grouped_shape"], axis=0),
        helper.make_node("Concat", ["b", "heads", "s", "head"], ["heads_shape"], axis=0),
    ]
    for name in ("k", "v"):
        nodes += [
            helper.make_node("Unsqueeze", [name, "at2"], [f"{name}_1"]),
            helper.make_node("Expand", [f"{name}_1", "grouped_shape"], [f"{name}_grouped"]),
            helper.make_node("Reshape", [f"{name}_grouped", "heads_shape"], [f"{name}_heads"]),
        ]
    nodes += [
        helper.make_node("Mul", ["q", "quarter"], ["q_scaled"]),
        helper.make_node("Mul", ["k_heads", "quarter"], ["k_scaled"]),
        helper.make_node("Transpose", ["k_scaled"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q_scaled", "kt"], ["qk"]),
        helper.make_node("Add", ["qk", "m"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v_heads"], ["y"]),
    ]
    initializers = [numpy_helper.from_array(np.array(head**-0.25, np.float32), "quarter")] + [
        numpy_helper.from_array(np.array([value], np.int64), name)
        for name, value in (("at0", 0), ("at2", 2), ("kv", kv_heads), ("group", group), ("head", head), ("heads", heads))
    ]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", heads, "seq", head]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", kv_heads, "seq", head]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", kv_heads, "seq", head]),
        helper.make_tensor_value_info("m", TensorProto.FLOAT, ["batch", 1, 1, "seq"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", heads, "seq", head])]
    graph = helper.make_graph(nodes, "grouped_attention", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _programs(data: bytes):
    """(the graph, its lowered program, that program with its attention fused)."""
    graph = load_graph(data)
    program = fuse(lower(graph))
    return graph, program, fuse_attention(program, ATTENTION_HEAD_MAX)


def _inputs(graph, batch: int, seq: int, seed: int = 0, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Random q, k, v (and a mask hiding about a third of the keys with -1e4, or `mask`)."""
    rng = np.random.default_rng(seed)
    sizes = {"batch": batch, "seq": seq}
    feed = {}
    for name, shape, _ in graph.input_specs():
        feed[name] = rng.standard_normal([evaluate(d, sizes) for d in shape]).astype(np.float32)
    if "m" in feed:
        feed["m"] = mask if mask is not None else np.where(rng.random(feed["m"].shape) < 0.3, -1e4, 0.0).astype(np.float32)
    return feed


def _check(data: bytes, sizes: list[tuple[int, int]], mask: np.ndarray | None = None) -> None:
    """The fused program, emulated, computes what the reference does at each (batch, seq)."""
    graph, _, fused = _programs(data)
    assert attention_count(fused) == 1
    emulated = emulate(fused, graph.size_limits)
    for seed, (batch, seq) in enumerate(sizes):
        inputs = _inputs(graph, batch, seq, seed, mask)
        want = run_graph(graph, inputs)
        got = emulated.run(inputs)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} batch={batch} seq={seq}")


@pytest.mark.parametrize("model", ["bert_dynamo", "bert_torchscript", "gpt2_dynamo", "gpt2_torchscript"])
def test_each_layer_s_attention_of_an_exported_transformer_becomes_one_kernel(model: str) -> None:
    _, program, fused = _programs((FIXTURES / f"{model}.onnx").read_bytes())
    calls = [k for k in fused.kernels if isinstance(k, AttentionCall)]
    assert len(calls) == 2  # the fixtures have two layers
    # five kernels a layer fewer (six for GPT-2's masking loop), and the scores never stored
    assert len(program.kernels) - len(fused.kernels) in (2 * 5, 2 * 6)
    stored = set().union(*(kernel_stores(k) for k in fused.kernels))
    assert all(call.scores.c not in stored and call.scores.c not in fused.slots for call in calls)
    # the exponent of exp2 is log2(e): the softmax's own
    assert all(call.log2_scale == pytest.approx(1.4426950) for call in calls)


@pytest.mark.parametrize(
    ("head", "width", "sizes"),
    [
        (64, 64, [(1, 45), (2, 70)]),  # more than one tile of keys and of query rows, ragged
        (8, 40, [(2, 33)]),  # a head of V wider than a warp: two columns a lane, the second ragged
        (128, 96, [(1, 40)]),  # wide heads: four query rows a warp
    ],
)
def test_fused_attention_with_an_additive_mask_computes_what_the_reference_does(head: int, width: int, sizes) -> None:
    _check(_attention(head, width), sizes)


def test_fused_attention_with_a_causal_mask_folds_the_masking_loop_into_the_score() -> None:
    data = _attention(32, mask="causal")
    _, program, fused = _programs(data)
    # the Where writes the masked scores in a loop of its own, read by the max and the exponentials
    assert len(program.kernels) - len(fused.kernels) == 6
    _check(data, [(1, 50), (2, 7)])


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 2), (4, 1)])
def test_grouped_kv_heads_are_found_and_the_fused_kernel_reads_each_group_s_k_and_v(heads: int, kv_heads: int) -> None:
    # the products see the heads as (kv heads, group) with K and V at stride 0 on the group, the
    # softmax's loops as heads: the rules equate the rows by their count, the kernel splits alike
    _check(grouped_attention(16, heads, kv_heads), [(1, 40), (2, 70)])


def test_a_row_whose_first_keys_are_all_masked_out_is_the_softmax_of_the_rest() -> None:
    # the first tile of keys holds only -inf for batch 0: the running max starts there and must
    # not turn the row into NaN; batch 1's row is masked entirely, NaN as in the reference
    batch, seq = 2, 50
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[0, ..., :40] = -np.inf
    mask[1] = -np.inf
    data = _attention(16)
    graph, _, fused = _programs(data)
    inputs = _inputs(graph, batch, seq, mask=mask)
    want = run_graph(graph, inputs)["y"]
    got = emulate(fused, graph.size_limits).run(inputs)["y"]
    assert np.isfinite(got[0]).all() and np.isnan(want[1]).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_torch_s_safe_softmax_runs_fused_and_a_row_masked_out_entirely_is_zeros() -> None:
    from tests.test_cpu_attention import safe_softmax_attention

    batch, seq = 2, 50
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[1] = -np.inf
    data = safe_softmax_attention(16)
    graph, _, fused = _programs(data)
    assert [k.empty_rows_zero for k in fused.kernels if isinstance(k, AttentionCall)] == [True]
    inputs = _inputs(graph, batch, seq, mask=mask)
    want = run_graph(graph, inputs)["y"]
    got = emulate(fused, graph.size_limits).run(inputs)["y"]
    assert (want[1] == 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_whose_probabilities_are_an_output_is_left_as_its_kernels() -> None:
    data = _attention(16, probabilities=True)
    graph, program, fused = _programs(data)
    assert fused is program and attention_count(fused) == 0
    inputs = _inputs(graph, 2, 20)
    got = emulate(scheduled(program, DEFAULT_SCHEDULE), graph.size_limits).run(inputs)
    for name, want in run_graph(graph, inputs).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)


def test_a_head_wider_than_the_kernel_holds_is_left_unfused() -> None:
    _, program, _ = _programs(_attention(ATTENTION_HEAD_MAX + 8))
    assert fuse_attention(program, ATTENTION_HEAD_MAX) is program
    assert attention_count(fuse_attention(program, ATTENTION_HEAD_MAX + 8)) == 1


def test_fused_attention_compiles_to_ptx_and_an_sm90_cubin_with_butterfly_shuffles() -> None:
    program = scheduled(fuse(lower(load_graph((FIXTURES / "bert_dynamo.onnx").read_bytes()))), DEFAULT_SCHEDULE)
    rendered = render_cuda(program)
    ptx, cubin = compile_cuda(rendered.source, "sm_90")
    assert set(re.findall(rb"\.entry (k\d+)\(", ptx)) == {launch.kernel.encode() for launch in rendered.launches}
    assert b"shfl.sync.bfly" in ptx and cubin[:4] == b"\x7fELF"
    # a launch per layer, its grid a block per (batch, head) and 32 query rows, 4 warps
    launches = [launch for launch in rendered.launches if "lc_qs[" in _function(rendered.source, launch.kernel)]
    assert len(launches) == 2
    sizes = {"batch": 3, "seq": 70}
    assert all([evaluate(d, sizes) for d in launch.grid] == [3 * 4, 3, 1] and launch.threads == 128 for launch in launches)


def _function(source: str, name: str) -> str:
    start = source.index(f" {name}(const lc_symbols S")
    end = source.find('extern "C"', start)
    return source[start : end if end >= 0 else len(source)]


@pytest.mark.parametrize(("seconds", "chosen"), [(0.5, "cuda-searched"), (2.0, "cuda-unfused-attention-searched")])
def test_on_a_gpu_fused_attention_is_kept_only_where_it_measures_faster(monkeypatch, seconds: float, chosen: str) -> None:
    from compiler import compile_onnx, devices

    # a program whose source has the fused kernel takes `seconds` a call, the others 1 s
    monkeypatch.setattr(devices, "_gpu_of_arch", lambda arch: _TimedEmulation("lc_qs[", seconds))
    report = compile_onnx(_attention(16, heads=1, mask="none"), "h100").report
    # both forms searched, each kernel by kernel, then each form's winners timed whole
    assert set(report["search"]["schedule"]["forms"]) == {"cuda", "cuda-unfused-attention"}
    assert {"cuda-searched", "cuda-unfused-attention-searched"} <= set(report["measuring"]["device_ms_by_size"])
    assert report["chosen"] == chosen
    assert report["fused_attention"] == (1 if chosen == "cuda-searched" else 0)


@pytest.mark.parametrize("precision", ["exported", "float16", "bfloat16"])
def test_a_transformer_compiled_for_a_gpu_type_runs_its_attention_fused_in_every_precision(precision: str) -> None:
    from compiler import compile_onnx

    report = compile_onnx((FIXTURES / "gpt2_dynamo.onnx").read_bytes(), "h100", precision=precision).report
    assert report["chosen"] == "cuda-default" and report["fused_attention"] == 2
    assert report["verified_on"] == "cpu emulation"


@pytest.mark.parametrize(
    ("precision", "head", "width", "mask"),
    [
        ("float16", 64, 64, "additive"),
        ("bfloat16", 64, 64, "additive"),
        ("float16", 32, 48, "causal"),
        ("bfloat16", 16, 16, "none"),
        ("tf32", 32, 48, "causal"),
    ],
)
def test_fused_attention_on_tensor_cores_computes_what_the_float32_reference_does_within_its_tolerance(
    precision: str, head: int, width: int, mask: str
) -> None:
    data = _attention(head, width, mask=mask)
    graph = load_graph(data)
    program = fuse_attention(_in_precision(fuse(lower(graph)), precision), ATTENTION_HEAD_MAX)
    source = render_cuda(program).source
    # 16-bit formats stage Q, K and V for warp products; tf32's tiles would not fit: CUDA cores
    assert ("lc_kt[" in source) == (precision != "tf32") and attention_count(program) == 1
    emulated = emulate(program, graph.size_limits)
    for seed, (batch, seq) in enumerate([(1, 70), (2, 9)]):
        inputs = _inputs(graph, batch, seq, seed)
        want = run_graph(graph, inputs)["y"]
        _narrow_close(emulated.run(inputs)["y"], want, precision, f"batch={batch} seq={seq}")


def test_a_head_wider_than_the_tensor_core_kernel_holds_takes_the_cuda_core_kernel() -> None:
    graph = load_graph(_attention(ATTENTION_MMA_HEAD_MAX + 16))
    program = fuse_attention(_in_precision(fuse(lower(graph)), "float16"), ATTENTION_HEAD_MAX)
    source = render_cuda(program).source
    assert attention_count(program) == 1 and "lc_kt[" not in source and "lc_ks[" in source
    inputs = _inputs(graph, 1, 40)
    _narrow_close(emulate(program, graph.size_limits).run(inputs)["y"], run_graph(graph, inputs)["y"], "float16", "y")


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_fused_attention_on_tensor_cores_compiles_to_an_sm90_cubin_with_its_warp_products(precision: str) -> None:
    graph = load_graph(_attention(64, mask="causal"))
    program = fuse_attention(_in_precision(fuse(lower(graph)), precision), ATTENTION_HEAD_MAX)
    rendered = render_cuda(program)
    ptx, cubin = compile_cuda(rendered.source, "sm_90")
    assert b"wmma.mma.sync.aligned.row.row.m16n16k16" in ptx and cubin[:4] == b"\x7fELF"
    # its static shared memory fits the 48 KB a block may have without opting in to more
    fused = next(launch for launch in rendered.launches if "lc_kt[" in _function(rendered.source, launch.kernel))
    declared = rb"\.shared \.align \d+ \.b8 _ZZ\d+" + fused.kernel.encode() + rb"E\d+lc_\w+\[(\d+)\]"
    sizes = [int(n) for n in re.findall(declared, ptx)]
    assert len(sizes) == 9 and sum(sizes) <= 48 * 1024, sizes


# ---- on a GPU (skipped without one) -------------------------------------------------------------


@pytest.mark.parametrize("precision", ["exported", "float16", "bfloat16"])
@pytest.mark.parametrize(("head", "mask"), [(64, "causal"), (32, "additive"), (128, "none")])
def test_on_a_gpu_fused_attention_computes_what_the_reference_does(precision: str, head: int, mask: str) -> None:
    from compiler.backends.cuda import CudaProgram, kernel_record

    driver = _gpu_driver()
    graph = load_graph(_attention(head, mask=mask))
    program = fuse(lower(graph))
    program = program if precision == "exported" else _in_precision(program, precision)
    program = fuse_attention(program, ATTENTION_HEAD_MAX)
    assert attention_count(program) == 1
    rendered = render_cuda(program)
    ptx, cubin = compile_cuda(rendered.source, driver.arch)
    kernel = kernel_record(program, rendered, driver.arch, graph.size_limits)
    loaded = CudaProgram(kernel, program.weights, {"program.ptx": ptx, "program.cubin": cubin}, driver)
    try:
        for seed, (batch, seq) in enumerate([(1, 130), (3, 45), (3, 45)]):  # the third replays a graph
            inputs = _inputs(graph, batch, seq, seed)
            got = loaded.run(inputs)["y"]
            want = run_graph(graph, inputs)["y"]
            if precision == "exported":
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"batch={batch} seq={seq}")
            else:
                _narrow_close(got, want, precision, f"batch={batch} seq={seq}")
    finally:
        loaded.close()
