"""CPU code generation by direct lowering: a flat list of NumPy kernels.

Most nodes become one kernel each, evaluated like the reference interpreter. A multiply whose
only consumer is a sum reduction becomes one einsum kernel over the un-broadcast operands, so
matmuls and convolutions run through BLAS instead of materializing the broadcast product.
Values are freed after their last use. This is the baseline the search compiler must beat.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.dtypes import numpy_dtype
from compiler.ir import Graph, Op
from compiler.reference import bind_symbols, eval_node

TARGET = "cpu"


def generate(graph: Graph) -> list[dict[str, Any]]:
    """Kernels in execution order; each names the node whose value it produces."""
    users: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for s in node.srcs:
            users.setdefault(s, []).append(i)
    kernels: dict[int, dict[str, Any]] = {}
    for i, node in enumerate(graph.nodes):
        if node.op is Op.SUM_REDUCE:
            fused = _einsum_kernel(graph, i, users)
            if fused is not None:
                kernels[i] = fused
                continue
        kernels[i] = {"kind": "node", "node": i, "deps": list(node.srcs)}
    needed: set[int] = {i for _, i in graph.outputs}
    for i in range(len(graph.nodes) - 1, -1, -1):
        if i in needed:
            needed.update(kernels[i]["deps"])
    return [kernels[i] for i in range(len(graph.nodes)) if i in needed]


def _einsum_kernel(graph: Graph, reduce_id: int, users: dict[int, list[int]]) -> dict | None:
    reduce = graph.nodes[reduce_id]
    product = graph.nodes[reduce.srcs[0]]
    if product.op is not Op.MUL or users.get(reduce.srcs[0]) != [reduce_id]:
        return None
    # BLAS dtypes only; the narrow formats are storage and never multiplied
    if product.dtype not in ("float16", "float32", "float64") or len(product.shape) > len(string.ascii_letters):
        return None
    letters = string.ascii_letters[: len(product.shape)]
    operands, subscripts, squeezes = [], [], []
    for src in product.srcs:
        node = graph.nodes[src]
        if node.op is Op.VIEW and node.arg[0] == "expand":
            base = node.srcs[0]
            base_shape = graph.nodes[base].shape
            # axes that were size 1 and got broadcast are dropped from this operand
            dropped = [a for a, (d, f) in enumerate(zip(base_shape, node.shape)) if d == 1 and f != 1]
        else:
            base, dropped = src, []
        operands.append(base)
        squeezes.append(dropped)
        subscripts.append("".join(c for a, c in enumerate(letters) if a not in dropped))
    kept = "".join(c for a, c in enumerate(letters) if a not in reduce.arg)
    return {
        "kind": "einsum",
        "node": reduce_id,
        "deps": operands,
        "squeeze": squeezes,
        "subscripts": ",".join(subscripts) + "->" + kept,
    }


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

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        graph = self.graph
        bindings = bind_symbols(graph, inputs)
        values: dict[int, np.ndarray] = {}
        for step, kernel in enumerate(self.kernels):
            i = kernel["node"]
            node = graph.nodes[i]
            if kernel["kind"] == "einsum":
                args = [
                    np.squeeze(values[d], axis=tuple(sq)) if sq else values[d]
                    for d, sq in zip(kernel["deps"], kernel["squeeze"])
                ]
                values[i] = np.einsum(kernel["subscripts"], *args, optimize=True).astype(
                    numpy_dtype(node.dtype), copy=False
                )
            elif node.op is Op.INPUT:
                values[i] = np.asarray(inputs[node.arg], dtype=numpy_dtype(node.dtype))
            else:
                values[i] = eval_node(node, [values[s] for s in node.srcs], graph, bindings)
            for dead in self._free_after[step]:
                values.pop(dead, None)
        return {name: np.asarray(values[i], order="C") for name, i in graph.outputs}
