"""A kernel-IR program in the precision an upload asks for (its `precision` option): stored in a
narrower float than it computes in, or with its products on TF32 tensor cores.

`narrow_storage(program, "float16")` gives float32 weights and temps the narrow dtype; nothing else
changes. Expressions keep their float32 dtypes, so a renderer reads a narrow buffer into a float32
value, computes in float32 (sums and products accumulate there), and rounds once as it stores.
Inputs and outputs keep their dtypes: a caller sends and gets what the model declares, and the
bytes saved are the weights' and the intermediates', which are most of what a layer moves.
A runtime converts a weight to its buffer's dtype as it uploads it (CudaProgram), so the
artifact keeps the graph's float32 weights and no second copy.

A graph exported in float16 or bfloat16 is computed the same way: in float32 (computed_in_float32
before lowering), its inputs, outputs, weights and temps stored in its format.

A weight or temp stays float32 where it holds a finite value beyond the narrow format's range or
derives from one: an attention mask's float32 minimum (-3.4e38) would become -inf in float16, and
a fully masked row's softmax NaN, where the float32 model gives a uniform row; a causal mask
weight of -1e9 times zero would be NaN, not zero."""

from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np

from compiler.errors import UnsupportedModel
from compiler.ir import Graph
from compiler.kernels.ir import Apply, Const, Expr, GemmCall, Guarded, Load, LoopKernel, Program

# the roles whose float32 buffers a narrow precision stores narrow ("panel" buffers are never
# stored; inputs and outputs are the model's interface)
NARROWED_ROLES = ("weight", "temp")
# the largest finite value of each narrow float
NARROW_MAX = {"float16": float(np.finfo(np.float16).max), "bfloat16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)}
# ops whose result is bounded whatever their operands (exp2 of a huge negative is 0)
_BOUNDING_OPS = frozenset({"exp2", "sin", "less_than", "recip"})


def narrow_storage(program: Program, dtype: str) -> Program:
    """The program with its float32 weights and temps stored as `dtype` (float16 or bfloat16),
    except temps whose values may exceed its finite range (see out_of_range)."""
    if dtype not in NARROW_MAX:
        raise ValueError(f"not a narrow float: {dtype!r}")
    wide = out_of_range(program, NARROW_MAX[dtype])
    buffers = [
        replace(b, dtype=dtype) if b.dtype == "float32" and b.role in NARROWED_ROLES and b.id not in wide else b
        for b in program.buffers
    ]
    return replace(program, buffers=buffers, tensor_cores=dtype)


def narrow_values(graph: Graph) -> str | None:
    """The narrow float (float16, bfloat16) a graph computes in, if any (UnsupportedModel for both)."""
    found = {node.dtype for node in graph.nodes} & set(NARROW_MAX)
    if len(found) > 1:
        raise UnsupportedModel([f"a graph computing in both {' and '.join(sorted(found))}"])
    return next(iter(found), None)


def computed_in_float32(graph: Graph) -> Graph:
    """The graph with its float16 and bfloat16 values (weights and inputs included) in float32:
    what a GPU program computes, rounding to the narrow format only where it stores a value."""
    narrow = set(NARROW_MAX)
    nodes = [replace(node, dtype="float32") if node.dtype in narrow else node for node in graph.nodes]
    weights = {k: v.astype(np.float32) if v.dtype.name in narrow else v for k, v in graph.weights.items()}
    return Graph(nodes, graph.inputs, graph.outputs, weights, graph.size_limits)


def with_interface_dtypes(program: Program, graph: Graph) -> Program:
    """The program's inputs and outputs in the dtypes the graph declares (a narrow float's are
    read into float32 and rounded as stored, like its temps)."""
    declared = {name: dtype for name, _, dtype in graph.input_specs()}
    declared.update({name: graph.nodes[i].dtype for name, i in graph.outputs})
    buffers = [
        replace(b, dtype=declared[b.name]) if b.role in ("input", "output") and b.name in declared else b
        for b in program.buffers
    ]
    return replace(program, buffers=buffers)


def tf32_products(program: Program) -> Program:
    """The program with its float32 products on tensor cores in TF32: operands rounded to 10
    mantissa bits, sums in float32; everything else, storage included, stays float32."""
    return replace(program, tensor_cores="tf32")


def out_of_range(program: Program, limit: float) -> set[int]:
    """Buffers whose values may be finite and beyond +-limit: weights holding such values (a
    causal mask of -1e9), and buffers computed from a finite constant beyond it or from such a
    buffer, through ops that do not bound their result."""
    wide = {
        b.id for b in program.buffers
        if b.role == "weight" and b.dtype == "float32" and _beyond(program.weights.get(b.name), limit)
    }
    for kernel in program.kernels:
        if isinstance(kernel, LoopKernel):
            for let in kernel.lets:
                if _exceeds(let.value, wide, limit):
                    wide.add(let.buffer)
            if _exceeds(kernel.value, wide, limit):
                wide.add(kernel.out)
        elif isinstance(kernel, GemmCall):
            panels = kernel.b_panels is not None and _exceeds(kernel.b_panels.kernel.value, wide, limit)
            epilogue = kernel.epilogue is not None and any(_exceeds(v, wide, limit) for v in kernel.epilogue.values)
            if kernel.a in wide or kernel.b in wide or panels or epilogue:
                wide.add(kernel.c)
    return wide


def _beyond(array, limit: float) -> bool:
    """Whether an array holds a finite value beyond +-limit (in float16 it would be infinite)."""
    if array is None or np.asarray(array).dtype != np.float32:
        return False
    magnitude = np.abs(np.asarray(array))
    return bool(((magnitude > limit) & np.isfinite(magnitude)).any())


def _exceeds(expr: Expr, wide: set[int], limit: float) -> bool:
    if isinstance(expr, Load):
        return expr.buffer in wide
    if isinstance(expr, Const):
        value = float(expr.value)
        return math.isfinite(value) and abs(value) > limit
    if isinstance(expr, Guarded):
        return _exceeds(expr.value, wide, limit) or _exceeds(Const(expr.fill, expr.dtype), wide, limit)
    if isinstance(expr, Apply):
        if expr.op in _BOUNDING_OPS or (expr.op == "cast" and expr.dtype != "float32"):
            return False
        return any(_exceeds(a, wide, limit) for a in expr.args)
    return False


__all__ = [
    "NARROWED_ROLES", "NARROW_MAX", "computed_in_float32", "narrow_storage", "narrow_values", "out_of_range",
    "tf32_products", "with_interface_dtypes",
]
