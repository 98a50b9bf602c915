"""Compile-time evaluation of ONNX nodes whose inputs are all known.

Exported graphs compute shapes at run time (Shape, Gather, Concat, Reshape...). Numeric values
are folded with onnx's own reference implementation, so folding follows the spec. Shapes that
hold symbolic dims are object arrays of ints and SymDims, folded here for the ops shape
computations use; whatever cannot be folded exactly returns None and is lowered instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper

from compiler.frontends.onnx_context import attrs
from compiler.shape import (
    ShapeError,
    as_dim,
    bounds,
    dim_add,
    dim_div,
    dim_floordiv,
    dim_max,
    dim_min,
    dim_mod,
    dim_mul,
    dim_sub,
    numel,
)

# ops that are not functions of their inputs, or whose folding would hide a large tensor
NOT_FOLDED = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"}
    | {"Bernoulli", "If", "Loop", "Scan", "SequenceMap", "Dropout"}
)
# a folded value becomes a weight, so keep folds to what shape arithmetic needs
MAX_FOLDED_ELEMENTS = 1 << 20


def fold_numeric(node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int):
    """Outputs of `node` evaluated by onnx.reference, or None when it should be lowered."""
    if node.op_type in NOT_FOLDED or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if sum(a.size for a in inputs if a is not None) > MAX_FOLDED_ELEMENTS:
        return None
    if _output_bound(node, inputs) > MAX_FOLDED_ELEMENTS:
        return None
    from onnx.reference import ReferenceEvaluator  # imported lazily: it loads every op

    feeds = {name: array for name, array in zip(node.input, inputs) if name}
    graph = helper.make_graph(
        [node],
        "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in feeds.items()],
        [helper.make_empty_tensor_value_info(o) for o in node.output if o],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            outputs = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # noqa: BLE001  the reference raises anything; lowering reports properly
        return None
    if any(not isinstance(o, np.ndarray) for o in outputs):
        return None
    return list(outputs)


def _output_bound(node: onnx.NodeProto, inputs: Sequence[np.ndarray | None]) -> int:
    """An upper bound on the output size of ops that grow a small input."""
    op = node.op_type
    try:
        if op == "ConstantOfShape":
            return int(np.prod(inputs[0], dtype=np.float64))
        if op == "Expand":
            shape = np.broadcast_shapes(inputs[0].shape, tuple(int(v) for v in inputs[1]))
            return int(np.prod(shape, dtype=np.float64))
        if op == "Tile":
            return int(inputs[0].size * np.prod(inputs[1], dtype=np.float64))
        if op == "Range":
            start, limit, delta = (float(np.asarray(a).item()) for a in inputs[:3])
            return int(abs((limit - start) / delta)) + 1 if delta else 0
        if op in ("Resize", "Upsample", "OneHot", "EyeLike", "Pad", "CenterCropPad"):
            return MAX_FOLDED_ELEMENTS + 1
    except (ValueError, TypeError, IndexError):
        return MAX_FOLDED_ELEMENTS + 1
    return 0


# ---- symbolic shape values ---------------------------------------------------------------


class _Unknown(Exception):
    """The fold cannot decide this exactly; the node is lowered instead."""


def _int_list(array: np.ndarray | None) -> list[int]:
    if array is None or array.dtype == object:
        raise _Unknown
    return [int(v) for v in array.reshape(-1)]


def _axes(node: onnx.NodeProto, args, opset: int) -> list[int] | None:
    if opset >= 13:
        return _int_list(args[1]) if len(args) > 1 and args[1] is not None else None
    return attrs(node).get("axes")


def _sym_div(a, b):
    a, b = as_dim(a), as_dim(b)
    if isinstance(a, int) and isinstance(b, int):
        if b == 0:
            raise _Unknown
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q  # ONNX integer Div truncates toward zero
    if isinstance(b, int) and b > 0 and bounds(a)[0] >= 0:
        return dim_floordiv(a, b)  # truncation is flooring for a non-negative numerator
    try:
        return dim_div(a, b)
    except ShapeError:
        raise _Unknown from None


def _sym_mod(a, b):
    a, b = as_dim(a), as_dim(b)
    if isinstance(b, int) and b > 0:
        return dim_mod(a, b)  # ONNX's integer Mod takes the divisor's sign, as Python's does
    if isinstance(a, int) and isinstance(b, int) and b != 0:
        return int(np.mod(a, b))
    raise _Unknown


def _sym_fmod(a, b):
    """C's fmod takes the dividend's sign: Python's mod where the dividend is non-negative."""
    if bounds(as_dim(a))[0] < 0:
        raise _Unknown
    return _sym_mod(a, b)


def _sym_add(a, b):
    return dim_add(as_dim(a), as_dim(b))


def _sym_sub(a, b):
    return dim_sub(as_dim(a), as_dim(b))


def _sym_mul(a, b):
    return dim_mul(as_dim(a), as_dim(b))


