"""The reference interpreter: runs an IR graph op by op in NumPy.

It is the oracle every compiled program is checked against, so it favours obviousness over
speed, with one exception: a broadcast multiply read only by a sum (a matmul or convolution) is
evaluated as one einsum (compiler/contraction.py), since materializing the product does not fit
in memory for real models. Symbolic dimensions are bound from the shapes of the inputs it is
given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from compiler.contraction import contract, find_contraction, users_of
from compiler.dtypes import numpy_dtype
from compiler.ir import Graph, Node, Op
from compiler.shape import ShapeError, SymDim, evaluate, evaluate_shape

_UNARY: dict[Op, Callable[[np.ndarray], np.ndarray]] = {
    Op.LOG2: np.log2,
    Op.EXP2: np.exp2,
    Op.SIN: np.sin,
    Op.SQRT: np.sqrt,
    Op.RECIP: np.reciprocal,
}

_BINARY: dict[Op, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    Op.ADD: np.add,
    Op.MUL: np.multiply,
    Op.MOD: np.fmod,
    Op.LESS_THAN: np.less,
}


def bind_symbols(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Symbol values implied by the given inputs; raises ShapeError on a conflict. A compound
    dimension (a decoder's mask spans past + seq) is checked once its symbols are bound."""
    bindings: dict[str, int] = {}
    compound: list[tuple[str, SymDim, int]] = []
    for name, shape, _ in graph.input_specs():
        actual = np.shape(inputs[name])
        if len(actual) != len(shape):
            raise ShapeError(f"input {name!r} has rank {len(actual)}, expected {len(shape)}")
        for declared, size in zip(shape, actual):
            if isinstance(declared, SymDim):
                symbol = declared.as_symbol()
                if symbol is None:
                    compound.append((name, declared, size))
                elif bindings.setdefault(symbol, size) != size:
                    raise ShapeError(
                        f"dimension {symbol!r} is {bindings[symbol]} elsewhere but {size} in input {name!r}"
                    )
            elif declared != size:
                raise ShapeError(f"input {name!r} has size {size} where {declared} is expected")
    for name, declared, size in compound:
        if not declared.symbols <= bindings.keys():
            raise ShapeError(
                f"input {name!r} declares dimension {declared}, whose symbols no other input gives"
            )
        if evaluate(declared, bindings) != size:
            raise ShapeError(
                f"input {name!r} has size {size} where {declared} = {evaluate(declared, bindings)} is expected"
            )
    return bindings


def apply_view(x: np.ndarray, transform: tuple, bindings: Mapping[str, int]) -> np.ndarray:
    kind = transform[0]
    if kind == "reshape":
        return x.reshape(evaluate_shape(transform[1], bindings))
    if kind == "permute":
        return x.transpose(transform[1])
    if kind == "expand":
        return np.broadcast_to(x, evaluate_shape(transform[1], bindings))
    if kind == "slice":
        index = []
        for axis, (start, stop, step) in enumerate(transform[1]):
            if isinstance(start, SymDim) or isinstance(stop, SymDim):
                # symbolic bounds are normalised, so they must land inside the axis
                start = evaluate(start, bindings)
                stop = None if stop is None else evaluate(stop, bindings)
                size = x.shape[axis]
                if not (0 <= start <= size and (stop is None or -1 <= stop <= size)):
                    raise ShapeError(f"slice [{start}:{stop}:{step}] of an axis of size {size}")
                if stop == -1:
                    stop = None
            index.append(slice(start, stop, step))
        return x[tuple(index)]
    if kind == "pad":
        _, widths, value = transform
        widths = [(evaluate(before, bindings), evaluate(after, bindings)) for before, after in widths]
        return np.pad(x, widths, mode="constant", constant_values=value)
    if kind == "window":
        _, axes, kernel, strides, dilations = transform
        spans = [d * (k - 1) + 1 for k, d in zip(kernel, dilations)]
        windows = np.lib.stride_tricks.sliding_window_view(x, spans, axis=axes)
        index = [slice(None)] * windows.ndim
        for axis, stride in zip(axes, strides):
            index[axis] = slice(None, None, stride)
        for j, dilation in enumerate(dilations):
            index[x.ndim + j] = slice(None, None, dilation)
        return windows[tuple(index)]
    raise ShapeError(f"unknown view transform {kind!r}")


def eval_node(node: Node, args: list[np.ndarray], graph: Graph, bindings: Mapping[str, int]):
    op = node.op
    dtype = numpy_dtype(node.dtype)
    if op in _UNARY:
        with np.errstate(all="ignore"):
            return _UNARY[op](args[0]).astype(dtype, copy=False)
    if op in _BINARY:
        with np.errstate(all="ignore"):
            return np.asarray(_BINARY[op](args[0], args[1])).astype(dtype, copy=False)
    if op is Op.SUM_REDUCE:
        return np.sum(args[0], axis=node.arg, dtype=dtype)
    if op is Op.MAX_REDUCE:
        return np.max(args[0], axis=node.arg)
    if op is Op.VIEW:
        return apply_view(args[0], node.arg, bindings)
    if op is Op.CAST:
        with np.errstate(all="ignore"):  # NaN or out-of-range floats to ints: undefined in ONNX too
            return args[0].astype(dtype)
    if op is Op.GATHER:
        data, indices = args
        axis = node.arg
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return np.take(data, indices, axis=axis)
    if op is Op.CONSTANT:
        return graph.weights[node.arg]
    if op is Op.IOTA:
        return np.arange(evaluate_shape(node.shape, bindings)[0], dtype=np.int64)
    raise ShapeError(f"reference interpreter cannot evaluate {op}")


def run_graph(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    bindings = bind_symbols(graph, inputs)
    # contractions as einsums: a VGG-19 layer's broadcast product alone would take 7 GB
    users = users_of(graph)
    contractions = {
        i: found for i in range(len(graph.nodes)) if (found := find_contraction(graph, i, users)) is not None
    }
    deps = [
        list(contractions[i].operands) if i in contractions else list(node.srcs)
        for i, node in enumerate(graph.nodes)
    ]
    needed = {i for _, i in graph.outputs}
    for i in range(len(graph.nodes) - 1, -1, -1):
        if i in needed:
            needed.update(deps[i])
    last_use = {s: i for i in sorted(needed) for s in deps[i]}
    keep = {i for _, i in graph.outputs}
    values: list[np.ndarray | None] = [None] * len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        if i not in needed:
            continue
        if node.op is Op.INPUT:
            values[i] = np.asarray(inputs[node.arg], dtype=numpy_dtype(node.dtype))
            continue
        args = [values[s] for s in deps[i]]
        if i in contractions:
            found = contractions[i]
            values[i] = contract(found.subscripts, found.squeezes, args, node.dtype)
        else:
            values[i] = eval_node(node, args, graph, bindings)
        for s in set(deps[i]):
            if last_use[s] == i and s not in keep:
                values[s] = None  # free values once their last reader ran, to bound peak memory
    return {name: np.asarray(values[i], order="C") for name, i in graph.outputs}
