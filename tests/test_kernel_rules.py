"""Rules reach known fused forms from primitive kernels (compiler/search/kernel_rules.py):
attention with an online softmax from a product, a row max, exp2, a row sum and a second
product, built here from primitive ops with no Softmax anywhere; a product with its elementwise
epilogue. The fused programs compute what the reference interpreter does, a score read outside
the pattern keeps it unfused, and without the rules nothing fuses: the rules decide."""

from __future__ import annotations

import math

import numpy as np
import pytest

from compiler.backends.cuda_emulator import emulate
from compiler.composite import matmul, reduce_keep
from compiler.ir import GraphBuilder, Op
from compiler.kernels.attention import attention_count, find_attention, fuse_attention
from compiler.kernels.epilogue import fuse_epilogues
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import AttentionCall, GemmCall
from compiler.kernels.lower import lower
from compiler.reference import run_graph
from compiler.search import kernel_rules
from compiler.search.rules import RuleSet
from compiler.shape import SymDim, evaluate
from tests.test_epilogue import assert_matches_reference

HEADS, HEAD, WIDTH = 2, 16, 24
# the kernel the tests ask of the fused attention: wider than any head here
HEAD_LIMIT = 128


def _primitive_attention(score_reader: bool = False):
    """y = softmax(q k^T / sqrt(head)) v spelled by primitives: the softmax as
    exp2(c * (s - max s)) * recip(sum), with the scale folded into the exponent's c. With
    `score_reader` the scores are summed into a second output too: an outside reader."""
    b = GraphBuilder()
    batch, seq = SymDim.named("batch"), SymDim.named("seq")
    q = b.input("q", (batch, HEADS, seq, HEAD), "float32")
    k = b.input("k", (batch, HEADS, seq, HEAD), "float32")
    v = b.input("v", (batch, HEADS, seq, WIDTH), "float32")
    scores = matmul(b, q, b.permute(k, (0, 1, 3, 2)))
    top = b.expand(reduce_keep(b, Op.MAX_REDUCE, scores, [-1]), b.shape(scores))
    shifted = b.binary(Op.ADD, scores, b.binary(Op.MUL, b.scalar_like(-1.0, top), top))
    scale = math.log2(math.e) / math.sqrt(HEAD)
    exponentials = b.unary(Op.EXP2, b.binary(Op.MUL, b.scalar_like(scale, shifted), shifted))
    sums = b.expand(reduce_keep(b, Op.SUM_REDUCE, exponentials, [-1]), b.shape(exponentials))
    probabilities = b.binary(Op.MUL, exponentials, b.unary(Op.RECIP, sums))
    outputs = [("y", matmul(b, probabilities, v))]
    if score_reader:
        outputs.append(("row_total", b.reduce(Op.SUM_REDUCE, scores, [-1])))
    return b.finish(outputs)


