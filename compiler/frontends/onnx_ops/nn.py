"""Lowerings of convolution, pooling and normalization ops."""

from __future__ import annotations

import numpy as np
import onnx

from compiler import composite as C
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse
from compiler.ir import GraphBuilder, Op
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


def _static_spatial(node: onnx.NodeProto, shape: tuple[Dim, ...]) -> list[int]:
    spatial = list(shape[2:])
    if not all(isinstance(d, int) for d in spatial):
        raise refuse(node, "symbolic spatial dimensions")
    return spatial  # type: ignore[return-value]


def _pad_or_crop(b: GraphBuilder, x: int, widths: list[tuple[int, int]]) -> int:
    """Pad each axis with zeros by (before, after); a negative width crops instead."""
    x = C.pad(b, x, [(max(0, lo), max(0, hi)) for lo, hi in widths], 0)
    if all(lo >= 0 and hi >= 0 for lo, hi in widths):
        return x
    bounds = tuple(
        (max(0, -lo), d + hi if hi < 0 else None, 1) for (lo, hi), d in zip(widths, b.shape(x))
    )
    return b.view(x, ("slice", bounds))


def _interleave_zeros(b: GraphBuilder, x: int, axis: int, stride: int) -> int:
    """Put stride-1 zeros between neighbours along `axis`: length n becomes (n-1)*stride+1."""
    if stride == 1:
        return x
    shape = b.shape(x)
    n = shape[axis]
    widths = [(0, 0)] * (len(shape) + 1)
    widths[axis + 1] = (0, stride - 1)
    spread = C.pad(b, b.unsqueeze(x, axis + 1), widths, 0)
    flat = b.reshape(spread, (*shape[:axis], n * stride, *shape[axis + 1 :]))
    bounds = [(0, None, 1)] * len(shape)
    bounds[axis] = (0, (n - 1) * stride + 1, 1)
    return b.view(flat, ("slice", tuple(bounds)))


def _reverse(b: GraphBuilder, x: int, axis: int) -> int:
    size = b.shape(x)[axis]
    return b.gather(x, b.constant(np.arange(size - 1, -1, -1, dtype=np.int64)), axis)


@lowers("ConvTranspose")
def _conv_transpose(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """A stride-1 convolution of the zero-interleaved input with the flipped, transposed kernel.

    Output position o reads position o + pad_begin of the full (uncropped) transposed
    convolution, whose positions past its end (output_padding) are zero.
    """
    b = ctx.b
    a = attrs(node)
    x, w = ctx.value(node, 0), ctx.value(node, 1)
    in_sizes = _static_spatial(node, b.shape(x))
    nd = len(in_sizes)
    ws = b.shape(w)
    kernel = [int(k) for k in ws[2:]]
    if list(a.get("kernel_shape", kernel)) != kernel or len(kernel) != nd:
        raise ShapeError(f"kernel_shape {a.get('kernel_shape')} disagrees with weight {list(ws)}")
    strides = list(a.get("strides", [1] * nd))
    dilations = list(a.get("dilations", [1] * nd))
    out_padding = list(a.get("output_padding", [0] * nd))
    group = a.get("group", 1)
    auto_pad = a.get("auto_pad", b"NOTSET").decode()
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    full = [s * (n - 1) + p + span for s, n, p, span in zip(strides, in_sizes, out_padding, spans)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") or "output_shape" in a:
        if "pads" in a:
            raise refuse(node, "both pads and output_shape or auto_pad")
        out_sizes = list(a.get("output_shape", [n * s for n, s in zip(in_sizes, strides)]))[-nd:]
        totals = [f - o for f, o in zip(full, out_sizes)]
        if auto_pad == "NOTSET":
            # a larger output just extends the end; for a smaller one the ONNX spec crops both
            # ends and its reference implementation only the end
            if any(t > 0 for t in totals):
                raise refuse(node, "an output_shape smaller than the full output and no auto_pad")
            begins = [0] * nd
        elif any(t < 0 for t in totals):
            # runtimes disagree on where a negative total padding goes
            raise refuse(node, f"auto_pad={auto_pad} with a kernel span smaller than the stride")
        else:
            begins = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
    elif auto_pad in ("NOTSET", "VALID"):
        raw = list(a.get("pads", [0] * (2 * nd))) if auto_pad == "NOTSET" else [0] * (2 * nd)
        begins = raw[:nd]
        out_sizes = [f - lo - hi for f, lo, hi in zip(full, raw[:nd], raw[nd:])]
    else:
        raise refuse(node, f"auto_pad={auto_pad}")
    if any(o < 1 for o in out_sizes):
        raise ShapeError(f"ConvTranspose output size {out_sizes} is empty")
    for i, s in enumerate(strides):
        x = _interleave_zeros(b, x, 2 + i, s)
    widths = [(0, 0), (0, 0)]
    for i in range(nd):
        left = spans[i] - 1 - begins[i]
        widths.append((left, out_sizes[i] + spans[i] - 1 - left - b.shape(x)[2 + i]))
    x = _pad_or_crop(b, x, widths)
    # weight [C, M/group, *K] -> [M, C/group, *K], each spatial axis reversed
    c, m_per_group = ws[0], ws[1]
    if c % group:
        raise ShapeError(f"ConvTranspose weight {list(ws)} does not split into {group} groups")
    w = b.reshape(w, (group, c // group, m_per_group, *kernel))
    w = b.reshape(b.permute(w, (0, 2, 1, *range(3, 3 + nd))), (group * m_per_group, c // group, *kernel))
    for i in range(nd):
        w = _reverse(b, w, 2 + i)
    bias = ctx.optional(node, 2)
    return [C.conv(b, x, w, bias, [(0, 0)] * nd, [1] * nd, dilations, group)]


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
