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
from compiler.shape import ShapeError, SymDim, dim_div, numel

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
    if isinstance(a, int | np.integer) and isinstance(b, int | np.integer):
        if b == 0:
            raise _Unknown
        q = abs(int(a)) // abs(int(b))
        return q if (a >= 0) == (b >= 0) else -q  # ONNX integer Div truncates toward zero
    try:
        return dim_div(a if isinstance(a, SymDim) else int(a), b if isinstance(b, SymDim) else int(b))
    except ShapeError:
        raise _Unknown from None


def _sym_mul(a, b):
    if isinstance(a, SymDim):
        return a * int(b) if not isinstance(b, SymDim) else a * b
    if isinstance(b, SymDim):
        return b * int(a)
    return int(a) * int(b)


def _sym_add(a, b):
    if isinstance(b, SymDim) and not isinstance(a, SymDim):
        a, b = b, a
    if isinstance(a, SymDim):
        if isinstance(b, SymDim) or int(b) != 0:
            raise _Unknown  # sums of symbols are not representable
        return a
    return int(a) + int(b)


def _sym_neg(b):
    if isinstance(b, SymDim):
        raise _Unknown
    return -int(b)


def _sym_equal(a, b) -> bool:
    if isinstance(a, SymDim) or isinstance(b, SymDim):
        if isinstance(a, SymDim) and isinstance(b, SymDim) and a == b:
            return True
        other = b if isinstance(a, SymDim) else a
        if not isinstance(other, SymDim) and int(other) < 1:
            return False  # a symbolic dim is at least 1
        raise _Unknown
    return int(a) == int(b)


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
    except _Unknown:
        return None


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
    if a == b:
        return a
    if isinstance(a, SymDim) or isinstance(b, SymDim):
        sym, other = (a, b) if isinstance(a, SymDim) else (b, a)
        if not isinstance(other, SymDim) and int(other) <= 1:
            return sym if op == "Max" else other  # symbolic dims are at least 1
        raise _Unknown
    return max(int(a), int(b)) if op == "Max" else min(int(a), int(b))


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
    "Add": lambda node, args, opset: [_elementwise(_sym_add, args[0], args[1])],
    "Sub": lambda node, args, opset: [_elementwise(lambda a, b: _sym_add(a, _sym_neg(b)), args[0], args[1])],
    "Equal": lambda node, args, opset: [_elementwise(_sym_equal, args[0], args[1], bool)],
    "Where": _where,
    "Max": _max_min,
    "Min": _max_min,
    "Size": lambda node, args, opset: [np.array(numel(args[0].shape), dtype=object)],
}


__all__ = ["fold_numeric", "fold_symbolic", "shape_of"]
