"""What every ONNX lowering shares: the lowering context, attribute access and the registry.

A lowering is a function (ctx, node) -> list of node ids, one per ONNX output, registered for one
or more op types with @lowers. Lowerings live in compiler.frontends.onnx_ops, grouped by kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from compiler.errors import InvalidModel, UnsupportedModel
from compiler.ir import GraphBuilder

ELEM_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.UINT32: "uint32",
    onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}


@dataclass
class Context:
    b: GraphBuilder
    opset: int
    # ONNX value name -> node id
    env: dict[str, int] = field(default_factory=dict)
    # ONNX value name -> array, for values known at compile time (shapes, axes, weights)
    consts: dict[str, np.ndarray] = field(default_factory=dict)

    def bind_constant(self, name: str, array: np.ndarray) -> None:
        if array.dtype.name not in ELEM_TYPES.values():
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


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


Lowering = Callable[[Context, onnx.NodeProto], list[int]]
LOWERINGS: dict[str, Lowering] = {}


def lowers(*op_types: str) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for op_type in op_types:
            LOWERINGS[op_type] = fn
        return fn

    return register


def refuse(node: onnx.NodeProto, what: str) -> UnsupportedModel:
    return UnsupportedModel([f"{node.op_type} with {what}"])

