"""Lowerings of shape computation, casts and data movement: Cast/CastLike, Unsqueeze/Squeeze,
Expand, ConstantOfShape, Range, Slice, Split, Tile and EyeLike (gathers and scatters are in
indexing.py).

Shape-valued inputs (a Reshape target, an Expand shape, a Range limit) are read with ctx.known,
so they may hold symbolic dims computed by Shape/Gather/Concat: one compiled program then serves
every batch and sequence size.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

from compiler import composite as C
from compiler.dtypes import is_float, is_signed_int
from compiler.frontends.onnx_context import (
    COMPUTED_AS,
    ELEM_TYPES,
    LOW_PRECISION_FLOATS,
    Context,
    attrs,
    dim_tensor,
    lowers,
    refuse,
)
from compiler.ir import GraphBuilder, Op
from compiler.shape import (
    Dim,
    ShapeError,
    SymDim,
    as_dim,
    bounds,
    broadcast_shapes,
    dim_add,
    dim_ceildiv,
    dim_max,
    dim_min,
    dim_mul,
    dim_sub,
    provably_le,
)

# ONNX slice bounds beyond this mean "to the end" (exporters write INT64_MAX or INT32_MAX)
_TO_END = 2**31 - 1


def _dims(ctx: Context, node: onnx.NodeProto, index: int, what: str) -> list[Dim]:
    """A 1-D shape input as dims, symbolic ones included."""
    known = ctx.known(node, index)
    if known is None:
        raise refuse(node, f"a {what} computed at run time")
    return [as_dim(v) for v in known.reshape(-1)]


def _axes_input(ctx: Context, node: onnx.NodeProto, since: int) -> list[int] | None:
    """Axes given as an attribute before opset `since` and as an optional input from it on."""
    if ctx.opset < since:
        axes = attrs(node).get("axes")
        return None if axes is None else list(axes)
    if len(node.input) > 1 and node.input[1]:
        return [int(v) for v in ctx.const(node, 1, "axes").reshape(-1)]
    return None


def _onnx_dtype(node: onnx.NodeProto, elem_type: int) -> str:
    dtype = ELEM_TYPES.get(elem_type)
    if dtype is None:
        raise refuse(node, f"element type {onnx.TensorProto.DataType.Name(elem_type)}")
    return dtype


# float8 formats that ONNX's Cast clamps to their largest finite value unless saturate=0
_SATURATING = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})


def _cast_to(b: GraphBuilder, x: int, dtype: str, saturate: bool = True) -> int:
    wide = COMPUTED_AS.get(dtype)
    if wide is None:
        return b.cast(x, dtype)
    if saturate and dtype in _SATURATING:
        if not is_float(b.dtype(x)):
            x = b.cast(x, "float32")
        # NaN-preserving clamp, as np.clip does in onnx.numpy_helper.saturate_cast; selecting
        # the bound keeps +0.0 as it is, where C.clamp's order reversal would make it -0.0
        limit = float(ml_dtypes.finfo(dtype).max)
        high, low = b.scalar_like(limit, x), b.scalar_like(-limit, x)
        x = C.where(b, C.less(b, high, x), high, x)
        x = C.where(b, C.less(b, x, low), low, x)
    # round to the declared format, then keep computing in the wider dtype
    return b.cast(b.cast(x, dtype), wide)


def _cast_with(ctx: Context, node: onnx.NodeProto, x: int, dtype: str) -> int:
    """Cast and CastLike share saturate (opset 19) and round_mode (opset 24, float8e8m0 only)."""
    if dtype == "float8_e8m0fnu":
        # ONNX rounds up by default, drops the sign and saturates; ml_dtypes rounds to nearest
        raise refuse(node, "element type FLOAT8E8M0 as the target")
    return _cast_to(ctx.b, x, dtype, saturate=attrs(node).get("saturate", 1) == 1)


@lowers("Cast")
def _cast(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    source = ctx.declared_types.get(node.input[0])
    if source is not None and ELEM_TYPES.get(source) is None:
        raise refuse(node, f"input type {onnx.TensorProto.DataType.Name(source)}")
    return [_cast_with(ctx, node, x, _onnx_dtype(node, attrs(node)["to"]))]


@lowers("CastLike")
def _cast_like(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    target = ctx.declared_types.get(node.input[1])
    if target is None:
        like = ctx.known(node, 1)
        dtype = like.dtype.name if like is not None else ctx.b.dtype(ctx.value(node, 1))
    else:
        dtype = _onnx_dtype(node, target)
    return [_cast_with(ctx, node, x, dtype)]


@lowers("Unsqueeze")
def _unsqueeze(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    axes = _axes_input(ctx, node, 13)
    if axes is None:
        raise refuse(node, "no axes")
    shape = list(ctx.b.shape(x))
    rank = len(shape) + len(axes)
    normalized = sorted(a % rank for a in axes)
    if len(set(normalized)) != len(normalized):
        raise ShapeError(f"repeated Unsqueeze axes {axes}")
    for axis in normalized:
        shape.insert(axis, 1)
    return [ctx.b.reshape(x, shape)]


@lowers("Squeeze")
def _squeeze(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    shape = ctx.b.shape(x)
    axes = _axes_input(ctx, node, 13)
    if axes is None:
        axes = [i for i, d in enumerate(shape) if d == 1]
    axes = {a % len(shape) for a in axes} if shape else set()
    for axis in axes:
        if shape[axis] != 1:
            raise ShapeError(f"Squeeze of axis {axis}, which has size {shape[axis]}")
    return [ctx.b.reshape(x, [d for i, d in enumerate(shape) if i not in axes])]


@lowers("Expand")
def _expand(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    target = tuple(_dims(ctx, node, 1, "shape"))
    return [ctx.b.broadcast_to(x, broadcast_shapes(ctx.b.shape(x), target))]


@lowers("ConstantOfShape")
def _constant_of_shape(ctx: Context, node: onnx.NodeProto) -> list[int]:
    value = attrs(node).get("value")
    scalar = numpy_helper.to_array(value).reshape(-1) if value is not None else np.zeros(1, np.float32)
    if scalar.dtype.name not in ELEM_TYPES.values():
        raise refuse(node, f"a value of dtype {scalar.dtype}")
    if scalar.dtype.name in LOW_PRECISION_FLOATS:
        scalar = scalar.astype(np.float32)
    shape = tuple(_dims(ctx, node, 0, "shape"))
    return [ctx.b.broadcast_to(ctx.b.constant(scalar[0]), shape)]


@lowers("Range")
def _range(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    start, limit, delta = (ctx.known(node, i) for i in range(3))
    if start is None or limit is None or delta is None:
        raise refuse(node, "bounds computed at run time")
    if delta.dtype == object:
        raise refuse(node, "a step that depends on symbolic dimensions")
    dtype = ctx.declared_types.get(node.input[0])
    dtype = ELEM_TYPES.get(dtype, start.dtype.name) if dtype else start.dtype.name
    first, last, step = start.reshape(-1)[0], limit.reshape(-1)[0], delta.reshape(-1)[0]
    if isinstance(first, SymDim) or isinstance(last, SymDim):
        if step != int(step) or not is_signed_int(dtype):
            raise refuse(node, "symbolic bounds with a non-integer step")
        step = int(step)
        first, last = as_dim(first), as_dim(last)
        span = dim_sub(last, first) if step > 0 else dim_sub(first, last)
        count: Dim = dim_max(dim_ceildiv(span, abs(step)), 0)
    else:
        count = max(int(np.ceil((float(last) - float(first)) / float(step))), 0)
    values = b.cast(b.iota(count), dtype)
    if step != 1:
        values = b.binary(Op.MUL, values, b.scalar_like(step, values))
    if isinstance(first, SymDim):
        values = b.binary(Op.ADD, values, b.cast(dim_tensor(b, first, values), dtype))
    elif first != 0:
        values = b.binary(Op.ADD, values, b.scalar_like(first, values))
    return [values]


def _slice_params(ctx: Context, node: onnx.NodeProto, rank: int):
    if ctx.opset < 10:
        a = attrs(node)
        starts, ends = list(a["starts"]), list(a["ends"])
        axes, steps = a.get("axes"), None
    else:
        starts = _dims(ctx, node, 1, "starts")
        ends = _dims(ctx, node, 2, "ends")
        axes = [int(v) for v in ctx.const(node, 3, "axes").reshape(-1)] if len(node.input) > 3 and node.input[3] else None
        steps = [int(v) for v in ctx.const(node, 4, "steps").reshape(-1)] if len(node.input) > 4 and node.input[4] else None
    axes = list(range(len(starts))) if axes is None else [a % rank for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    return starts, ends, axes, steps


@lowers("Slice")
def _slice(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    shape = ctx.b.shape(x)
    starts, ends, axes, steps = _slice_params(ctx, node, len(shape))
    triples: list[tuple] = [(0, None, 1)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step == 0:
            raise ShapeError("Slice with step 0")
        triples[axis] = _slice_triple(ctx, node, shape[axis], start, end, step)
    return [ctx.b.view(x, ("slice", tuple(triples)))]


def _slice_triple(ctx: Context, node: onnx.NodeProto, dim: Dim, start: Dim, end: Dim, step: int) -> tuple:
    """ONNX's clamping of (start, end) against `dim`, done symbolically where needed."""
    if all(isinstance(v, int) for v in (dim, start, end)):
        # clamp like ONNX (and Python) so the view holds plain in-range bounds
        lo, hi, st = slice(start, end, step).indices(dim)
        if st < 0 and hi < 0:
            hi = None
        return (lo, hi, st)
    if step > 0:
        lo = _clamp_dim(ctx, _from_end(node, start, dim), 0, dim)
        hi = None if isinstance(end, int) and end >= _TO_END else _clamp_dim(ctx, _from_end(node, end, dim), 0, dim)
        if hi == dim:
            hi = None
    else:
        lo = _clamp_dim(ctx, _from_end(node, start, dim), 0, dim_sub(dim, 1))
        hi = None if isinstance(end, int) and end <= -_TO_END else _clamp_dim(ctx, _from_end(node, end, dim), -1, dim_sub(dim, 1))
        if hi == -1:
            hi = None
    return (lo, hi, step)


