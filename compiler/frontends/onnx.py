"""ONNX frontend: parses and validates a model, then lowers each node to primitive IR.

Every op type we accept has one lowering function in LOWERINGS. A graph that uses any other op
type is refused before lowering starts, with all the missing op types listed at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx.version_converter
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from compiler import composite as C
from compiler.errors import InvalidModel, UnsupportedModel
from compiler.ir import Graph, GraphBuilder, Op
from compiler.shape import Dim, ShapeError, SymDim, dim_div, numel

ONNX_DOMAINS = ("", "ai.onnx")
MIN_OPSET = 7
# older models are converted to this opset first
UPGRADE_TO_OPSET = 13

_ELEM_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}


def parse_model(data: bytes) -> onnx.ModelProto:
    """Bytes to a validated ModelProto; every malformation becomes InvalidModel."""
    if not data:
        raise InvalidModel("the file is empty")
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidModel(f"not a valid ONNX model (protobuf decoding failed: {exc})") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.opset_import:
        raise InvalidModel("not a valid ONNX model (no IR version, graph or opset import)")
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise InvalidModel(
                f"initializer {tensor.name!r} refers to external data; upload one self-contained file"
            )
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise InvalidModel(f"invalid ONNX graph: {first_line}") from None
    if not model.graph.output:
        raise InvalidModel("the ONNX graph declares no outputs")
    return model


def missing_ops(model: onnx.ModelProto) -> list[str]:
    missing = set()
    for node in model.graph.node:
        if node.domain not in ONNX_DOMAINS:
            missing.add(f"{node.domain}.{node.op_type}")
        elif node.op_type not in LOWERINGS:
            missing.add(node.op_type)
    return sorted(missing)


def onnx_to_graph(model: onnx.ModelProto) -> Graph:
    missing = missing_ops(model)
    if missing:
        raise UnsupportedModel(missing)
    opset = _opset(model)
    if opset < MIN_OPSET:
        model = _upgrade(model, opset)
        opset = _opset(model)
    ctx = _Context(GraphBuilder(), opset)
    graph = model.graph
    for tensor in graph.initializer:
        ctx.bind_constant(tensor.name, numpy_helper.to_array(tensor))
    for value in graph.input:
        if value.name not in ctx.env:
            shape, dtype = _value_type(value)
            ctx.env[value.name] = ctx.b.input(value.name, shape, dtype)
    for node in graph.node:
        try:
            outputs = LOWERINGS[node.op_type](ctx, node)
        except ShapeError as exc:
            raise InvalidModel(f"node {node.name or node.op_type!r} ({node.op_type}): {exc}") from None
        for index, name in enumerate(node.output):
            if name and index >= len(outputs):
                raise UnsupportedModel([f"{node.op_type} with output {index} ({name!r}) in use"])
            if name:
                ctx.env[name] = outputs[index]
    result = []
    for out in graph.output:
        if out.name not in ctx.env:
            raise InvalidModel(f"graph output {out.name!r} is produced by no node")
        result.append((out.name, ctx.env[out.name]))
    return ctx.b.finish(result)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), 0)


def _upgrade(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Old opsets are converted with onnx.version_converter rather than lowered twice."""
    try:
        return onnx.version_converter.convert_version(model, UPGRADE_TO_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors and more
        raise UnsupportedModel([f"opset {opset}, which could not be converted ({exc})"]) from None


def load_graph(data: bytes) -> Graph:
    return onnx_to_graph(parse_model(data))


def _symbol_name(raw: str) -> str:
    cleaned = re.sub(r"[^0-9A-Za-z_]", "_", raw)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"d_{cleaned}"


def _value_type(value: onnx.ValueInfoProto) -> tuple[tuple[Dim, ...], str]:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise UnsupportedModel([f"non-tensor graph input {value.name!r}"])
    dtype = _ELEM_TYPES.get(tensor_type.elem_type)
    if dtype is None:
        name = onnx.TensorProto.DataType.Name(tensor_type.elem_type)
        raise UnsupportedModel([f"input {value.name!r} of element type {name}"])
    if not tensor_type.HasField("shape"):
        raise UnsupportedModel([f"input {value.name!r} without a declared rank"])
    shape: list[Dim] = []
    for axis, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif dim.dim_param:
            shape.append(SymDim.named(_symbol_name(dim.dim_param)))
        else:
            shape.append(SymDim.named(_symbol_name(f"{value.name}_{axis}")))
    return tuple(shape), dtype


@dataclass
class _Context:
    b: GraphBuilder
    opset: int
    # ONNX value name -> node id
    env: dict[str, int] = field(default_factory=dict)
    # ONNX value name -> array, for values known at compile time (shapes, axes, weights)
    consts: dict[str, np.ndarray] = field(default_factory=dict)

    def bind_constant(self, name: str, array: np.ndarray) -> None:
        if array.dtype.name not in _ELEM_TYPES.values():
            raise UnsupportedModel([f"constant {name!r} of dtype {array.dtype}"])
        self.consts[name] = array
        self.env[name] = self.b.constant(array)

    def value(self, node: onnx.NodeProto, index: int) -> int:
        name = node.input[index]
        if name not in self.env:
            raise InvalidModel(f"node {node.name or node.op_type!r} reads {name!r}, which nothing defines")
        return self.env[name]

    def optional(self, node: onnx.NodeProto, index: int) -> int | None:
        if index < len(node.input) and node.input[index]:
            return self.value(node, index)
        return None

    def const(self, node: onnx.NodeProto, index: int, what: str) -> np.ndarray:
        name = node.input[index]
        if name not in self.consts:
            raise UnsupportedModel([f"{node.op_type} with a {what} computed at run time"])
        return self.consts[name]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


Lowering = Callable[[_Context, onnx.NodeProto], list[int]]
LOWERINGS: dict[str, Lowering] = {}


def lowers(*op_types: str) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for op_type in op_types:
            LOWERINGS[op_type] = fn
        return fn

    return register


def _refuse(node: onnx.NodeProto, what: str) -> UnsupportedModel:
    return UnsupportedModel([f"{node.op_type} with {what}"])


@lowers("Identity", "Dropout")
def _identity(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
        if ctx.const(node, 2, "training_mode").item():
            raise _refuse(node, "training_mode=1")
    return [ctx.value(node, 0)]


_BINARY: dict[str, Callable[[GraphBuilder, int, int], int]] = {
    "Add": C.add,
    "Sub": C.sub,
    "Mul": C.mul,
    "Div": C.div,
}


@lowers(*_BINARY)
def _binary(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    if ctx.opset < 7 and _attrs(node).get("broadcast"):
        raise _refuse(node, "legacy broadcast attribute")
    return [_BINARY[node.op_type](ctx.b, ctx.value(node, 0), ctx.value(node, 1))]


_UNARY: dict[str, Callable[[GraphBuilder, int], int]] = {
    "Relu": C.relu,
    "Sigmoid": C.sigmoid,
    "Tanh": C.tanh,
    "Neg": C.neg,
    "Exp": C.exp,
    "Log": C.log,
    "Sqrt": lambda b, x: b.unary(Op.SQRT, x),
    "Reciprocal": lambda b, x: b.unary(Op.RECIP, x),
    "Sin": lambda b, x: b.unary(Op.SIN, x),
}


@lowers(*_UNARY)
def _unary(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    if not ctx.b.dtype(x).startswith("float"):
        raise _refuse(node, f"{ctx.b.dtype(x)} input")
    return [_UNARY[node.op_type](ctx.b, x)]


@lowers("Gemm")
def _gemm(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    a = _attrs(node)
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
def _matmul(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    return [C.matmul(ctx.b, ctx.value(node, 0), ctx.value(node, 1))]


@lowers("Softmax")
def _softmax(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if ctx.opset >= 13:
        return [C.softmax(b, x, _attrs(node).get("axis", -1))]
    # before opset 13 Softmax normalizes over all axes from `axis` on, as a 2-D matrix
    shape = b.shape(x)
    flat = C.flatten(b, x, _attrs(node).get("axis", 1))
    return [b.reshape(C.softmax(b, flat, -1), shape)]


@lowers("Reshape")
def _reshape(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    requested = [int(v) for v in ctx.const(node, 1, "shape").reshape(-1)]
    allow_zero = _attrs(node).get("allowzero", 0)
    return [ctx.b.reshape(x, _resolve_reshape(ctx.b.shape(x), requested, allow_zero))]


def _resolve_reshape(shape: tuple[Dim, ...], requested: list[int], allow_zero: int) -> list[Dim]:
    out: list[Dim] = []
    infer_at = None
    for i, r in enumerate(requested):
        if r == 0 and not allow_zero:
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
def _flatten(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    return [C.flatten(ctx.b, ctx.value(node, 0), _attrs(node).get("axis", 1))]


@lowers("Transpose")
def _transpose(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    rank = len(ctx.b.shape(x))
    perm = _attrs(node).get("perm", list(range(rank))[::-1])
    return [ctx.b.permute(x, [p % rank for p in perm])]


@lowers("Concat")
def _concat(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    parts = [ctx.value(node, i) for i in range(len(node.input)) if node.input[i]]
    return [C.concat(ctx.b, parts, _attrs(node)["axis"])]


@lowers("Constant")
def _constant(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    a = _attrs(node)
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
        raise _refuse(node, f"attribute {sorted(a)}")
    ctx.bind_constant(node.output[0], array)
    return [ctx.env[node.output[0]]]


def _spatial_attrs(ctx: _Context, node: onnx.NodeProto, spatial: tuple[Dim, ...], kernel):
    """Resolve pads/strides/dilations (including auto_pad) for conv and pooling."""
    a = _attrs(node)
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
                raise _refuse(node, "auto_pad over a symbolic dimension")
            out = -(-d // s)
            total = max(0, (out - 1) * s + dil * (k - 1) + 1 - d)
            small, big = total // 2, total - total // 2
            pads.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    elif auto_pad == "VALID":
        pads = [(0, 0)] * nd
    elif auto_pad != "NOTSET":
        raise _refuse(node, f"auto_pad={auto_pad}")
    return pads, strides, dilations


@lowers("Conv")
def _conv(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, w = ctx.value(node, 0), ctx.value(node, 1)
    kernel = tuple(_attrs(node).get("kernel_shape", b.shape(w)[2:]))
    if tuple(b.shape(w)[2:]) != kernel:
        raise ShapeError(f"kernel_shape {list(kernel)} disagrees with weight {list(b.shape(w))}")
    pads, strides, dilations = _spatial_attrs(ctx, node, b.shape(x)[2:], kernel)
    group = _attrs(node).get("group", 1)
    return [C.conv(b, x, w, ctx.optional(node, 2), pads, strides, dilations, group)]


@lowers("MaxPool", "AveragePool")
def _pool(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = _attrs(node)
    if len(node.output) > 1 and node.output[1]:
        raise _refuse(node, "an Indices output")
    if a.get("storage_order", 0):
        raise _refuse(node, "storage_order=1")
    x = ctx.value(node, 0)
    kernel = tuple(a["kernel_shape"])
    spatial = b.shape(x)[2:]
    pads, strides, dilations = _spatial_attrs(ctx, node, spatial, kernel)
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
def _global_pool(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    shape = b.shape(x)
    axes = list(range(2, len(shape)))
    if node.op_type == "GlobalMaxPool":
        return [C.reduce_keep(b, Op.MAX_REDUCE, x, axes)]
    count = numel(shape[2:])
    if not isinstance(count, int):
        raise _refuse(node, "symbolic spatial dimensions")
    return [C.scale(b, C.reduce_keep(b, Op.SUM_REDUCE, x, axes), 1.0 / count)]


@lowers("BatchNormalization")
def _batch_norm(ctx: _Context, node: onnx.NodeProto) -> list[int]:
    a = _attrs(node)
    if a.get("training_mode", 0) or (len(node.output) > 1 and any(node.output[1:])):
        raise _refuse(node, "training mode")
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