def _inputs(graph, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = {"batch": batch, "seq": seq}
    return {
        name: rng.standard_normal([evaluate(d, sizes) for d in shape]).astype(np.float32)
        for name, shape, _ in graph.input_specs()
    }


def test_attention_built_from_primitives_is_found_by_the_rules_and_matches_the_reference() -> None:
    graph = _primitive_attention()
    program = fuse(lower(graph))
    fused = fuse_attention(program, HEAD_LIMIT)
    (call,) = [k for k in fused.kernels if isinstance(k, AttentionCall)]
    # six kernels (two products, max, exponentials, sums, division) became one
    assert len(program.kernels) - len(fused.kernels) == 5
    assert call.log2_scale == pytest.approx(math.log2(math.e) / math.sqrt(HEAD))
    emulated = emulate(fused, graph.size_limits)
    for seed, (batch, seq) in enumerate([(1, 45), (2, 70)]):
        inputs = _inputs(graph, batch, seq, seed)
        want = run_graph(graph, inputs)["y"]
        np.testing.assert_allclose(emulated.run(inputs)["y"], want, rtol=1e-4, atol=1e-5, err_msg=f"{batch} {seq}")


def test_the_rules_compose_softmax_first_then_attention() -> None:
    program = fuse(lower(_primitive_attention()))
    graph = kernel_rules.kernel_graph(program, HEAD_LIMIT)
    graph.run(kernel_rules.ATTENTION_RULES)
    # each smaller rule's conclusion is there, and each builds on the one before
    (shifted,) = graph.rows("ShiftedExp")
    (row_sum,) = graph.rows("ExpSum")
    (softmaxed,) = graph.rows("Softmaxed")
    (source,) = graph.rows("ScoreSource")
    (candidate,) = graph.rows("AttentionCandidate")
    assert row_sum[1] == shifted[0] and softmaxed[3] == shifted[0] and source[0] == shifted[1]
    assert candidate[2:7] == (shifted[1], shifted[0], row_sum[0], softmaxed[1], softmaxed[0])
    assert isinstance(program.kernels[candidate[0]], GemmCall) and isinstance(program.kernels[candidate[5]], GemmCall)
    # a found attention is one e-class with the division it replaces: the fused term and the
    # primitive kernels are equal terms
    ((match, _),) = find_attention(program, HEAD_LIMIT)
    found = kernel_rules.kernel_graph(program, HEAD_LIMIT)
    found.run(kernel_rules.ATTENTION_RULES)
    found.add_facts([f"(Undisturbed {match[0]} {match[6]})"])
    found.run(kernel_rules.ATTENTION_FOUND_RULES)
    found.egraph.parse_and_run_program(f"(check (= $k{match[6]} (OnlineAttention g x c v)))")
    found.egraph.parse_and_run_program(f"(check (= $k{match[6]} (SoftmaxTimes x c v)))")


def test_a_score_read_outside_the_pattern_keeps_the_attention_unfused() -> None:
    graph = _primitive_attention(score_reader=True)
    program = fuse(lower(graph))
    assert fuse_attention(program, HEAD_LIMIT) is program
    inputs = _inputs(graph, 2, 20, 0)
    got = emulate(program, graph.size_limits).run(inputs)
    for name, want in run_graph(graph, inputs).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_head_wider_than_the_limit_is_refused_by_the_rules() -> None:
    program = fuse(lower(_primitive_attention()))
    assert fuse_attention(program, WIDTH - 1) is program
    assert attention_count(fuse_attention(program, WIDTH)) == 1


def _product_with_bias_and_gelu():
    """y = gelu(x @ w + bias), gelu as h * sigmoid(1.702 h) in primitives."""
    rng = np.random.default_rng(4)
    b = GraphBuilder()
    rows = SymDim.named("n")
    x = b.input("x", (rows, 24), "float32")
    w = b.constant(rng.standard_normal((24, 40)).astype(np.float32))
    bias = b.broadcast_to(b.constant(rng.standard_normal(40).astype(np.float32)), (rows, 40))
    h = b.binary(Op.ADD, matmul(b, x, w), bias)
    exponent = b.binary(Op.MUL, b.scalar_like(-1.702 * math.log2(math.e), h), h)
    sigmoid = b.unary(Op.RECIP, b.binary(Op.ADD, b.scalar_like(1.0, h), b.unary(Op.EXP2, exponent)))
    return b.finish([("y", b.binary(Op.MUL, h, sigmoid))])


def test_a_product_s_bias_and_gelu_are_found_as_its_epilogue_and_match_the_reference() -> None:
    graph = _product_with_bias_and_gelu()
    program = fuse(lower(graph))
    (call,) = [k for k in program.kernels if isinstance(k, GemmCall)]
    assert call.epilogue is not None and len(program.kernels) == 1
    for gemm in ("blas", "tiled"):
        assert_matches_reference(graph, program, gemm)


def _without(monkeypatch, name: str) -> None:
    """The named stage of kernel_rules emptied of rules (its sets kept, each with no rule)."""
    emptied = tuple(RuleSet(rs.name, rs.doc, ()) for rs in getattr(kernel_rules, name))
    monkeypatch.setattr(kernel_rules, name, emptied)


@pytest.mark.parametrize("stage", ["ATTENTION_RULES", "ATTENTION_FOUND_RULES"])
def test_without_the_attention_rules_nothing_fuses(monkeypatch, stage: str) -> None:
    program = fuse(lower(_primitive_attention()))
    _without(monkeypatch, stage)
    assert fuse_attention(program, HEAD_LIMIT) is program


@pytest.mark.parametrize("stage", ["EPILOGUE_RULES", "EPILOGUE_FOUND_RULES"])
def test_without_the_epilogue_rules_nothing_fuses(monkeypatch, stage: str) -> None:
    graph = _product_with_bias_and_gelu()
    _without(monkeypatch, stage)
    program = fuse(lower(graph))
    assert all(k.epilogue is None for k in program.kernels if isinstance(k, GemmCall))
    assert fuse_epilogues(program) is program


def test_without_one_smaller_rule_the_softmax_is_not_composed(monkeypatch) -> None:
    program = fuse(lower(_primitive_attention()))
    softmax = kernel_rules.SOFTMAX
    kept = tuple(rule for rule in softmax.rules if rule.name != "row_sum_of_exponentials")
    rulesets = tuple(
        RuleSet(rs.name, rs.doc, kept) if rs is softmax else rs for rs in kernel_rules.ATTENTION_RULES
    )
    monkeypatch.setattr(kernel_rules, "ATTENTION_RULES", rulesets)
    assert fuse_attention(program, HEAD_LIMIT) is program
