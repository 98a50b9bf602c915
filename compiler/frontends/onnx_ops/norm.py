"""Lowerings of the normalization ops: BatchNormalization, LayerNormalization,
RMSNormalization, InstanceNormalization, GroupNormalization, LpNormalization,
MeanVarianceNormalization and LRN.

Means go through composite.mean_keep; standardizing is (x - mean) times 1/sqrt(var + epsilon),
computed in the stash_type where the op has one and cast back once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from compiler import composite as C
from compiler.dtypes import is_float
from compiler.frontends.onnx_context import (
    ELEM_TYPES,
    Context,
    attrs,
    float_input,
    lowers,
    normalized_axis,
    refuse,
)
from compiler.ir import GraphBuilder, Op
from compiler.shape import ShapeError

# ---- shared helpers ------------------------------------------------------------------------


def _stash_dtype(node: onnx.NodeProto) -> str:
    stash = attrs(node).get("stash_type", onnx.TensorProto.FLOAT)
    dtype = ELEM_TYPES.get(stash)
    if dtype is None or not is_float(dtype):
        raise refuse(node, f"stash_type={stash}")
    return dtype


def _inverse_root(b: GraphBuilder, x: int, epsilon: float) -> int:
    """1 / sqrt(x + epsilon)."""
    return b.unary(Op.RECIP, C.sqrt(b, C.shift(b, x, epsilon)))


def _standardize(b: GraphBuilder, x: int, axes: Sequence[int], epsilon: float) -> tuple[int, int, int]:
    """(x - mean) / sqrt(var + epsilon) over `axes`, with the mean and 1/std (axes kept)."""
    mean = C.mean_keep(b, x, axes)
    centered = C.sub(b, x, mean)
    inv_std = _inverse_root(b, C.mean_keep(b, b.binary(Op.MUL, centered, centered), axes), epsilon)
    return C.mul(b, centered, inv_std), mean, inv_std


def _affine(b: GraphBuilder, x: int, scale: int | None, bias: int | None) -> int:
    if scale is not None:
        x = C.mul(b, x, scale)
    if bias is not None:
        x = C.add(b, x, bias)
    return x


def _per_channel(b: GraphBuilder, v: int, rank: int) -> int:
    """A [C] vector shaped to broadcast against [N, C, *spatial]."""
    return b.reshape(v, (1, b.shape(v)[0], *([1] * (rank - 2))))


def _channel_affine(ctx: Context, node: onnx.NodeProto, x: int, rank: int) -> int:
    """x times the per-channel scale (input 1) plus the per-channel bias (input 2)."""
    scale, bias = (_per_channel(ctx.b, ctx.value(node, i), rank) for i in (1, 2))
    return _affine(ctx.b, x, scale, bias)


# ---- normalizing with given statistics -----------------------------------------------------


@lowers("BatchNormalization")
def _batch_norm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    a = attrs(node)
    if a.get("training_mode", 0) or (len(node.output) > 1 and any(node.output[1:])):
        raise refuse(node, "training mode")
    b = ctx.b
    x = ctx.value(node, 0)
    eps = a.get("epsilon", 1e-5)
    rank = len(b.shape(x))
    channel_shape = (1, b.shape(x)[1], *([1] * (rank - 2)))
    names = node.input[1:5]
    dtype = b.dtype(x)
    if all(n in ctx.consts for n in names):
        # constant statistics fold into one multiply and one add per channel
        scale, bias, mean, var = (ctx.consts[n].astype(np.float64) for n in names)
        factor = scale / np.sqrt(var + eps)
        offset = bias - mean * factor
        mul = b.constant(factor.astype(dtype).reshape(channel_shape))
        add = b.constant(offset.astype(dtype).reshape(channel_shape))
        return [C.add(b, C.mul(b, x, mul), add)]
    scale, bias, mean, var = (b.reshape(ctx.value(node, i), channel_shape) for i in range(1, 5))
    inv_std = _inverse_root(b, var, eps)
    return [C.add(b, C.mul(b, C.sub(b, x, mean), C.mul(b, inv_std, scale)), bias)]


# ---- normalizing with the input's own statistics -------------------------------------------


@lowers("LayerNormalization")
def _layer_norm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = float_input(ctx, node)
    rank = len(b.shape(x))
    axis = normalized_axis(node, a.get("axis", -1), rank)
    stash = _stash_dtype(node)
    normalized, mean, inv_std = _standardize(b, b.cast(x, stash), range(axis, rank), a.get("epsilon", 1e-5))
    y = _affine(b, b.cast(normalized, b.dtype(x)), ctx.value(node, 1), ctx.optional(node, 2))
    return [y, mean, inv_std]


@lowers("RMSNormalization")
def _rms_norm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = float_input(ctx, node)
    rank = len(b.shape(x))
    axes = range(normalized_axis(node, a.get("axis", -1), rank), rank)
    stashed = b.cast(x, _stash_dtype(node))
    mean_square = C.mean_keep(b, b.binary(Op.MUL, stashed, stashed), axes)
    inv_rms = _inverse_root(b, mean_square, a.get("epsilon", 1e-5))
    normalized = b.cast(C.mul(b, stashed, inv_rms), b.dtype(x))
    return [C.mul(b, normalized, ctx.value(node, 1))]


@lowers("InstanceNormalization")
def _instance_norm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = float_input(ctx, node)
    rank = len(b.shape(x))
    if rank < 3:
        raise ShapeError(f"InstanceNormalization of a rank-{rank} input")
    normalized, _, _ = _standardize(b, x, range(2, rank), attrs(node).get("epsilon", 1e-5))
    return [_channel_affine(ctx, node, normalized, rank)]


@lowers("GroupNormalization")
def _group_norm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    if ctx.opset < 21:  # opset 18 scaled per group, and onnx.checker rejects it as deprecated
        raise refuse(node, f"opset {ctx.opset} semantics (one scale per group)")
    b = ctx.b
    a = attrs(node)
    x = float_input(ctx, node)
    shape = b.shape(x)
    rank = len(shape)
    groups, channels = a["num_groups"], shape[1]
    if rank < 3 or not isinstance(channels, int) or channels % groups:
        raise ShapeError(f"GroupNormalization of {list(shape)} into {groups} groups")
    grouped_shape = (shape[0], groups, channels // groups, *shape[2:])
    grouped = b.reshape(b.cast(x, _stash_dtype(node)), grouped_shape)
    normalized, _, _ = _standardize(b, grouped, range(2, rank + 1), a.get("epsilon", 1e-5))
    normalized = b.reshape(b.cast(normalized, b.dtype(x)), shape)
    return [_channel_affine(ctx, node, normalized, rank)]


@lowers("MeanVarianceNormalization")
def _mvn(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = float_input(ctx, node)
    rank = len(b.shape(x))
    axes = sorted({normalized_axis(node, v, rank) for v in attrs(node).get("axes", [0, 2, 3])})
    # the ONNX definition: (x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9)
    mean = C.mean_keep(b, x, axes)
    variance = C.sub(b, C.mean_keep(b, b.binary(Op.MUL, x, x), axes), b.binary(Op.MUL, mean, mean))
    std = C.shift(b, C.sqrt(b, variance), 1e-9)
    return [C.div(b, C.sub(b, x, mean), std)]


# ---- normalizing by a norm -----------------------------------------------------------------


@lowers("LpNormalization")
def _lp_norm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = float_input(ctx, node)
    axis = normalized_axis(node, a.get("axis", -1), len(b.shape(x)))
    p = a.get("p", 2)
    if p == 1:
        norm = C.reduce_keep(b, Op.SUM_REDUCE, C.absolute(b, x), [axis])
    elif p == 2:
        norm = C.sqrt(b, C.reduce_keep(b, Op.SUM_REDUCE, b.binary(Op.MUL, x, x), [axis]))
    else:
        raise refuse(node, f"p={p}")
    norm = b.expand(norm, b.shape(x))
    # a zero norm gives zeros, not 0/0 (a NaN norm stays NaN; native programs read a subnormal as 0)
    is_zero = C.equal(b, norm, b.scalar_like(0, norm))
    return [C.where(b, is_zero, b.scalar_like(0, x), b.binary(Op.MUL, x, b.unary(Op.RECIP, norm)))]


@lowers("LRN")
def _lrn(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = float_input(ctx, node)
    shape = b.shape(x)
    size = a["size"]
    if len(shape) < 3 or not isinstance(shape[1], int):
        raise refuse(node, f"input shape {list(shape)}")
    before, after = (size - 1) // 2, size // 2
    widths = [(0, 0)] * len(shape)
    widths[1] = (before, after)
    squares = C.pad(b, b.binary(Op.MUL, x, x), widths, 0)
    windows = b.view(squares, ("window", (1,), (size,), (1,), (1,)))
    square_sum = b.reduce(Op.SUM_REDUCE, windows, [-1])
    base = C.shift(b, C.scale(b, square_sum, a.get("alpha", 1e-4) / size), a.get("bias", 1.0))
    return [b.binary(Op.MUL, x, C.pow_positive(b, base, -a.get("beta", 0.75)))]