def _sym_compare(op: str):
    """A comparison of dims, decided by the bounds of their difference (symbols are >= 1)."""

    def compare(a, b) -> bool:
        low, high = bounds(dim_sub(as_dim(a), as_dim(b)))
        decided = {
            "Equal": (low == high == 0, low > 0 or high < 0),
            "Less": (high < 0, low >= 0),
            "LessOrEqual": (high <= 0, low > 0),
            "Greater": (low > 0, high <= 0),
            "GreaterOrEqual": (low >= 0, high < 0),
        }[op]
        if decided[0]:
            return True
        if decided[1]:
            return False
        raise _Unknown

    return compare


def _elementwise(fn: Callable, a: np.ndarray, b: np.ndarray, out_dtype=object) -> np.ndarray:
    a, b = np.broadcast_arrays(a.astype(object), b.astype(object))
    out = np.empty(a.shape, dtype=out_dtype)
    for index in np.ndindex(a.shape):
        out[index] = fn(a[index], b[index])
    return out


def fold_symbolic(node: onnx.NodeProto, args: list[np.ndarray | None], opset: int):
    """Outputs of a shape-computing node with symbolic inputs, or None."""
    try:
        return _FOLDERS[node.op_type](node, args, opset) if node.op_type in _FOLDERS else None
    except (_Unknown, ShapeError, ValueError, IndexError, TypeError):
        return None  # lowered instead, where a malformed node is reported with its name


def shape_of(node: onnx.NodeProto, shape: tuple, opset: int) -> np.ndarray:
    """The Shape op over a (possibly symbolic) shape, with opset-15 start/end."""
    a = attrs(node)
    rank = len(shape)
    start, end = a.get("start", 0), a.get("end", rank)
    picked = list(shape)[slice(max(-rank, min(start, rank)), max(-rank, min(end, rank)) if "end" in a else None)]
    return np.array(picked, dtype=object).reshape(len(picked))


def _reshape(node, args, opset):
    data = args[0]
    requested = _int_list(args[1])
    out = []
    for i, r in enumerate(requested):
        if r == 0 and not attrs(node).get("allowzero", 0):
            out.append(data.shape[i])
        else:
            out.append(r)
    return [data.reshape(out)]


def _slice(node, args, opset):
    data = args[0]
    if opset < 10:
        a = attrs(node)
        starts, ends, axes, steps = a["starts"], a["ends"], a.get("axes"), None
    else:
        starts, ends = _int_list(args[1]), _int_list(args[2])
        axes = _int_list(args[3]) if len(args) > 3 and args[3] is not None else None
        steps = _int_list(args[4]) if len(args) > 4 and args[4] is not None else None
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    index = [slice(None)] * data.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps):
        index[ax % data.ndim] = slice(s, e, st)
    return [data[tuple(index)]]


def _unsqueeze(node, args, opset):
    axes = _axes(node, args, opset)
    data = args[0]
    rank = data.ndim + len(axes)
    out = data
    for ax in sorted(a % rank for a in axes):
        out = np.expand_dims(out, ax)
    return [out]


def _squeeze(node, args, opset):
    axes = _axes(node, args, opset)
    data = args[0]
    return [np.squeeze(data, axis=tuple(a % data.ndim for a in axes) if axes else None)]


def _cast(node, args, opset):
    to = attrs(node)["to"]
    if to not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        raise _Unknown
    return [args[0]]


def _where(node, args, opset):
    cond = args[0]
    if cond.dtype == object:
        raise _Unknown
    return [np.where(cond.astype(bool), args[1].astype(object), args[2].astype(object))]


def _max_min(node, args, opset):
    values = args[0].astype(object)
    for other in args[1:]:
        values = _elementwise(lambda a, b: _pick(node.op_type, a, b), values, other)
    return [values]


def _pick(op: str, a, b):
    return dim_max(as_dim(a), as_dim(b)) if op == "Max" else dim_min(as_dim(a), as_dim(b))


def _compare(node, args, opset):
    return [_elementwise(_sym_compare(node.op_type), args[0], args[1], bool)]


_FOLDERS: dict[str, Callable] = {
    "Identity": lambda node, args, opset: [args[0]],
    "Gather": lambda node, args, opset: [
        np.take(args[0], np.asarray(_int_list(args[1])).reshape(args[1].shape), axis=attrs(node).get("axis", 0))
    ],
    "Concat": lambda node, args, opset: [
        np.concatenate([a.astype(object) for a in args if a is not None], axis=attrs(node)["axis"])
    ],
    "Reshape": _reshape,
    "Slice": _slice,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Cast": _cast,
    "Mul": lambda node, args, opset: [_elementwise(_sym_mul, args[0], args[1])],
    "Div": lambda node, args, opset: [_elementwise(_sym_div, args[0], args[1])],
    "Mod": lambda node, args, opset: [_elementwise(_sym_mod if not attrs(node).get("fmod") else _sym_fmod, args[0], args[1])],
    "Add": lambda node, args, opset: [_elementwise(_sym_add, args[0], args[1])],
    "Sub": lambda node, args, opset: [_elementwise(_sym_sub, args[0], args[1])],
    "Neg": lambda node, args, opset: [_elementwise(_sym_sub, np.zeros((), dtype=object), args[0])],
    **{op: _compare for op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")},
    "Where": _where,
    "Max": _max_min,
    "Min": _max_min,
    "Size": lambda node, args, opset: [np.array(numel(args[0].shape), dtype=object)],
}


__all__ = ["fold_numeric", "fold_symbolic", "shape_of"]
