"""Lowerings of the core ONNX ops: matmul, softmax and layout (arithmetic is in elementwise)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from compiler import composite as C
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse
from compiler.shape import Dim, ShapeError, SymDim, as_dim, dim_div, numel


@lowers("Identity", "Dropout")
def _identity(ctx: Context, node: onnx.NodeProto) -> list[int]:
    if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
        if ctx.const(node, 2, "training_mode").item():
            raise refuse(node, "training_mode=1")
    return [ctx.value(node, 0)]


@lowers("Gemm")
def _gemm(ctx: Context, node: onnx.NodeProto) -> list[int]:
    a = attrs(node)
    b = ctx.b
    x, w = ctx.value(node, 0), ctx.value(node, 1)
    if a.get("transA", 0):
        x = b.permute(x, (1, 0))
    if a.get("transB", 0):
        w = b.permute(w, (1, 0))
    out = C.scale(b, C.matmul(b, x, w), a.get("alpha", 1.0))
    bias = ctx.optional(node, 2)
    if bias is not None:
        out = C.add(b, out, C.scale(b, bias, a.get("beta", 1.0)))
    return [out]


@lowers("MatMul")
def _matmul(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [C.matmul(ctx.b, ctx.value(node, 0), ctx.value(node, 1))]


@lowers("Softmax")
def _softmax(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if ctx.opset >= 13:
        return [C.softmax(b, x, attrs(node).get("axis", -1))]
    # before opset 13 Softmax normalizes over all axes from `axis` on, as a 2-D matrix
    shape = b.shape(x)
    flat = C.flatten(b, x, attrs(node).get("axis", 1))
    return [b.reshape(C.softmax(b, flat, -1), shape)]


@lowers("Reshape")
def _reshape(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    known = ctx.known(node, 1)
    if known is None:
        raise refuse(node, "a shape computed at run time")
    requested = [as_dim(v) for v in known.reshape(-1)]
    allow_zero = attrs(node).get("allowzero", 0)
    return [ctx.b.reshape(x, _resolve_reshape(ctx.b.shape(x), requested, allow_zero))]


def _resolve_reshape(shape: tuple[Dim, ...], requested: list[Dim], allow_zero: int) -> list[Dim]:
    out: list[Dim] = []
    infer_at = None
    for i, r in enumerate(requested):
        if isinstance(r, SymDim):
            out.append(r)
        elif r == 0 and not allow_zero:
            if i >= len(shape):
                raise ShapeError(f"Reshape copies dimension {i} of a rank-{len(shape)} input")
            out.append(shape[i])
        elif r == -1:
            if infer_at is not None:
                raise ShapeError("Reshape with more than one -1")
            infer_at = i
            out.append(1)
        elif r < -1:
            raise ShapeError(f"Reshape to negative size {r}")
        else:
            out.append(r)
    if infer_at is not None:
        out[infer_at] = dim_div(numel(shape), numel(out))
    return out


@lowers("Flatten")
def _flatten(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [C.flatten(ctx.b, ctx.value(node, 0), attrs(node).get("axis", 1))]


@lowers("Transpose")
def _transpose(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    rank = len(ctx.b.shape(x))
    perm = attrs(node).get("perm", list(range(rank))[::-1])
    return [ctx.b.permute(x, [p % rank for p in perm])]


@lowers("Concat")
def _concat(ctx: Context, node: onnx.NodeProto) -> list[int]:
    parts = [ctx.value(node, i) for i in range(len(node.input)) if node.input[i]]
    return [C.concat(ctx.b, parts, attrs(node)["axis"])]


@lowers("Constant")
def _constant(ctx: Context, node: onnx.NodeProto) -> list[int]:
    a = attrs(node)
    if "value" in a:
        array = numpy_helper.to_array(a["value"])
    elif "value_float" in a:
        array = np.asarray(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        array = np.asarray(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        array = np.asarray(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        array = np.asarray(a["value_ints"], dtype=np.int64)
    else:
        raise refuse(node, f"attribute {sorted(a)}")
    ctx.bind_constant(node.output[0], array)
    return [ctx.lookup(node.output[0])]

