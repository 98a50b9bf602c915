"""Lowerings of reductions and what ranks or accumulates along an axis: the Reduce ops,
ArgMax/ArgMin, Hardmax, LogSoftmax, CumSum/CumProd, Einsum, the losses and TopK.

Everything is spelled in primitives (normalizations are in norm.py): min as a max of
order-reversed values, products and scans as log-depth trees of exact multiplications (never
exp2 of summed logs), index lookups as gathers from flattened tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from compiler import composite as C
from compiler.dtypes import highest, is_float, lowest
from compiler.frontends.onnx_context import (
    Context,
    attrs,
    float_input,
    lowers,
    normalized_axis,
    refuse,
    text,
)
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, ShapeError, numel

# ---- reductions --------------------------------------------------------------------------


def _product(node: onnx.NodeProto, b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    shape = b.shape(x)
    kept = [a for a in range(len(shape)) if a not in axes]
    length = numel([shape[a] for a in axes])
    if not isinstance(length, int):
        raise refuse(node, "a product over symbolic dimensions")
    flat = b.reshape(b.permute(x, [*kept, *axes]), (*(shape[a] for a in kept), length))
    return C.product_last(b, flat)


def _log_sum_exp(b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    peak = C.reduce_keep(b, Op.MAX_REDUCE, x, axes)
    # an infinite peak (all -inf, or some +inf) is not subtracted: it would give inf - inf
    peak = C.where(b, C.is_finite(b, peak), peak, b.scalar_like(0, peak))
    shifted = C.exp(b, C.sub(b, x, peak))
    total = b.reduce(Op.SUM_REDUCE, shifted, axes)
    return b.binary(Op.ADD, C.log(b, total), b.reshape(peak, b.shape(total)))


def _reduce(node: onnx.NodeProto, b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    """The reduction of `node`'s kind over `axes`, with those axes removed."""
    kind = node.op_type
    if kind in ("ReduceSum", "ReduceMean"):
        return b.reduce(Op.SUM_REDUCE, x, axes) if kind == "ReduceSum" else C.mean(b, x, axes)
    if kind in ("ReduceSumSquare", "ReduceL2"):
        total = b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, x, x), axes)
        return total if kind == "ReduceSumSquare" else b.unary(Op.SQRT, total)
    if kind == "ReduceL1":
        return b.reduce(Op.SUM_REDUCE, C.absolute(b, x), axes)
    if kind == "ReduceLogSum":
        return C.log(b, b.reduce(Op.SUM_REDUCE, x, axes))
    if kind == "ReduceLogSumExp":
        return _log_sum_exp(b, x, axes)
    if kind == "ReduceMax":
        return b.reduce(Op.MAX_REDUCE, x, axes)
    if kind == "ReduceMin":
        return C.reduce_min(b, x, axes)
    assert kind == "ReduceProd"
    return _product(node, b, x, axes)


def _empty_reduction(kind: str, dtype: str) -> np.ndarray:
    """The value of a reduction over no elements."""
    if dtype == "bool":
        return np.asarray(kind == "ReduceMin")
    if kind in ("ReduceMax", "ReduceMin"):
        return np.asarray(lowest(dtype) if kind == "ReduceMax" else highest(dtype), dtype=dtype)
    value = {"ReduceProd": 1, "ReduceMean": np.nan, "ReduceLogSum": -np.inf, "ReduceLogSumExp": -np.inf}
    return np.asarray(value.get(kind, 0), dtype=dtype)


