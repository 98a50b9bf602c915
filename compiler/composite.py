"""Composite operations spelled in primitive ops: what every frontend lowers to.

Each function takes a GraphBuilder and node ids and returns a node id. Broadcasting follows
NumPy. The choices here (exp as exp2, division as a reciprocal, max as a reduction over a
stacked pair) keep the IR to the primitive set; the search compiler later recognizes the
patterns again (matmul is a broadcast multiply followed by a sum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from compiler.errors import UnsupportedModel
from compiler.ir import GraphBuilder, Op
from compiler.reference import apply_view
from compiler.shape import Dim, ShapeError, broadcast_shapes, dim_add, dim_mul, dim_sub, numel

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def _is_float(dtype: str) -> bool:
    return dtype.startswith("float")


def broadcast_pair(b: GraphBuilder, x: int, y: int) -> tuple[int, int]:
    shape = broadcast_shapes(b.shape(x), b.shape(y))
    return b.broadcast_to(x, shape), b.broadcast_to(y, shape)


def add(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.ADD, *broadcast_pair(b, x, y))


def mul(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.MUL, *broadcast_pair(b, x, y))


def scale(b: GraphBuilder, x: int, factor: float) -> int:
    return x if factor == 1 else b.binary(Op.MUL, x, b.scalar_like(factor, x))


def shift(b: GraphBuilder, x: int, offset: float) -> int:
    return x if offset == 0 else b.binary(Op.ADD, x, b.scalar_like(offset, x))


def neg(b: GraphBuilder, x: int) -> int:
    return scale(b, x, -1)


def sub(b: GraphBuilder, x: int, y: int) -> int:
    if b.dtype(x).startswith("uint") or b.dtype(x) == "bool":
        raise UnsupportedModel([f"Sub on {b.dtype(x)} tensors"])
    x, y = broadcast_pair(b, x, y)
    return b.binary(Op.ADD, x, neg(b, y))


def div(b: GraphBuilder, x: int, y: int) -> int:
    if not _is_float(b.dtype(x)):
        raise UnsupportedModel(["Div on integer tensors"])
    x, y = broadcast_pair(b, x, y)
    return b.binary(Op.MUL, x, b.unary(Op.RECIP, y))


def exp(b: GraphBuilder, x: int) -> int:
    return b.unary(Op.EXP2, scale(b, x, LOG2_E))


def log(b: GraphBuilder, x: int) -> int:
    return scale(b, b.unary(Op.LOG2, x), LN_2)


def sigmoid(b: GraphBuilder, x: int) -> int:
    return b.unary(Op.RECIP, shift(b, exp(b, neg(b, x)), 1.0))


def tanh(b: GraphBuilder, x: int) -> int:
    return shift(b, scale(b, sigmoid(b, scale(b, x, 2.0)), 2.0), -1.0)


def stack_last(b: GraphBuilder, parts: Sequence[int]) -> int:
    """Stack same-shaped tensors along a new last axis (zero padding plus addition)."""
    return concat(b, [b.unsqueeze(p, -1) for p in parts], axis=-1)


def maximum(b: GraphBuilder, x: int, y: int) -> int:
    x, y = broadcast_pair(b, x, y)
    return b.reduce(Op.MAX_REDUCE, stack_last(b, [x, y]), [-1])


def minimum(b: GraphBuilder, x: int, y: int) -> int:
    return neg(b, maximum(b, neg(b, x), neg(b, y)))


def where(b: GraphBuilder, cond: int, x: int, y: int) -> int:
    """cond ? x : y, as a gather from the interleaved pair, so inf and NaN pass through untouched."""
    shape = broadcast_shapes(broadcast_shapes(b.shape(cond), b.shape(x)), b.shape(y))
    x, y = b.broadcast_to(x, shape), b.broadcast_to(y, shape)
    if b.dtype(x) != b.dtype(y):
        raise ShapeError(f"Where branches differ in dtype: {b.dtype(x)} vs {b.dtype(y)}")
    count = numel(shape)
    pairs = b.reshape(stack_last(b, [y, x]), (dim_mul(count, 2),))
    flat_cond = b.reshape(b.cast(b.broadcast_to(cond, shape), "int64"), (count,))
    index = b.binary(Op.ADD, scale(b, b.iota(count), 2), flat_cond)
    return b.reshape(b.gather(pairs, index, 0), shape)


def less(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.LESS_THAN, *broadcast_pair(b, x, y))


def logical_not(b: GraphBuilder, cond: int) -> int:
    # False < True is the only true case, so c < True is not c
    cond = b.cast(cond, "bool")
    return b.binary(Op.LESS_THAN, cond, b.scalar_like(True, cond))


def logical_and(b: GraphBuilder, p: int, q: int) -> int:
    return b.cast(mul(b, b.cast(p, "int8"), b.cast(q, "int8")), "bool")


def equal(b: GraphBuilder, x: int, y: int) -> int:
    """x == y for non-NaN values: neither is below the other."""
    return logical_and(b, logical_not(b, less(b, x, y)), logical_not(b, less(b, y, x)))


def is_nan(b: GraphBuilder, x: int) -> int:
    # NaN is the only value neither below +inf nor above -inf
    below_inf = less(b, x, b.scalar_like(np.inf, x))
    above_minus_inf = less(b, b.scalar_like(-np.inf, x), x)
    return logical_and(b, logical_not(b, below_inf), logical_not(b, above_minus_inf))


def power_by_squaring(b: GraphBuilder, x: int, n: int) -> int | None:
    """x**n for a compile-time n >= 1 (exact modulo 2**bits for integers); None for n == 0."""
    result = None
    square = x
    while n:
        if n & 1:
            result = square if result is None else b.binary(Op.MUL, result, square)
        n >>= 1
        if n:
            square = b.binary(Op.MUL, square, square)
    return result


def relu(b: GraphBuilder, x: int) -> int:
    # max over (x, 0) keeps relu(-inf) = 0 and propagates NaN, unlike x * (x > 0)
    zero_padded = b.view(b.unsqueeze(x, -1), ("pad", ((0, 0),) * len(b.shape(x)) + ((0, 1),), 0))
    return b.reduce(Op.MAX_REDUCE, zero_padded, [-1])


def concat(b: GraphBuilder, parts: Sequence[int], axis: int) -> int:
    """Concatenate by padding each part with zeros to the full extent and adding."""
    rank = len(b.shape(parts[0]))
    axis %= rank
    sizes = [b.shape(p)[axis] for p in parts]
    total: Dim = 0
    for size in sizes:
        total = dim_add(total, size)
    result = None
    offset: Dim = 0
    for part, size in zip(parts, sizes):
        widths: list[tuple[Dim, Dim]] = [(0, 0)] * rank
        widths[axis] = (offset, dim_sub(dim_sub(total, offset), size))
        padded = b.view(part, ("pad", tuple(widths), 0))
        result = padded if result is None else b.binary(Op.ADD, result, padded)
        offset = dim_add(offset, size)
    assert result is not None
    return result


def keepdims(b: GraphBuilder, reduced: int, shape: Sequence[Dim], axes: Sequence[int]) -> int:
    rank = len(shape)
    norm = {a % rank for a in axes}
    return b.reshape(reduced, [1 if i in norm else d for i, d in enumerate(shape)])


def reduce_keep(b: GraphBuilder, op: Op, x: int, axes: Sequence[int]) -> int:
    shape = b.shape(x)
    return keepdims(b, b.reduce(op, x, axes), shape, axes)


def softmax(b: GraphBuilder, x: int, axis: int) -> int:
    shape = b.shape(x)
    peak = b.expand(reduce_keep(b, Op.MAX_REDUCE, x, [axis]), shape)
    e = exp(b, b.binary(Op.ADD, x, neg(b, peak)))
    total = b.expand(reduce_keep(b, Op.SUM_REDUCE, e, [axis]), shape)
    return b.binary(Op.MUL, e, b.unary(Op.RECIP, total))


def matmul(b: GraphBuilder, x: int, y: int) -> int:
    """NumPy matmul semantics, including 1-D operands and broadcast batch dimensions."""
    x_vec, y_vec = len(b.shape(x)) == 1, len(b.shape(y)) == 1
    if x_vec:
        x = b.reshape(x, (1, *b.shape(x)))
    if y_vec:
        y = b.reshape(y, (*b.shape(y), 1))
    xs, ys = b.shape(x), b.shape(y)
    if xs[-1] != ys[-2]:
        raise ShapeError(f"matmul inner dimensions differ: {xs[-1]} vs {ys[-2]}")
    batch = broadcast_shapes(xs[:-2], ys[:-2])
    m, k, n = xs[-2], xs[-1], ys[-1]
    full = (*batch, m, k, n)
    xe = b.broadcast_to(b.unsqueeze(x, -1), full)
    ye = b.broadcast_to(b.unsqueeze(y, -3), full)
    out = b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, xe, ye), [-2])
    final = (*batch, *(() if x_vec else (m,)), *(() if y_vec else (n,)))
    return b.reshape(out, final)


def pad(b: GraphBuilder, x: int, widths: Sequence[tuple[Dim, Dim]], value: float) -> int:
    if all(w == (0, 0) for w in widths):
        return x
    return b.view(x, ("pad", tuple(widths), value))


def conv(
    b: GraphBuilder,
    x: int,
    w: int,
    bias: int | None,
    pads: Sequence[tuple[int, int]],
    strides: Sequence[int],
    dilations: Sequence[int],
    group: int,
) -> int:
    """N-d convolution [N, C, *S] x [OC, C/G, *K] as windows, a multiply and a sum."""
    xs, ws = b.shape(x), b.shape(w)
    nd = len(xs) - 2
    n, c = xs[0], xs[1]
    oc, cg, kernel = ws[0], ws[1], tuple(ws[2:])
    if not isinstance(c, int) or c != cg * group or oc % group:  # type: ignore[operator]
        raise ShapeError(f"Conv channels do not match: input {c}, weight {list(ws)}, group {group}")
    ocg = oc // group  # type: ignore[operator]
    padded = pad(b, x, [(0, 0), (0, 0), *pads], 0)
    windows = b.view(padded, ("window", tuple(range(2, 2 + nd)), kernel, tuple(strides), tuple(dilations)))
    out_spatial = b.shape(windows)[2 : 2 + nd]
    full = (n, group, ocg, cg, *out_spatial, *kernel)
    xw = b.reshape(windows, (n, group, 1, cg, *out_spatial, *kernel))
    ww = b.reshape(w, (1, group, ocg, cg, *([1] * nd), *kernel))
    prod = b.binary(Op.MUL, b.expand(xw, full), b.expand(ww, full))
    reduce_axes = [3, *range(4 + nd, 4 + 2 * nd)]
    out = b.reshape(b.reduce(Op.SUM_REDUCE, prod, reduce_axes), (n, oc, *out_spatial))
    if bias is not None:
        out = add(b, out, b.reshape(bias, (1, oc, *([1] * nd))))
    return out


def pool(
    b: GraphBuilder,
    x: int,
    kind: str,
    kernel: Sequence[int],
    pads: Sequence[tuple[int, int]],
    strides: Sequence[int],
    dilations: Sequence[int],
    count_include_pad: bool = False,
    ceil_extra: Sequence[int] | None = None,
) -> int:
    """Max or average pooling over the trailing len(kernel) axes.

    `ceil_extra` pads the end of each axis further (ceil_mode); that padding is never counted.
    """
    shape = b.shape(x)
    nd = len(kernel)
    lead = len(shape) - nd
    spatial = shape[lead:]
    if not all(isinstance(d, int) for d in spatial):
        raise UnsupportedModel(["pooling over symbolic spatial dimensions"])
    extra = list(ceil_extra or [0] * nd)
    widths = [(0, 0)] * lead + [(p[0], p[1] + e) for p, e in zip(pads, extra)]
    dtype = np.dtype(b.dtype(x))
    lowest = -np.inf if dtype.kind == "f" else np.iinfo(dtype).min
    fill = lowest if kind == "max" else 0.0
    view = ("window", tuple(range(lead, lead + nd)), tuple(kernel), tuple(strides), tuple(dilations))
    windows = b.view(pad(b, x, widths, fill), view)
    window_axes = list(range(len(shape), len(shape) + nd))
    if kind == "max":
        return b.reduce(Op.MAX_REDUCE, windows, window_axes)
    total = b.reduce(Op.SUM_REDUCE, windows, window_axes)
    counts = _window_counts(spatial, kernel, pads, extra, strides, dilations, count_include_pad)
    inv = b.constant((1.0 / counts).astype(b.dtype(x)))
    return mul(b, total, inv)


def _window_counts(spatial, kernel, pads, extra, strides, dilations, include_pad) -> np.ndarray:
    """How many real (or, with include_pad, real plus user-padded) elements each window sees."""
    ones = np.ones(spatial, dtype=np.float64)
    nd = len(kernel)
    user_pads = [(p[0], p[1]) for p in pads]
    if include_pad:
        ones = np.pad(ones, user_pads, constant_values=1.0)
        user_pads = [(0, 0)] * nd
    padded = np.pad(ones, [(p[0], p[1]) for p in user_pads], constant_values=0.0)
    padded = np.pad(padded, [(0, e) for e in extra], constant_values=0.0)
    windows = apply_view(padded, ("window", tuple(range(nd)), kernel, strides, dilations), {})
    return windows.sum(axis=tuple(range(nd, 2 * nd)))


def flatten(b: GraphBuilder, x: int, axis: int) -> int:
    shape = b.shape(x)
    if axis < 0:
        axis += len(shape)
    return b.reshape(x, (numel(shape[:axis]), numel(shape[axis:])))
