"""Weight-only int8 (Q8): the `precision="int8"` option.

Every float32 weight that only matrix products read, and that is large enough to matter, is
stored as int8 with one float32 scale per output channel (per column of the product it feeds:
the axes it is not summed over), symmetric: scale = max|w| / 127 over the channel, q =
round(w / scale). The graph then reads `cast(q) * scale` where it read the weight, so every
later stage sees an ordinary graph: the reference interpreter computes the quantized model
exactly, folding never widens the int8 back (it would quadruple the bytes), and the lowering
gives such a product's B operand as panels that dequantize a block of columns into cache as the
product consumes them (or, for a matrix-vector product, a loop that reads the int8 inline), so
the weights cross memory as bytes and the search measures those forms like any other.

A table that gathers read rows of (an embedding) is stored the same way with a scale per row,
which the gather widens as it reads a row. A weight whose readers need scales along different
axes (one table gathered by rows and multiplied summing its rows), or that anything else reads,
stays float32.

The error this costs is measured against the float graph at compile time (quantization_error)
and refused past INT8_TOLERANCE."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.contraction import find_contraction, users_of
from compiler.ir import Graph, GraphWriter, Node, Op
from compiler.shape import is_static

# a weight smaller than this many elements stays float32: its bytes are noise beside the
# activations, and a bias or a norm's scale is not a product's operand anyway
MIN_QUANTIZED_ELEMENTS = 4096
INT8_MAX = 127


@dataclass(frozen=True)
class QuantizedWeight:
    key: str
    shape: tuple[int, ...]
    # the weight's axes a product sums over: the scale is one value along them
    summed_axes: tuple[int, ...]


def quantize_weights(graph: Graph) -> tuple[Graph, dict[str, Any]]:
    """The graph with its products' large float32 weights stored as int8 plus per-channel
    scales, and a report: how many weights, their bytes before and after, and which weights
    stayed float32 and why."""
    chosen, kept = _quantizable(graph)
    if not chosen:
        return graph, {"weights": 0, "bytes_before": 0, "bytes_after": 0, "kept_float": kept}
    writer = GraphWriter(graph.weights)
    remap: list[int] = []
    before = after = 0
    for node in graph.nodes:
        node = Node(node.op, tuple(remap[s] for s in node.srcs), node.shape, node.dtype, node.arg)
        spec = chosen.get(node.arg) if node.op is Op.CONSTANT else None
        if spec is None:
            remap.append(writer.add(node))
            continue
        weight = np.asarray(graph.weights[spec.key], np.float32)
        values, scales = quantize(weight, spec.summed_axes)
        before += weight.nbytes
        after += values.nbytes + scales.nbytes
        values_key, scales_key = f"{spec.key}:q8", f"{spec.key}:q8scale"
        writer.weights[values_key] = values
        writer.weights[scales_key] = scales
        stored = writer.add(Node(Op.CONSTANT, (), node.shape, "int8", values_key))
        widened = writer.add(Node(Op.CAST, (stored,), node.shape, "float32", None))
        scale = writer.add(Node(Op.CONSTANT, (), scales.shape, "float32", scales_key))
        spread = writer.add(Node(Op.VIEW, (scale,), node.shape, "float32", ("expand", node.shape)))
        remap.append(writer.add(Node(Op.MUL, (widened, spread), node.shape, "float32", None)))
    for spec in chosen.values():
        writer.weights.pop(spec.key, None)
    quantized = writer.finish(
        [remap[i] for i in graph.inputs], [(name, remap[i]) for name, i in graph.outputs], graph.size_limits
    )
    report = {
        "weights": len(chosen),
        "bytes_before": int(before),
        "bytes_after": int(after),
        "kept_float": kept,
    }
    return quantized, report


def quantize(weight: np.ndarray, summed_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales shaped like the weight with the summed axes kept as 1):
    symmetric per channel, a channel of zeros scaled by 1."""
    peak = np.max(np.abs(weight), axis=summed_axes, keepdims=True)
    scales = np.where(peak > 0, peak / INT8_MAX, 1.0).astype(np.float32)
    values = np.clip(np.rint(weight / scales), -INT8_MAX, INT8_MAX).astype(np.int8)
    return values, scales


