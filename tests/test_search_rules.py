"""The search compiler's first stage (compiler/search): every rule family keeps the reference
interpreter's answers and actually fires; the search is deterministic, bounded and never raises."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.frontends.onnx import load_graph
from compiler.ir import Graph, GraphBuilder, Node, Op, SymDim
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.search import SearchBudget, optimize
from compiler.search import egraph as search_egraph
from tests.hf_corpus import CORPUS, exported, make_inputs

N = SymDim.named("n")


def ops(graph: Graph) -> Counter[Op]:
    return Counter(node.op for node in graph.nodes)


def views(graph: Graph) -> Counter[str]:
    return Counter(node.arg[0] for node in graph.nodes if node.op is Op.VIEW)


def assert_same_values(
    expected: np.ndarray, actual: np.ndarray, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Equal up to rounding; NaN where the reference has NaN. Re-associated constants may move
    an overflow: values past 1e30 (or non-finite) only have to be past it on both sides."""
    assert expected.shape == actual.shape and expected.dtype == actual.dtype
    if expected.dtype.kind not in "fc":
        np.testing.assert_array_equal(actual, expected)
        return
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    huge_e, huge_a = ~(np.abs(e) < 1e30), ~(np.abs(a) < 1e30)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
    np.testing.assert_array_equal(huge_a, huge_e)
    both = ~huge_e
    np.testing.assert_allclose(a[both], e[both], rtol=rtol, atol=atol)


def check(graph: Graph, budget: SearchBudget | None = None, seeds=(0, 1)) -> tuple[Graph, dict]:
    """Optimizes and compares with the original on random inputs; returns the result."""
    optimized, report = optimize(graph, budget or SearchBudget())
    assert report["fallback"] is None
    assert optimized.input_specs() == graph.input_specs()
    assert optimized.output_specs() == graph.output_specs()
    assert set(optimized.weights) == {n.arg for n in optimized.nodes if n.op is Op.CONSTANT}
    assert optimized.size_limits == graph.size_limits
    for seed in seeds:
        inputs = sample_inputs(graph, seed=seed, int_high=2)
        expected, actual = run_graph(graph, inputs), run_graph(optimized, inputs)
        for name in expected:
            assert_same_values(expected[name], actual[name])
    return optimized, report


def fired(report: dict, ruleset: str, rule: str) -> int:
    return report["rules"][ruleset].get(rule, 0)


# ---- algebra ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
def test_multiply_by_one_and_add_zero_are_removed(dtype):
    b = GraphBuilder()
    x = b.input("x", (N, 4), dtype)
    y = b.binary(Op.MUL, x, b.scalar_like(1, x))
    z = b.binary(Op.ADD, b.scalar_like(0, y), y)
    graph = b.finish([("z", b.unary(Op.SQRT, z) if dtype == "float32" else z)])
    optimized, report = check(graph)
    assert ops(optimized)[Op.MUL] == 0 and ops(optimized)[Op.ADD] == 0
    assert fired(report, "identities", "mul_by_one_left") or fired(report, "identities", "mul_by_one_right")


def test_layer_norm_scale_of_ones_and_bias_of_zeros_are_removed():
    b = GraphBuilder()
    x = b.input("x", (N, 4), "float32")
    gamma = b.broadcast_to(b.constant(np.ones(4, np.float32)), (N, 4))
    beta = b.broadcast_to(b.constant(np.zeros(4, np.float32)), (N, 4))
    graph = b.finish([("y", b.binary(Op.ADD, b.binary(Op.MUL, x, gamma), beta))])
    optimized, _ = check(graph)
    assert ops(optimized)[Op.MUL] == 0 and ops(optimized)[Op.ADD] == 0


def test_a_constant_not_all_ones_is_kept():
    b = GraphBuilder()
    x = b.input("x", (N, 4), "float32")
    almost = b.broadcast_to(b.constant(np.array([1, 1, 2, 1], np.float32)), (N, 4))
    graph = b.finish([("y", b.binary(Op.MUL, x, almost))])
    optimized, _ = check(graph)
    assert ops(optimized)[Op.MUL] == 1


