"""Lowerings of convolution, pooling and normalization ops."""

from __future__ import annotations

import numpy as np
import onnx

from compiler import composite as C
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse
from compiler.ir import Op
from compiler.shape import Dim, ShapeError, numel


def _spatialattrs(ctx: Context, node: onnx.NodeProto, spatial: tuple[Dim, ...], kernel):
    """Resolve pads/strides/dilations (including auto_pad) for conv and pooling."""
    a = attrs(node)
    nd = len(kernel)
    strides = list(a.get("strides", [1] * nd))
    dilations = list(a.get("dilations", [1] * nd))
    raw_pads = list(a.get("pads", [0] * (2 * nd)))
    pads = [(raw_pads[i], raw_pads[i + nd]) for i in range(nd)]
    auto_pad = a.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for d, k, s, dil in zip(spatial, kernel, strides, dilations):
            if not isinstance(d, int):
                raise refuse(node, "auto_pad over a symbolic dimension")
            out = -(-d // s)
            total = max(0, (out - 1) * s + dil * (k - 1) + 1 - d)
            small, big = total // 2, total - total // 2
            pads.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    elif auto_pad == "VALID":
        pads = [(0, 0)] * nd
    elif auto_pad != "NOTSET":
        raise refuse(node, f"auto_pad={auto_pad}")
    return pads, strides, dilations


@lowers("Conv")
def _conv(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, w = ctx.value(node, 0), ctx.value(node, 1)
    kernel = tuple(attrs(node).get("kernel_shape", b.shape(w)[2:]))
    if tuple(b.shape(w)[2:]) != kernel:
        raise ShapeError(f"kernel_shape {list(kernel)} disagrees with weight {list(b.shape(w))}")
    pads, strides, dilations = _spatialattrs(ctx, node, b.shape(x)[2:], kernel)
    group = attrs(node).get("group", 1)
    return [C.conv(b, x, w, ctx.optional(node, 2), pads, strides, dilations, group)]


@lowers("MaxPool", "AveragePool")
def _pool(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    if len(node.output) > 1 and node.output[1]:
        raise refuse(node, "an Indices output")
    if a.get("storage_order", 0):
        raise refuse(node, "storage_order=1")
    x = ctx.value(node, 0)
    kernel = tuple(a["kernel_shape"])
    spatial = b.shape(x)[2:]
    pads, strides, dilations = _spatialattrs(ctx, node, spatial, kernel)
    extra = [0] * len(kernel)
    if a.get("ceil_mode", 0):
        for i, (d, k, s, dil, (pb, pe)) in enumerate(zip(spatial, kernel, strides, dilations, pads)):
            span = dil * (k - 1) + 1
            out = -(-(d + pb + pe - span) // s) + 1
            if (out - 1) * s >= d + pb:  # the last window may not start in the end padding
                out -= 1
            extra[i] = max(0, (out - 1) * s + span - (d + pb + pe))
    kind = "max" if node.op_type == "MaxPool" else "avg"
    include_pad = bool(a.get("count_include_pad", 0))
    return [C.pool(b, x, kind, kernel, pads, strides, dilations, include_pad, extra)]


@lowers("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    shape = b.shape(x)
    axes = list(range(2, len(shape)))
    if node.op_type == "GlobalMaxPool":
        return [C.reduce_keep(b, Op.MAX_REDUCE, x, axes)]
    count = numel(shape[2:])
    if not isinstance(count, int):
        raise refuse(node, "symbolic spatial dimensions")
    return [C.scale(b, C.reduce_keep(b, Op.SUM_REDUCE, x, axes), 1.0 / count)]


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
        scale, bias, mean, var = (ctx.consts[n].astype(np.float64) for n in names)
        factor = scale / np.sqrt(var + eps)
        offset = bias - mean * factor
        mul = b.constant(factor.astype(dtype).reshape(channel_shape))
        add = b.constant(offset.astype(dtype).reshape(channel_shape))
        return [C.add(b, C.mul(b, x, mul), add)]
    scale, bias, mean, var = (b.reshape(ctx.value(node, i), channel_shape) for i in range(1, 5))
    inv_std = b.unary(Op.RECIP, b.unary(Op.SQRT, C.shift(b, var, eps)))
    return [C.add(b, C.mul(b, C.sub(b, x, mean), C.mul(b, inv_std, scale)), bias)]
