"""Lowerings of quantization, scatter and grid-sampling ops.

Quantization reproduces ONNX's arithmetic exactly: a float32 quotient x / scale is taken in
float64 and rounded once to float32, which is the correctly rounded quotient (a float32 quotient
is never close enough to a rounding midpoint for the float64 error to matter); it is then
rounded half to even and saturated. Integer products are exact in int32.

There is no scatter primitive: each output position compares its flat index against the flat
target of every update, a [positions, updates] matrix, and reduces over the updates.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from compiler import composite as C
from compiler.frontends.onnx_context import ELEM_TYPES, Context, attrs, lowers, refuse, wrap_negative
from compiler.frontends.onnx_ops.elementwise import (
    _all,
    _any,
    _clamp,
    _eq,
    _flip,
    _floor,
    _max,
    _min,
    _round_half_even,
    _sub,
    _where,
)
from compiler.frontends.onnx_ops.nn import _spatialattrs
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, dim_mul, numel

# ---- quantization --------------------------------------------------------------------------

# the float types quantization arithmetic is reproduced in exactly
_FLOATS = ("float32", "float16")
_QUANT_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}


def _stored(ctx: Context, node: onnx.NodeProto, index: int) -> str:
    """The dtype the model declares for input `index`; the graph carries float16 and the narrow
    types in a wider one."""
    declared = ELEM_TYPES.get(ctx.declared_types.get(node.input[index], 0))
    return declared or ctx.b.dtype(ctx.value(node, index))


def _round_to(b: GraphBuilder, x: int, dtype: str) -> int:
    """x rounded to `dtype` and carried in x's own float type."""
    return b.cast(b.cast(x, dtype), b.dtype(x))


def _quotient(b: GraphBuilder, x: int, y: int, dtype: str) -> int:
    """x / y correctly rounded to `dtype` (float32 or float16), returned as float32."""
    x, y = C.broadcast_pair(b, b.cast(x, "float64"), b.cast(y, "float64"))
    # rounded straight from float64: a detour through float32 could round twice
    return b.cast(b.cast(b.binary(Op.MUL, x, b.unary(Op.RECIP, y)), dtype), "float32")


def _quant_type(node: onnx.NodeProto, elem_type: int) -> str:
    dtype = ELEM_TYPES.get(elem_type)
    if dtype not in _QUANT_RANGES:
        raise refuse(node, f"quantized type {onnx.TensorProto.DataType.Name(elem_type)}")
    return dtype