def test_multiply_by_zero_is_folded_for_integers_only():
    for dtype, muls in (("int32", 0), ("float32", 1)):  # float: inf * 0 is NaN, not 0
        b = GraphBuilder()
        x = b.input("x", (N, 3), dtype)
        graph = b.finish([("y", b.binary(Op.MUL, b.scalar_like(0, x), x))])
        optimized, _ = check(graph)
        assert ops(optimized)[Op.MUL] == muls, dtype


def test_reciprocal_of_reciprocal_is_removed_for_floats_only():
    for dtype, recips in (("float32", 0), ("int64", 2)):
        b = GraphBuilder()
        x = b.input("x", (N, 3), dtype)
        graph = b.finish([("y", b.unary(Op.RECIP, b.unary(Op.RECIP, x)))])
        optimized, _ = check(graph)
        assert ops(optimized)[Op.RECIP] == recips, dtype


def test_log2_of_exp2_is_removed_only_for_bounded_values():
    b = GraphBuilder()
    x = b.input("x", (N, 3), "float32")
    bounded = b.binary(Op.MUL, b.scalar_like(40.0, x), b.unary(Op.SIN, x))  # |v| <= 64
    graph = b.finish(
        [
            ("bounded", b.unary(Op.LOG2, b.unary(Op.EXP2, bounded))),
            ("unbounded", b.unary(Op.LOG2, b.unary(Op.EXP2, x))),  # exp2(200) is inf in float32
        ]
    )
    optimized, report = check(graph)
    assert fired(report, "identities", "log2_of_bounded_exp2") >= 1
    assert ops(optimized)[Op.LOG2] == 1 and ops(optimized)[Op.EXP2] == 1
    big = {"x": np.full((2, 3), 200.0, np.float32)}
    assert np.array_equal(run_graph(optimized, big)["unbounded"], run_graph(graph, big)["unbounded"])


def test_exp2_of_log2_is_removed_only_for_non_negative_values():
    b = GraphBuilder()
    x = b.input("x", (N, 3), "float32")
    squared = b.binary(Op.MUL, x, x)
    graph = b.finish(
        [
            ("square", b.unary(Op.EXP2, b.unary(Op.LOG2, squared))),
            ("any", b.unary(Op.EXP2, b.unary(Op.LOG2, x))),  # NaN for negative x
        ]
    )
    optimized, report = check(graph)
    assert fired(report, "identities", "exp2_of_nonneg_log2") >= 1
    assert ops(optimized)[Op.LOG2] == 1


@pytest.mark.parametrize("op", [Op.MUL, Op.ADD])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_chains_of_scalar_constants_fold_into_one(op, dtype):
    b = GraphBuilder()
    x = b.input("x", (N, 4), dtype)
    y = x
    for value in (3, 5, 7):
        y = b.binary(op, b.scalar_like(value, y), y)
    graph = b.finish([("y", y)])
    optimized, report = check(graph)
    assert ops(optimized)[op] == 1
    assert sum(report["rules"]["constant_chains"].values()) >= 1


def test_a_chain_whose_product_would_overflow_is_kept():
    b = GraphBuilder()
    x = b.input("x", (N, 4), "float32")
    y = b.binary(Op.MUL, b.scalar_like(1e30, x), b.binary(Op.MUL, b.scalar_like(1e30, x), x))
    graph = b.finish([("y", y)])
    optimized, _ = check(graph)
    assert ops(optimized)[Op.MUL] == 2
    tiny = {"x": np.full((2, 4), 1e-40, np.float32)}
    assert np.array_equal(run_graph(optimized, tiny)["y"], run_graph(graph, tiny)["y"])


# ---- casts and masks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "through", "casts_left"),
    [("bool", "uint8", 0), ("int32", "int64", 0), ("float16", "float32", 0), ("float32", "float16", 2)],
)
def test_a_cast_through_a_wider_type_and_back_is_removed(source, through, casts_left):
    b = GraphBuilder()
    x = b.input("x", (N, 3), source)
    graph = b.finish([("y", b.cast(b.cast(x, through), source))])
    optimized, _ = check(graph)
    assert ops(optimized)[Op.CAST] == casts_left


