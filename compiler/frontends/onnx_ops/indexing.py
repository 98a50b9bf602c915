"""Lowerings of data-dependent indexing: gathers (Gather, GatherElements, GatherND, OneHot,
Compress), scatters (ScatterElements, Scatter, ScatterND, TensorScatter) and GridSample.

Every lookup is the GATHER primitive; with several index axes it reads a flattened tensor at a
row-major flat index built from one int64 index tensor per axis. Negative indices wrap as ONNX
allows. There is no scatter
primitive: each output position compares its flat index against the flat target of every
update, a [positions, updates] matrix, and reduces over the updates. GridSample gathers the taps
around each sampled point and weights them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from compiler import composite as C
from compiler.dtypes import is_float, lowest
from compiler.frontends.onnx_context import (
    Context,
    attrs,
    dim_tensor,
    lowers,
    refuse,
    stored_dtype,
    text,
    wrap_negative,
)
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, dim_mul, numel

# ---- gathers -------------------------------------------------------------------------------


@lowers("Gather")
def _gather(ctx: Context, node: onnx.NodeProto) -> list[int]:
    data, indices = ctx.value(node, 0), ctx.value(node, 1)
    axis = attrs(node).get("axis", 0)
    if ctx.b.dtype(indices) not in ("int64", "int32"):
        raise refuse(node, f"{ctx.b.dtype(indices)} indices")
    return [ctx.b.gather(data, indices, axis)]


def _flat_index(b: GraphBuilder, shape: tuple[Dim, ...], per_axis: list[int]) -> int:
    """Row-major linear index from one int64 index tensor per axis (all of one shape)."""
    total = None
    stride: Dim = 1
    for axis in range(len(shape) - 1, -1, -1):
        term = (
            per_axis[axis]
            if stride == 1
            else b.binary(Op.MUL, per_axis[axis], dim_tensor(b, stride, per_axis[axis]))
        )
        total = term if total is None else b.binary(Op.ADD, total, term)
        stride = dim_mul(stride, shape[axis])
    return total


@lowers("GatherElements")
def _gather_elements(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    data, indices = ctx.value(node, 0), ctx.value(node, 1)
    shape, index_shape = b.shape(data), b.shape(indices)
    axis = attrs(node).get("axis", 0) % len(shape)
    along = wrap_negative(ctx, indices, shape[axis])
    per_axis = [along if i == axis else C.axis_positions(b, index_shape, i) for i in range(len(shape))]
    flat = b.reshape(data, (numel(shape),))
    return [b.gather(flat, _flat_index(b, shape, per_axis), 0)]


@lowers("GatherND")
def _gather_nd(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    data, indices = ctx.value(node, 0), ctx.value(node, 1)
    shape, index_shape = b.shape(data), b.shape(indices)
    batch = attrs(node).get("batch_dims", 0)
    depth = index_shape[-1]
    if not isinstance(depth, int):
        raise refuse(node, "a symbolic index depth")
    lookup_shape = index_shape[:-1]
    indices = b.cast(indices, "int64")
    per_axis = [C.axis_positions(b, lookup_shape, i) for i in range(batch)]
    for k in range(depth):
        triples = [(0, None, 1)] * (len(index_shape) - 1) + [(k, k + 1, 1)]
        component = b.reshape(b.view(indices, ("slice", tuple(triples))), lookup_shape)
        per_axis.append(wrap_negative(ctx, component, shape[batch + k]))
    addressed = shape[: batch + depth]
    rest = shape[batch + depth :]
    flat = b.reshape(data, (numel(addressed), *rest))
    return [b.gather(flat, _flat_index(b, addressed, per_axis), 0)]


@lowers("OneHot")
def _one_hot(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    indices = ctx.value(node, 0)
    depth = int(np.asarray(ctx.const(node, 1, "depth")).reshape(-1)[0])
    values = ctx.value(node, 2)
    axis = attrs(node).get("axis", -1)
    index_shape = b.shape(indices)
    rank = len(index_shape) + 1
    axis %= rank
    if is_float(b.dtype(indices)):
        indices = b.cast(indices, "int64")  # ONNX casts non-integer indices down
    indices = wrap_negative(ctx, indices, depth)
    out_shape = list(index_shape)
    out_shape.insert(axis, depth)
    spread = b.expand(b.unsqueeze(indices, axis), out_shape)
    positions = C.axis_positions(b, tuple(out_shape), axis)
    hot = C.equal(b, spread, positions)
    off = b.view(values, ("slice", ((0, 1, 1),)))
    on = b.view(values, ("slice", ((1, 2, 1),)))
    return [C.where(b, hot, b.reshape(on, ()), b.reshape(off, ()))]


@lowers("Compress")
def _compress(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    condition = ctx.const(node, 1, "condition").reshape(-1).astype(bool)
    axis = attrs(node).get("axis")
    if axis is None:
        x, axis = b.reshape(x, (numel(b.shape(x)),)), 0
    dim = b.shape(x)[axis % len(b.shape(x))]
    picked = np.flatnonzero(condition[: dim if isinstance(dim, int) else None]).astype(np.int64)
    return [b.gather(x, b.constant(picked), axis)]


# ---- scatter -------------------------------------------------------------------------------

# the [positions, updates, row] comparison tensors (and GridSample's taps) are materialized
_MAX_ELEMENTS = 10**8


def _scatter_inputs(ctx: Context, node: onnx.NodeProto) -> tuple[int, int, int, str]:
    """data, indices, updates and the reduction."""
    data, indices, updates = (ctx.value(node, i) for i in range(3))
    reduction = text(attrs(node).get("reduction", b"none"))
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise refuse(node, f"reduction={reduction}")
    if reduction != "none" and ctx.b.dtype(data) == "bool":
        raise refuse(node, f"reduction={reduction} on bool data")
    return data, indices, updates, reduction


def _static_shape(node: onnx.NodeProto, shape: tuple[Dim, ...], what: str) -> tuple[int, ...]:
    if not all(isinstance(d, int) for d in shape):
        raise refuse(node, f"a symbolic {what} shape")
    return tuple(shape)  # type: ignore[arg-type]


def _scatter_rows(b: GraphBuilder, data: int, updates: int, target: int, reduction: str) -> int:
    """data [P, S] with row target[q] of it combined with updates [Q, S] row q.

    For reduction none the last update to a row wins, as in the ONNX reference.
    """
    rows, width = b.shape(data)
    count = b.shape(updates)[0]
    hits = C.equal(b, b.reshape(b.iota(rows), (rows, 1)), b.reshape(target, (1, count)))  # [P, Q]
    hit_any = b.reshape(b.reduce(Op.MAX_REDUCE, b.cast(hits, "uint8"), [1]), (rows, 1))
    hit_any = b.cast(b.expand(hit_any, (rows, width)), "bool")
    if reduction == "none":
        numbered = C.mul(b, b.cast(hits, "int64"), b.reshape(C.shift(b, b.iota(count), 1), (1, count)))
        last = C.shift(b, b.reduce(Op.MAX_REDUCE, numbered, [1]), -1)
        chosen = b.gather(updates, C.maximum(b, last, b.scalar_like(0, last)), 0)
        return C.where(b, hit_any, chosen, data)
    full = (rows, width, count)
    hits = b.expand(b.reshape(hits, (rows, 1, count)), full)
    values = b.expand(b.reshape(b.permute(updates, (1, 0)), (1, width, count)), full)
    dtype = b.dtype(data)
    if reduction == "min":
        values, data = C.reverse_order(b, values), C.reverse_order(b, data)
    if reduction == "add":
        combined = C.add(
            b, data, b.reduce(Op.SUM_REDUCE, C.where(b, hits, values, b.scalar_like(0, values)), [2])
        )
    elif reduction == "mul":
        combined = C.mul(b, data, C.product_last(b, C.where(b, hits, values, b.scalar_like(1, values))))
    else:
        peak = b.reduce(Op.MAX_REDUCE, C.where(b, hits, values, b.scalar_like(lowest(dtype), values)), [2])
        combined = C.maximum(b, data, peak)
    result = C.where(b, hit_any, combined, data)
    return C.reverse_order(b, result) if reduction == "min" else result


def _check_size(node: onnx.NodeProto, what: str, *sizes: int) -> None:
    if int(np.prod(sizes)) > _MAX_ELEMENTS:
        raise refuse(node, f"{' x '.join(map(str, sizes))} {what} (more than {_MAX_ELEMENTS})")


@lowers("ScatterElements", "Scatter")
def _scatter_elements(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    data, indices, updates, reduction = _scatter_inputs(ctx, node)
    data_shape = _static_shape(node, b.shape(data), "data")
    update_shape = _static_shape(node, b.shape(updates), "updates")
    rank = len(data_shape)
    axis = attrs(node).get("axis", 0) % rank
    positions, count = numel(data_shape), numel(update_shape)
    _check_size(node, "position-update pairs", positions, count)
    # the flat data position of every update, with its coordinate along axis still to add
    coords = list(np.indices(update_shape))
    coords[axis] = np.zeros(update_shape, dtype=np.int64)
    base = np.ravel_multi_index(coords, data_shape).reshape(-1) if count else np.zeros(0, np.int64)
    stride = int(np.prod(data_shape[axis + 1 :]))
    along = b.reshape(wrap_negative(ctx, indices, data_shape[axis]), (count,))
    target = C.add(b, b.constant(base.astype(np.int64)), C.scale(b, along, stride))
    flat = _scatter_rows(
        b, b.reshape(data, (positions, 1)), b.reshape(updates, (count, 1)), target, reduction
    )
    return [b.reshape(flat, data_shape)]


@lowers("ScatterND")
def _scatter_nd(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    data, indices, updates, reduction = _scatter_inputs(ctx, node)
    data_shape = _static_shape(node, b.shape(data), "data")
    index_shape = _static_shape(node, b.shape(indices), "indices")
    depth = index_shape[-1]
    rows, width = numel(data_shape[:depth]), numel(data_shape[depth:])
    count = numel(index_shape[:-1])
    _check_size(node, "position-update pairs", rows, count, width)
    strides = np.array([int(np.prod(data_shape[i + 1 : depth])) for i in range(depth)], dtype=np.int64)
    columns = [
        wrap_negative(
            ctx,
            b.view(indices, ("slice", ((0, None, 1),) * (len(index_shape) - 1) + ((i, i + 1, 1),))),
            data_shape[i],
        )
        for i in range(depth)
    ]
    target = None
    for column, stride in zip(columns, strides):
        term = C.scale(b, b.reshape(column, (count,)), int(stride))
        target = term if target is None else b.binary(Op.ADD, target, term)
    if target is None:
        raise refuse(node, "indices with an empty last dimension")
    flat = _scatter_rows(
        b, b.reshape(data, (rows, width)), b.reshape(updates, (count, width)), target, reduction
    )
    return [b.reshape(flat, data_shape)]


@lowers("TensorScatter")
def _tensor_scatter(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """Each cache position m of batch row b takes update position m - write_indices[b] when that
    lies in the update (modulo the cache length in circular mode)."""
    b = ctx.b
    a = attrs(node)
    cache, update, write = ctx.value(node, 0), ctx.value(node, 1), ctx.optional(node, 2)
    mode = text(a.get("mode", b"linear"))
    if mode not in ("linear", "circular"):
        raise refuse(node, f"mode={mode}")
    shape = _static_shape(node, b.shape(cache), "cache")
    axis = a.get("axis", -2) % len(shape)
    if axis == 0:
        raise refuse(node, "axis=0")
    length, written = shape[axis], _static_shape(node, b.shape(update), "update")[axis]
    outer, inner, width = numel(shape[:axis]), numel(shape[1:axis]), numel(shape[axis + 1 :])
    batch_of_row = b.constant(np.arange(outer, dtype=np.int64) // inner)
    start = (
        b.constant(np.zeros(outer, np.int64))
        if write is None
        else b.gather(b.cast(write, "int64"), batch_of_row, 0)
    )
    source = C.sub(b, b.reshape(b.iota(length), (1, length)), b.reshape(start, (outer, 1)))  # [rows, length]
    if mode == "circular":
        source = b.binary(Op.MOD, source, b.scalar_like(length, source))
        source = C.where(b, C.less(b, source, b.scalar_like(0, source)), C.shift(b, source, length), source)
    hit = C.in_range(b, source, 0, written)
    within = C.clamp(b, source, 0, written - 1)
    flat = C.add(b, within, C.scale(b, b.reshape(b.iota(outer), (outer, 1)), written))
    rows = b.gather(b.reshape(update, (outer * written, width)), b.reshape(flat, (outer * length,)), 0)
    hit = b.expand(b.reshape(hit, (outer * length, 1)), (outer * length, width))
    result = C.where(b, hit, rows, b.reshape(cache, (outer * length, width)))
    return [b.reshape(result, shape)]


# ---- GridSample ----------------------------------------------------------------------------

_GRID_MODES = {
    "bilinear": "linear",
    "linear": "linear",
    "nearest": "nearest",
    "bicubic": "cubic",
    "cubic": "cubic",
}
_CUBIC_ALPHA = -0.75


def _reflect(b: GraphBuilder, v: int, low: float, high: float) -> int:
    """v (float64) reflected by the near border until it lies in [low, high], as ONNX does it."""
    span = high - low
    below, above = C.less(b, v, b.scalar_like(low, v)), C.less(b, b.scalar_like(high, v), v)
    distance = C.where(b, below, C.shift(b, C.neg(b, v), low), C.shift(b, v, -high))
    # whole spans crossed; the float quotient is corrected so the remainder is exact
    turns = C.floor(b, C.scale(b, distance, 1.0 / span))
    rest = C.sub(b, distance, C.scale(b, turns, span))
    under = C.less(b, rest, b.scalar_like(0.0, rest))
    turns = C.where(b, under, C.shift(b, turns, -1.0), turns)
    rest = C.where(b, under, C.shift(b, rest, span), rest)
    over = C.logical_not(b, C.less(b, rest, b.scalar_like(span, rest)))
    turns = C.where(b, over, C.shift(b, turns, 1.0), turns)
    rest = C.where(b, over, C.shift(b, rest, -span), rest)
    even = C.equal(b, b.binary(Op.MOD, turns, b.scalar_like(2.0, turns)), b.scalar_like(0.0, turns))
    # an even number of turns leaves v reflected once off the near border
    near_low = C.where(b, even, C.shift(b, rest, low), C.shift(b, C.neg(b, rest), high))
    near_high = C.where(b, even, C.shift(b, C.neg(b, rest), high), C.shift(b, rest, low))
    return C.where(b, below, near_low, C.where(b, above, near_high, v))


def _cubic_weights(b: GraphBuilder, t: int) -> list[int]:
    """Keys' cubic convolution weights of the taps at -1, 0, 1, 2 for a fraction t."""
    a = _CUBIC_ALPHA

    def outer(d: int) -> int:  # 1 < d < 2
        return C.shift(
            b,
            b.binary(Op.MUL, C.shift(b, b.binary(Op.MUL, C.shift(b, C.scale(b, d, a), -5 * a), d), 8 * a), d),
            -4 * a,
        )

    def inner(d: int) -> int:  # 0 <= d <= 1
        return C.shift(
            b, b.binary(Op.MUL, b.binary(Op.MUL, C.shift(b, C.scale(b, d, a + 2), -(a + 3)), d), d), 1.0
        )

    one_minus = C.one_minus(b, t)
    return [outer(C.shift(b, t, 1.0)), inner(t), inner(one_minus), outer(C.shift(b, one_minus, 1.0))]


