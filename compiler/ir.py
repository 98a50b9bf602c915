"""The primitive-op IR.

A graph is a list of nodes in topological order (SSA: a node refers to its sources by index).
Compute is a small set of primitive ops; layout changes (reshape, permute, expand, slice, pad,
sliding windows) are VIEW nodes that move no arithmetic, so a code generator may fold them into
index expressions. Binary ops take operands of identical shape: broadcasting is spelled out with
views by the frontend. The builder hash-conses nodes, so identical subexpressions exist once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from compiler.dtypes import DTYPES, numpy_dtype
from compiler.shape import (
    Dim,
    Shape,
    ShapeError,
    SymDim,
    dim_add,
    dim_ceildiv,
    dim_div,
    dim_floordiv,
    dim_from_json,
    dim_max,
    dim_sub,
    dim_to_json,
    is_static,
    numel,
    probably_equal,
    shape_from_json,
    shape_to_json,
    symbol_limit,
)


class Op(StrEnum):
    INPUT = "input"
    CONSTANT = "constant"
    CAST = "cast"
    GATHER = "gather"
    # 0, 1, ..., n-1 as int64; n may be symbolic
    IOTA = "iota"
    # unary
    LOG2 = "log2"
    EXP2 = "exp2"
    SIN = "sin"
    SQRT = "sqrt"
    RECIP = "recip"
    # binary
    ADD = "add"
    MUL = "mul"
    MOD = "mod"
    LESS_THAN = "less_than"
    # reductions (the reduced axes are removed)
    SUM_REDUCE = "sum_reduce"
    MAX_REDUCE = "max_reduce"
    # layout only
    VIEW = "view"


UNARY_OPS = frozenset({Op.LOG2, Op.EXP2, Op.SIN, Op.SQRT, Op.RECIP})
BINARY_OPS = frozenset({Op.ADD, Op.MUL, Op.MOD, Op.LESS_THAN})
REDUCE_OPS = frozenset({Op.SUM_REDUCE, Op.MAX_REDUCE})



@dataclass(frozen=True, slots=True)
class Node:
    op: Op
    srcs: tuple[int, ...]
    shape: Shape
    dtype: str
    # op-specific, hashable and JSON-able: input name, weight key, reduce axes, view transform
    arg: Any = None


@dataclass
class Graph:
    nodes: list[Node]
    # node ids of INPUT nodes, in signature order
    inputs: list[int]
    # (output name, node id), in signature order
    outputs: list[tuple[str, int]]
    # CONSTANT node arg -> array
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    # symbol -> the largest size the model itself allows (a buffer cut to the sequence length)
    size_limits: dict[str, int] = field(default_factory=dict)

    def input_specs(self) -> list[tuple[str, Shape, str]]:
        return [(self.nodes[i].arg, self.nodes[i].shape, self.nodes[i].dtype) for i in self.inputs]

    def output_specs(self) -> list[tuple[str, Shape, str]]:
        return [(name, self.nodes[i].shape, self.nodes[i].dtype) for name, i in self.outputs]

    def to_json(self) -> dict[str, Any]:
        data = {
            "nodes": [_node_to_json(n) for n in self.nodes],
            "inputs": self.inputs,
            "outputs": [[name, i] for name, i in self.outputs],
        }
        if self.size_limits:
            data["size_limits"] = dict(sorted(self.size_limits.items()))
        return data

    @staticmethod
    def from_json(data: dict[str, Any], weights: dict[str, np.ndarray]) -> Graph:
        return Graph(
            nodes=[_node_from_json(n) for n in data["nodes"]],
            inputs=list(data["inputs"]),
            outputs=[(name, i) for name, i in data["outputs"]],
            weights=weights,
            size_limits=dict(data.get("size_limits", {})),
        )

    def content_hash(self) -> str:
        """Hash of structure and weights: the natural compile-cache key."""
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode())
        for key in sorted(self.weights):
            array = np.ascontiguousarray(self.weights[key])
            digest.update(f"{key}:{array.dtype}:{array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()


def _freeze(value: Any) -> Any:
    """JSON lists back to tuples, so node args stay hashable."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _node_to_json(node: Node) -> dict[str, Any]:
    arg = node.arg
    if node.op is Op.VIEW:
        arg = view_to_json(arg)
    return {
        "op": node.op.value,
        "srcs": list(node.srcs),
        "shape": shape_to_json(node.shape),
        "dtype": node.dtype,
        "arg": arg,
    }