def test_a_cast_to_the_values_own_dtype_is_removed():
    graph = Graph(
        [Node(Op.INPUT, (), (N, 3), "float32", "x"), Node(Op.CAST, (0,), (N, 3), "float32")], [0], [("y", 1)]
    )
    optimized, report = check(graph)
    assert ops(optimized)[Op.CAST] == 0
    assert fired(report, "casts", "cast_to_own_dtype") >= 1


def test_boolean_masks_computed_through_integers_stay_boolean():
    b = GraphBuilder()
    p, q = b.input("p", (N, 3), "bool"), b.input("q", (N, 3), "bool")
    both = b.cast(b.binary(Op.MUL, b.cast(p, "uint8"), b.cast(q, "uint8")), "bool")
    either = b.cast(b.binary(Op.ADD, b.cast(p, "int64"), b.cast(q, "int64")), "bool")
    graph = b.finish([("both", both), ("either", either)])
    optimized, report = check(graph)
    assert ops(optimized)[Op.CAST] == 0
    assert fired(report, "masks", "bool_and_through_numbers") >= 1
    assert fired(report, "masks", "bool_or_through_numbers") >= 1


# ---- views -----------------------------------------------------------------------------------


def test_permutes_compose_and_an_identity_permute_disappears():
    b = GraphBuilder()
    x = b.input("x", (N, 4, 5), "float32")
    once = b.permute(b.permute(x, (1, 2, 0)), (0, 2, 1))
    back = b.permute(b.permute(x, (1, 0, 2)), (1, 0, 2))
    graph = b.finish([("once", b.unary(Op.SIN, once)), ("back", b.unary(Op.SIN, back))])
    optimized, report = check(graph)
    assert views(optimized)["permute"] == 1
    assert report["layout_rules"]["compose_permutes"] >= 2


def test_reshapes_compose_and_expands_compose():
    b = GraphBuilder()
    x = b.input("x", (N, 4, 6), "float32")
    round_trip = b.reshape(b.reshape(x, (N, 24)), (N, 4, 6))
    flat = b.reshape(b.reshape(x, (N, 4, 2, 3)), (N, 24))
    row = b.input("row", (1, 1, 6), "float32")
    wide = b.expand(b.expand(row, (1, 4, 6)), (N, 4, 6))
    outs = [("round_trip", round_trip), ("flat", flat), ("wide", b.binary(Op.ADD, wide, x))]
    graph = b.finish([(name, b.unary(Op.SIN, v)) for name, v in outs])
    optimized, report = check(graph)
    assert views(optimized) == Counter({"reshape": 1, "expand": 1})
    assert report["layout_rules"]["compose_reshapes"] >= 2 and report["layout_rules"]["compose_expands"] >= 1


def test_views_to_the_same_shape_are_removed():
    shape = (N, 3)
    graph = Graph(
        [
            Node(Op.INPUT, (), shape, "float32", "x"),
            Node(Op.VIEW, (0,), shape, "float32", ("reshape", shape)),
            Node(Op.VIEW, (1,), shape, "float32", ("expand", shape)),
            Node(Op.VIEW, (2,), shape, "float32", ("slice", ((0, None, 1), (0, 3, 1)))),
            Node(Op.SIN, (3,), shape, "float32"),
        ],
        [0],
        [("y", 4)],
    )
    optimized, _ = check(graph)
    assert ops(optimized)[Op.VIEW] == 0


def test_a_reduction_over_axes_of_size_one_becomes_a_reshape():
    b = GraphBuilder()
    x = b.input("x", (N, 1, 4), "float32")
    graph = b.finish([("s", b.reduce(Op.SUM_REDUCE, x, [1])), ("m", b.reduce(Op.MAX_REDUCE, x, [1]))])
    optimized, _ = check(graph)
    assert ops(optimized)[Op.SUM_REDUCE] == 0 and ops(optimized)[Op.MAX_REDUCE] == 0


# ---- folding ---------------------------------------------------------------------------------