def _axis_taps(b: GraphBuilder, x: int, extent: int, mode: str, padding: str, align: bool):
    """Per sample along one axis: tap indices (int64), weights (None for nearest) and, for zeros
    padding, whether each tap lies inside the input (None otherwise), each [..., taps]."""
    low, high = (0.0, extent - 1.0) if align else (-0.5, extent - 0.5)
    if mode == "nearest":
        x = C.round_half_even(b, x)
    outside = C.logical_or(b, C.less(b, x, b.scalar_like(low, x)), C.less(b, b.scalar_like(high, x), x))
    if padding == "border":
        x = C.where(b, outside, C.clamp(b, x, 0.0, extent - 1.0), x)
    elif padding == "reflection":
        # the reference reflects in double precision and stores the result in float32
        x = b.cast(_reflect(b, b.cast(x, "float64"), low, high), "float32")
    if mode == "nearest":
        taps, weights = b.unsqueeze(x, -1), None
    else:
        start = C.floor(b, x)
        t = C.sub(b, x, start)
        offsets = [0.0, 1.0] if mode == "linear" else [-1.0, 0.0, 1.0, 2.0]
        taps = C.stack_last(b, [C.shift(b, start, o) for o in offsets])
        if mode == "linear":
            weights = C.stack_last(b, [C.one_minus(b, t), t])
        else:
            weights = C.stack_last(b, _cubic_weights(b, t))
    if padding == "reflection":
        taps = _reflect(b, b.cast(taps, "float64"), low, high)
    # truncation, as the reference's int(); clamped first so no huge float is cast
    index = b.cast(C.clamp(b, taps, -1.0, float(extent)), "int64")
    valid = None
    if padding == "zeros":
        valid = C.in_range(b, index, 0, extent)
    # out-of-range taps (zeros padding) still gather somewhere in range, then are masked
    index = C.clamp(b, index, 0, extent - 1)
    return index, weights, valid