def _node_from_json(data: dict[str, Any]) -> Node:
    op = Op(data["op"])
    arg = data["arg"]
    arg = view_from_json(arg) if op is Op.VIEW else _freeze(arg)
    return Node(op, tuple(data["srcs"]), shape_from_json(data["shape"]), data["dtype"], arg)


# ---- views -------------------------------------------------------------------------------
# A view transform is a tuple: (kind, *params). Dims inside params may be symbolic.
#   ("reshape", shape)
#   ("permute", perm)
#   ("expand", shape)                       size-1 axes broadcast to shape
#   ("slice", ((start, stop, step), ...))   one triple per axis; stop None means past the end in
#                                           the step's direction. Symbolic bounds are normalised by
#                                           the frontend: 0 <= start <= stop <= dim for step > 0.
#   ("pad", ((before, after), ...), value)  constant padding, one pair of (possibly symbolic) widths per axis
#   ("window", axes, kernel, strides, dilations)  sliding windows; window axes appended last


def view_to_json(transform: tuple) -> list[Any]:
    kind = transform[0]
    if kind in ("reshape", "expand"):
        return [kind, shape_to_json(transform[1])]
    if kind == "pad":
        return [kind, [[dim_to_json(before), dim_to_json(after)] for before, after in transform[1]], transform[2]]
    if kind == "slice":
        return [kind, [[dim_to_json(start), None if stop is None else dim_to_json(stop), step] for start, stop, step in transform[1]]]
    return [kind, *transform[1:]]


def view_from_json(data: list[Any]) -> tuple:
    kind = data[0]
    if kind in ("reshape", "expand"):
        return (kind, shape_from_json(data[1]))
    if kind == "pad":
        return (kind, tuple((dim_from_json(before), dim_from_json(after)) for before, after in data[1]), data[2])
    if kind == "slice":
        return (kind, tuple((dim_from_json(start), None if stop is None else dim_from_json(stop), step) for start, stop, step in data[1]))
    return (kind, *(_freeze(p) for p in data[1:]))


def view_shape(shape: Shape, transform: tuple) -> Shape:
    kind = transform[0]
    if kind in ("slice", "pad") and len(transform[1]) != len(shape):
        raise ShapeError(f"a {kind} of {len(transform[1])} axes applied to {_fmt(shape)}")
    if kind == "reshape":
        target = transform[1]
        if not probably_equal(numel(target), numel(shape)):
            raise ShapeError(f"cannot reshape {_fmt(shape)} to {_fmt(target)}")
        return target
    if kind == "permute":
        perm = transform[1]
        if sorted(perm) != list(range(len(shape))):
            raise ShapeError(f"bad permutation {list(perm)} for rank {len(shape)}")
        return tuple(shape[p] for p in perm)
    if kind == "expand":
        target = transform[1]
        if len(target) != len(shape) or any(s != t and s != 1 for s, t in zip(shape, target)):
            raise ShapeError(f"cannot expand {_fmt(shape)} to {_fmt(target)}")
        return target
    if kind == "slice":
        return tuple(_sliced_dim(d, *triple) for d, triple in zip(shape, transform[1], strict=True))
    if kind == "pad":
        return tuple(_padded_dim(d, b, a) for d, (b, a) in zip(shape, transform[1], strict=True))
    if kind == "window":
        _, axes, kernel, strides, dilations = transform
        if not len(axes) == len(kernel) == len(strides) == len(dilations) or any(a >= len(shape) for a in axes):
            raise ShapeError(f"a window over axes {list(axes)} of {_fmt(shape)} with kernel {list(kernel)}")
        out = list(shape)
        for axis, k, s, dil in zip(axes, kernel, strides, dilations, strict=True):
            d = shape[axis]
            span = dil * (k - 1) + 1
            if isinstance(d, int) and d < span:
                raise ShapeError(f"window of span {span} does not fit in dimension {d}")
            # a symbolic length too short for the window is refused when the request binds it
            out[axis] = dim_add(dim_floordiv(dim_sub(d, span), s), 1)
        return tuple(out) + tuple(kernel)
    raise ShapeError(f"unknown view transform {kind!r}")