def test_weights_only_subgraphs_fold_into_one_weight():
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", (N, 4), "float32")
    w = b.constant(rng.standard_normal((4, 4)).astype(np.float32))
    scaled = b.binary(Op.MUL, b.unary(Op.RECIP, b.scalar_like(4.0, w)), b.permute(w, (1, 0)))
    column = b.reduce(Op.SUM_REDUCE, scaled, [1])  # [4], from weights only
    graph = b.finish([("y", b.binary(Op.ADD, x, b.broadcast_to(column, (N, 4))))])
    optimized, report = check(graph)
    # the folded column, reshaped to [1, 4] (folded too) and expanded
    assert ops(optimized) == Counter({Op.INPUT: 1, Op.CONSTANT: 1, Op.VIEW: 1, Op.ADD: 1})
    assert report["folding"]["fold_weights_only"] >= 4
    assert [w.shape for w in optimized.weights.values()] == [(1, 4)]


def test_an_expand_of_a_scalar_to_a_big_tensor_stays_a_view():
    b = GraphBuilder()
    big = b.broadcast_to(b.constant(np.float32(2.0)), (512, 512))
    x = b.input("x", (512, 512), "float32")
    graph = b.finish([("y", b.binary(Op.MUL, x, big))])
    optimized, _ = check(graph, seeds=(0,))
    assert ops(optimized)[Op.VIEW] >= 1
    assert sum(w.nbytes for w in optimized.weights.values()) <= 64


def test_a_tied_weight_is_not_copied_by_folding():
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    ids = b.input("ids", (N,), "int64")
    table = b.constant(rng.standard_normal((64, 16)).astype(np.float32))
    embedded = b.gather(table, ids, 0)  # [n, 16]
    head = b.permute(table, (1, 0))  # [16, 64]: still a view of the one stored table
    logits = b.reduce(
        Op.SUM_REDUCE,
        b.binary(
            Op.MUL, b.expand(b.reshape(embedded, (N, 16, 1)), (N, 16, 64)), b.broadcast_to(head, (N, 16, 64))
        ),
        [1],
    )
    graph = b.finish([("logits", logits)])
    optimized, _ = check(graph)
    assert sum(w.nbytes for w in optimized.weights.values()) == 64 * 16 * 4


# ---- random graphs ---------------------------------------------------------------------------

_CONSTANTS = (0.0, 1.0, 2.0, -0.5, 3.0, 0.25)


@st.composite
def random_graphs(draw) -> Graph:
    """Small graphs of elementwise ops, views, casts and scalar or vector constants over two
    [n, 2, 3] inputs of one dtype; each new value may read any earlier one."""
    dtype = draw(st.sampled_from(["float32", "float32", "int32"]))
    floats = dtype == "float32"
    b = GraphBuilder()
    values = [b.input("x", (N, 2, 3), dtype), b.input("y", (N, 2, 3), dtype)]
    for _ in range(draw(st.integers(1, 12))):
        x = draw(st.sampled_from(values))
        kind = draw(st.sampled_from(["unary", "scalar", "vector", "binary", "view", "cast"]))
        if kind == "unary" and floats:
            op = draw(st.sampled_from([Op.RECIP, Op.EXP2, Op.LOG2, Op.SQRT, Op.SIN]))
            values.append(b.unary(op, x))
        elif kind == "scalar":
            op = draw(st.sampled_from([Op.MUL, Op.ADD]))
            value = draw(st.sampled_from(_CONSTANTS[1:] if op is Op.MUL and floats else _CONSTANTS))
            c = b.scalar_like(value if floats else int(value), x)
            values.append(b.binary(op, c, x) if draw(st.booleans()) else b.binary(op, x, c))
        elif kind == "vector":
            row = draw(st.lists(st.sampled_from(_CONSTANTS[1:]), min_size=3, max_size=3))
            c = b.broadcast_to(b.reshape(b.constant(np.array(row, dtype)), (1, 3)), (N, 2, 3))
            values.append(b.binary(draw(st.sampled_from([Op.MUL, Op.ADD])), x, c))
        elif kind == "binary":
            values.append(b.binary(draw(st.sampled_from([Op.MUL, Op.ADD])), x, draw(st.sampled_from(values))))
        elif kind == "view":
            way = draw(st.sampled_from(["permute_back", "reshape_back", "scramble"]))
            if way == "permute_back":
                values.append(b.permute(b.permute(x, (0, 2, 1)), (0, 2, 1)))
            elif way == "reshape_back":
                values.append(b.reshape(b.reshape(x, (N, 6)), (N, 2, 3)))
            else:
                values.append(b.reshape(b.permute(x, (0, 2, 1)), (N, 2, 3)))
        else:
            through = draw(st.sampled_from(["float64", "float16", "bool", "int64", "uint8"]))
            values.append(b.cast(b.cast(x, through), dtype))
    outputs = draw(st.lists(st.sampled_from(values[2:]), min_size=1, max_size=3))
    return b.finish([(f"out{k}", v) for k, v in enumerate(outputs)])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs_keep_their_values(graph):
    check(graph, seeds=(0,))


