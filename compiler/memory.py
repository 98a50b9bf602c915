"""How much memory a program needs for given symbol sizes, known before it runs.

Walking the kernels in order with each value freed after its last reader (as the executors do)
gives the live bytes at every step, as a polynomial in the symbols. The peak is their maximum:
at compile time only the steps that are largest at some probe of sizes are kept (a handful), and
at request time those are evaluated at the request's sizes. Views that move no data cost nothing;
everything else holds its whole output.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from compiler.dtypes import numpy_dtype
from compiler.ir import Graph, Op
from compiler.shape import Dim, dim_add, dim_mul, dim_to_json, evaluate, numel, parse_dim, symbols_of

# views numpy serves without copying
_FREE_VIEWS = frozenset({"reshape", "permute", "expand", "slice", "window"})
# sizes each symbol is probed at when choosing which steps to keep
_PROBES = (1, 16, 256, 4096, 65536)


def live_bytes_per_step(graph: Graph, kernels: Sequence[Mapping[str, Any]]) -> list[Dim]:
    held: dict[int, Dim] = {}
    last_use = {dep: step for step, kernel in enumerate(kernels) for dep in kernel["deps"]}
    outputs = {i for _, i in graph.outputs}
    totals: list[Dim] = []
    for step, kernel in enumerate(kernels):
        node = graph.nodes[kernel["node"]]
        free_view = node.op is Op.VIEW and node.arg[0] in _FREE_VIEWS
        if node.op is not Op.CONSTANT and not free_view:
            held[kernel["node"]] = dim_mul(numel(node.shape), numpy_dtype(node.dtype).itemsize)
        total: Dim = 0
        for size in held.values():
            total = dim_add(total, size)
        totals.append(total)
        for dep in kernel["deps"]:
            if last_use.get(dep) == step and dep not in outputs:
                held.pop(dep, None)
    return totals


def memory_terms(graph: Graph, kernels: Sequence[Mapping[str, Any]]) -> list[str]:
    """The step totals that are the peak at some probe of symbol sizes, as dim strings; the
    peak for given sizes is the largest of them (peak_bytes)."""
    totals = list(dict.fromkeys(live_bytes_per_step(graph, kernels)))
    if not totals:
        return ["0"]
    names = sorted(symbols_of(totals))
    keep: dict[int, None] = {}
    for sizes in itertools.product(_PROBES, repeat=len(names)):
        bindings = dict(zip(names, sizes))
        best = max(range(len(totals)), key=lambda i: evaluate(totals[i], bindings))
        keep[best] = None
    return [str(dim_to_json(totals[i])) for i in keep]


def peak_bytes(terms: Sequence[str], bindings: Mapping[str, int]) -> int:
    return max(evaluate(parse_dim(term), bindings) for term in terms)


__all__ = ["live_bytes_per_step", "memory_terms", "peak_bytes"]
