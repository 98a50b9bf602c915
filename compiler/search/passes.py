"""Python passes around the e-graph: layout canonicalization, constant folding, pruning.

Each pass reads a graph in topological order and writes a new one through ``compiler.ir.GraphWriter``, which
hash-conses nodes, so a rewrite that makes two nodes identical leaves one. None recurses: graphs
of thousands of nodes are walked with loops.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Collection, Iterable

import numpy as np

from compiler.dtypes import numpy_dtype
from compiler.ir import Graph, GraphWriter, Node, Op, view_shape
from compiler.reference import eval_node
from compiler.search.rules import FOLD_SLACK_BYTES, LAYOUT_RULES, static_bytes
from compiler.shape import ShapeError, is_static

# ops whose operands may be swapped
COMMUTATIVE = frozenset({Op.ADD, Op.MUL})
# a layout rewrite is retried on its own result at most this many times (a chain collapses in 2)
_MAX_LAYOUT_STEPS = 16


def canonicalize_layout(graph: Graph, counts: Counter[str]) -> Graph:
    """Applies LAYOUT_RULES to every node until none matches; counts[rule name] += matches."""
    writer = GraphWriter(graph.weights)
    remap: list[int] = []
    for node in graph.nodes:
        node = Node(node.op, tuple(remap[s] for s in node.srcs), node.shape, node.dtype, node.arg)
        remap.append(_place_canonical(writer, node, counts))
    inputs = [remap[i] for i in graph.inputs]
    return writer.finish(inputs, [(name, remap[i]) for name, i in graph.outputs], graph.size_limits)


def _place_canonical(writer: GraphWriter, node: Node, counts: Counter[str]) -> int:
    for _ in range(_MAX_LAYOUT_STEPS):
        replacement = _first_layout_match(node, writer.nodes, counts)
        if replacement is None:
            break
        src, transform = replacement
        if transform is None:
            return src
        node = Node(Op.VIEW, (src,), node.shape, node.dtype, transform)
    return writer.add(node)


def _first_layout_match(
    node: Node, nodes: list[Node], counts: Counter[str]
) -> tuple[int, tuple | None] | None:
    for name, rule in LAYOUT_RULES:
        replacement = rule(node, nodes)
        if replacement is None:
            continue
        src, transform = replacement
        # a rule never changes a value's shape or dtype; refuse one that would
        if nodes[src].dtype != node.dtype:
            continue
        try:
            shape = nodes[src].shape if transform is None else view_shape(nodes[src].shape, transform)
        except ShapeError:
            continue
        if shape != node.shape:
            continue
        counts[name] += 1
        return replacement
    return None


def fold_constants(graph: Graph, counts: Counter[str], kept: Collection[str] = ()) -> Graph:
    """Evaluates nodes computed from weights only into new weights, once, with the reference
    interpreter's node evaluator, unless the result is larger than the weights it frees plus
    FOLD_SLACK_BYTES (a weight still read elsewhere is not freed: a transposed copy of a tied
    embedding would double it; nor is one named in `kept`, which the caller stores anyway). An
    iota of static length reads no weights: it folds when small."""
    readers = Counter(s for node in graph.nodes for s in set(node.srcs))
    readers.update(i for _, i in graph.outputs)
    writer = GraphWriter(graph.weights)
    remap: list[int] = []
    for i, node in enumerate(graph.nodes):
        node = Node(node.op, tuple(remap[s] for s in node.srcs), node.shape, node.dtype, node.arg)
        folded = _fold(node, graph.nodes[i].srcs, writer, readers, kept)
        if folded is not None:
            counts["fold_weights_only"] += 1
            for s in set(graph.nodes[i].srcs):
                readers[s] -= 1
            node = folded
        remap.append(writer.add(node))
    inputs = [remap[i] for i in graph.inputs]
    return writer.finish(inputs, [(name, remap[i]) for name, i in graph.outputs], graph.size_limits)


def _fold(
    node: Node, old_srcs: tuple[int, ...], writer: GraphWriter, readers: Counter[int], kept: Collection[str]
) -> Node | None:
    if node.op in (Op.INPUT, Op.CONSTANT) or not is_static(node.shape):
        return None
    srcs = [writer.nodes[s] for s in node.srcs]
    if any(s.op is not Op.CONSTANT for s in srcs):
        return None
    size = static_bytes(node.shape, node.dtype)
    freed = sum(
        writer.weights[writer.nodes[new].arg].nbytes
        for new, old in dict(zip(node.srcs, old_srcs)).items()
        if readers[old] == 1 and writer.nodes[new].arg not in kept
    )
    if size is None or size > freed + FOLD_SLACK_BYTES:
        return None
    try:
        value = eval_node(node, [writer.weights[s.arg] for s in srcs], Graph([], [], [], writer.weights), {})
        value = np.asarray(value).astype(numpy_dtype(node.dtype), copy=False)
        if not value.flags.c_contiguous:  # (not ascontiguousarray: it makes a 0-d array 1-d)
            value = value.copy()
    except (ArithmeticError, IndexError, ValueError, TypeError, KeyError):
        return None
    if value.shape != tuple(int(d) for d in node.shape):
        return None
    key = _folded_key(node, [s.arg for s in srcs])
    writer.weights.setdefault(key, value)
    return Node(Op.CONSTANT, (), node.shape, node.dtype, key)


def _folded_key(node: Node, src_keys: Iterable[str]) -> str:
    """A weight key derived from how the value is computed, so it is deterministic and cheap
    (the value itself is never hashed)."""
    text = json.dumps(
        [node.op.value, repr(node.arg), [str(d) for d in node.shape], node.dtype, list(src_keys)]
    )
    return "f" + hashlib.sha256(text.encode()).hexdigest()[:24]


def constant_valued(graph: Graph) -> list[bool]:
    """Per node: computed from weights only (a CONSTANT, or an op over such values)."""
    const: list[bool] = []
    for node in graph.nodes:
        const.append(node.op is Op.CONSTANT or (bool(node.srcs) and all(const[s] for s in node.srcs)))
    return const


def program_cost(graph: Graph) -> int:
    """The e-graph's cost model over a whole graph: compute 10, views and leaves 1."""
    return sum(1 if n.op in (Op.VIEW, Op.INPUT, Op.CONSTANT, Op.IOTA) else 10 for n in graph.nodes)


def check_graph(graph: Graph, like: Graph) -> None:
    """Raises ValueError unless graph is well formed and has like's signature."""
    for i, node in enumerate(graph.nodes):
        if any(s >= i for s in node.srcs):
            raise ValueError(f"node {i} reads a later node")
    if graph.input_specs() != like.input_specs():
        raise ValueError("inputs changed")
    if graph.output_specs() != like.output_specs():
        raise ValueError("outputs changed")
    for node in graph.nodes:
        if node.op is Op.CONSTANT and node.arg not in graph.weights:
            raise ValueError(f"missing weight {node.arg}")


__all__ = [
    "COMMUTATIVE",
    "canonicalize_layout",
    "check_graph",
    "constant_valued",
    "fold_constants",
    "program_cost",
]
