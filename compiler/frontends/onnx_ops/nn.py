"""Lowerings of convolution, pooling and normalization ops."""

from __future__ import annotations

import numpy as np
import onnx

from compiler import composite as C
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, ShapeError, dim_mul, numel


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
    bounds = tuple((max(0, -lo), d + hi if hi < 0 else None, 1) for (lo, hi), d in zip(widths, b.shape(x)))
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


def _pool_geometry(ctx: Context, node: onnx.NodeProto, x: int):
    """Kernel, pads, strides, dilations, and the extra end padding that ceil_mode needs."""
    a = attrs(node)
    kernel = tuple(a["kernel_shape"])
    spatial = _static_spatial(node, ctx.b.shape(x))
    pads, strides, dilations = _spatialattrs(ctx, node, tuple(spatial), kernel)
    extra = [0] * len(kernel)
    if a.get("ceil_mode", 0):
        for i, (d, k, s, dil, (pb, pe)) in enumerate(zip(spatial, kernel, strides, dilations, pads)):
            span = dil * (k - 1) + 1
            out = -(-(d + pb + pe - span) // s) + 1
            if (out - 1) * s >= d + pb:  # the last window may not start in the end padding
                out -= 1
            extra[i] = max(0, (out - 1) * s + span - (d + pb + pe))
    return kernel, pads, strides, dilations, extra


def _windows(b: GraphBuilder, x: int, kernel, pads, strides, dilations, extra, fill) -> int:
    """[N, C, *S] padded with `fill` -> [N, C, *out, *kernel] sliding windows."""
    nd = len(kernel)
    widths = [(0, 0), (0, 0)] + [(lo, hi + e) for (lo, hi), e in zip(pads, extra)]
    view = ("window", tuple(range(2, 2 + nd)), tuple(kernel), tuple(strides), tuple(dilations))
    return b.view(C.pad(b, x, widths, fill), view)


@lowers("MaxPool", "AveragePool")
def _pool(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = ctx.value(node, 0)
    geometry = _pool_geometry(ctx, node, x)
    kernel, pads, strides, dilations, extra = geometry
    if node.op_type == "AveragePool":
        include_pad = bool(a.get("count_include_pad", 0))
        return [C.pool(b, x, "avg", kernel, pads, strides, dilations, include_pad, extra)]
    peak = C.pool(b, x, "max", kernel, pads, strides, dilations, False, extra)
    if len(node.output) < 2 or not node.output[1]:
        return [peak]
    return [peak, _max_pool_indices(b, x, peak, geometry, bool(a.get("storage_order", 0)))]


def _max_pool_indices(b: GraphBuilder, x: int, peak: int, geometry, column_major: bool) -> int:
    """Flat input index of each window's maximum; on ties the first in row-major order wins."""
    shape = b.shape(x)
    spatial = shape[2:]
    nd = len(spatial)
    size = int(np.prod(spatial))
    dtype = np.dtype(b.dtype(x))
    lowest = -np.inf if dtype.kind == "f" else np.iinfo(dtype).min
    values = _windows(b, x, *geometry, lowest)
    # padded positions get index `size`, past every real one, so they never win a tie
    positions = b.constant(np.arange(size, dtype=np.int64).reshape(1, 1, *spatial))
    full = b.shape(values)
    position_windows = b.expand(_windows(b, positions, *geometry, size), (1, 1, *full[2:]))
    position_windows = b.expand(position_windows, full)
    below_peak = b.binary(Op.LESS_THAN, values, b.expand(b.reshape(peak, (*b.shape(peak), *[1] * nd)), full))
    candidates = C.where(b, below_peak, b.scalar_like(size, position_windows), position_windows)
    window_axes = list(range(2 + nd, 2 + 2 * nd))
    first = C.neg(b, b.reduce(Op.MAX_REDUCE, C.neg(b, candidates), window_axes))
    if column_major:
        coords = np.unravel_index(np.arange(size), spatial)
        table = np.ravel_multi_index(coords, spatial, order="F").astype(np.int64)
        first = b.gather(b.constant(table), first, 0)
    planes = b.reshape(C.scale(b, b.iota(dim_mul(shape[0], shape[1])), size), (*shape[:2], *[1] * nd))
    return C.add(b, first, planes)


def _abs_power(b: GraphBuilder, x: int, p: int) -> int:
    """|x|**p for a positive integer p, by repeated squaring."""
    base = x if p % 2 == 0 else C.maximum(b, x, C.neg(b, x))
    result = None
    while p:
        if p & 1:
            result = base if result is None else b.binary(Op.MUL, result, base)
        p >>= 1
        if p:
            base = b.binary(Op.MUL, base, base)
    assert result is not None
    return result


def _root(b: GraphBuilder, x: int, p: int) -> int:
    """x**(1/p) for x >= 0."""
    while p % 2 == 0:
        x, p = b.unary(Op.SQRT, x), p // 2
    if p == 1:
        return x
    return b.unary(Op.EXP2, C.scale(b, b.unary(Op.LOG2, x), 1.0 / p))


def _lp_order(ctx: Context, node: onnx.NodeProto, x: int) -> int:
    p = attrs(node).get("p", 2)
    if not isinstance(p, int) or p < 1:
        raise refuse(node, f"p={p}")
    if not ctx.b.dtype(x).startswith("float"):
        raise refuse(node, f"{ctx.b.dtype(x)} input")
    return p


@lowers("LpPool")
def _lp_pool(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    p = _lp_order(ctx, node, x)
    geometry = _pool_geometry(ctx, node, x)
    windows = _windows(b, _abs_power(b, x, p), *geometry, 0)
    nd = len(geometry[0])
    total = b.reduce(Op.SUM_REDUCE, windows, list(range(2 + nd, 2 + 2 * nd)))
    return [_root(b, total, p)]


@lowers("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    shape = b.shape(x)
    axes = list(range(2, len(shape)))
    if node.op_type == "GlobalMaxPool":
        return [C.reduce_keep(b, Op.MAX_REDUCE, x, axes)]
    if node.op_type == "GlobalLpPool":
        p = _lp_order(ctx, node, x)
        return [_root(b, C.reduce_keep(b, Op.SUM_REDUCE, _abs_power(b, x, p), axes), p)]
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


@lowers("Trilu")
def _trilu(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """Zero every element whose column minus row lies outside the kept band (k may be a run-time value)."""
    b = ctx.b
    x = ctx.value(node, 0)
    shape = b.shape(x)
    if len(shape) < 2:
        raise ShapeError(f"Trilu needs a rank-2 or higher input, got {list(shape)}")
    rows, cols = shape[-2:]
    plane = (rows, cols)
    row = b.expand(b.reshape(b.iota(rows), (rows, 1)), plane)
    col = b.expand(b.reshape(b.iota(cols), (1, cols)), plane)
    offset = b.binary(Op.ADD, col, C.neg(b, row))
    k = ctx.optional(node, 1)
    k = b.scalar_like(0, offset) if k is None else b.expand(b.reshape(b.cast(k, "int64"), (1, 1)), plane)
    # upper keeps col - row >= k, lower keeps col - row <= k
    if attrs(node).get("upper", 1):
        outside = b.binary(Op.LESS_THAN, offset, k)
    else:
        outside = b.binary(Op.LESS_THAN, k, offset)
    outside = b.broadcast_to(outside, shape)
    return [C.where(b, outside, b.scalar_like(0, x), x)]


def _block_size(node: onnx.NodeProto, x_shape: tuple[Dim, ...]) -> int:
    if len(x_shape) != 4:
        raise ShapeError(f"{node.op_type} needs a rank-4 input, got {list(x_shape)}")
    return attrs(node)["blocksize"]


def _mode(node: onnx.NodeProto) -> str:
    mode = attrs(node).get("mode", b"DCR").decode()
    if mode not in ("DCR", "CRD"):
        raise refuse(node, f"mode={mode}")
    return mode


@lowers("DepthToSpace")
def _depth_to_space(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    n, c, h, w = b.shape(x)
    bs = _block_size(node, b.shape(x))
    if not isinstance(c, int) or c % (bs * bs):
        raise ShapeError(f"DepthToSpace channels {c} do not split into blocks of {bs}x{bs}")
    depth = c // (bs * bs)
    if _mode(node) == "DCR":
        blocks, perm = b.reshape(x, (n, bs, bs, depth, h, w)), (0, 3, 4, 1, 5, 2)
    else:
        blocks, perm = b.reshape(x, (n, depth, bs, bs, h, w)), (0, 1, 4, 2, 5, 3)
    return [b.reshape(b.permute(blocks, perm), (n, depth, dim_mul(h, bs), dim_mul(w, bs)))]


@lowers("SpaceToDepth")
def _space_to_depth(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    n, c, h, w = b.shape(x)
    bs = _block_size(node, b.shape(x))
    if not isinstance(h, int) or not isinstance(w, int) or h % bs or w % bs:
        raise ShapeError(f"SpaceToDepth spatial size {h}x{w} does not split into blocks of {bs}")
    blocks = b.reshape(x, (n, c, h // bs, bs, w // bs, bs))
    perm = (0, 3, 5, 1, 2, 4) if _mode(node) == "DCR" else (0, 1, 3, 5, 2, 4)
    return [b.reshape(b.permute(blocks, perm), (n, dim_mul(c, bs * bs), h // bs, w // bs))]


@lowers("Pad")
def _pad(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = ctx.value(node, 0)
    shape = b.shape(x)
    rank = len(shape)
    mode = a.get("mode", b"constant").decode()
    # the fill value: known at compile time (a number), a run-time value (a node id) or zero
    fill: float | int | None = 0
    if ctx.opset < 11:
        raw = [int(p) for p in a.get("pads", a.get("paddings", []))]
        fill = a.get("value", 0.0)
    else:
        raw = [int(p) for p in ctx.const(node, 1, "pads").reshape(-1)]
        if len(node.input) > 2 and node.input[2]:
            known = ctx.consts.get(node.input[2])
            fill = None if known is None else known.reshape(-1)[0].item()
    axes = list(range(rank))
    if len(node.input) > 3 and node.input[3]:
        axes = [int(i) % rank for i in ctx.const(node, 3, "axes").reshape(-1)]
    if len(raw) != 2 * len(axes):
        raise ShapeError(f"Pad has {len(raw)} pads for {len(axes)} axes")
    widths = [(0, 0)] * rank
    for i, axis in enumerate(axes):
        widths[axis] = (raw[i], raw[i + len(axes)])
    for axis, w in enumerate(widths):
        if w != (0, 0) and not isinstance(shape[axis], int):
            raise refuse(node, "padding along a symbolic dimension")
    if mode == "constant":
        if fill is None:
            return [_pad_with_runtime_fill(b, x, widths, ctx.value(node, 2))]
        fill = np.asarray(fill).astype(b.dtype(x)).item()
        cropped = _pad_or_crop(b, x, [(min(0, lo), min(0, hi)) for lo, hi in widths])
        return [C.pad(b, cropped, [(max(0, lo), max(0, hi)) for lo, hi in widths], fill)]
    if mode not in ("reflect", "edge", "wrap"):
        raise refuse(node, f"mode={mode}")
    for axis, (lo, hi) in enumerate(widths):
        if lo < 0 or hi < 0:
            # whether cropping comes before or after the reflection is not pinned down
            raise refuse(node, f"negative pads in mode={mode}")
        if mode == "reflect" and max(lo, hi) >= shape[axis] and (lo, hi) != (0, 0):
            raise refuse(node, "reflect padding as wide as the axis")
        if (lo, hi) != (0, 0):
            source = np.pad(np.arange(shape[axis], dtype=np.int64), (lo, hi), mode=mode)
            x = b.gather(x, b.constant(source), axis)
    return [x]


def _pad_with_runtime_fill(b: GraphBuilder, x: int, widths, value: int) -> int:
    """Pad with zeros, then select the run-time fill value outside the original extent."""
    rank = len(widths)
    inside = _pad_or_crop(b, b.expand(b.constant(np.ones((1,) * rank, dtype=bool)), b.shape(x)), widths)
    fill = b.expand(b.reshape(value, (1,) * rank), b.shape(inside))
    return C.where(b, inside, _pad_or_crop(b, x, widths), fill)