def _per_axis(ctx: Context, node: onnx.NodeProto, value: int, x_shape: tuple[Dim, ...]) -> int:
    """A scale or zero point broadcastable to x: per tensor, per axis or blocked."""
    b = ctx.b
    a = attrs(node)
    rank = len(x_shape)
    shape = b.shape(value)
    block = a.get("block_size", 0)
    if not block:
        if numel(shape) == 1:
            return b.reshape(value, ())
        if len(shape) != 1 or rank == 0:
            raise refuse(node, f"a scale of shape {list(shape)} without block_size")
        axis = a.get("axis", 1) % rank
        return b.reshape(value, [shape[0] if i == axis else 1 for i in range(rank)])
    axis = a.get("axis", 1) % rank
    extent = x_shape[axis]
    if not isinstance(extent, int) or len(shape) != rank:
        raise refuse(node, "blocked quantization over a symbolic axis")
    index = b.constant(np.arange(extent, dtype=np.int64) // block)
    return b.gather(value, index, axis)


def _saturate(b: GraphBuilder, rounded: int, zero_point: int | None, dtype: str) -> int:
    """rounded + zero_point, clamped to dtype's range and cast to it (rounded is integral)."""
    if zero_point is not None:
        rounded = C.add(b, rounded, b.cast(zero_point, b.dtype(rounded)))
    low, high = _QUANT_RANGES[dtype]
    return b.cast(_clamp(b, rounded, low, high), dtype)


@lowers("QuantizeLinear")
def _quantize_linear(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x, scale, zero_point = ctx.value(node, 0), ctx.value(node, 1), ctx.optional(node, 2)
    x_dtype, scale_dtype = _stored(ctx, node, 0), _stored(ctx, node, 1)
    if x_dtype not in _FLOATS or scale_dtype not in _FLOATS:
        raise refuse(node, f"{x_dtype} input and {scale_dtype} scale")
    if zero_point is not None:
        dtype = _stored(ctx, node, 2)
        if dtype not in _QUANT_RANGES:
            raise refuse(node, f"quantized type {dtype}")
    else:
        dtype = _quant_type(node, a.get("output_dtype", onnx.TensorProto.UINT8))
    precision = a.get("precision", 0)
    if precision:
        division = ELEM_TYPES.get(precision)
        if division not in ("float32", "float16"):
            raise refuse(node, f"precision {onnx.TensorProto.DataType.Name(precision)}")
    else:
        division = x_dtype
    x_shape = b.shape(x)
    quotient = _quotient(b, x, _per_axis(ctx, node, scale, x_shape), division)
    if zero_point is not None:
        zero_point = _per_axis(ctx, node, zero_point, x_shape)
    return [_saturate(b, _round_half_even(b, quotient), zero_point, dtype)]


@lowers("DequantizeLinear")
def _dequantize_linear(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x, scale, zero_point = ctx.value(node, 0), ctx.value(node, 1), ctx.optional(node, 2)
    x_dtype, scale_dtype = _stored(ctx, node, 0), _stored(ctx, node, 1)
    if x_dtype not in (*_QUANT_RANGES, "int32"):
        raise refuse(node, f"input of type {x_dtype}")
    if scale_dtype not in (*_FLOATS, "float64"):
        raise refuse(node, f"{scale_dtype} scale")
    out = ELEM_TYPES.get(a["output_dtype"]) if a.get("output_dtype") else b.dtype(scale)
    if out not in (*_FLOATS, "float64"):
        raise refuse(node, f"output_dtype {a.get('output_dtype')}")
    # NumPy's promotions in the ONNX reference: int32 and float64 operands make it float64
    work = "float64" if "float64" in (x_dtype, b.dtype(scale)) or x_dtype == "int32" else "float32"
    shifted = b.cast(b.cast(x, "float32"), work)
    if zero_point is not None:
        zero_point = b.cast(_per_axis(ctx, node, zero_point, b.shape(x)), work)
        shifted = _sub(b, shifted, zero_point)
    scale = b.cast(_per_axis(ctx, node, scale, b.shape(x)), work)
    result = b.cast(C.mul(b, shifted, scale), "float32" if out == "float16" else out)
    return [result]


@lowers("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if _stored(ctx, node, 0) != "float32":
        raise refuse(node, f"{_stored(ctx, node, 0)} input")
    flat = b.reshape(x, (numel(b.shape(x)),))
    zero = b.constant(np.float32(0.0))
    high = _max(b, [b.reduce(Op.MAX_REDUCE, flat, [0]), zero])
    low = _min(b, [C.neg(b, b.reduce(Op.MAX_REDUCE, C.neg(b, flat), [0])), zero])
    span = _sub(b, high, low)
    span = _where(b, _eq(b, span, zero), b.constant(np.float32(1.0)), span)
    scale = _quotient(b, span, b.constant(np.float32(255.0)), "float32")
    zero_point = _round_half_even(b, _clamp(b, C.neg(b, _quotient(b, low, scale, "float32")), 0, 255))
    rounded = _round_half_even(b, _quotient(b, x, scale, "float32"))
    y = _saturate(b, rounded, zero_point, "uint8")
    return [y, scale, b.cast(zero_point, "uint8")]


def _single(ctx: Context, node: onnx.NodeProto, index: int, what: str) -> int | None:
    """An optional per-tensor operand as a scalar."""
    value = ctx.optional(node, index)
    if value is None:
        return None
    if numel(ctx.b.shape(value)) != 1:
        raise refuse(node, f"a {what} of shape {list(ctx.b.shape(value))}")
    return ctx.b.reshape(value, ())


def _widened(b: GraphBuilder, x: int, zero_point: int | None) -> int:
    """x - zero_point in int32."""
    x = b.cast(x, "int32")
    return x if zero_point is None else C.sub(b, x, b.cast(zero_point, "int32"))


def _check_integer(ctx: Context, node: onnx.NodeProto, *indices: int) -> None:
    for i in indices:
        dtype = _stored(ctx, node, i)
        if dtype not in ("int8", "uint8"):
            raise refuse(node, f"input {i} of type {dtype}")


def _multiplier(ctx: Context, node: onnx.NodeProto, scales: tuple[int, int, int], per_channel: int) -> int:
    """(s1 * s2) / s3 rounded as the ONNX reference does it, in the scales' declared type."""
    b = ctx.b
    s1, s2, s3 = scales
    dtype = _stored(ctx, node, s1)
    if any(_stored(ctx, node, i) != dtype for i in scales) or dtype not in _FLOATS:
        raise refuse(node, f"scales of types {[_stored(ctx, node, i) for i in scales]}")
    first = _single(ctx, node, s1, "scale")
    second = ctx.value(node, s2)
    if numel(b.shape(second)) == 1:
        second = b.reshape(second, ())
    elif b.shape(second) != (per_channel,):
        raise refuse(node, f"a scale of shape {list(b.shape(second))}")
    third = _single(ctx, node, s3, "scale")
    product = _round_to(b, C.mul(b, first, second), dtype)
    return _quotient(b, product, third, dtype)


def _requantize(b: GraphBuilder, acc: int, multiplier: int, zero_point: int | None, dtype: str) -> int:
    """round(acc * multiplier + zero_point), saturated: in float64 as NumPy promotes it."""
    scaled = C.mul(b, b.cast(acc, "float64"), b.cast(multiplier, "float64"))
    if zero_point is not None:
        scaled = C.add(b, scaled, b.cast(zero_point, "float64"))
    return _saturate(b, _round_half_even(b, scaled), None, dtype)


@lowers("QLinearMatMul")
def _qlinear_matmul(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    _check_integer(ctx, node, 0, 3)
    a_int = _widened(b, ctx.value(node, 0), _single(ctx, node, 2, "zero point"))
    b_int = _widened(b, ctx.value(node, 3), _single(ctx, node, 5, "zero point"))
    acc = C.matmul(b, a_int, b_int)
    multiplier = _multiplier(ctx, node, (1, 4, 6), 1)
    y_zero = _single(ctx, node, 7, "zero point")
    dtype = _stored(ctx, node, 7 if y_zero is not None else 0)
    return [_requantize(b, acc, multiplier, y_zero, dtype)]


@lowers("QLinearConv")
def _qlinear_conv(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    _check_integer(ctx, node, 0, 3)
    x = _widened(b, ctx.value(node, 0), _single(ctx, node, 2, "zero point"))
    w = ctx.value(node, 3)
    ws = b.shape(w)
    out_channels, rank = ws[0], len(ws)
    w_zero = ctx.optional(node, 5)
    if w_zero is not None and numel(b.shape(w_zero)) != 1:
        if b.shape(w_zero) != (out_channels,):
            raise refuse(node, f"a weight zero point of shape {list(b.shape(w_zero))}")
        w_zero = b.reshape(w_zero, (out_channels, *[1] * (rank - 1)))
    elif w_zero is not None:
        w_zero = b.reshape(w_zero, ())
    w = _widened(b, w, w_zero)
    bias = ctx.optional(node, 8)
    if bias is not None and b.dtype(bias) != "int32":
        raise refuse(node, f"a {b.dtype(bias)} bias")
    kernel = tuple(attrs(node).get("kernel_shape", ws[2:]))
    pads, strides, dilations = _spatialattrs(ctx, node, b.shape(x)[2:], kernel)
    acc = C.conv(b, x, w, bias, pads, strides, dilations, attrs(node).get("group", 1))
    multiplier = _multiplier(ctx, node, (1, 4, 6), out_channels)
    if b.shape(multiplier) == (out_channels,):
        multiplier = b.reshape(multiplier, (1, out_channels, *[1] * (rank - 2)))
    y_zero = _single(ctx, node, 7, "zero point")
    dtype = _stored(ctx, node, 7 if y_zero is not None else 0)
    return [_requantize(b, acc, multiplier, y_zero, dtype)]


@lowers("MatMulInteger")
def _matmul_integer(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    _check_integer(ctx, node, 0, 1)
    a_int = _widened(b, ctx.value(node, 0), _single(ctx, node, 2, "zero point for A"))
    # a per-column zero point for B broadcasts along B's last axis
    b_zero = ctx.optional(node, 3)
    if b_zero is not None and numel(b.shape(b_zero)) == 1:
        b_zero = b.reshape(b_zero, ())
    elif b_zero is not None and b.shape(b_zero) != b.shape(ctx.value(node, 1))[-1:]:
        raise refuse(node, f"a zero point for B of shape {list(b.shape(b_zero))}")
    b_int = _widened(b, ctx.value(node, 1), b_zero)
    return [C.matmul(b, a_int, b_int)]


# ---- scatter -------------------------------------------------------------------------------

# the [positions, updates, row] comparison tensors (and GridSample's taps) are materialized
_MAX_ELEMENTS = 10**8


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _scatter_inputs(ctx: Context, node: onnx.NodeProto) -> tuple[int, int, int, str]:
    """data, indices, updates and the reduction."""
    data, indices, updates = (ctx.value(node, i) for i in range(3))
    reduction = _text(attrs(node).get("reduction", b"none"))
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise refuse(node, f"reduction={reduction}")
    if reduction != "none" and ctx.b.dtype(data) == "bool":
        raise refuse(node, f"reduction={reduction} on bool data")
    return data, indices, updates, reduction


def _static_shape(node: onnx.NodeProto, shape: tuple[Dim, ...], what: str) -> tuple[int, ...]:
    if not all(isinstance(d, int) for d in shape):
        raise refuse(node, f"a symbolic {what} shape")
    return tuple(shape)  # type: ignore[arg-type]


def _product_last(b: GraphBuilder, x: int) -> int:
    """The product along the last axis (removed), by halving: padded to a power of two with ones."""
    *lead, length = b.shape(x)
    width = 1 << max(0, (length - 1).bit_length())
    x = C.pad(b, x, [(0, 0)] * len(lead) + [(0, width - length)], 1)
    keep = ((0, None, 1),) * (len(lead) + 1)
    while width > 1:
        width //= 2
        pairs = b.reshape(x, (*lead, width, 2))
        halves = [b.reshape(b.view(pairs, ("slice", (*keep, (i, i + 1, 1)))), (*lead, width)) for i in (0, 1)]
        x = b.binary(Op.MUL, *halves)
    return b.reshape(x, tuple(lead))


def _scatter_rows(b: GraphBuilder, data: int, updates: int, target: int, reduction: str) -> int:
    """data [P, S] with row target[q] of it combined with updates [Q, S] row q.

    For reduction none the last update to a row wins, as in the ONNX reference.
    """
    rows, width = b.shape(data)
    count = b.shape(updates)[0]
    hits = _eq(b, b.reshape(b.iota(rows), (rows, 1)), b.reshape(target, (1, count)))  # [P, Q]
    hit_any = b.reshape(b.reduce(Op.MAX_REDUCE, b.cast(hits, "uint8"), [1]), (rows, 1))
    hit_any = b.cast(b.expand(hit_any, (rows, width)), "bool")
    if reduction == "none":
        numbered = C.mul(b, b.cast(hits, "int64"), b.reshape(C.shift(b, b.iota(count), 1), (1, count)))
        last = C.shift(b, b.reduce(Op.MAX_REDUCE, numbered, [1]), -1)
        chosen = b.gather(updates, _max(b, [last, b.scalar_like(0, last)]), 0)
        return _where(b, hit_any, chosen, data)
    full = (rows, width, count)
    hits = b.expand(b.reshape(hits, (rows, 1, count)), full)
    values = b.expand(b.reshape(b.permute(updates, (1, 0)), (1, width, count)), full)
    dtype = b.dtype(data)
    if reduction == "min":
        values, data = _flip(b, values), _flip(b, data)
    if reduction == "add":
        combined = C.add(
            b, data, b.reduce(Op.SUM_REDUCE, _where(b, hits, values, b.scalar_like(0, values)), [2])
        )
    elif reduction == "mul":
        combined = C.mul(b, data, _product_last(b, _where(b, hits, values, b.scalar_like(1, values))))
    else:
        lowest = -np.inf if dtype.startswith("float") else np.iinfo(dtype).min
        peak = b.reduce(Op.MAX_REDUCE, _where(b, hits, values, b.scalar_like(lowest, values)), [2])
        combined = _max(b, [data, peak])
    result = _where(b, hit_any, combined, data)
    return _flip(b, result) if reduction == "min" else result


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
    mode = _text(a.get("mode", b"linear"))
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
    source = _sub(b, b.reshape(b.iota(length), (1, length)), b.reshape(start, (outer, 1)))  # [rows, length]
    if mode == "circular":
        source = b.binary(Op.MOD, source, b.scalar_like(length, source))
        source = _where(b, C.less(b, source, b.scalar_like(0, source)), C.shift(b, source, length), source)
    hit = _all(
        b, C.logical_not(b, C.less(b, source, b.scalar_like(0, source))), C.less(b, source, b.scalar_like(written, source))
    )
    within = _clamp(b, source, 0, written - 1)
    flat = C.add(b, within, C.scale(b, b.reshape(b.iota(outer), (outer, 1)), written))
    rows = b.gather(b.reshape(update, (outer * written, width)), b.reshape(flat, (outer * length,)), 0)
    hit = b.expand(b.reshape(hit, (outer * length, 1)), (outer * length, width))
    result = _where(b, hit, rows, b.reshape(cache, (outer * length, width)))
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
    distance = _where(b, below, C.shift(b, C.neg(b, v), low), C.shift(b, v, -high))
    # whole spans crossed; the float quotient is corrected so the remainder is exact
    turns = _floor(b, C.scale(b, distance, 1.0 / span))
    rest = _sub(b, distance, C.scale(b, turns, span))
    under = C.less(b, rest, b.scalar_like(0.0, rest))
    turns = _where(b, under, C.shift(b, turns, -1.0), turns)
    rest = _where(b, under, C.shift(b, rest, span), rest)
    over = C.logical_not(b, C.less(b, rest, b.scalar_like(span, rest)))
    turns = _where(b, over, C.shift(b, turns, 1.0), turns)
    rest = _where(b, over, C.shift(b, rest, -span), rest)
    even = _eq(b, b.binary(Op.MOD, turns, b.scalar_like(2.0, turns)), b.scalar_like(0.0, turns))
    # an even number of turns leaves v reflected once off the near border
    near_low = _where(b, even, C.shift(b, rest, low), C.shift(b, C.neg(b, rest), high))
    near_high = _where(b, even, C.shift(b, C.neg(b, rest), high), C.shift(b, rest, low))
    return _where(b, below, near_low, _where(b, above, near_high, v))


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

    one_minus = C.shift(b, C.neg(b, t), 1.0)
    return [outer(C.shift(b, t, 1.0)), inner(t), inner(one_minus), outer(C.shift(b, one_minus, 1.0))]


def _axis_taps(b: GraphBuilder, x: int, extent: int, mode: str, padding: str, align: bool):
    """Per sample along one axis: tap indices (int64), weights (None for nearest) and, for zeros
    padding, whether each tap lies inside the input (None otherwise), each [..., taps]."""
    low, high = (0.0, extent - 1.0) if align else (-0.5, extent - 0.5)
    if mode == "nearest":
        x = _round_half_even(b, x)
    outside = _any(b, C.less(b, x, b.scalar_like(low, x)), C.less(b, b.scalar_like(high, x), x))
    if padding == "border":
        x = _where(b, outside, _clamp(b, x, 0.0, extent - 1.0), x)
    elif padding == "reflection":
        # the reference reflects in double precision and stores the result in float32
        x = b.cast(_reflect(b, b.cast(x, "float64"), low, high), "float32")
    if mode == "nearest":
        taps, weights = b.unsqueeze(x, -1), None
    else:
        start = _floor(b, x)
        t = _sub(b, x, start)
        offsets = [0.0, 1.0] if mode == "linear" else [-1.0, 0.0, 1.0, 2.0]
        taps = C.stack_last(b, [C.shift(b, start, o) for o in offsets])
        if mode == "linear":
            weights = C.stack_last(b, [C.shift(b, C.neg(b, t), 1.0), t])
        else:
            weights = C.stack_last(b, _cubic_weights(b, t))
    if padding == "reflection":
        taps = _reflect(b, b.cast(taps, "float64"), low, high)
    # truncation, as the reference's int(); clamped first so no huge float is cast
    index = b.cast(_clamp(b, taps, -1.0, float(extent)), "int64")
    valid = None
    if padding == "zeros":
        valid = _all(
            b, C.logical_not(b, C.less(b, index, b.scalar_like(0, index))), C.less(b, index, b.scalar_like(extent, index))
        )
    # out-of-range taps (zeros padding) still gather somewhere in range, then are masked
    index = _clamp(b, index, 0, extent - 1)
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
    mode = _GRID_MODES.get(_text(a.get("mode", b"bilinear")))
    padding = _text(a.get("padding_mode", b"zeros"))
    align = bool(a.get("align_corners", 0))
    if mode is None or padding not in ("zeros", "border", "reflection"):
        raise refuse(node, f"mode={_text(a.get('mode', b''))} padding_mode={padding}")
    # float16 coordinates would be rounded at every step by the reference: not reproduced
    if _stored(ctx, node, 0) != "float32" or _stored(ctx, node, 1) != "float32":
        raise refuse(node, f"{_stored(ctx, node, 0)} input and {_stored(ctx, node, 1)} grid")
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
        valid = _outer(b, valid, ok, lambda p, q: _all(b, p, q))
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
        picked = _where(b, valid, picked, b.scalar_like(0.0, picked))
    if weight is not None:
        picked = C.mul(b, picked, b.reshape(weight, (batch, samples, taps, 1)))
    out = b.reduce(Op.SUM_REDUCE, picked, [2])  # [N, samples, C]
    return [b.reshape(b.permute(out, (0, 2, 1)), (batch, channels, *out_spatial))]