def _sliced_dim(d: Dim, start: Dim, stop: Dim | None, step: int) -> Dim:
    if start == 0 and stop is None and step == 1:
        return d
    if isinstance(d, int) and isinstance(start, int) and (stop is None or isinstance(stop, int)):
        return len(range(*slice(start, stop, step).indices(d)))
    if step > 0:
        end = d if stop is None else stop
        return dim_max(dim_ceildiv(dim_sub(end, start), step), 0)
    end = -1 if stop is None else stop
    return dim_max(dim_ceildiv(dim_sub(start, end), -step), 0)


def _padded_dim(d: Dim, before: Dim, after: Dim) -> Dim:
    return dim_add(d, dim_add(before, after))


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# ---- building ----------------------------------------------------------------------------


class GraphWriter:
    """Builds a graph node by node; identical nodes are created once."""

    def __init__(self, weights: dict[str, np.ndarray] | None = None) -> None:
        self.nodes: list[Node] = []
        self.weights: dict[str, np.ndarray] = dict(weights or {})
        self._index: dict[Node, int] = {}

    def add(self, node: Node) -> int:
        existing = self._index.get(node)
        if existing is not None:
            return existing
        self.nodes.append(node)
        self._index[node] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def finish(self, inputs: list[int], outputs: list[tuple[str, int]], size_limits: dict[str, int]) -> Graph:
        return prune(Graph(self.nodes, inputs, outputs, self.weights, dict(size_limits)))


