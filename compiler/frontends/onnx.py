"""ONNX frontend: parses and validates a model, then lowers each node to primitive IR.

Every op type we accept has one lowering function in LOWERINGS. A graph that uses any other op
type is refused before lowering starts, with all the missing op types listed at once.
"""

from __future__ import annotations

import re

import onnx
import onnx.version_converter
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from compiler.errors import InvalidModel, UnsupportedModel
from compiler.frontends import onnx_ops  # noqa: F401  (registers the lowerings)
from compiler.frontends.onnx_context import ELEM_TYPES, LOWERINGS, Context
from compiler.ir import Graph, GraphBuilder
from compiler.shape import Dim, ShapeError, SymDim

ONNX_DOMAINS = ("", "ai.onnx")
MIN_OPSET = 7
# older models are converted to this opset first
UPGRADE_TO_OPSET = 13


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
    ctx = Context(GraphBuilder(), opset)
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
    dtype = ELEM_TYPES.get(tensor_type.elem_type)
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


