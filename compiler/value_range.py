"""Value ranges of integer IR nodes: what a frontend can prove about indices before run time.

Exported graphs index with tensors built from Range, iota, clamps and comparisons
(``mask[arange(B)[:, None], arange(S)]``). Knowing such an index lies in [0, size) lets the
frontend drop the negative-index wrap and accept it against a symbolic size. Bounds are Dims
(symbolic where the values depend on a batch or sequence size) or None when nothing is known.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from compiler.ir import GraphBuilder, Node, Op
from compiler.shape import Dim, bounds, dim_add, dim_max, dim_min, dim_mul, dim_sub, numel

# no tensor extent we could allocate reaches this, so no symbol's value does either
SYMBOL_CEILING = 2**31 - 1

Bound = Dim | None
Range = tuple[Bound, Bound]
_UNKNOWN: Range = (None, None)


class ValueRanges:
    """Bounds of every node of one builder, computed once in topological order."""

    def __init__(self, b: GraphBuilder) -> None:
        self.b = b
        self._ranges: list[Range] = []

    def of(self, node_id: int) -> Range:
        while len(self._ranges) <= node_id:
            node = self.b.nodes[len(self._ranges)]
            self._ranges.append(self._infer(node) if _is_integral(node.dtype) else _UNKNOWN)
        return self._ranges[node_id]

    def non_negative(self, node_id: int) -> bool:
        low = self.of(node_id)[0]
        return low is not None and bounds(low)[0] >= 0

    def below(self, node_id: int, size: Dim) -> bool:
        """Every value is < size."""
        high = self.of(node_id)[1]
        return high is not None and bounds(dim_sub(size, dim_add(high, 1)))[0] >= 0

    def _infer(self, node: Node) -> Range:
        rule = _RULES.get(node.op)
        return rule(self, node) if rule is not None else _UNKNOWN

    def _src(self, node: Node, k: int = 0) -> Range:
        return self._ranges[node.srcs[k]]


def _is_integral(dtype: str) -> bool:
    return dtype == "bool" or dtype.startswith(("int", "uint"))


def _both(fn: Callable[[Dim, Dim], Dim], x: Bound, y: Bound) -> Bound:
    return None if x is None or y is None else fn(x, y)


def _union(x: Range, y: Range) -> Range:
    return (_both(dim_min, x[0], y[0]), _both(dim_max, x[1], y[1]))


def _constant(ranges: ValueRanges, node: Node) -> Range:
    array = np.asarray(ranges.b.weights[node.arg])
    if array.size == 0:
        return _UNKNOWN
    return (int(array.min()), int(array.max()))


def _view(ranges: ValueRanges, node: Node) -> Range:
    source = ranges._src(node)
    if node.arg[0] == "pad":
        fill = int(node.arg[2])
        return _union(source, (fill, fill))
    return source


def _cast(ranges: ValueRanges, node: Node) -> Range:
    source_dtype = ranges.b.dtype(node.srcs[0])
    if node.dtype == "bool" or source_dtype == "bool":
        return (0, 1)
    if not _is_integral(source_dtype):
        return _UNKNOWN
    low, high = ranges._src(node)
    # a narrowing cast wraps around: the range holds only where every value fits the target
    info = np.iinfo(node.dtype)
    fits = (
        low is not None and high is not None
        and bounds(low)[0] >= info.min and bounds(high, _Ceiling())[1] <= info.max
    )
    return (low, high) if fits else _UNKNOWN


class _Ceiling(dict):
    """Every symbol's largest possible value, for bounds()."""

    def __contains__(self, symbol: object) -> bool:
        return True

    def __missing__(self, symbol: str) -> int:
        return SYMBOL_CEILING


def _add(ranges: ValueRanges, node: Node) -> Range:
    (a_low, a_high), (b_low, b_high) = ranges._src(node, 0), ranges._src(node, 1)
    return (_both(dim_add, a_low, b_low), _both(dim_add, a_high, b_high))


def _mul(ranges: ValueRanges, node: Node) -> Range:
    if not (ranges.non_negative(node.srcs[0]) and ranges.non_negative(node.srcs[1])):
        return _UNKNOWN
    (a_low, a_high), (b_low, b_high) = ranges._src(node, 0), ranges._src(node, 1)
    return (_both(dim_mul, a_low, b_low), _both(dim_mul, a_high, b_high))


def _mod(ranges: ValueRanges, node: Node) -> Range:
    divisor_low, divisor_high = ranges._src(node, 1)
    if not ranges.non_negative(node.srcs[0]) or divisor_high is None:
        return _UNKNOWN
    if divisor_low is None or bounds(divisor_low)[0] < 1:
        return _UNKNOWN
    return (0, dim_sub(divisor_high, 1))


def _sum(ranges: ValueRanges, node: Node) -> Range:
    if not ranges.non_negative(node.srcs[0]):
        return _UNKNOWN
    low, high = ranges._src(node)
    source_shape = ranges.b.shape(node.srcs[0])
    count = numel(source_shape[axis] for axis in node.arg)
    # a dim materialized as a sum over ones is exactly that dim
    return (_both(dim_mul, low, count), _both(dim_mul, high, count))


_RULES: dict[Op, Callable[[ValueRanges, Node], Range]] = {
    Op.CONSTANT: _constant,
    Op.IOTA: lambda ranges, node: (0, dim_sub(node.shape[0], 1)),
    Op.VIEW: _view,
    Op.CAST: _cast,
    Op.ADD: _add,
    Op.MUL: _mul,
    Op.MOD: _mod,
    Op.LESS_THAN: lambda ranges, node: (0, 1),
    Op.GATHER: lambda ranges, node: ranges._src(node, 0),
    Op.MAX_REDUCE: lambda ranges, node: ranges._src(node),
    Op.SUM_REDUCE: _sum,
}


__all__ = ["ValueRanges"]