def _from_end(node: onnx.NodeProto, value: Dim, dim: Dim) -> Dim:
    """A negative bound counts from the end of the axis."""
    low, high = bounds(value)
    if low >= 0:
        return value
    if high < 0:
        return dim_add(value, dim)
    raise refuse(node, f"a bound {value} whose sign is not known at compile time")


def _clamp_dim(ctx: Context, value: Dim, low: Dim, high: Dim) -> Dim:
    value = dim_max(value, low)
    if isinstance(high, int) and not isinstance(value, int) and not provably_le(high, value):
        # a symbolic bound into a fixed axis (a buffer cut to the sequence length): the model
        # then serves only sizes up to that axis, and requests beyond it are refused
        ctx.b.limit_size(value, high)
        return value
    return dim_min(value, high)


@lowers("Split")
def _split(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    a = attrs(node)
    shape = b.shape(x)
    axis = a.get("axis", 0) % len(shape)
    dim = shape[axis]
    if ctx.opset >= 13 and len(node.input) > 1 and node.input[1]:
        sizes: list[Dim] = _dims(ctx, node, 1, "split")
    elif "split" in a:
        sizes = list(a["split"])
    else:
        parts = a.get("num_outputs", len(node.output))
        chunk = dim_ceildiv(dim, parts)
        sizes = [chunk] * (parts - 1) + [dim_sub(dim, dim_mul(chunk, parts - 1))]
        if isinstance(dim, int):
            sizes = [min(chunk, dim - i * chunk) for i in range(parts)]
    total: Dim = 0
    for size in sizes:
        total = dim_add(total, size)
    if total != dim:
        raise ShapeError(f"split sizes {[str(s) for s in sizes]} do not add up to {dim}")
    outputs, offset = [], 0
    for size in sizes:
        triples = [(0, None, 1)] * len(shape)
        triples[axis] = (offset, dim_add(offset, size), 1)
        outputs.append(b.view(x, ("slice", tuple(triples))))
        offset = dim_add(offset, size)
    return outputs


@lowers("Tile")
def _tile(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    repeats = [int(v) for v in ctx.const(node, 1, "repeats").reshape(-1)]
    shape = b.shape(x)
    if len(repeats) != len(shape):
        raise ShapeError(f"Tile repeats {repeats} for a rank-{len(shape)} input")
    interleaved = b.reshape(x, [d for dim in shape for d in (1, dim)])
    expanded = b.expand(interleaved, [d for r, dim in zip(repeats, shape) for d in (r, dim)])
    return [b.reshape(expanded, [dim_mul(r, dim) for r, dim in zip(repeats, shape)])]


@lowers("EyeLike")
def _eye_like(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    shape = ctx.b.shape(x)
    if len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        raise refuse(node, f"shape {list(shape)}")
    a = attrs(node)
    dtype = _onnx_dtype(node, a["dtype"]) if "dtype" in a else ctx.b.dtype(x)
    if dtype in LOW_PRECISION_FLOATS:
        dtype = "float32"
    return [ctx.b.constant(np.eye(shape[0], shape[1], k=a.get("k", 0), dtype=dtype))]