def _outer(
    b: GraphBuilder, acc: int | None, term: int | None, combine: Callable[[int, int], int]
) -> int | None:
    """Combines [..., taps] of one more axis into acc [..., taps, ..., taps], its taps last."""
    if term is None or acc is None:
        return term
    shape = (*b.shape(acc), b.shape(term)[-1])
    placed = (*b.shape(term)[:-1], *[1] * (len(shape) - len(b.shape(term))), b.shape(term)[-1])
    return combine(b.expand(b.unsqueeze(acc, -1), shape), b.expand(b.reshape(term, placed), shape))


@lowers("GridSample")
def _grid_sample(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x, grid = ctx.value(node, 0), ctx.value(node, 1)
    mode = _GRID_MODES.get(text(a.get("mode", b"bilinear")))
    padding = text(a.get("padding_mode", b"zeros"))
    align = bool(a.get("align_corners", 0))
    if mode is None or padding not in ("zeros", "border", "reflection"):
        raise refuse(node, f"mode={text(a.get('mode', b''))} padding_mode={padding}")
    # float16 coordinates would be rounded at every step by the reference: not reproduced
    if stored_dtype(ctx, node, 0) != "float32" or stored_dtype(ctx, node, 1) != "float32":
        raise refuse(node, f"{stored_dtype(ctx, node, 0)} input and {stored_dtype(ctx, node, 1)} grid")
    x_shape, grid_shape = b.shape(x), b.shape(grid)
    batch, channels, spatial = x_shape[0], x_shape[1], _static_shape(node, x_shape[2:], "spatial")
    nd = len(spatial)
    out_spatial = _static_shape(node, grid_shape[1:-1], "grid")
    if grid_shape[-1] != nd or len(out_spatial) != nd or grid_shape[0] != batch:
        raise refuse(node, f"input of shape {list(x_shape)} and grid of shape {list(grid_shape)}")
    if padding == "reflection" and align and 1 in spatial:
        raise refuse(node, "reflection padding with align_corners over an axis of size 1")
    samples = numel(out_spatial)
    taps_per_axis = {"nearest": 1, "linear": 2, "cubic": 4}[mode]
    _check_size(node, "sampled taps", samples, taps_per_axis**nd, channels)
    # the grid's last axis lists coordinates innermost (x = width) first
    coords = b.reshape(grid, (batch, samples, nd))
    flat_index = weight = valid = None
    for axis, extent in enumerate(spatial):
        column = nd - 1 - axis
        g = b.reshape(
            b.view(coords, ("slice", ((0, None, 1), (0, None, 1), (column, column + 1, 1)))), (batch, samples)
        )
        half = C.scale(b, C.shift(b, g, 1.0), 0.5)
        pos = C.scale(b, half, extent - 1.0) if align else C.shift(b, C.scale(b, half, float(extent)), -0.5)
        index, w, ok = _axis_taps(b, pos, extent, mode, padding, align)
        stride = int(np.prod(spatial[axis + 1 :]))
        flat_index = _outer(b, flat_index, C.scale(b, index, stride), lambda p, q: b.binary(Op.ADD, p, q))
        valid = _outer(b, valid, ok, lambda p, q: C.logical_and(b, p, q))
        weight = _outer(b, weight, w, lambda p, q: b.binary(Op.MUL, p, q))
    assert flat_index is not None
    positions = numel(spatial)
    taps = taps_per_axis**nd
    rows = C.add(
        b,
        b.reshape(flat_index, (batch, samples * taps)),
        C.scale(b, b.reshape(b.iota(batch), (batch, 1)), positions),
    )
    table = b.reshape(
        b.permute(b.reshape(x, (batch, channels, positions)), (0, 2, 1)),
        (dim_mul(batch, positions), channels),
    )
    picked = b.gather(table, b.reshape(rows, (dim_mul(batch, samples * taps),)), 0)
    picked = b.reshape(picked, (batch, samples, taps, channels))
    if valid is not None:
        valid = b.expand(b.reshape(valid, (batch, samples, taps, 1)), b.shape(picked))
        picked = C.where(b, valid, picked, b.scalar_like(0.0, picked))
    if weight is not None:
        picked = C.mul(b, picked, b.reshape(weight, (batch, samples, taps, 1)))
    out = b.reduce(Op.SUM_REDUCE, picked, [2])  # [N, samples, C]
    return [b.reshape(b.permute(out, (0, 2, 1)), (batch, channels, *out_spatial))]
