"""Contractions: a multiply whose only reader is a sum reduction, evaluated as one einsum.

Matmuls and convolutions reach the IR as a broadcast multiply followed by a sum. Evaluated node
by node, the product is materialized at its full broadcast size (7 GB for one VGG-19 layer);
as an einsum over the un-broadcast operands it runs through BLAS in the memory of its result.
The NumPy code generator and the reference interpreter both use this, so the one recognition
rule lives here.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from compiler.dtypes import numpy_dtype
from compiler.ir import Graph, Op

# BLAS dtypes only; the narrow formats are storage and never multiplied
_EINSUM_DTYPES = frozenset({"float16", "float32", "float64"})


@dataclass(frozen=True)
class Contraction:
    # the SUM_REDUCE node whose value this computes
    reduce: int
    # the un-broadcast operands of the product (an expand view's source, or the factor itself)
    operands: tuple[int, ...]
    # per operand, the axes that were size 1 and got broadcast: squeezed before the einsum
    squeezes: tuple[tuple[int, ...], ...]
    subscripts: str


def users_of(graph: Graph) -> dict[int, list[int]]:
    users: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for s in node.srcs:
            users.setdefault(s, []).append(i)
    return users


def find_contraction(graph: Graph, reduce_id: int, users: dict[int, list[int]]) -> Contraction | None:
    """The contraction a SUM_REDUCE node computes, or None when it is not one."""
    reduce = graph.nodes[reduce_id]
    if reduce.op is not Op.SUM_REDUCE:
        return None
    product = graph.nodes[reduce.srcs[0]]
    if product.op is not Op.MUL or users.get(reduce.srcs[0]) != [reduce_id]:
        return None
    if product.dtype not in _EINSUM_DTYPES or len(product.shape) > len(string.ascii_letters):
        return None
    letters = string.ascii_letters[: len(product.shape)]
    operands, subscripts, squeezes = [], [], []
    for src in product.srcs:
        node = graph.nodes[src]
        if node.op is Op.VIEW and node.arg[0] == "expand":
            base = node.srcs[0]
            base_shape = graph.nodes[base].shape
            dropped = tuple(a for a, (d, f) in enumerate(zip(base_shape, node.shape)) if d == 1 and f != 1)
        else:
            base, dropped = src, ()
        operands.append(base)
        squeezes.append(dropped)
        subscripts.append("".join(c for a, c in enumerate(letters) if a not in dropped))
    kept = "".join(c for a, c in enumerate(letters) if a not in reduce.arg)
    return Contraction(reduce_id, tuple(operands), tuple(squeezes), ",".join(subscripts) + "->" + kept)


def contract(subscripts: str, squeezes: Sequence[Sequence[int]], args: Sequence[np.ndarray], dtype: str) -> np.ndarray:
    operands = [np.squeeze(a, axis=tuple(sq)) if sq else a for a, sq in zip(args, squeezes)]
    return np.einsum(subscripts, *operands, optimize=True).astype(numpy_dtype(dtype), copy=False)


__all__ = ["Contraction", "contract", "find_contraction", "users_of"]
