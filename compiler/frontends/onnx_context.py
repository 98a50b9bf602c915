"""What every ONNX lowering shares: the lowering context, attribute and input access, and the
registry.

A lowering is a function (ctx, node) -> list of node ids, one per ONNX output, registered for one
or more op types with @lowers. Lowerings live in compiler.frontends.onnx_ops, grouped by concept;
the math they emit is spelled in compiler.composite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from compiler import composite
from compiler.dtypes import NARROW_FLOATS, NARROW_INTS, NARROW_UINTS, is_float
from compiler.errors import InvalidModel, UnsupportedModel
from compiler.ir import GraphBuilder, Op
from compiler.shape import Dim, ShapeError, SymDim
from compiler.value_range import ValueRanges

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
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
    onnx.TensorProto.FLOAT8E4M3FNUZ: "float8_e4m3fnuz",
    onnx.TensorProto.FLOAT8E5M2: "float8_e5m2",
    onnx.TensorProto.FLOAT8E5M2FNUZ: "float8_e5m2fnuz",
    onnx.TensorProto.FLOAT8E8M0: "float8_e8m0fnu",
    onnx.TensorProto.FLOAT4E2M1: "float4_e2m1fn",
    onnx.TensorProto.INT4: "int4",
    onnx.TensorProto.UINT4: "uint4",
    onnx.TensorProto.INT2: "int2",
    onnx.TensorProto.UINT2: "uint2",
}


# storage formats computed in a wider dtype inside the graph; cast back where the model declares
# them (inputs, outputs, Cast)
COMPUTED_AS: dict[str, str] = (
    {name: "float32" for name in NARROW_FLOATS | {"float16"}}
    | {name: "int8" for name in NARROW_INTS}
    | {name: "uint8" for name in NARROW_UINTS}
)
LOW_PRECISION_FLOATS = frozenset(name for name, wide in COMPUTED_AS.items() if wide == "float32")


@dataclass
class Context:
    b: GraphBuilder
    opset: int
    # ONNX value name -> node id
    env: dict[str, int] = field(default_factory=dict)
    # ONNX value name -> array, for values known at compile time (shapes, axes, weights)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    # ONNX value name -> object array of ints and SymDims: shapes that depend on symbolic dims
    symbolic: dict[str, np.ndarray] = field(default_factory=dict)
    # ONNX value name -> ONNX element type, where the model declares it or inference tells it
    declared_types: dict[str, int] = field(default_factory=dict)
    # lowers a sequence of NodeProtos into this context (set by the driver; used for subgraphs)
    lower_nodes: Callable[[Sequence[onnx.NodeProto]], None] | None = None
    # what is provable about integer values (indices) before run time
    ranges: ValueRanges = field(init=False)

    def __post_init__(self) -> None:
        self.ranges = ValueRanges(self.b)

    def bind_constant(self, name: str, array: np.ndarray) -> None:
        if array.dtype.name not in ELEM_TYPES.values():
            raise UnsupportedModel([f"constant {name!r} of dtype {array.dtype}"])
        self.consts[name] = array
        self.env.pop(name, None)  # its node is created on first use

    def bind_known(self, name: str, array: np.ndarray) -> None:
        """A compile-time value; int arrays holding symbolic dims are kept symbolic."""
        if array.dtype == object:
            if not any(isinstance(v, SymDim) for v in array.flat):
                array = array.astype(np.int64)
            else:
                self.symbolic[name] = array
                self.env.pop(name, None)
                return
        self.bind_constant(name, array)

    def known(self, node: onnx.NodeProto, index: int) -> np.ndarray | None:
        """The compile-time value of input `index` (possibly symbolic), or None."""
        if index >= len(node.input) or not node.input[index]:
            return None
        name = node.input[index]
        return self.consts.get(name, self.symbolic.get(name))

    def value(self, node: onnx.NodeProto, index: int) -> int:
        return self.lookup(node.input[index], node)

    def lookup(self, name: str, reader: onnx.NodeProto | None = None) -> int:
        if name in self.env:
            return self.env[name]
        if name in self.consts:
            array = self.consts[name]
            if array.dtype.name in COMPUTED_AS:
                array = array.astype(COMPUTED_AS[array.dtype.name])
            self.env[name] = self.b.constant(array)
        elif name in self.symbolic:
            self.env[name] = materialize(self.b, self.symbolic[name])
        else:
            who = f"node {reader.name or reader.op_type!r}" if reader is not None else "the graph"
            raise InvalidModel(f"{who} reads {name!r}, which nothing defines")
        return self.env[name]

    def optional(self, node: onnx.NodeProto, index: int) -> int | None:
        if index < len(node.input) and node.input[index]:
            return self.value(node, index)
        return None

    def const(self, node: onnx.NodeProto, index: int, what: str) -> np.ndarray:
        name = node.input[index]
        if name in self.symbolic:
            raise UnsupportedModel([f"{node.op_type} with a {what} that depends on symbolic dimensions"])
        if name not in self.consts:
            raise UnsupportedModel([f"{node.op_type} with a {what} computed at run time"])
        return self.consts[name]


def materialize(b: GraphBuilder, array: np.ndarray) -> int:
    """An int64 tensor node holding symbolic dims: each dim is a sum over a tensor of ones."""
    one = b.constant(np.ones(1, dtype=np.int64))
    scalars = []
    for v in array.flat:
        if isinstance(v, SymDim):
            scalars.append(b.reduce(Op.SUM_REDUCE, b.expand(one, (v,)), [0]))
        else:
            scalars.append(b.constant(np.asarray(int(v), dtype=np.int64)))
    if array.ndim == 0:
        return scalars[0]
    stacked = composite.concat(b, [b.reshape(s, (1,)) for s in scalars], 0)
    return b.reshape(stacked, array.shape)


def dim_tensor(b: GraphBuilder, dim: Dim, like: int) -> int:
    """`dim` as an int64 tensor of the shape of node `like`."""
    if isinstance(dim, int):
        return b.scalar_like(dim, like)
    return b.broadcast_to(materialize(b, np.array(dim, dtype=object)), b.shape(like))


def wrap_negative(ctx: Context, index: int, size: Dim) -> int:
    """An int64 index with negative values counted from the end of an axis of `size`, as ONNX
    allows; indices provably non-negative (built from Range, iota...) are left as they are."""
    b = ctx.b
    index = b.cast(index, "int64")
    if ctx.ranges.non_negative(index):
        return index
    negative = b.cast(b.binary(Op.LESS_THAN, index, b.scalar_like(0, index)), "int64")
    return b.binary(Op.ADD, index, b.binary(Op.MUL, negative, dim_tensor(b, size, negative)))


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def text(value: bytes | str) -> str:
    """A string attribute as str (onnx gives bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def normalized_axis(node: onnx.NodeProto, axis: int, rank: int) -> int:
    """An axis attribute in [0, rank), negative ones counted from the end."""
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{node.op_type} axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


def float_input(ctx: Context, node: onnx.NodeProto, index: int = 0) -> int:
    """Input `index`, refused unless it is a float tensor."""
    x = ctx.value(node, index)
    if not is_float(ctx.b.dtype(x)):
        raise refuse(node, f"{ctx.b.dtype(x)} input")
    return x


def stored_dtype(ctx: Context, node: onnx.NodeProto, index: int) -> str:
    """The dtype the model declares for input `index`; the graph carries float16 and the narrow
    types in a wider one (COMPUTED_AS)."""
    declared = ELEM_TYPES.get(ctx.declared_types.get(node.input[index], 0))
    return declared or ctx.b.dtype(ctx.value(node, index))


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
