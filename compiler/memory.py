"""How much memory a program needs for given symbol sizes, known before it runs.

Walking the kernels in order with each value freed after its last reader (as the executors do)
gives the live bytes at every step, as a polynomial in the symbols. The peak is their maximum:
at compile time only the steps that are largest at some probe of sizes are kept (a handful), and
at request time those are evaluated at the request's sizes. Views that move no data cost nothing;
everything else holds its whole output.

A compile's MemoryBudget says whether running the graph at given symbol sizes fits its memory
limit; the symbol-size helpers below spell the sizes a compile runs a graph at.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from compiler.dtypes import numpy_dtype
from compiler.errors import CompilerError
from compiler.ir import Graph, Op
from compiler.shape import Dim, SymDim, dim_add, dim_mul, dim_to_json, evaluate, numel, parse_dim, symbols_of

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


# ---- the compile's memory budget ----------------------------------------------------------------

# inputs are drawn as float64 and then narrowed: while one is drawn it needs about twice its
# float32 bytes more
_DRAW_OVERHEAD = 2


class MemoryBudget:
    """Whether the compile can run the graph at given symbol sizes within its memory limit (its
    process's address-space limit, which the compile sandbox sets; None: no limit): what the
    process holds now (the model's weights among it), the inputs at those sizes as they are
    drawn, and the peak of live values the program holds (peak_bytes, above). A size that
    would not fit is passed over before its inputs are made, and noted for the report: measuring
    at a full batch of a large model used to take the only compile slot for most of a minute
    before failing on the limit."""

    def __init__(self, graph: Graph, terms: Sequence[str], limit: int | None) -> None:
        self.graph = graph
        self.terms = terms
        self.limit = limit
        # the sizes passed over, and why: the report's measuring notes
        self.notes: list[str] = []

    def need(self, sizes: Mapping[str, int]) -> int | None:
        """Bytes the process would hold while running at `sizes` (symbol -> size, as
        sample_inputs takes them); None when the sizes do not bind every symbol of the terms."""
        bindings: dict[str, int] = {}
        drawn = 0
        for _, shape, dtype in self.graph.input_specs():
            concrete = [sample_size(self.graph, d, sizes) if isinstance(d, SymDim) else int(d) for d in shape]
            for declared, size in zip(shape, concrete):
                if isinstance(declared, SymDim) and (symbol := declared.as_symbol()) is not None:
                    bindings[symbol] = size
            drawn += math.prod(concrete) * numpy_dtype(dtype).itemsize
        try:
            values = peak_bytes(self.terms, bindings) if self.terms else 0
        except (ValueError, KeyError, ArithmeticError):  # (ShapeError is a ValueError)
            return None
        return _address_space_in_use() + values + _DRAW_OVERHEAD * drawn

    def fits(self, sizes: Mapping[str, int], label: str | None = None) -> bool:
        """Whether running at `sizes` fits; when not and a `label` is given, a note says so."""
        over = self._over(sizes)
        if over is not None and label is not None:
            self.notes.append(f"{label} not measured: {over}")
        return over is None

    def largest(self, symbol_sizes: Sequence[int], what: str) -> int | None:
        """The first of `symbol_sizes` (every symbol at it) that fits, or None; a note for each
        passed over."""
        for size in symbol_sizes:
            over = self._over(wanted_sizes(self.graph, size))
            if over is None:
                return size
            self.notes.append(f"{what} {size} passed over: {over}")
        return None

    def check_smallest(self) -> None:
        """CompilerError, at once, when even one run at the smallest sizes (every symbol 1) would
        pass the limit: it could be neither verified nor served."""
        if self.limit is None:
            return
        held = _address_space_in_use()
        need = self.need(wanted_sizes(self.graph, 1))
        if need is not None and need > self.limit:
            raise CompilerError(
                f"the model needs about {_gib(need - held)} of memory to run once at its smallest size "
                f"(every symbol 1), besides the {_gib(held)} the compiler holds with its weights: "
                f"more than the limit of {self.limit / 2**30:g} GiB"
            )

    def _over(self, sizes: Mapping[str, int]) -> str | None:
        """Why running at `sizes` does not fit, or None when it does (or nobody knows)."""
        need = None if self.limit is None else self.need(sizes)
        if need is None or need <= self.limit:
            return None
        return f"it needs about {_gib(need)}, over the compile's memory limit of {self.limit / 2**30:g} GiB"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _address_space_in_use() -> int:
    """This process's address space in bytes, what its limit (RLIMIT_AS) counts; 0 where /proc
    does not say (no such limit is set there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---- symbol sizes ---------------------------------------------------------------------------------


def wanted_sizes(graph: Graph, symbol_size: int, distinct: bool = False) -> dict[str, int]:
    """Each input symbol at `symbol_size`, or with `distinct` at symbol_size, symbol_size + 1, ..."""
    return {name: symbol_size + (k if distinct else 0) for k, name in enumerate(input_symbols(graph))}


def halvings(size: int) -> list[int]:
    """size, size // 2, ... down to 1."""
    return [size >> k for k in range(size.bit_length())]


def input_symbols(graph: Graph) -> list[str]:
    """The symbols the inputs' shapes name (those of compound dims too), sorted."""
    return sorted(
        {s for _, shape, _ in graph.input_specs() for d in shape if isinstance(d, SymDim) for s in d.symbols}
    )


def sample_size(graph: Graph, dim: SymDim, wanted: Mapping[str, int]) -> int:
    """The size `dim` takes when its symbol is wanted at a size: that one, within the model's limit."""
    symbol = dim.as_symbol()
    if symbol is None:  # a compound dim (past + seq) follows its symbols' sizes
        return evaluate(dim, {s: min(wanted[s], graph.size_limits.get(s, wanted[s])) for s in dim.symbols})
    return min(wanted[symbol], graph.size_limits.get(symbol, wanted[symbol]))


__all__ = [
    "MemoryBudget",
    "halvings",
    "input_symbols",
    "live_bytes_per_step",
    "memory_terms",
    "peak_bytes",
    "sample_size",
    "wanted_sizes",
]
