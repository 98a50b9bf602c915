"""CPU code generation by direct lowering: a flat list of NumPy kernels.

Most nodes become one kernel each, evaluated like the reference interpreter. A multiply whose
only consumer is a sum reduction becomes one einsum kernel over the un-broadcast operands, so
matmuls and convolutions run through BLAS instead of materializing the broadcast product.
Values are freed after their last use. This is the baseline the search compiler must beat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.contraction import contract, find_contraction, users_of
from compiler.dtypes import numpy_dtype
from compiler.ir import Graph, Op
from compiler.reference import bind_symbols, eval_node

TARGET = "cpu"


def generate(graph: Graph) -> list[dict[str, Any]]:
    """Kernels in execution order; each names the node whose value it produces."""
    users = users_of(graph)
    kernels: dict[int, dict[str, Any]] = {}
    for i, node in enumerate(graph.nodes):
        found = find_contraction(graph, i, users)
        if found is not None:
            kernels[i] = {
                "kind": "einsum",
                "node": i,
                "deps": list(found.operands),
                "squeeze": [list(sq) for sq in found.squeezes],
                "subscripts": found.subscripts,
            }
            continue
        kernels[i] = {"kind": "node", "node": i, "deps": list(node.srcs)}
    needed: set[int] = {i for _, i in graph.outputs}
    for i in range(len(graph.nodes) - 1, -1, -1):
        if i in needed:
            needed.update(kernels[i]["deps"])
    return [kernels[i] for i in range(len(graph.nodes)) if i in needed]


@dataclass
class Executable:
    """A generated program bound to its graph and weights, ready to run on the CPU."""

    graph: Graph
    kernels: list[dict[str, Any]]

    def __post_init__(self) -> None:
        last_use: dict[int, int] = {}
        for step, kernel in enumerate(self.kernels):
            for dep in kernel["deps"]:
                last_use[dep] = step
        outputs = {i for _, i in self.graph.outputs}
        self._free_after: list[list[int]] = [[] for _ in self.kernels]
        for dep, step in last_use.items():
            if dep not in outputs:
                self._free_after[step].append(dep)

    def resident_bytes(self) -> int:
        """Memory held for the program's lifetime: the graph's weights."""
        return sum(w.nbytes for w in self.graph.weights.values())

    def run(self, inputs: Mapping[str, np.ndarray], busy: bool = False) -> dict[str, np.ndarray]:
        """The outputs (`busy` is for programs with threads of their own: NumPy's run on one)."""
        graph = self.graph
        bindings = bind_symbols(graph, inputs)
        values: dict[int, np.ndarray] = {}
        for step, kernel in enumerate(self.kernels):
            i = kernel["node"]
            node = graph.nodes[i]
            if kernel["kind"] == "einsum":
                args = [values[d] for d in kernel["deps"]]
                values[i] = contract(kernel["subscripts"], kernel["squeeze"], args, node.dtype)
            elif node.op is Op.INPUT:
                values[i] = np.asarray(inputs[node.arg], dtype=numpy_dtype(node.dtype))
            else:
                values[i] = eval_node(node, [values[s] for s in node.srcs], graph, bindings)
            for dead in self._free_after[step]:
                values.pop(dead, None)
        return {name: np.asarray(values[i], order="C") for name, i in graph.outputs}
