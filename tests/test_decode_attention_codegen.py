"""Code generation for a decoding step's attention on the CPU: the KV cache's concatenation, the
repeat of key and value heads for grouped-query attention, and a gather of rows through an index,
each compiled natively and checked against onnxruntime at several symbolic sizes."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import compile_onnx, executable
from compiler.backends import native_cpu
from compiler.frontends.onnx import load_graph
from compiler.kernels.ir import GemmCall, Load, LoopKernel
from compiler.kernels.ir_walk import walk
from compiler.kernels.lower import lower
from compiler.render.c import LOOP_FORMS, render

FLOAT = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "decode-attention", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _check(data: bytes, feeds_list: list[dict[str, np.ndarray]], rtol: float = 1e-5) -> None:
    artifact = compile_onnx(data, candidates=("native-blas",))
    assert artifact.report["chosen"] == "native-blas", artifact.report["rejected"]
    program = executable(artifact)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        want = session.run(None, feeds)
        got = program.run(feeds)
        for output, expected in zip(session.get_outputs(), want):
            np.testing.assert_allclose(got[output.name], expected, rtol=rtol, atol=1e-5, err_msg=output.name)


@pytest.mark.parametrize("axis", [2, 3, 1])
def test_a_concatenation_along_an_inner_axis_of_symbolic_size_copies_each_part(axis: int) -> None:
    """present = Concat(past, new) as a decode step writes its KV cache, along the sequence axis
    (2), the last axis (3, rotate_half's) and the heads (1); sizes change between runs of the
    same program and each size runs twice in a row."""
    past_shape = ["batch", 4, "past", 8]
    new_shape = ["batch", 4, 1, 8]
    out_shape = ["batch", 4, "total", 8]
    if axis != 2:
        past_shape = ["batch", 4, 3, 8]
        past_shape[axis] = "past"
        new_shape = ["batch", 4, 3, 8]
        new_shape[axis] = 1
        out_shape = ["batch", 4, 3, 8]
        out_shape[axis] = "total"
    data = _model(
        [helper.make_node("Concat", ["past", "new"], ["present"], axis=axis)],
        [
            helper.make_tensor_value_info("past", FLOAT, past_shape),
            helper.make_tensor_value_info("new", FLOAT, new_shape),
        ],
        [helper.make_tensor_value_info("present", FLOAT, out_shape)],
    )
    rng = np.random.default_rng(axis)
    feeds_list = []
    for batch, past in ((1, 5), (3, 17), (2, 1), (1, 5)):
        shape = [batch, 4, past, 8] if axis == 2 else [batch, 4, 3, 8]
        shape[axis] = past
        new = list(shape)
        new[axis] = 1
        feeds = {
            "past": rng.standard_normal(shape).astype(np.float32),
            "new": rng.standard_normal(new).astype(np.float32),
        }
        feeds_list += [feeds, feeds]
    _check(data, feeds_list)


def _grouped_attention_scores(copies: int, spelled_by: str) -> bytes:
    """q [batch, 8, 1, 16] @ K^T, K [batch, 8 / copies, total, 16] repeated to 8 heads the way
    exported Llama graphs spell it (Unsqueeze, Concat of copies or Expand, Reshape)."""
    kv_heads = 8 // copies
    nodes = [helper.make_node("Unsqueeze", ["k", "two"], ["k5"])]
    if spelled_by == "concat":
        nodes.append(helper.make_node("Concat", ["k5"] * copies, ["repeated"], axis=2))
    else:
        nodes.append(helper.make_node("Expand", ["k5", "expand_shape"], ["repeated"]))
    nodes += [
        helper.make_node("Reshape", ["repeated", "heads_shape"], ["k_heads"]),
        helper.make_node("Transpose", ["k_heads"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("MatMul", ["scores", "k_heads"], ["mixed"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array([2], np.int64), "two"),
        numpy_helper.from_array(np.array([1, 1, copies, 1, 1], np.int64), "expand_shape"),
        numpy_helper.from_array(np.array([0, 8, -1, 16], np.int64), "heads_shape"),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("q", FLOAT, ["batch", 8, 1, 16]),
            helper.make_tensor_value_info("k", FLOAT, ["batch", kv_heads, "total", 16]),
        ],
        [
            helper.make_tensor_value_info("scores", FLOAT, ["batch", 8, 1, "total"]),
            helper.make_tensor_value_info("mixed", FLOAT, ["batch", 8, 1, 16]),
        ],
        initializers,
    )


@pytest.mark.parametrize("copies, spelled_by", [(2, "concat"), (4, "concat"), (2, "expand")])
def test_repeated_key_heads_are_read_in_place_by_both_products(copies: int, spelled_by: str) -> None:
    """The query head axis splits into key head x group: K is read where it lies, with stride 0
    along the group, by the scores' product (transposed) and by the second product; nothing is
    copied per query head."""
    data = _grouped_attention_scores(copies, spelled_by)
    graph = load_graph(data)
    program = lower(graph)
    k_input = next(b.id for b in program.buffers if b.name == "k")
    calls = [k for k in program.kernels if isinstance(k, GemmCall)]
    assert not [k for k in program.kernels if isinstance(k, LoopKernel)]
    assert len(calls) == 2 and all(call.b == k_input for call in calls)
    assert [call.trans_b for call in calls] == [True, False]
    for call in calls:
        group = list(call.batch).index(copies)
        assert call.b_batch_strides[group] == 0 and call.a_batch_strides[group] != 0
    rng = np.random.default_rng(copies)
    feeds_list = []
    for batch, total in ((1, 7), (3, 33), (2, 1)):
        feeds = {
            "q": rng.standard_normal((batch, 8, 1, 16)).astype(np.float32),
            "k": rng.standard_normal((batch, 8 // copies, total, 16)).astype(np.float32),
        }
        feeds_list += [feeds, feeds]
    _check(data, feeds_list, rtol=1e-4)


def test_a_concatenation_of_different_reads_of_one_tensor_is_not_a_repeat() -> None:
    """Concat(x, x) along an axis x already has: the parts read x at different offsets, and the sum
    of guarded parts must stay (only copies of the same element merge)."""
    data = _model(
        [
            helper.make_node("Concat", ["x", "x", "x"], ["y"], axis=1),
            helper.make_node("ReduceSum", ["y", "axes"], ["s"], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", FLOAT, ["batch", "n", 4])],
        [
            helper.make_tensor_value_info("y", FLOAT, ["batch", "m", 4]),
            helper.make_tensor_value_info("s", FLOAT, ["batch", 4]),
        ],
        [numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )
    rng = np.random.default_rng(5)
    _check(
        data, [{"x": rng.standard_normal((b, n, 4)).astype(np.float32)} for b, n in ((1, 3), (2, 9), (2, 9))]
    )


def test_rows_gathered_through_an_index_feed_a_reduction() -> None:
    """A paged KV cache's read: rows of a pool picked by slot numbers, then reduced against a query
    (the scores), then summed."""
    data = _model(
        [
            helper.make_node("Gather", ["pool", "slots"], ["rows"], axis=0),
            helper.make_node("Mul", ["rows", "q"], ["products"]),
            helper.make_node("ReduceSum", ["products", "last"], ["scores"], keepdims=0),
            helper.make_node("ReduceMax", ["scores"], ["best"], axes=[1], keepdims=0),
        ],
        [
            helper.make_tensor_value_info("pool", FLOAT, ["slots_total", 16]),
            helper.make_tensor_value_info("slots", TensorProto.INT64, ["batch", "past"]),
            helper.make_tensor_value_info("q", FLOAT, ["batch", 1, 16]),
        ],
        [
            helper.make_tensor_value_info("scores", FLOAT, ["batch", "past"]),
            helper.make_tensor_value_info("best", FLOAT, ["batch"]),
        ],
        [numpy_helper.from_array(np.array([2], np.int64), "last")],
    )
    rng = np.random.default_rng(7)
    feeds_list = []
    for batch, past in ((1, 5), (4, 40), (4, 40), (2, 3)):
        pool = rng.standard_normal((64, 16)).astype(np.float32)
        slots = rng.integers(0, 64, (batch, past)).astype(np.int64)
        feeds_list.append(
            {"pool": pool, "slots": slots, "q": rng.standard_normal((batch, 1, 16)).astype(np.float32)}
        )
    _check(data, feeds_list)


def test_copies_of_one_value_over_ranges_with_a_gap_stay_apart() -> None:
    """Pad(u) at the first and at the last of three places, added: the same element guarded to two
    ranges that do not touch, whose sum is zero between them."""
    data = _model(
        [
            helper.make_node("Pad", ["u", "first"], ["at_first"]),
            helper.make_node("Pad", ["u", "last"], ["at_last"]),
            helper.make_node("Add", ["at_first", "at_last"], ["y"]),
        ],
        [helper.make_tensor_value_info("u", FLOAT, ["batch", 1, 4])],
        [helper.make_tensor_value_info("y", FLOAT, ["batch", 3, 4])],
        [
            numpy_helper.from_array(np.array([0, 0, 0, 0, 2, 0], np.int64), "first"),
            numpy_helper.from_array(np.array([0, 2, 0, 0, 0, 0], np.int64), "last"),
        ],
    )
    rng = np.random.default_rng(9)
    _check(data, [{"u": rng.standard_normal((b, 1, 4)).astype(np.float32)} for b in (1, 3)])


def test_a_row_gathered_from_a_pool_is_indexed_once_and_copied_contiguously() -> None:
    """present = Concat(pool[slots], new): the slot of each past position is read once per row of
    head values (hoisted out of the row's loop, which then vectorizes), the new position's row is
    a plain copy, and the result equals onnxruntime's."""
    data = _model(
        [
            helper.make_node("Gather", ["pool", "slots"], ["past"], axis=0),
            helper.make_node("Concat", ["past", "new"], ["present"], axis=1),
        ],
        [
            helper.make_tensor_value_info("pool", FLOAT, ["pool_slots", 4, 16]),
            helper.make_tensor_value_info("slots", TensorProto.INT64, ["batch", "past"]),
            helper.make_tensor_value_info("new", FLOAT, ["batch", 1, 4, 16]),
        ],
        [helper.make_tensor_value_info("present", FLOAT, ["batch", "total", 4, 16])],
    )
    source = render(lower(load_graph(data)))
    hoisted = source.index("const int64_t lc_g0 = lc_index(")
    assert "#pragma omp simd" in source[hoisted:]
    rng = np.random.default_rng(11)
    feeds_list = []
    for batch, past in ((1, 5), (3, 20), (3, 20), (2, 0)):
        feeds_list.append(
            {
                "pool": rng.standard_normal((48, 4, 16)).astype(np.float32),
                "slots": rng.integers(-48, 48, (batch, past)).astype(np.int64),
                "new": rng.standard_normal((batch, 1, 4, 16)).astype(np.float32),
            }
        )
    _check(data, feeds_list)


def test_a_computed_key_is_packed_for_a_transposed_product_by_a_contiguous_copy() -> None:
    """K^T of a key computed on the way (scaled here; gathered from a pool in a paged cache) is
    stored as K's rows for a transposed call: the copy reads and writes along the head size."""
    data = _model(
        [
            helper.make_node("Mul", ["k", "half"], ["scaled"]),
            helper.make_node("Transpose", ["scaled"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        ],
        [
            helper.make_tensor_value_info("q", FLOAT, ["batch", 4, 1, 16]),
            helper.make_tensor_value_info("k", FLOAT, ["batch", 4, "total", 16]),
        ],
        [helper.make_tensor_value_info("scores", FLOAT, ["batch", 4, 1, "total"])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "half")],
    )
    program = lower(load_graph(data))
    (call,) = [k for k in program.kernels if isinstance(k, GemmCall)]
    (copy,) = [k for k in program.kernels if isinstance(k, LoopKernel) and k.out == call.b]
    loads = [e for e in walk(copy.value) if isinstance(e, Load)]
    assert call.trans_b and dict(loads[0].index.terms)[f"o{len(copy.shape) - 1}"] == 1
    rng = np.random.default_rng(13)
    feeds_list = []
    for batch, total in ((1, 9), (2, 30), (2, 30)):
        feeds = {
            "q": rng.standard_normal((batch, 4, 1, 16)).astype(np.float32),
            "k": rng.standard_normal((batch, 4, total, 16)).astype(np.float32),
        }
        feeds_list.append(feeds)
    _check(data, feeds_list)


def test_a_reduction_over_a_gathered_row_reads_its_index_once() -> None:
    """The sum of squares of an embedding row (a norm of a gathered token): the row's index is read
    once, before the reduced loop, which then vectorizes; ids out of range are still reported."""
    data = _model(
        [
            helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
            helper.make_node("Mul", ["rows", "rows"], ["squares"]),
            helper.make_node("ReduceSum", ["squares", "last"], ["norms"], keepdims=0),
        ],
        [
            helper.make_tensor_value_info("table", FLOAT, ["vocab", 32]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
        ],
        [helper.make_tensor_value_info("norms", FLOAT, ["batch"])],
        [numpy_helper.from_array(np.array([1], np.int64), "last")],
    )
    source = render(lower(load_graph(data)))
    hoisted = source.index("const int64_t lc_g0 = lc_index(")
    assert "#pragma omp simd reduction(+:acc)" in source[hoisted:]
    rng = np.random.default_rng(17)
    feeds_list = [
        {
            "table": rng.standard_normal((50, 32)).astype(np.float32),
            "ids": rng.integers(-50, 50, batch).astype(np.int64),
        }
        for batch in (1, 7, 7)
    ]
    _check(data, feeds_list)
    program = executable(compile_onnx(data, candidates=("native-blas",)))
    with pytest.raises(Exception, match="index"):
        program.run({"table": feeds_list[0]["table"], "ids": np.array([50], np.int64)})


def test_the_loop_form_of_a_product_reads_a_computed_query_once() -> None:
    """scores = (q * c + q * s) @ K^T at one query row: the loop form of the product (the search's
    alternative to the library call at one row) reads the query from the call's packed copy rather
    than recomputing it for every key; each loop form, forced, equals onnxruntime."""
    data = _model(
        [
            helper.make_node("Mul", ["q", "c"], ["qc"]),
            helper.make_node("Mul", ["q", "s"], ["qs"]),
            helper.make_node("Add", ["qc", "qs"], ["rotated"]),
            helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["rotated", "k_t"], ["scores"]),
        ],
        [
            helper.make_tensor_value_info("q", FLOAT, ["batch", 4, 1, 16]),
            helper.make_tensor_value_info("c", FLOAT, ["batch", 1, 1, 16]),
            helper.make_tensor_value_info("s", FLOAT, ["batch", 1, 1, 16]),
            helper.make_tensor_value_info("k", FLOAT, ["batch", 4, "total", 16]),
        ],
        [helper.make_tensor_value_info("scores", FLOAT, ["batch", 4, 1, "total"])],
    )
    program = lower(load_graph(data))
    (call,) = [k for k in program.kernels if isinstance(k, GemmCall)]
    assert call.loops is not None
    assert {e.buffer for e in walk(call.loops.value) if isinstance(e, Load)} == {call.a, call.b}
    graph = load_graph(data)
    number = program.kernels.index(call)
    runs = [
        native_cpu.NativeProgram(
            native_cpu.describe(program, graph.size_limits),
            program.weights,
            native_cpu.build(render(program, gemm={number: form})),
        )
        for form in LOOP_FORMS
    ]
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(19)
    for batch, total in ((1, 6), (3, 41), (3, 41)):
        feeds = {
            "q": rng.standard_normal((batch, 4, 1, 16)).astype(np.float32),
            "c": rng.standard_normal((batch, 1, 1, 16)).astype(np.float32),
            "s": rng.standard_normal((batch, 1, 1, 16)).astype(np.float32),
            "k": rng.standard_normal((batch, 4, total, 16)).astype(np.float32),
        }
        want = session.run(None, feeds)[0]
        for run in runs:
            np.testing.assert_allclose(run.run(feeds)["scores"], want, rtol=1e-4, atol=1e-5)