def quantization_error(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Per float output, the largest absolute difference relative to the largest expected
    magnitude (or 1): the measure PRECISION_TOLERANCE bounds."""
    errors = {}
    for name, want in expected.items():
        if not np.issubdtype(want.dtype, np.floating):
            continue
        e = want.astype(np.float64)
        a = np.asarray(actual[name]).astype(np.float64)
        finite = np.isfinite(e) & np.isfinite(a)
        scale = max(float(np.max(np.abs(e[finite]), initial=0.0)), 1.0)
        errors[name] = float(np.max(np.abs(e[finite] - a[finite]), initial=0.0)) / scale
    return errors


def _quantizable(graph: Graph) -> tuple[dict[str, QuantizedWeight], dict[str, str]]:
    """The weights to quantize by key, and the large float32 weights kept float with why: those
    products read (scaled per output channel) or gathers read rows of (scaled per row)."""
    users = users_of(graph)
    summed: dict[str, set[tuple[int, ...]]] = {}
    read_by_product: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        if node.op is Op.GATHER and graph.nodes[node.srcs[0]].op is Op.CONSTANT:
            # a table's rows are gathered: a scale per row, which every element of the row shares
            table = graph.nodes[node.srcs[0]]
            summed.setdefault(table.arg, set()).add(tuple(a for a in range(len(table.shape)) if a != node.arg))
        if node.op is not Op.SUM_REDUCE:
            continue
        found = find_contraction(graph, i, users)
        if found is None or len(found.operands) != 2:
            continue
        product = graph.nodes[node.srcs[0]]
        for factor in product.srcs:
            traced = _weight_axes(graph, factor, node.arg)
            if traced is None:
                continue
            constant, axes, chain = traced
            summed.setdefault(graph.nodes[constant].arg, set()).add(axes)
            for j in chain:
                read_by_product[j] = read_by_product.get(j, 0) + 1
    chosen: dict[str, QuantizedWeight] = {}
    kept: dict[str, str] = {}
    for i, node in enumerate(graph.nodes):
        if node.op is not Op.CONSTANT or node.dtype != "float32" or not is_static(node.shape):
            continue
        if int(np.prod(node.shape, dtype=np.int64)) < MIN_QUANTIZED_ELEMENTS:
            continue
        axes = summed.get(node.arg)
        if axes is None:
            continue
        if len(axes) > 1:
            kept[node.arg] = "its readers need scales along different axes (products summing different axes, or a gather)"
            continue
        if _other_readers(graph, i, users, read_by_product):
            kept[node.arg] = "read by something other than a matrix product"
            continue
        if not np.all(np.isfinite(graph.weights[node.arg])):
            kept[node.arg] = "it holds values that are not finite (inf or NaN), which no scale represents"
            continue
        chosen[node.arg] = QuantizedWeight(node.arg, tuple(int(d) for d in node.shape), next(iter(axes)))
    return chosen, kept


def _weight_axes(graph: Graph, factor: int, reduced: tuple[int, ...]) -> tuple[int, tuple[int, ...], list[int]] | None:
    """(the constant, its axes the product sums over, the view nodes between) when a product's
    factor is a float32 constant seen through an expand, permutes and reshapes that only add or
    drop axes of size 1; None otherwise."""
    axes = list(range(len(graph.nodes[factor].shape)))
    # each axis of the current node: the product axis it is, or None (an added axis of size 1)
    origin: list[int | None] = list(axes)
    chain = [factor]
    current = factor
    while graph.nodes[current].op is Op.VIEW:
        node = graph.nodes[current]
        source = graph.nodes[node.srcs[0]]
        kind = node.arg[0]
        if kind == "expand":
            pass  # same axes, sizes broadcast
        elif kind == "permute":
            perm = node.arg[1]
            moved: list[int | None] = [None] * len(perm)
            for j, p in enumerate(perm):
                moved[p] = origin[j]
            origin = moved
        elif kind == "reshape":
            if [d for d in node.shape if d != 1] != [d for d in source.shape if d != 1]:
                return None
            kept_axes = [o for o, d in zip(origin, node.shape) if d != 1]
            sizes = iter(kept_axes)
            origin = [next(sizes) if d != 1 else None for d in source.shape]
        else:
            return None
        current = node.srcs[0]
        chain.append(current)
    node = graph.nodes[current]
    if node.op is not Op.CONSTANT or node.dtype != "float32":
        return None
    summed = tuple(j for j, o in enumerate(origin) if o is not None and o in reduced)
    if not summed or len(summed) == len(origin):
        return None
    return current, summed, chain[:-1]


def _other_readers(graph: Graph, constant: int, users: dict[int, list[int]], read_by_product: dict[int, int]) -> bool:
    """Whether the constant, or a view of it on the way to a product, has a reader that is not
    on such a path (or is an output)."""
    outputs = {i for _, i in graph.outputs}
    stack = [constant]
    while stack:
        i = stack.pop()
        if i in outputs:
            return True
        for user in users.get(i, []):
            node = graph.nodes[user]
            if node.op is Op.VIEW and user in read_by_product:
                stack.append(user)
            elif node.op is Op.GATHER and i == constant and node.srcs[0] == constant:
                continue
            elif not (node.op is Op.MUL and (i in read_by_product or i == constant) and _feeds_product(graph, user, users)):
                return True
    return False


def _feeds_product(graph: Graph, mul: int, users: dict[int, list[int]]) -> bool:
    readers = users.get(mul, [])
    return len(readers) == 1 and graph.nodes[readers[0]].op is Op.SUM_REDUCE


__all__ = ["INT8_MAX", "MIN_QUANTIZED_ELEMENTS", "QuantizedWeight", "quantization_error", "quantize", "quantize_weights"]