# ---- the search itself -----------------------------------------------------------------------


def _bert() -> tuple[dict, Graph]:
    entry = next(e for e in exported() if e["file"] == "bert_dynamo.onnx")
    return entry, load_graph((CORPUS / entry["file"]).read_bytes())


def test_a_real_bert_loses_nodes_and_keeps_its_outputs():
    entry, graph = _bert()
    optimized, report = optimize(graph)
    assert report["fallback"] is None
    assert len(optimized.nodes) <= 0.85 * len(graph.nodes)
    assert report["nodes_before"] == len(graph.nodes) and report["nodes_after"] == len(optimized.nodes)
    rng = np.random.default_rng(0)
    for batch, seq in entry["checks"]:
        feeds = make_inputs(entry, batch, seq, rng)
        expected, actual = run_graph(graph, feeds), run_graph(optimized, feeds)
        for name in expected:
            np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5)


def test_the_report_says_what_ran():
    _, graph = _bert()
    _, report = optimize(graph)
    assert json.loads(json.dumps(report)) == report
    assert set(report["rules"]) == {"facts", "identities", "casts", "masks", "constant_chains"}
    assert report["rounds"] and set(report["rounds"][0]["enodes"]) == {
        "initial",
        "simplify",
        "constant_chains",
        "cleanup",
    }
    assert {"layout", "fold", "egraph_build", "egraph_run", "extract", "rebuild", "total"} <= set(
        report["seconds"]
    )
    assert report["cost_after"] < report["cost_before"]


def test_optimizing_is_deterministic():
    _, graph = _bert()
    first, _ = optimize(graph)
    second, _ = optimize(graph)
    assert first.to_json() == second.to_json()
    assert first.content_hash() == second.content_hash()


@pytest.mark.parametrize(
    "budget",
    [
        SearchBudget(max_seconds=0.0),
        SearchBudget(max_enodes=1),
        SearchBudget(max_iterations=1, analysis_iterations=1),
        SearchBudget(chunk_nodes=7),
        SearchBudget(max_rounds=0),
    ],
    ids=["no-time", "one-enode", "one-iteration", "tiny-chunks", "no-rounds"],
)
def test_a_tiny_budget_still_returns_an_equal_graph(budget):
    _, graph = _bert()
    optimized, report = check(graph, budget, seeds=(0,))
    assert len(optimized.nodes) <= len(graph.nodes)
    if budget.max_enodes == 1:
        assert all(reasons == {"enodes": 1} for reasons in report["rounds"][0]["stopped"].values())


def test_a_failing_e_graph_leaves_the_best_graph_so_far(monkeypatch):
    def broken(egraph):
        raise RuntimeError("extraction failed")

    monkeypatch.setattr(search_egraph, "_extract", broken)
    _, graph = _bert()
    optimized, report = optimize(graph)
    assert "extraction failed" in report["fallback"]
    assert len(optimized.nodes) < len(graph.nodes)  # the Python passes' result
    inputs = sample_inputs(graph, int_high=1)
    expected, actual = run_graph(graph, inputs), run_graph(optimized, inputs)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6)
