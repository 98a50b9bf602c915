"""Lowerings of the quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
QLinearMatMul, QLinearConv and MatMulInteger.

Quantization reproduces ONNX's arithmetic exactly: a float32 quotient x / scale is taken in
float64 and rounded once to float32, which is the correctly rounded quotient (a float32 quotient
is never close enough to a rounding midpoint for the float64 error to matter); it is then
rounded half to even and saturated. Integer products are exact in int32.
"""

from __future__ import annotations

import numpy as np
import onnx

from compiler import composite as C
from compiler.frontends.onnx_context import ELEM_TYPES, Context, attrs, lowers, refuse, stored_dtype
from compiler.frontends.onnx_ops.nn import spatial_attrs
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, numel

# ---- quantization --------------------------------------------------------------------------

# the float types quantization arithmetic is reproduced in exactly
_FLOATS = ("float32", "float16")
_QUANT_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}


def _round_to(b: GraphBuilder, x: int, dtype: str) -> int:
    """x rounded to `dtype` and carried in x's own float type."""
    return b.cast(b.cast(x, dtype), b.dtype(x))


def _quotient(b: GraphBuilder, x: int, y: int, dtype: str) -> int:
    """x / y correctly rounded to `dtype` (float32 or float16), returned as float32."""
    quotient = C.div(b, b.cast(x, "float64"), b.cast(y, "float64"))
    # rounded straight from float64: a detour through float32 could round twice
    return b.cast(b.cast(quotient, dtype), "float32")


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
    return b.cast(C.clamp(b, rounded, low, high), dtype)


@lowers("QuantizeLinear")
def _quantize_linear(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x, scale, zero_point = ctx.value(node, 0), ctx.value(node, 1), ctx.optional(node, 2)
    x_dtype, scale_dtype = stored_dtype(ctx, node, 0), stored_dtype(ctx, node, 1)
    if x_dtype not in _FLOATS or scale_dtype not in _FLOATS:
        raise refuse(node, f"{x_dtype} input and {scale_dtype} scale")
    if zero_point is not None:
        dtype = stored_dtype(ctx, node, 2)
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
    return [_saturate(b, C.round_half_even(b, quotient), zero_point, dtype)]


@lowers("DequantizeLinear")
def _dequantize_linear(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x, scale, zero_point = ctx.value(node, 0), ctx.value(node, 1), ctx.optional(node, 2)
    x_dtype, scale_dtype = stored_dtype(ctx, node, 0), stored_dtype(ctx, node, 1)
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
        shifted = C.sub(b, shifted, zero_point)
    scale = b.cast(_per_axis(ctx, node, scale, b.shape(x)), work)
    result = b.cast(C.mul(b, shifted, scale), "float32" if out == "float16" else out)
    return [result]


@lowers("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if stored_dtype(ctx, node, 0) != "float32":
        raise refuse(node, f"{stored_dtype(ctx, node, 0)} input")
    flat = b.reshape(x, (numel(b.shape(x)),))
    zero = b.constant(np.float32(0.0))
    high = C.maximum(b, b.reduce(Op.MAX_REDUCE, flat, [0]), zero)
    low = C.minimum(b, C.reduce_min(b, flat, [0]), zero)
    span = C.sub(b, high, low)
    span = C.where(b, C.equal(b, span, zero), b.constant(np.float32(1.0)), span)
    scale = _quotient(b, span, b.constant(np.float32(255.0)), "float32")
    zero_point = C.round_half_even(b, C.clamp(b, C.neg(b, _quotient(b, low, scale, "float32")), 0, 255))
    rounded = C.round_half_even(b, _quotient(b, x, scale, "float32"))
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
        dtype = stored_dtype(ctx, node, i)
        if dtype not in ("int8", "uint8"):
            raise refuse(node, f"input {i} of type {dtype}")


def _multiplier(ctx: Context, node: onnx.NodeProto, scales: tuple[int, int, int], per_channel: int) -> int:
    """(s1 * s2) / s3 rounded as the ONNX reference does it, in the scales' declared type."""
    b = ctx.b
    s1, s2, s3 = scales
    dtype = stored_dtype(ctx, node, s1)
    if any(stored_dtype(ctx, node, i) != dtype for i in scales) or dtype not in _FLOATS:
        raise refuse(node, f"scales of types {[stored_dtype(ctx, node, i) for i in scales]}")
    first = _single(ctx, node, s1, "scale")
    second = ctx.value(node, s2)
    if numel(b.shape(second)) == 1:
        second = b.reshape(second, ())
    elif b.shape(second) != (per_channel,):
        raise refuse(node, f"a scale of shape {list(b.shape(second))}")
    third = _single(ctx, node, s3, "scale")
    product = _round_to(b, C.mul(b, first, second), dtype)
    return _quotient(b, product, third, dtype)


def _requantize(ctx: Context, node: onnx.NodeProto, acc: int, multiplier: int) -> int:
    """round(acc * multiplier + y_zero_point), saturated to the output type (input 7's, else
    input 0's): in float64 as NumPy promotes it."""
    b = ctx.b
    zero_point = _single(ctx, node, 7, "zero point")
    dtype = stored_dtype(ctx, node, 7 if zero_point is not None else 0)
    scaled = C.mul(b, b.cast(acc, "float64"), b.cast(multiplier, "float64"))
    if zero_point is not None:
        scaled = C.add(b, scaled, b.cast(zero_point, "float64"))
    return _saturate(b, C.round_half_even(b, scaled), None, dtype)


@lowers("QLinearMatMul")
def _qlinear_matmul(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    _check_integer(ctx, node, 0, 3)
    a_int = _widened(b, ctx.value(node, 0), _single(ctx, node, 2, "zero point"))
    b_int = _widened(b, ctx.value(node, 3), _single(ctx, node, 5, "zero point"))
    acc = C.matmul(b, a_int, b_int)
    return [_requantize(ctx, node, acc, _multiplier(ctx, node, (1, 4, 6), 1))]


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
    pads, strides, dilations = spatial_attrs(ctx, node, b.shape(x)[2:], kernel)
    acc = C.conv(b, x, w, bias, pads, strides, dilations, attrs(node).get("group", 1))
    multiplier = _multiplier(ctx, node, (1, 4, 6), out_channels)
    if b.shape(multiplier) == (out_channels,):
        multiplier = b.reshape(multiplier, (1, out_channels, *[1] * (rank - 2)))
    return [_requantize(ctx, node, acc, multiplier)]


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
