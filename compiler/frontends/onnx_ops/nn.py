"""Lowerings of convolution, pooling, spatial layout and resampling ops: Conv, ConvTranspose,
Col2Im, ConvInteger, the pools, Trilu, DepthToSpace/SpaceToDepth, Pad, Resize and Upsample.

Normalizations are in norm.py, GridSample (a data-dependent gather) in indexing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from compiler import composite as C
from compiler.dtypes import is_float, lowest
from compiler.errors import UnsupportedModel
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse, text
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, ShapeError, SymDim, as_dim, bounds, dim_mul, numel


def spatial_attrs(ctx: Context, node: onnx.NodeProto, spatial: tuple[Dim, ...], kernel):
    """Resolve pads/strides/dilations (including auto_pad) for conv and pooling."""
    a = attrs(node)
    nd = len(kernel)
    strides = list(a.get("strides", [1] * nd))
    dilations = list(a.get("dilations", [1] * nd))
    raw_pads = list(a.get("pads", [0] * (2 * nd)))
    pads = [(raw_pads[i], raw_pads[i + nd]) for i in range(nd)]
    auto_pad = text(a.get("auto_pad", b"NOTSET"))
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
    pads, strides, dilations = spatial_attrs(ctx, node, b.shape(x)[2:], kernel)
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
    auto_pad = text(a.get("auto_pad", b"NOTSET"))
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
    return [_transposed_conv(b, x, w, ctx.optional(node, 2), strides, dilations, group, begins, out_sizes)]


def _transposed_conv(
    b: GraphBuilder, x: int, w: int, bias, strides, dilations, group, begins, out_sizes
) -> int:
    """Transposed convolution of x [N, C, *S] with w [C, M/group, *K]: output position o holds
    position o + begins of the full result, which is zero past its end."""
    ws = b.shape(w)
    nd = len(strides)
    kernel = ws[2:]
    for i, s in enumerate(strides):
        x = _interleave_zeros(b, x, 2 + i, s)
    widths = [(0, 0), (0, 0)]
    for i in range(nd):
        left = (kernel[i] - 1) * dilations[i] - begins[i]
        widths.append((left, out_sizes[i] + (kernel[i] - 1) * dilations[i] - left - b.shape(x)[2 + i]))
    x = _pad_or_crop(b, x, widths)
    # weight [C, M/group, *K] -> [M, C/group, *K], each spatial axis reversed
    c, m_per_group = ws[0], ws[1]
    if c % group:
        raise ShapeError(f"transposed convolution weight {list(ws)} does not split into {group} groups")
    w = b.reshape(w, (group, c // group, m_per_group, *kernel))
    w = b.reshape(b.permute(w, (0, 2, 1, *range(3, 3 + nd))), (group * m_per_group, c // group, *kernel))
    for i in range(nd):
        w = _reverse(b, w, 2 + i)
    return C.conv(b, x, w, bias, [(0, 0)] * nd, [1] * nd, dilations, group)


@lowers("Col2Im")
def _col2im(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """Sum each column back onto its block: a transposed convolution, grouped by channel, whose
    kernel is one-hot in the block position a column entry came from."""
    b = ctx.b
    a = attrs(node)
    x = ctx.value(node, 0)
    image = [int(v) for v in ctx.const(node, 1, "image_shape").reshape(-1)]
    block = [int(v) for v in ctx.const(node, 2, "block_shape").reshape(-1)]
    nd = len(image)
    strides = list(a.get("strides", [1] * nd))
    dilations = list(a.get("dilations", [1] * nd))
    pads = list(a.get("pads", [0] * (2 * nd)))
    n, columns, length = b.shape(x)
    block_size = int(np.prod(block))
    if not isinstance(columns, int) or columns % block_size:
        raise ShapeError(f"Col2Im input {list(b.shape(x))} does not hold blocks of {block}")
    channels = columns // block_size
    grid = [
        (d + pads[i] + pads[i + nd] - dilations[i] * (k - 1) - 1) // strides[i] + 1
        for i, (d, k) in enumerate(zip(image, block))
    ]
    if min(grid) < 1 or int(np.prod(grid)) != length:
        raise ShapeError(f"Col2Im input length {length} is not the {grid} grid of blocks")
    x = b.reshape(x, (n, columns, *grid))
    one_hot = np.eye(block_size, dtype=b.dtype(x)).reshape(block_size, 1, *block)
    w = b.constant(np.tile(one_hot, (channels, 1, *[1] * nd)))
    return [_transposed_conv(b, x, w, None, strides, dilations, channels, pads[:nd], image)]


@lowers("ConvInteger")
def _conv_integer(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """Both operands widened to int32 and shifted by their zero points, then an int32 Conv."""
    b = ctx.b
    x = b.cast(ctx.value(node, 0), "int32")
    w = b.cast(ctx.value(node, 1), "int32")
    x_zero, w_zero = ctx.optional(node, 2), ctx.optional(node, 3)
    rank = len(b.shape(w))
    if x_zero is not None:
        if numel(b.shape(x_zero)) != 1:
            raise refuse(node, "a per-channel input zero point")
        x = C.sub(b, x, b.reshape(b.cast(x_zero, "int32"), ()))
    if w_zero is not None:
        count = numel(b.shape(w_zero))
        w_zero = b.reshape(b.cast(w_zero, "int32"), (count, *[1] * (rank - 1)) if count != 1 else ())
        w = C.sub(b, w, w_zero)
    kernel = tuple(attrs(node).get("kernel_shape", b.shape(w)[2:]))
    pads, strides, dilations = spatial_attrs(ctx, node, b.shape(x)[2:], kernel)
    return [C.conv(b, x, w, None, pads, strides, dilations, attrs(node).get("group", 1))]


def _pool_geometry(ctx: Context, node: onnx.NodeProto, x: int):
    """Kernel, pads, strides, dilations, and the extra end padding that ceil_mode needs."""
    a = attrs(node)
    kernel = tuple(a["kernel_shape"])
    spatial = _static_spatial(node, ctx.b.shape(x))
    pads, strides, dilations = spatial_attrs(ctx, node, tuple(spatial), kernel)
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
    values = _windows(b, x, *geometry, lowest(b.dtype(x)))
    # padded positions get index `size`, past every real one, so they never win a tie
    positions = b.constant(np.arange(size, dtype=np.int64).reshape(1, 1, *spatial))
    full = b.shape(values)
    position_windows = b.expand(_windows(b, positions, *geometry, size), (1, 1, *full[2:]))
    position_windows = b.expand(position_windows, full)
    below_peak = C.less(b, values, b.expand(b.reshape(peak, (*b.shape(peak), *[1] * nd)), full))
    candidates = C.where(b, below_peak, b.scalar_like(size, position_windows), position_windows)
    window_axes = list(range(2 + nd, 2 + 2 * nd))
    first = C.reduce_min(b, candidates, window_axes)
    if column_major:
        coords = np.unravel_index(np.arange(size), spatial)
        table = np.ravel_multi_index(coords, spatial, order="F").astype(np.int64)
        first = b.gather(b.constant(table), first, 0)
    planes = b.reshape(C.scale(b, b.iota(dim_mul(shape[0], shape[1])), size), (*shape[:2], *[1] * nd))
    return C.add(b, first, planes)


def _abs_power(b: GraphBuilder, x: int, p: int) -> int:
    """|x|**p for a positive integer p, by repeated squaring."""
    base = x if p % 2 == 0 else C.absolute(b, x)
    return C.power_by_squaring(b, base, p)


def _root(b: GraphBuilder, x: int, p: int) -> int:
    """x**(1/p) for x >= 0."""
    while p % 2 == 0:
        x, p = C.sqrt(b, x), p // 2
    return x if p == 1 else C.pow_positive(b, x, 1.0 / p)


def _lp_order(ctx: Context, node: onnx.NodeProto, x: int) -> int:
    p = attrs(node).get("p", 2)
    if not isinstance(p, int) or p < 1:
        raise refuse(node, f"p={p}")
    if not is_float(ctx.b.dtype(x)):
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
    row, col = C.axis_positions(b, plane, 0), C.axis_positions(b, plane, 1)
    offset = b.binary(Op.ADD, col, C.neg(b, row))
    k = ctx.optional(node, 1)
    k = b.scalar_like(0, offset) if k is None else b.expand(b.reshape(b.cast(k, "int64"), (1, 1)), plane)
    # upper keeps col - row >= k, lower keeps col - row <= k
    if attrs(node).get("upper", 1):
        outside = C.less(b, offset, k)
    else:
        outside = C.less(b, k, offset)
    outside = b.broadcast_to(outside, shape)
    return [C.where(b, outside, b.scalar_like(0, x), x)]


def _block_size(node: onnx.NodeProto, x_shape: tuple[Dim, ...]) -> int:
    if len(x_shape) != 4:
        raise ShapeError(f"{node.op_type} needs a rank-4 input, got {list(x_shape)}")
    return attrs(node)["blocksize"]


def _mode(node: onnx.NodeProto) -> str:
    mode = text(attrs(node).get("mode", b"DCR"))
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
    mode = text(a.get("mode", b"constant"))
    # the fill value: known at compile time (a number), a run-time value (a node id) or zero
    fill: float | int | None = 0
    if ctx.opset < 11:
        raw = [int(p) for p in a.get("pads", a.get("paddings", []))]
        fill = a.get("value", 0.0)
    else:
        known = ctx.known(node, 1)
        if known is None:
            raise refuse(node, "pads computed at run time")
        raw = [as_dim(p) for p in known.reshape(-1)]
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
    symbolic = any(isinstance(d, SymDim) for d in raw)
    for axis, w in enumerate(widths):
        if w == (0, 0) or (isinstance(shape[axis], int) and not symbolic):
            continue
        if mode != "constant" or any(bounds(d)[0] < 0 for d in w):
            raise refuse(node, f"mode={mode} padding or cropping along a symbolic dimension")
    if symbolic and fill is not None:
        fill = np.asarray(fill).astype(b.dtype(x)).item()
        return [C.pad(b, x, widths, fill)]
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


# ---- Resize and Upsample: per resized axis, a gather with a compile-time index table of the
# taps each output reads, times compile-time tap weights, summed (nearest: the gather alone) ----


def _source_coords(transform: str, out: int, size: int, scale: float, roi: tuple[float, float]):
    """Where each output position samples the input (float64), as ONNX's reference computes it,
    and which positions fall outside a tf_crop_and_resize crop (None for the other modes)."""
    y = np.arange(out, dtype=np.float64)
    width = scale * size
    if transform == "align_corners":
        return (np.zeros(out) if width == 1 else y * (size - 1) / (width - 1)), None
    if transform == "asymmetric":
        return y / scale, None
    if transform == "pytorch_half_pixel":
        return (np.full(out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5), None
    if transform == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if transform == "half_pixel_symmetric":
        offset = size / 2 * (1 - out / width)
        return offset + (y + 0.5) / scale - 0.5, None
    start, end = roi  # tf_crop_and_resize
    if width == 1:
        coords = np.full(out, (end - start) * (size - 1) / 2)
    else:
        coords = y * (end - start) * (size - 1) / (width - 1)
    coords = coords + start * (size - 1)
    return coords, (coords < 0) | (coords > size - 1)


def _tap_weights(mode: str, ratio: float, scale: float, cubic_a: float, antialias: bool) -> np.ndarray:
    if mode == "linear" and not antialias:
        return np.array([1 - ratio, ratio])
    if mode == "linear":
        scale = min(scale, 1.0)
        start = int(np.floor(-1 / scale) + 1)
        args = (np.arange(start, 2 - start) - ratio) * scale
        weights = np.clip(1 - np.abs(args), 0, 1)
        return weights / weights.sum()
    a = cubic_a
    if not antialias:
        r, s = ratio, 1 - ratio
        return np.array(
            [
                ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                ((a + 2) * r - (a + 3)) * r * r + 1,
                ((a + 2) * s - (a + 3)) * s * s + 1,
                ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a,
            ]
        )
    scale = min(scale, 1.0)
    start = int(np.floor(-2 / scale) + 1)
    args = np.abs(scale * (np.arange(start, 2 - start) - ratio))
    near = (a + 2) * args**3 - (a + 3) * args**2 + 1
    far = a * args**3 - 5 * a * args**2 + 8 * a * args - 4 * a
    weights = np.where(args <= 1, near, np.where(args < 2, far, 0.0))
    return weights / weights.sum()


def _taps(coords: np.ndarray, count: int) -> np.ndarray:
    """The `count` input positions around each coordinate (unclamped), chosen as ONNX's
    reference chooses them: the nearest ones, preferring the lower on a tie."""
    half = int(np.ceil(count / 2))
    shifted = coords + half
    base = np.floor(shifted).astype(np.int64)
    frac = shifted - base
    if count % 2 == 0:
        offset = np.where(frac == 0, -(count // 2), -(count // 2) + 1)
    else:
        first = -((count - 1) // 2)
        offset = np.where(frac <= 0.5, first, first + 1)
    return (base + offset)[:, None] + np.arange(count)[None, :] - half


def _ratios(coords: np.ndarray) -> np.ndarray:
    whole = np.floor(coords)
    return np.where(coords == whole, 1.0, coords - whole)


def _nearest_source(coords: np.ndarray, rounding: str) -> np.ndarray:
    ratios = _ratios(coords)
    if rounding == "round_prefer_floor":
        upper = ratios > 0.5
    elif rounding == "round_prefer_ceil":
        upper = ratios >= 0.5
    elif rounding == "floor":
        upper = np.zeros(len(coords), dtype=bool)
    else:  # ceil
        upper = np.ones(len(coords), dtype=bool)
    # integral coordinates count as ratio 1 between the position below and themselves
    upper |= ratios == 1.0
    return _taps(coords, 2)[np.arange(len(coords)), upper.astype(np.int64)]


@dataclass(frozen=True)
class _ResizeSpec:
    mode: str  # nearest, linear or cubic
    transform: str  # coordinate_transformation_mode
    rounding: str = "round_prefer_floor"  # nearest_mode
    cubic_a: float = -0.75
    exclude_outside: bool = False
    antialias: bool = False
    extrapolation: float = 0.0


def _resize_axis(
    b: GraphBuilder, x: int, axis: int, out: int, scale: float, roi: tuple[float, float], spec: _ResizeSpec
) -> int:
    size = b.shape(x)[axis]
    coords, outside_crop = _source_coords(spec.transform, out, size, scale, roi)
    if spec.mode == "nearest":
        source = _nearest_source(coords, spec.rounding)
        if spec.exclude_outside and ((source < 0) | (source >= size)).any():
            raise UnsupportedModel(["Resize nearest with exclude_outside sampling outside the input"])
        y = b.gather(x, b.constant(np.clip(source, 0, size - 1)), axis)
    else:
        ratios = _ratios(coords)
        weights = np.stack([_tap_weights(spec.mode, r, scale, spec.cubic_a, spec.antialias) for r in ratios])
        taps = _taps(coords, weights.shape[1])
        if spec.exclude_outside:
            weights = np.where((taps < 0) | (taps >= size), 0.0, weights)
            sums = weights.sum(axis=1, keepdims=True)
            weights = weights / np.where(sums == 0, 1.0, sums)
        count = weights.shape[1]
        shape = b.shape(x)
        gathered = b.gather(x, b.constant(np.clip(taps, 0, size - 1).reshape(-1)), axis)
        gathered = b.reshape(gathered, (*shape[:axis], out, count, *shape[axis + 1 :]))
        lead, trail = (1,) * axis, (1,) * (len(shape) - axis - 1)
        weight_node = b.constant(weights.astype(b.dtype(x)).reshape(*lead, out, count, *trail))
        y = b.reduce(Op.SUM_REDUCE, C.mul(b, gathered, weight_node), [axis + 1])
    if outside_crop is not None and outside_crop.any():
        shape = b.shape(y)
        mask = b.constant(outside_crop.reshape((1,) * axis + (out,) + (1,) * (len(shape) - axis - 1)))
        fill = b.scalar_like(spec.extrapolation, y)
        y = C.where(b, b.expand(mask, shape), fill, y)
    return y


def _resize(
    node: onnx.NodeProto,
    b: GraphBuilder,
    x: int,
    scales: list[float],
    sizes: list[int],
    rois: list[tuple[float, float]],
    spec: _ResizeSpec,
) -> int:
    if spec.mode not in ("nearest", "linear", "cubic"):
        raise refuse(node, f"mode={spec.mode}")
    if spec.mode != "nearest" and not is_float(b.dtype(x)):
        raise refuse(node, f"mode={spec.mode} on {b.dtype(x)} data")
    for axis, (scale, out, roi) in enumerate(zip(scales, sizes, rois)):
        size = b.shape(x)[axis]
        if np.isclose(scale, 1.0) and out == size and np.allclose(roi, (0.0, 1.0)):
            continue
        if not isinstance(size, int):
            raise refuse(node, "resizing a symbolic dimension")
        if out < 1 or scale <= 0:
            raise ShapeError(f"Resize to size {out} (scale {scale}) along axis {axis}")
        x = _resize_axis(b, x, axis, out, scale, roi, spec)
    return x


@lowers("Resize")
def _resize_op(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    x = ctx.value(node, 0)
    shape = b.shape(x)
    rank = len(shape)
    strings = {k: text(v) for k, v in a.items() if isinstance(v, bytes)}
    if ctx.opset < 11:  # Resize-10 is Upsample-9 under a new name
        scales = [float(s) for s in ctx.const(node, 1, "scales").reshape(-1)]
        return [_upsample(node, b, x, scales, strings.get("mode", "nearest"))]
    spec = _ResizeSpec(
        mode=strings.get("mode", "nearest"),
        transform=strings.get("coordinate_transformation_mode", "half_pixel"),
        rounding=strings.get("nearest_mode", "round_prefer_floor"),
        cubic_a=a.get("cubic_coeff_a", -0.75),
        exclude_outside=bool(a.get("exclude_outside", 0)),
        antialias=bool(a.get("antialias", 0)),
        extrapolation=a.get("extrapolation_value", 0.0),
    )
    known_transforms = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners")
    if spec.transform not in (*known_transforms, "asymmetric", "tf_crop_and_resize"):
        raise refuse(node, f"coordinate_transformation_mode={spec.transform}")
    if spec.rounding not in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
        raise refuse(node, f"nearest_mode={spec.rounding}")
    if spec.antialias and spec.mode == "nearest":
        raise refuse(node, "antialias in mode nearest")
    axes = [int(i) % rank for i in a.get("axes", range(rank))]
    if len(set(axes)) != len(axes):
        raise ShapeError(f"Resize axes {a['axes']} repeat an axis")

    def given(index: int, what: str) -> np.ndarray | None:
        if index >= len(node.input) or not node.input[index]:
            return None
        array = ctx.const(node, index, what).reshape(-1)
        return array if array.size else None

    roi_in = given(1, "roi") if spec.transform == "tf_crop_and_resize" else None
    scale_in, size_in = given(2, "scales"), given(3, "sizes")
    if (scale_in is None) == (size_in is None):
        raise ShapeError("Resize needs exactly one of scales and sizes")
    full_scales = [1.0] * rank
    rois = [(0.0, 1.0)] * rank
    if spec.transform == "tf_crop_and_resize":
        if roi_in is None or len(roi_in) != 2 * len(axes):
            raise ShapeError(f"Resize roi {roi_in} does not match {len(axes)} axes")
        for i, axis in enumerate(axes):
            rois[axis] = (float(roi_in[i]), float(roi_in[len(axes) + i]))
    if scale_in is not None:
        if len(scale_in) != len(axes):
            raise ShapeError(f"Resize has {len(scale_in)} scales for {len(axes)} axes")
        for axis, scale in zip(axes, scale_in):
            full_scales[axis] = float(scale)
        dims = [_static_dim(node, shape, axis) if axis in axes else shape[axis] for axis in range(rank)]
        sizes = [int(s * d) if axis in axes else d for axis, (s, d) in enumerate(zip(full_scales, dims))]
        if spec.transform == "tf_crop_and_resize" and any(r != (0.0, 1.0) for r in rois):
            # the spec scales the cropped extent, ONNX's reference the whole input
            raise refuse(node, "tf_crop_and_resize with scales and a crop")
    else:
        if len(size_in) != len(axes):
            raise ShapeError(f"Resize has {len(size_in)} sizes for {len(axes)} axes")
        sizes = list(shape)
        for axis, out in zip(axes, size_in):
            full_scales[axis] = int(out) / _static_dim(node, shape, axis)
            sizes[axis] = int(out)
        policy = strings.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            if policy not in ("not_larger", "not_smaller"):
                raise refuse(node, f"keep_aspect_ratio_policy={policy}")
            pick = min if policy == "not_larger" else max
            common = pick(full_scales[axis] for axis in axes)
            for axis in axes:
                full_scales[axis] = common
                sizes[axis] = int(common * shape[axis] + 0.5)
    return [_resize(node, b, x, full_scales, sizes, rois, spec)]


def _static_dim(node: onnx.NodeProto, shape: tuple[Dim, ...], axis: int) -> int:
    d = shape[axis]
    if not isinstance(d, int):
        raise refuse(node, "resizing a symbolic dimension")
    return d


def _upsample(node: onnx.NodeProto, b: GraphBuilder, x: int, scales: list[float], mode: str) -> int:
    """Upsample (and Resize-10): asymmetric coordinates, nearest rounding down."""
    shape = b.shape(x)
    if len(scales) != len(shape):
        raise ShapeError(f"{node.op_type} has {len(scales)} scales for rank {len(shape)}")
    if mode not in ("nearest", "linear"):
        raise refuse(node, f"mode={mode}")
    spec = _ResizeSpec(
        mode="nearest" if mode == "nearest" else "linear", transform="asymmetric", rounding="floor"
    )
    sizes = [
        d if s == 1 else int(s * _static_dim(node, shape, i)) for i, (s, d) in enumerate(zip(scales, shape))
    ]
    return _resize(node, b, x, scales, sizes, [(0.0, 1.0)] * len(shape), spec)


@lowers("Upsample")
def _upsample_op(ctx: Context, node: onnx.NodeProto) -> list[int]:
    a = attrs(node)
    if "scales" in a:
        scales = [float(s) for s in a["scales"]]
    else:
        scales = [float(s) for s in ctx.const(node, 1, "scales").reshape(-1)]
    return [_upsample(node, ctx.b, ctx.value(node, 0), scales, text(a.get("mode", b"nearest")))]
