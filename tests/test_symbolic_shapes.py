"""Symbolic dimension arithmetic, and the graph patterns real exports build from it.

Each graph below is compiled once, with `batch` and `seq` symbolic, and compared with onnxruntime
at several sizes: slices of symbolic axes with any bounds, concatenation along them, shapes
computed with +, -, floor division, Max and Min, Range from a symbolic start, CumSum over the
sequence, and the index lookups transformers emits (GatherND over Range indices, negative
indices into symbolic axes).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from compiler import Artifact, UnsupportedModel, compile_onnx, executable
from compiler.frontends.onnx import load_graph
from compiler.ir import GraphBuilder, Op
from compiler.pipeline import sample_inputs, verification_case
from compiler.shape import (
    ShapeError,
    SymDim,
    bounds,
    dim_div,
    dim_floordiv,
    dim_max,
    dim_min,
    evaluate,
    parse_dim,
)
from compiler.value_range import ValueRanges

SEQ, BATCH = SymDim.named("seq"), SymDim.named("batch")
SIZES = ((1, 1), (2, 5), (3, 12))


# ---- the arithmetic ------------------------------------------------------------------------------


def test_sums_and_differences_are_canonical() -> None:
    assert SEQ + 1 - 1 == SEQ
    assert (SEQ + 1) + (SEQ - 1) == 2 * SEQ
    assert SEQ - SEQ == 0 and isinstance(SEQ - SEQ, int)
    assert str(SEQ - 1) == "seq-1" and str(784 * BATCH * SEQ) == "784*batch*seq"
    assert (BATCH + 2) * SEQ == BATCH * SEQ + 2 * SEQ


def test_floor_division_simplifies_what_divides() -> None:
    assert dim_floordiv(2 * SEQ + 2, 2) == SEQ + 1
    assert dim_floordiv(2 * SEQ + 1, 2) == SEQ  # the remainder 1 never reaches 2
    odd = dim_floordiv(SEQ + 1, 2)
    assert isinstance(odd, SymDim) and str(odd) == "floordiv(seq+1,2)"
    assert [evaluate(odd, {"seq": n}) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]


def test_max_and_min_use_that_symbols_are_at_least_one() -> None:
    assert dim_max(SEQ, 1) == SEQ and dim_min(SEQ, 1) == 1
    assert dim_max(SEQ, SEQ + 1) == SEQ + 1 and dim_min(SEQ - 1, SEQ) == SEQ - 1
    undecided = dim_max(SEQ, 4)
    assert isinstance(undecided, SymDim) and evaluate(undecided, {"seq": 2}) == 4
    assert bounds(undecided) == (4, float("inf"))


def test_text_form_round_trips() -> None:
    for dim in (SEQ + 1, SEQ - 1, 3 - SEQ, 2 * dim_floordiv(SEQ + 1, 2), dim_max(SEQ, 4), 12 * BATCH * SEQ):
        assert parse_dim(str(dim)) == dim
    assert parse_dim("(seq + 1) // 2") == dim_floordiv(SEQ + 1, 2)
    with pytest.raises(ShapeError, match="cannot parse"):
        parse_dim("seq +")


def test_exact_division() -> None:
    assert dim_div(384 * BATCH * SEQ, 32 * BATCH) == 12 * SEQ
    assert dim_div(2 * SEQ + 2, SEQ + 1) == 2
    with pytest.raises(ShapeError, match="not divisible"):
        dim_div(SEQ + 1, 2)


# ---- graphs ------------------------------------------------------------------------------------------


def model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m.SerializeToString()


def int64(name: str, values) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], list(values))


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])
MASK = helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"])


def out(name: str = "y", elem=TensorProto.FLOAT, rank: int = 3) -> onnx.ValueInfoProto:
    """An output of known rank whose dims the compiler must work out."""
    return helper.make_tensor_value_info(name, elem, [None] * rank)


def slice_model(starts, ends, steps) -> bytes:
    return model(
        [helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])],
        [X], [out()],
        [int64("s", starts), int64("e", ends), int64("a", [1]), int64("st", steps)],
    )


CASES = {
    # x[:, 1:], x[:, :-1], x[:, ::-1], x[:, -3:], x[:, 1::2], x[:, -2::-2]
    "slice_from_one": slice_model([1], [2**63 - 1], [1]),
    "slice_drop_last": slice_model([0], [-1], [1]),
    "slice_reversed": slice_model([-1], [-(2**63)], [-1]),
    "slice_last_three": slice_model([-3], [2**63 - 1], [1]),
    "slice_odd_positions": slice_model([1], [2**63 - 1], [2]),
    "slice_reversed_by_two": slice_model([-2], [-(2**63)], [-2]),
    # concat(x, x[:, :1]) along seq: seq + 1
    "concat_along_seq": model(
        [
            helper.make_node("Slice", ["x", "zero", "one", "one"], ["head"]),
            helper.make_node("Concat", ["x", "head"], ["y"], axis=1),
        ],
        [X], [out()], [int64("zero", [0]), int64("one", [1])],
    ),
    # reshape to [batch, (seq + 1) // 2, 8] after padding seq to an even length computed at run time
    "pad_to_even_and_fold_pairs": model(
        [
            helper.make_node("Shape", ["x"], ["seq"], start=1, end=2),
            helper.make_node("Mod", ["seq", "two"], ["odd"]),
            helper.make_node("Concat", ["zeros3", "zero", "odd", "zero"], ["pads"], axis=0),
            helper.make_node("Pad", ["x", "pads"], ["padded"]),
            helper.make_node("Add", ["seq", "one"], ["seq_plus"]),
            helper.make_node("Div", ["seq_plus", "two"], ["half"]),
            helper.make_node("Shape", ["x"], ["batch"], start=0, end=1),
            helper.make_node("Concat", ["batch", "half", "eight"], ["target"], axis=0),
            helper.make_node("Reshape", ["padded", "target"], ["y"]),
        ],
        [X], [out()],
        [int64("zero", [0]), int64("one", [1]), int64("two", [2]), int64("zeros3", [0, 0, 0]), int64("eight", [8])],
    ),
    # Max(seq, 3) as a Range limit, then Min(seq, 3) rows of it: shapes through Max/Min
    "max_min_of_shapes": model(
        [
            helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
            helper.make_node("Max", ["shape", "three"], ["longest"]),
            helper.make_node("Min", ["shape", "three"], ["shortest"]),
            helper.make_node("Squeeze", ["longest"], ["limit"]),
            helper.make_node("Range", ["zero_scalar", "limit", "one_scalar"], ["positions"]),
            helper.make_node("Slice", ["positions", "zero", "shortest"], ["y"]),
        ],
        [X], [out("y", TensorProto.INT64, 1)],
        [
            int64("three", [3]), int64("zero", [0]),
            helper.make_tensor("zero_scalar", TensorProto.INT64, [], [0]),
            helper.make_tensor("one_scalar", TensorProto.INT64, [], [1]),
        ],
    ),
    # positions seq-1, ..., 2*seq-2: Range from a symbolic start
    "range_from_symbolic_start": model(
        [
            helper.make_node("Shape", ["mask"], ["shape"], start=1, end=2),
            helper.make_node("Squeeze", ["shape"], ["seq"]),
            helper.make_node("Sub", ["seq", "one_scalar"], ["start"]),
            helper.make_node("Add", ["start", "seq"], ["limit"]),
            helper.make_node("Range", ["start", "limit", "one_scalar"], ["y"]),
        ],
        [MASK], [out("y", TensorProto.INT64, 1)],
        [helper.make_tensor("one_scalar", TensorProto.INT64, [], [1])],
    ),
    # RoBERTa's position ids: cumsum(mask) * mask + padding index
    "position_ids_from_cumsum": model(
        [
            helper.make_node("CumSum", ["mask", "axis"], ["running"]),
            helper.make_node("Mul", ["running", "mask"], ["kept"]),
            helper.make_node("Add", ["kept", "pad_index"], ["y"]),
        ],
        [MASK], [out("y", TensorProto.INT64, 2)],
        [helper.make_tensor("axis", TensorProto.INT64, [], [1]), helper.make_tensor("pad_index", TensorProto.INT64, [], [1])],
    ),
    "reverse_exclusive_cumsum": model(
        [helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=1, reverse=1)],
        [X], [out()], [helper.make_tensor("axis", TensorProto.INT64, [], [1])],
    ),
    # transformers 5's padding-mask lookup: mask[arange(B)[:, None], arange(S)] as a GatherND
    "gather_nd_over_ranges": model(
        [
            helper.make_node("Shape", ["mask"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero_scalar"], ["batch"], axis=0),
            helper.make_node("Gather", ["shape", "one_scalar"], ["seq"], axis=0),
            helper.make_node("Range", ["zero_scalar", "batch", "one_scalar"], ["rows"]),
            helper.make_node("Range", ["zero_scalar", "seq", "one_scalar"], ["cols"]),
            helper.make_node("Unsqueeze", ["rows", "one"], ["rows_2d"]),
            helper.make_node("Unsqueeze", ["cols", "zero"], ["cols_2d"]),
            helper.make_node("Add", ["rows_2d", "zero_scalar"], ["rows_b"]),
            helper.make_node("Mul", ["cols_2d", "one_scalar"], ["cols_b"]),
            helper.make_node("Unsqueeze", ["rows_b", "minus_one"], ["r"]),
            helper.make_node("Unsqueeze", ["cols_b", "minus_one"], ["c"]),
            helper.make_node("Shape", ["mask"], ["full"]),
            helper.make_node("Concat", ["full", "one"], ["index_shape"], axis=0),
            helper.make_node("Expand", ["r", "index_shape"], ["r_full"]),
            helper.make_node("Expand", ["c", "index_shape"], ["c_full"]),
            helper.make_node("Concat", ["r_full", "c_full"], ["index"], axis=-1),
            helper.make_node("GatherND", ["mask", "index"], ["y"]),
        ],
        [MASK], [out("y", TensorProto.INT64, 2)],
        [
            int64("zero", [0]), int64("one", [1]), int64("minus_one", [-1]),
            helper.make_tensor("zero_scalar", TensorProto.INT64, [], [0]),
            helper.make_tensor("one_scalar", TensorProto.INT64, [], [1]),
        ],
    ),
    # the last and the first position of every row, the last by a negative index into seq
    "negative_indices_into_seq": model(
        [helper.make_node("GatherElements", ["mask", "idx"], ["y"], axis=1)],
        [MASK], [out("y", TensorProto.INT64, 2)],
        [helper.make_tensor("idx", TensorProto.INT64, [1, 2], [-1, 0])],
    ),
    # split seq into [1, seq-1] with sizes computed from the shape
    "split_first_token": model(
        [
            helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
            helper.make_node("Sub", ["shape", "one"], ["rest"]),
            helper.make_node("Concat", ["one", "rest"], ["sizes"], axis=0),
            helper.make_node("Split", ["x", "sizes"], ["first", "y"], axis=1),
        ],
        [X], [out()], [int64("one", [1])],
    ),
    # a causal mask: triu of ones over [seq, seq], then Where on the broadcast [batch, 1, seq, seq]
    "causal_mask_from_trilu_and_where": model(
        [
            helper.make_node("Shape", ["mask"], ["shape"], start=1, end=2),
            helper.make_node("Concat", ["shape", "shape"], ["square"], axis=0),
            helper.make_node("ConstantOfShape", ["square"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
            helper.make_node("Trilu", ["ones", "one_scalar"], ["future"], upper=1),
            helper.make_node("Cast", ["future"], ["blocked"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["mask", "axes"], ["padding"]),
            helper.make_node("Cast", ["padding"], ["padding_f"], to=TensorProto.FLOAT),
            helper.make_node("Where", ["blocked", "minus_inf", "padding_f"], ["y"]),
        ],
        [MASK], [out("y", TensorProto.FLOAT, 4)],
        [
            int64("axes", [1, 2]),
            helper.make_tensor("one_scalar", TensorProto.INT64, [], [1]),
            helper.make_tensor("minus_inf", TensorProto.FLOAT, [], [-np.inf]),
        ],
    ),
}


def onnx_attention(is_causal: int) -> bytes:
    """ONNX's own Attention op (opset 23) over [batch, heads, seq, head_dim], expanded from its
    function body with a symbolic sequence."""
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", 2, "seq", 4])
    graph = helper.make_graph(
        [helper.make_node("Attention", ["q", "q", "q"], ["y"], is_causal=is_causal)], "g", [q], [out("y", rank=4)]
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return m.SerializeToString()


CASES["onnx_attention"] = onnx_attention(0)
CASES["onnx_attention_causal"] = onnx_attention(1)


def inputs_of(data: bytes, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    names = {i.name for i in onnx.load_from_string(data).graph.input}
    feeds: dict[str, np.ndarray] = {}
    if "x" in names:
        feeds["x"] = rng.standard_normal((batch, seq, 4)).astype(np.float32)
    if "q" in names:
        feeds["q"] = rng.standard_normal((batch, 2, seq, 4)).astype(np.float32)
    if "mask" in names:
        lengths = seq - np.arange(batch) % seq
        feeds["mask"] = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return feeds


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_compile_matches_onnxruntime_at_every_size(case: str) -> None:
    data = CASES[case]
    program = executable(compile_onnx(data, "cpu"))
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for batch, seq in SIZES:
        feeds = inputs_of(data, batch, seq)
        (want,) = session.run(["y"], feeds)
        got = program.run(feeds)["y"]
        assert got.shape == want.shape, (case, batch, seq)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{case} batch={batch} seq={seq}")


def test_symbolic_output_dims_are_reported_in_the_signature() -> None:
    artifact = compile_onnx(CASES["concat_along_seq"], "cpu")
    assert artifact.signature.outputs[0].to_json()["shape"] == ["batch", "seq+1", 4]
    artifact = compile_onnx(CASES["pad_to_even_and_fold_pairs"], "cpu")
    assert artifact.signature.outputs[0].to_json()["shape"] == ["batch", "floordiv(seq+1,2)", 8]


# ---- reshapes that reorder symbols -----------------------------------------------------------------
# A Reshape of a row-major buffer reinterprets its bytes: (batch, seq, 4) -> (seq, batch, 4) is the
# same memory with a new shape, not a transpose. Generated C once read such a target as if batch
# were seq (the two only differ at run time), so these run where the symbols differ from each other
# and their products differ from both.


def _dims(name: str, symbols: list[str]) -> list[onnx.NodeProto]:
    """`name`'s own dims, one 1-element tensor per symbol (Shape then Gather, as exporters write)."""
    nodes = [helper.make_node("Shape", [name], [f"{name}_shape"])]
    for axis, symbol in enumerate(symbols):
        nodes.append(helper.make_node("Gather", [f"{name}_shape", f"at{axis}"], [symbol], axis=0))
    return nodes