class GraphBuilder(GraphWriter):
    """Appends nodes with shape and dtype inference; identical nodes are created once."""

    def __init__(self) -> None:
        super().__init__()
        self._inputs: list[int] = []
        self.size_limits: dict[str, int] = {}

    def node(self, i: int) -> Node:
        return self.nodes[i]

    def shape(self, i: int) -> Shape:
        return self.nodes[i].shape

    def dtype(self, i: int) -> str:
        return self.nodes[i].dtype

    def input(self, name: str, shape: Shape, dtype: str) -> int:
        i = self.add(Node(Op.INPUT, (), tuple(shape), dtype, name))
        self._inputs.append(i)
        return i

    def constant(self, value: np.ndarray | float, dtype: str | None = None) -> int:
        array = np.asarray(value, dtype=None if dtype is None else numpy_dtype(dtype))
        if array.dtype.name not in DTYPES:
            raise ShapeError(f"constant of unsupported dtype {array.dtype}")
        key = "c" + hashlib.sha256(
            f"{array.dtype}:{array.shape}".encode() + np.ascontiguousarray(array).tobytes()
        ).hexdigest()[:24]
        self.weights.setdefault(key, array)
        return self.add(Node(Op.CONSTANT, (), tuple(array.shape), array.dtype.name, key))

    def iota(self, length: Dim) -> int:
        return self.add(Node(Op.IOTA, (), (length,), "int64"))

    def scalar_like(self, value: float, like: int) -> int:
        """A scalar constant broadcast to the shape and dtype of node `like`."""
        c = self.constant(value, self.dtype(like))
        return self.broadcast_to(c, self.shape(like))

    def unary(self, op: Op, x: int) -> int:
        assert op in UNARY_OPS
        return self.add(Node(op, (x,), self.shape(x), self.dtype(x)))

    def binary(self, op: Op, a: int, b: int) -> int:
        assert op in BINARY_OPS
        sa, sb = self.shape(a), self.shape(b)
        if sa != sb:
            raise ShapeError(f"{op} operands differ in shape: {_fmt(sa)} vs {_fmt(sb)}")
        if self.dtype(a) != self.dtype(b):
            raise ShapeError(f"{op} operands differ in dtype: {self.dtype(a)} vs {self.dtype(b)}")
        dtype = "bool" if op is Op.LESS_THAN else self.dtype(a)
        if op in (Op.ADD, Op.MUL) and a > b:
            a, b = b, a  # canonical order for commutative ops, so hash-consing finds more
        return self.add(Node(op, (a, b), sa, dtype))

    def reduce(self, op: Op, x: int, axes: Sequence[int]) -> int:
        assert op in REDUCE_OPS
        shape = self.shape(x)
        rank = len(shape)
        norm = tuple(sorted({a % rank for a in axes})) if rank else ()
        if not norm:
            return x
        out = tuple(d for i, d in enumerate(shape) if i not in norm)
        return self.add(Node(op, (x,), out, self.dtype(x), norm))

    def cast(self, x: int, dtype: str) -> int:
        if dtype not in DTYPES:
            raise ShapeError(f"cast to unsupported dtype {dtype}")
        if self.dtype(x) == dtype:
            return x
        return self.add(Node(Op.CAST, (x,), self.shape(x), dtype))

    def gather(self, data: int, indices: int, axis: int) -> int:
        shape = self.shape(data)
        axis %= len(shape)
        out = shape[:axis] + self.shape(indices) + shape[axis + 1 :]
        return self.add(Node(Op.GATHER, (data, indices), out, self.dtype(data), axis))

    def view(self, x: int, transform: tuple) -> int:
        shape = self.shape(x)
        out = view_shape(shape, transform)
        if transform[0] in ("reshape", "expand") and out == shape:
            return x
        if transform[0] == "permute" and tuple(transform[1]) == tuple(range(len(shape))):
            return x
        return self.add(Node(Op.VIEW, (x,), out, self.dtype(x), transform))

    # -- layout helpers used by every frontend --
    def reshape(self, x: int, shape: Sequence[Dim]) -> int:
        return self.view(x, ("reshape", tuple(shape)))

    def permute(self, x: int, perm: Sequence[int]) -> int:
        return self.view(x, ("permute", tuple(perm)))

    def expand(self, x: int, shape: Sequence[Dim]) -> int:
        return self.view(x, ("expand", tuple(shape)))

    def broadcast_to(self, x: int, shape: Shape) -> int:
        """Numpy-style broadcast: left-pad the rank with 1s, then expand."""
        src = self.shape(x)
        if len(src) > len(shape):
            raise ShapeError(f"cannot broadcast {_fmt(src)} to {_fmt(shape)}")
        padded = (1,) * (len(shape) - len(src)) + src
        return self.expand(self.reshape(x, padded), shape)

    def unsqueeze(self, x: int, axis: int) -> int:
        shape = list(self.shape(x))
        shape.insert(axis % (len(shape) + 1), 1)
        return self.reshape(x, shape)

    def limit_size(self, dim: Dim, bound: int) -> None:
        """Records that the graph holds only while dim <= bound: requests beyond it are refused
        when validated, rather than failing while they run."""
        limit = symbol_limit(dim, bound)
        if limit is None:
            return  # a compound form: checked when run, and refused there as a bad size
        symbol, most = limit
        if most < 1:
            raise ShapeError(f"{dim} must stay at most {bound}, which no size of {symbol} allows")
        self.size_limits[symbol] = min(most, self.size_limits.get(symbol, most))

    def finish(self, outputs: list[tuple[str, int]]) -> Graph:
        graph = Graph(list(self.nodes), list(self._inputs), outputs, dict(self.weights), dict(self.size_limits))
        return prune(graph)


def prune(graph: Graph) -> Graph:
    """Drop nodes no output depends on (inputs are kept: they are the signature)."""
    live = set(graph.inputs) | {i for _, i in graph.outputs}
    for i in range(len(graph.nodes) - 1, -1, -1):
        if i in live:
            live.update(graph.nodes[i].srcs)
    remap: dict[int, int] = {}
    nodes: list[Node] = []
    for i, node in enumerate(graph.nodes):
        if i in live:
            remap[i] = len(nodes)
            nodes.append(
                Node(node.op, tuple(remap[s] for s in node.srcs), node.shape, node.dtype, node.arg)
            )
    used_weights = {n.arg for n in nodes if n.op is Op.CONSTANT}
    return Graph(
        nodes=nodes,
        inputs=[remap[i] for i in graph.inputs],
        outputs=[(name, remap[i]) for name, i in graph.outputs],
        weights={k: v for k, v in graph.weights.items() if k in used_weights},
        size_limits=graph.size_limits,
    )


__all__ = [
    "BINARY_OPS",
    "DTYPES",
    "REDUCE_OPS",
    "UNARY_OPS",
    "Dim",
    "Graph",
    "GraphBuilder",
    "Node",
    "Op",
    "Shape",
    "ShapeError",
    "SymDim",
    "dim_div",
    "dim_from_json",
    "dim_to_json",
    "is_static",
    "prune",
    "view_shape",
]