# the opset from which the axes are an input rather than an attribute
_AXES_INPUT_SINCE = {"ReduceSum": 13}
_FLOAT_ONLY = ("ReduceMean", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp")


def _reduce_axes(ctx: Context, node: onnx.NodeProto, rank: int) -> list[int] | None:
    """The normalized axes to reduce, or None when the node is a no-op."""
    a = attrs(node)
    if ctx.opset >= _AXES_INPUT_SINCE.get(node.op_type, 18):
        axes = None
        if len(node.input) > 1 and node.input[1]:
            name = node.input[1]
            if name in ctx.consts:
                axes = [int(v) for v in ctx.consts[name].reshape(-1)]
            elif ctx.b.shape(ctx.value(node, 1)) == (0,):
                axes = []  # an empty axes tensor is known empty from its shape alone
            else:
                raise refuse(node, "axes computed at run time")
    else:
        axes = a.get("axes")
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return None
        return list(range(rank))
    if any(not -rank <= v < rank for v in axes) or len({v % rank for v in axes}) != len(axes):
        raise ShapeError(f"{node.op_type} axes {axes} invalid for rank {rank}")
    return sorted(v % rank for v in axes)


@lowers(
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)
def _reduction(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    shape, dtype = b.shape(x), b.dtype(x)
    if dtype == "bool" and node.op_type not in ("ReduceMax", "ReduceMin"):
        raise refuse(node, "bool input")
    if not is_float(dtype) and node.op_type in _FLOAT_ONLY:
        raise refuse(node, f"{dtype} input")
    axes = _reduce_axes(ctx, node, len(shape))
    if axes is None:
        return [x]
    keepdims = attrs(node).get("keepdims", 1)
    out_shape = tuple(1 if i in axes else d for i, d in enumerate(shape) if keepdims or i not in axes)
    if numel(shape) == 0:
        fill = b.constant(_empty_reduction(node.op_type, dtype))
        return [b.broadcast_to(fill, out_shape)]
    return [b.reshape(_reduce(node, b, x, axes), out_shape)]


# ---- arg max / arg min / hard max --------------------------------------------------------

# larger than any axis length, so BIG - position ranks earlier positions higher
_BIG = 1 << 62


def _at_maximum(b: GraphBuilder, x: int, axis: int) -> int:
    """Where x attains its maximum along `axis` (the NaNs, if any, as numpy's argmax has it)."""
    peak = b.expand(C.reduce_keep(b, Op.MAX_REDUCE, x, [axis]), b.shape(x))
    hit = C.logical_not(b, C.less(b, x, peak))
    if is_float(b.dtype(x)):
        # a NaN peak: not(x < NaN) holds everywhere, only the NaNs themselves count
        nan_peak_elsewhere = C.logical_and(b, C.is_nan(b, peak), C.logical_not(b, C.is_nan(b, x)))
        hit = C.logical_and(b, hit, C.logical_not(b, nan_peak_elsewhere))
    return hit


def _hit_index(b: GraphBuilder, hit: int, axis: int, last: bool) -> int:
    """The first (or last) position along `axis` where `hit` holds, as int64 with axis removed."""
    position = C.axis_positions(b, b.shape(hit), axis)
    hit = b.cast(hit, "int64")
    if last:
        score = b.binary(Op.MUL, hit, C.shift(b, position, 1))
        return C.shift(b, b.reduce(Op.MAX_REDUCE, score, [axis]), -1)
    score = b.binary(Op.MUL, hit, C.shift(b, C.neg(b, position), _BIG))
    return C.shift(b, C.neg(b, b.reduce(Op.MAX_REDUCE, score, [axis])), _BIG)


def _comparable(b: GraphBuilder, x: int) -> int:
    return b.cast(x, "uint8") if b.dtype(x) == "bool" else x


@lowers("ArgMax", "ArgMin")
def _arg_extreme(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = _comparable(b, ctx.value(node, 0))
    shape = b.shape(x)
    axis = normalized_axis(node, a.get("axis", 0), len(shape))
    if shape[axis] == 0:
        raise ShapeError(f"{node.op_type} over an empty axis")
    if node.op_type == "ArgMin":
        x = C.reverse_order(b, x)
    index = _hit_index(b, _at_maximum(b, x, axis), axis, bool(a.get("select_last_index", 0)))
    if a.get("keepdims", 1):
        index = C.keepdims(b, index, shape, [axis])
    return [index]


def _along_flattened(ctx: Context, node: onnx.NodeProto, fn) -> list[int]:
    """Apply fn(b, x, axis): along `axis` from opset 13, before that over all axes from `axis` on."""
    b = ctx.b
    x = float_input(ctx, node)
    shape = b.shape(x)
    if ctx.opset >= 13:
        return [fn(b, x, normalized_axis(node, attrs(node).get("axis", -1), len(shape)))]
    axis = attrs(node).get("axis", 1)
    axis += len(shape) if axis < 0 else 0
    if not 0 <= axis <= len(shape):
        raise ShapeError(f"{node.op_type} axis {axis} out of range for rank {len(shape)}")
    return [b.reshape(fn(b, C.flatten(b, x, axis), 1), shape)]


def _log_softmax(b: GraphBuilder, x: int, axis: int) -> int:
    shape = b.shape(x)
    shifted = C.sub(b, x, C.reduce_keep(b, Op.MAX_REDUCE, x, [axis]))
    log_total = C.log(b, C.reduce_keep(b, Op.SUM_REDUCE, C.exp(b, shifted), [axis]))
    return b.binary(Op.ADD, shifted, C.neg(b, b.expand(log_total, shape)))


def _hardmax(b: GraphBuilder, x: int, axis: int) -> int:
    shape = b.shape(x)
    first = C.keepdims(b, _hit_index(b, _at_maximum(b, x, axis), axis, last=False), shape, [axis])
    position_shape = [1] * len(shape)
    position_shape[axis] = shape[axis]
    position = b.reshape(b.iota(shape[axis]), position_shape)
    return b.cast(b.broadcast_to(C.equal(b, position, first), shape), b.dtype(x))


@lowers("LogSoftmax")
def _log_softmax_node(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return _along_flattened(ctx, node, _log_softmax)


@lowers("Hardmax")
def _hardmax_node(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return _along_flattened(ctx, node, _hardmax)


# ---- scans -------------------------------------------------------------------------------


def _shifted(b: GraphBuilder, x: int, axis: int, distance: int, fill: float, backward: bool) -> int:
    """x moved `distance` places along `axis` (towards the end, or the start if backward)."""
    rank = len(b.shape(x))
    n = b.shape(x)[axis]
    widths = [(0, 0)] * rank
    widths[axis] = (0, distance) if backward else (distance, 0)
    bounds = [(0, None, 1)] * rank
    bounds[axis] = (distance, n + distance, 1) if backward else (0, n, 1)
    return b.view(C.pad(b, x, widths, fill), ("slice", tuple(bounds)))


@lowers("CumSum", "CumProd")
def _cumulative(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = ctx.value(node, 0)
    shape = b.shape(x)
    if b.dtype(x) == "bool":
        raise refuse(node, "bool input")
    if node.input[1] in ctx.consts:
        axis = normalized_axis(node, int(ctx.consts[node.input[1]].reshape(())), len(shape))
    elif len(shape) == 1:
        axis = 0  # the only valid axis of a vector, whatever its value at run time
    else:
        raise refuse(node, "an axis computed at run time")
    n = shape[axis]
    backward = bool(a.get("reverse", 0))
    if not isinstance(n, int):
        if node.op_type != "CumSum":
            raise refuse(node, "a product scan over a symbolic dimension")
        return [_masked_cumsum(b, x, axis, backward, bool(a.get("exclusive", 0)))]
    op, fill = (Op.ADD, 0) if node.op_type == "CumSum" else (Op.MUL, 1)
    if a.get("exclusive", 0):
        x = _shifted(b, x, axis, 1, fill, backward)
    # Hillis-Steele scan: log2(n) rounds, each combining with the value `distance` places back
    distance = 1
    while distance < n:
        x = b.binary(op, x, _shifted(b, x, axis, distance, fill, backward))
        distance *= 2
    return [x]


def _masked_cumsum(b: GraphBuilder, x: int, axis: int, backward: bool, exclusive: bool) -> int:
    """A running sum over an axis of symbolic length: a contraction with a triangular 0/1 matrix
    (out[i] = sum of x[j] over the j that precede i), since the scan's round count is unknown."""
    shape = b.shape(x)
    n = shape[axis]
    rank = len(shape)
    out_pos = b.reshape(b.iota(n), (n, 1))
    in_pos = b.reshape(b.iota(n), (1, n))
    later, earlier = (in_pos, out_pos) if not backward else (out_pos, in_pos)
    # j precedes i: j < i when exclusive, j <= i (j < i + 1) otherwise
    bound = earlier if exclusive else C.shift(b, earlier, 1)
    taken = b.cast(C.less(b, later, bound), b.dtype(x))
    moved = b.permute(x, [d for d in range(rank) if d != axis] + [axis])
    summed = b.reduce(Op.SUM_REDUCE, C.mul(b, b.unsqueeze(moved, -2), taken), [-1])
    inverse = list(range(rank - 1))
    inverse.insert(axis, rank - 1)
    return b.permute(summed, inverse)


# ---- einsum ------------------------------------------------------------------------------


def _einsum_terms(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """Input and output subscripts, each letter one axis, with ellipses spelled out."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ShapeError(f"Einsum equation {equation!r} names {len(terms)} operands, got {len(ranks)}")
    ellipsis_rank = max(
        (rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t), default=0
    )
    # characters outside the ASCII letters stand for the axes an ellipsis covers
    broadcast = "".join(chr(0x100 + i) for i in range(ellipsis_rank))
    expanded = []
    for term, rank in zip(terms, ranks):
        if "..." in term:
            covered = rank - len(term.replace("...", ""))
            if covered < 0:
                raise ShapeError(f"Einsum term {term!r} has more letters than rank {rank}")
            term = term.replace("...", broadcast[ellipsis_rank - covered :])
        if len(term) != rank or not all(c.isalpha() for c in term):
            raise ShapeError(f"Einsum term {term!r} does not fit an operand of rank {rank}")
        expanded.append(term)
    if arrow:
        output = rhs.replace("...", broadcast)
    else:
        letters = "".join(expanded)
        output = broadcast + "".join(sorted(c for c in set(letters) if c.isascii() and letters.count(c) == 1))
    if len(set(output)) != len(output) or not set(output) <= set("".join(expanded)):
        raise ShapeError(f"Einsum output {rhs!r} is not a set of input subscripts")
    return expanded, output


def _diagonal(node: onnx.NodeProto, b: GraphBuilder, x: int, term: str) -> tuple[int, str]:
    """Take diagonals until no subscript repeats within the term."""
    while repeated := next((c for c in term if term.count(c) > 1), None):
        first = term.index(repeated)
        second = term.index(repeated, first + 1)
        n = b.shape(x)[first]
        if not isinstance(n, int):
            raise refuse(node, "a diagonal over a symbolic dimension")
        rest = [i for i in range(len(term)) if i not in (first, second)]
        moved = b.permute(x, [*rest, first, second])
        flat = b.reshape(moved, (*b.shape(moved)[:-2], n * n))
        # every (n+1)-th element of the flattened square is on the diagonal
        x = b.view(flat, ("slice", (*(((0, None, 1),) * len(rest)), (0, None, n + 1))))
        term = "".join(term[i] for i in rest) + repeated
    return x, term


def _sum_out(b: GraphBuilder, x: int, term: str, keep: set[str]) -> tuple[int, str]:
    axes = [i for i, c in enumerate(term) if c not in keep]
    return b.reduce(Op.SUM_REDUCE, x, axes), "".join(c for c in term if c in keep)


def _aligned(b: GraphBuilder, x: int, term: str, target: str, sizes: dict[str, Dim]) -> int:
    """x, whose axes are `term`, laid out over the axes `target` (absent ones broadcast)."""
    present = [c for c in target if c in term]
    x = b.permute(x, [term.index(c) for c in present])
    x = b.reshape(x, [b.shape(x)[present.index(c)] if c in term else 1 for c in target])
    return b.expand(x, [sizes[c] for c in target])


@lowers("Einsum")
def _einsum(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    operands = [ctx.value(node, i) for i in range(len(node.input))]
    equation = text(attrs(node)["equation"])
    terms, output = _einsum_terms(equation, [len(b.shape(x)) for x in operands])
    sizes: dict[str, Dim] = {}
    for x, term in zip(operands, terms):
        for c, d in zip(term, b.shape(x)):
            if sizes.get(c, 1) == 1:
                sizes[c] = d
    pending = []
    for i, (x, term) in enumerate(zip(operands, terms)):
        x, term = _diagonal(node, b, x, term)
        others = "".join(terms[:i] + terms[i + 1 :])
        pending.append(_sum_out(b, x, term, set(output) | set(others)))
    result, term = pending[0]
    for i, (x, x_term) in enumerate(pending[1:], start=1):
        union = term + "".join(c for c in dict.fromkeys(x_term) if c not in term)
        product = b.binary(
            Op.MUL, _aligned(b, result, term, union, sizes), _aligned(b, x, x_term, union, sizes)
        )
        later = set(output) | set("".join(t for _, t in pending[i + 1 :]))
        result, term = _sum_out(b, product, union, later)
    return [b.permute(result, [term.index(c) for c in output])]


# ---- losses ------------------------------------------------------------------------------


def _reduction_attr(node: onnx.NodeProto) -> str:
    reduction = text(attrs(node).get("reduction", b"mean"))
    if reduction not in ("none", "sum", "mean"):
        raise refuse(node, f"reduction={reduction}")
    return reduction


def _negative_log_likelihood(ctx: Context, node: onnx.NodeProto, log_prob: int) -> int:
    """-log_prob[n, target[n, ...], ...] * weight[target], reduced as `node` asks."""
    b = ctx.b
    shape = b.shape(log_prob)
    if len(shape) < 2 or not isinstance(shape[1], int):
        raise refuse(node, f"input shape {list(shape)}")
    classes = shape[1]
    target = b.cast(ctx.value(node, 1), "int64")
    target_shape = b.shape(target)
    if target_shape != (shape[0], *shape[2:]):
        raise ShapeError(f"{node.op_type} target {list(target_shape)} does not fit input {list(shape)}")
    count = numel(target_shape)
    target = b.reshape(target, (count,))
    ignore_index = attrs(node).get("ignore_index")
    ignored = None
    if ignore_index is not None:
        ignored = C.equal(b, target, b.scalar_like(ignore_index, target))
        target = C.where(b, ignored, b.scalar_like(0, target), target)
    # out-of-range targets are undefined; wrapping them keeps the gathers in bounds
    target = b.binary(Op.MOD, target, b.scalar_like(classes, target))
    rows = C.flatten(b, b.permute(log_prob, [0, *range(2, len(shape)), 1]), len(shape) - 1)
    flat = b.reshape(rows, (numel(b.shape(rows)),))
    picked = b.gather(flat, b.binary(Op.ADD, C.scale(b, b.iota(count), classes), target), 0)
    weight = ctx.optional(node, 2)
    weights = b.scalar_like(1, picked) if weight is None else b.gather(weight, target, 0)
    zero = b.scalar_like(0, picked)
    if ignored is not None:
        weights = C.where(b, ignored, zero, weights)
    loss = C.neg(b, b.binary(Op.MUL, picked, weights))
    if ignored is not None:  # an ignored -inf log-probability still contributes 0, not NaN
        loss = C.where(b, ignored, zero, loss)
    reduction = _reduction_attr(node)
    if reduction == "none":
        return b.reshape(loss, target_shape)
    total = b.reduce(Op.SUM_REDUCE, loss, [0])
    if reduction == "sum":
        return total
    return C.div(b, total, b.reduce(Op.SUM_REDUCE, weights, [0]))


@lowers("NegativeLogLikelihoodLoss")
def _nll_loss(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [_negative_log_likelihood(ctx, node, float_input(ctx, node))]


@lowers("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(ctx: Context, node: onnx.NodeProto) -> list[int]:
    scores = float_input(ctx, node)
    if len(ctx.b.shape(scores)) < 2:
        raise ShapeError("SoftmaxCrossEntropyLoss of a rank-1 input")
    log_prob = _log_softmax(ctx.b, scores, 1)
    return [_negative_log_likelihood(ctx, node, log_prob), log_prob]


# ---- top k -------------------------------------------------------------------------------


def _topk_order_key(b: GraphBuilder, x: int, largest: bool) -> int:
    """A key whose descending order is the output order; NaN counts as the largest value."""
    if is_float(b.dtype(x)):
        x = C.where(b, C.is_nan(b, x), b.scalar_like(np.inf, x), x)
    return x if largest else C.reverse_order(b, x)


@lowers("TopK")
def _top_k(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """Rank every element by counting who goes before it, then gather ranks 0..k-1.

    Element i's rank is the number of j with key[j] > key[i], or key[j] == key[i] and j < i
    (ties go to the lower index), so the ranks are a permutation and each output slot finds
    exactly one element: exact for any dtype, at O(n^2) work per row.
    """
    b = ctx.b
    a = attrs(node)
    x = _comparable(b, ctx.value(node, 0))
    shape = b.shape(x)
    axis = normalized_axis(node, a.get("axis", -1), len(shape))
    k = int(ctx.const(node, 1, "k").reshape(())) if ctx.opset >= 10 else a["k"]
    n = shape[axis]
    if not isinstance(n, int):
        raise refuse(node, "a symbolic axis length")
    if not 0 <= k <= n:
        raise ShapeError(f"TopK k={k} for an axis of length {n}")
    moved = b.permute(x, [*(i for i in range(len(shape)) if i != axis), axis])
    rows = numel(b.shape(moved)[:-1])
    flat_rows = b.reshape(moved, (rows, n))
    key = _topk_order_key(b, flat_rows, bool(a.get("largest", 1)))
    mine, theirs = b.reshape(key, (rows, n, 1)), b.reshape(key, (rows, 1, n))
    above, below = C.less(b, mine, theirs), C.less(b, theirs, mine)
    earlier = b.constant(np.tri(n, n, -1, dtype=bool))  # [i, j]: j < i
    # the keys hold no NaN, so "not below" is "above or tied"
    before = C.logical_or(b, above, C.logical_and(b, C.logical_not(b, below), earlier))
    rank = b.reduce(Op.SUM_REDUCE, b.cast(before, "int64"), [2])
    slots = b.reshape(b.iota(k), (1, k, 1))
    chosen = b.cast(C.equal(b, b.reshape(rank, (rows, 1, n)), slots), "int64")
    position = b.reshape(b.iota(n), (1, 1, n))
    index = b.reduce(Op.SUM_REDUCE, C.mul(b, chosen, position), [2])
    flat_index = C.add(b, index, C.scale(b, b.reshape(b.iota(rows), (rows, 1)), n))
    values = b.gather(b.reshape(flat_rows, (numel((rows, n)),)), b.reshape(flat_index, (numel((rows, k)),)), 0)
    out_moved = (*b.shape(moved)[:-1], k)
    inverse = [*range(axis), len(shape) - 1, *range(axis, len(shape) - 1)]
    values = b.permute(b.reshape(values, out_moved), inverse)
    indices = b.permute(b.reshape(index, out_moved), inverse)
    return [b.cast(values, b.dtype(ctx.value(node, 0))), indices]