def _axes(count: int) -> list[onnx.TensorProto]:
    return [int64(f"at{axis}", [axis]) for axis in range(count)]


X3 = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", "heads", 2])

REORDERING_RESHAPES = {
    # (batch, seq, 4) -> (seq, batch, 4)
    "swap_two_symbols": model(
        [
            *_dims("x", ["batch", "seq"]),
            helper.make_node("Concat", ["seq", "batch", "four"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [X], [out()], [*_axes(2), int64("four", [4])],
    ),
    # (batch, seq, heads, 2) -> (heads, batch, seq, 2)
    "permute_three_symbols": model(
        [
            *_dims("x", ["batch", "seq", "heads"]),
            helper.make_node("Concat", ["heads", "batch", "seq", "two"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [X3], [out(rank=4)], [*_axes(3), int64("two", [2])],
    ),
    # (batch, seq, 4) -> (batch, seq*4), negated (a buffer of its own), -> (seq, batch*4)
    "merge_then_split_the_other_way": model(
        [
            *_dims("x", ["batch", "seq"]),
            helper.make_node("Concat", ["batch", "minus_one"], ["merged_shape"], axis=0),
            helper.make_node("Reshape", ["x", "merged_shape"], ["merged"]),
            helper.make_node("Neg", ["merged"], ["negated"]),
            helper.make_node("Mul", ["batch", "four"], ["batch_by_four"]),
            helper.make_node("Concat", ["seq", "batch_by_four"], ["target"], axis=0),
            helper.make_node("Reshape", ["negated", "target"], ["y"]),
        ],
        [X], [out(rank=2)], [*_axes(2), int64("four", [4]), int64("minus_one", [-1])],
    ),
    # Flatten to (batch*seq, 4), then back as (seq, batch, 4)
    "flatten_then_swap": model(
        [
            *_dims("x", ["batch", "seq"]),
            helper.make_node("Flatten", ["x"], ["flat"], axis=2),
            helper.make_node("Relu", ["flat"], ["positive"]),
            helper.make_node("Concat", ["seq", "batch", "four"], ["target"], axis=0),
            helper.make_node("Reshape", ["positive", "target"], ["y"]),
        ],
        [X], [out()], [*_axes(2), int64("four", [4])],
    ),
    # Unsqueeze to (batch, 1, seq, 4), reshaped to (seq, 1, batch, 4), Squeeze back to rank 3
    "unsqueeze_swap_squeeze": model(
        [
            *_dims("x", ["batch", "seq"]),
            helper.make_node("Unsqueeze", ["x", "one"], ["tall"]),
            helper.make_node("Concat", ["seq", "one", "batch", "four"], ["target"], axis=0),
            helper.make_node("Reshape", ["tall", "target"], ["swapped"]),
            helper.make_node("Squeeze", ["swapped", "one"], ["y"]),
        ],
        [X], [out()], [*_axes(2), int64("one", [1]), int64("four", [4])],
    ),
    # row 0 of every batch Expanded over seq, then read as (seq, batch, 4)
    "expand_then_swap": model(
        [
            *_dims("x", ["batch", "seq"]),
            helper.make_node("Slice", ["x", "zero", "one", "one"], ["first"]),
            helper.make_node("Shape", ["x"], ["full"]),
            helper.make_node("Expand", ["first", "full"], ["spread"]),
            helper.make_node("Add", ["spread", "x"], ["summed"]),
            helper.make_node("Concat", ["seq", "batch", "four"], ["target"], axis=0),
            helper.make_node("Reshape", ["summed", "target"], ["y"]),
        ],
        [X], [out()], [*_axes(2), int64("zero", [0]), int64("one", [1]), int64("four", [4])],
    ),
}
# (batch, seq, heads): each symbol differs from the others and from their products
REORDER_SIZES = ((2, 5, 3), (5, 3, 2), (3, 2, 7))


@pytest.mark.parametrize("candidate", ["native-blas", "native-loops"])
@pytest.mark.parametrize("case", sorted(REORDERING_RESHAPES))
def test_reshapes_that_reorder_symbols_match_onnxruntime(case: str, candidate: str) -> None:
    data = REORDERING_RESHAPES[case]
    artifact = compile_onnx(data, candidates=(candidate,))
    # the generated C itself, not the NumPy lowering it falls back to when verification fails
    assert artifact.report["chosen"] == candidate, artifact.report["rejected"]
    program = executable(artifact)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rank = len(onnx.load_from_string(data).graph.input[0].type.tensor_type.shape.dim)
    for batch, seq, heads in REORDER_SIZES:
        shape = (batch, seq, heads, 2) if rank == 4 else (batch, seq, 4)
        x = np.random.default_rng(batch * 100 + seq).standard_normal(shape).astype(np.float32)
        (want,) = session.run(["y"], {"x": x})
        got = program.run({"x": x})["y"]
        assert got.shape == want.shape, (case, shape)
        np.testing.assert_array_equal(got, want, err_msg=f"{case} {candidate} at {shape}")


def test_verification_gives_each_symbol_its_own_size() -> None:
    """A program that mixes two symbols up agrees with the reference when all symbols share one
    size: the compile's check runs them at different sizes."""
    graph = load_graph(REORDERING_RESHAPES["permute_three_symbols"])
    inputs, _ = verification_case(graph)
    assert len(set(inputs["x"].shape[:3])) == 3
    assert sample_inputs(graph)["x"].shape == (3, 3, 3, 2)


# ---- honest refusals ---------------------------------------------------------------------------------

DATA_DEPENDENT = {
    "NonZero": model([helper.make_node("NonZero", ["mask"], ["y"])], [MASK], [out("y", TensorProto.INT64, 2)]),
    "Unique": model([helper.make_node("Unique", ["mask"], ["y"])], [MASK], [out("y", TensorProto.INT64, 1)]),
    # a Reshape whose target is read from the data
    "Reshape": model(
        [
            helper.make_node("ReduceMax", ["mask"], ["longest"], keepdims=0),
            helper.make_node("Reshape", ["longest", "one"], ["count"]),
            helper.make_node("Concat", ["minus_one", "count"], ["target"], axis=0),
            helper.make_node("Reshape", ["mask", "target"], ["y"], name="reshape_to_data"),
        ],
        [MASK], [out("y", TensorProto.INT64, 2)], [int64("one", [1]), int64("minus_one", [-1])],
    ),
}


@pytest.mark.parametrize("op", sorted(DATA_DEPENDENT))
def test_shapes_that_depend_on_data_are_refused_naming_the_op(op: str) -> None:
    with pytest.raises(UnsupportedModel, match=op):
        compile_onnx(DATA_DEPENDENT[op], "cpu")


def test_a_refusal_inside_the_graph_names_the_node() -> None:
    with pytest.raises(UnsupportedModel, match=r"Reshape with a shape computed at run time \(node 'reshape_to_data'\)"):
        compile_onnx(DATA_DEPENDENT["Reshape"], "cpu")


def test_a_buffer_cut_to_the_sequence_length_limits_the_sequence() -> None:
    # positions[: seq + 1] of an 8-row table: the model serves seq up to 7, and says so
    data = model(
        [
            helper.make_node("Shape", ["mask"], ["seq"], start=1, end=2),
            helper.make_node("Add", ["seq", "one"], ["end"]),
            helper.make_node("Slice", ["table", "zero", "end"], ["y"]),
        ],
        [MASK], [out("y", TensorProto.FLOAT, 1)],
        [int64("zero", [0]), int64("one", [1]), helper.make_tensor("table", TensorProto.FLOAT, [8], list(range(8)))],
    )
    artifact = compile_onnx(data, "cpu")
    assert artifact.signature.size_limits == {"seq": 7}
    assert artifact.signature.outputs[0].to_json()["shape"] == ["seq+1"]
    program = executable(artifact)
    np.testing.assert_array_equal(program.run({"mask": np.ones((1, 7), np.int64)})["y"], np.arange(8))
    with pytest.raises(ShapeError, match="slice"):
        program.run({"mask": np.ones((1, 8), np.int64)})


def test_indices_provably_in_range_skip_the_negative_index_wrap() -> None:
    # Range-built indices are known to be >= 0, so no comparison is emitted for them; a constant
    # -1 needs the wrap (one LessThan), computed against the symbolic length
    def comparisons(case: str) -> int:
        return sum(node.op is Op.LESS_THAN for node in compile_onnx(CASES[case], "cpu").graph.nodes)

    assert comparisons("gather_nd_over_ranges") == 0
    assert comparisons("negative_indices_into_seq") == 1


@pytest.mark.parametrize("case", ["concat_along_seq", "pad_to_even_and_fold_pairs", "slice_reversed_by_two", "split_first_token"])
def test_symbolic_views_survive_the_artifact_files(case: str) -> None:
    artifact = compile_onnx(CASES[case], "cpu")
    files = artifact.to_files()
    loaded = Artifact.from_files(files.__getitem__)
    assert loaded.signature == artifact.signature
    assert loaded.graph_hash == artifact.graph_hash == loaded.graph.content_hash()
    feeds = inputs_of(CASES[case], 2, 7)
    np.testing.assert_array_equal(executable(loaded).run(feeds)["y"], executable(artifact).run(feeds)["y"])


def test_value_ranges_do_not_survive_a_narrowing_cast() -> None:
    b = GraphBuilder()
    positions = b.iota(SEQ)
    wide = b.constant(np.array([200, 100], np.int64))
    ranges = ValueRanges(b)
    assert ranges.non_negative(positions) and ranges.below(positions, SEQ)
    assert not ranges.below(positions, SEQ - 1)
    assert ranges.non_negative(b.cast(wide, "int16"))
    assert not ranges.non_negative(b.cast(wide, "int8"))  # 200 wraps to -56
    assert ranges.non_negative(b.cast(positions, "int32"))  # no extent reaches 2**31
    assert not ranges.non_negative(b.cast(positions, "int16"))
