"""Verification: every compiled program is checked against the reference interpreter
(compiler/reference.py) on random inputs before it can be chosen.

    inputs, expected = verification_case(graph, budget)   # random inputs, the reference's outputs
    error = max_error(expected[name], actual[name])       # VerificationFailed past the tolerance

`verify` runs a code generator's program (the NumPy lowering) against the reference; native and
CUDA candidates are run on their Device (compiler/devices.py) and compared with max_error.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from compiler.codegen import CODEGENS
from compiler.dtypes import is_float, numpy_dtype
from compiler.errors import CompilerError
from compiler.ir import Graph, Op
from compiler.memory import MemoryBudget, halvings, sample_size, wanted_sizes
from compiler.reference import run_graph
from compiler.shape import SymDim
from compiler.targets import EXPORTED, PRECISION_TOLERANCE
from compiler.tuning import VERIFY_SYMBOL_SIZE


class VerificationFailed(CompilerError):
    """The generated program disagrees with the reference interpreter: a compiler bug."""


def verification_case(
    graph: Graph, budget: MemoryBudget | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random inputs and the reference's outputs for them. Each symbol has its own size, so a
    program that reads one symbol for another (batch for seq) disagrees; all share one size only
    when the model does not run with different ones, or when distinct sizes do not fit the
    `budget` (then the largest size up to VERIFY_SYMBOL_SIZE that fits)."""
    budget = budget or MemoryBudget(graph, [], None)
    if budget.fits(wanted_sizes(graph, VERIFY_SYMBOL_SIZE, distinct=True)):
        try:
            inputs = sample_inputs(graph, distinct=True)
            return inputs, run_graph(graph, inputs)
        except (ValueError, IndexError):  # (ShapeError is a ValueError)
            pass
    size = budget.largest(halvings(VERIFY_SYMBOL_SIZE), "the verification size") or 1
    inputs = sample_inputs(graph, symbol_size=size)
    try:
        return inputs, run_graph(graph, inputs)
    except IndexError:
        # integer inputs used as indices may be out of range at random; index 0 is always valid
        inputs = sample_inputs(graph, int_high=1, symbol_size=size)
        return inputs, run_graph(graph, inputs)


def sample_inputs(
    graph: Graph, seed: int = 0, int_high: int = 3, symbol_size: int = VERIFY_SYMBOL_SIZE, distinct: bool = False,
    sizes: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Random inputs for every signature input, with each symbol set to a small size: the same
    for all, or with `distinct` symbol_size, symbol_size + 1, ... in the order of their names, or
    as `sizes` gives (each within the model's size limit)."""
    rng = np.random.default_rng(seed)
    specs = graph.input_specs()
    wanted = {**wanted_sizes(graph, symbol_size, distinct), **(sizes or {})}
    inputs = {}
    for name, shape, dtype in specs:
        concrete = tuple(sample_size(graph, d, wanted) if isinstance(d, SymDim) else d for d in shape)
        if is_float(dtype):
            inputs[name] = rng.standard_normal(concrete).astype(numpy_dtype(dtype))
        elif dtype == "bool":
            inputs[name] = rng.random(concrete) < 0.5
        else:
            inputs[name] = rng.integers(0, int_high, concrete).astype(numpy_dtype(dtype))
    return inputs


def verify(
    graph: Graph, kernels: list, target: str, case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
) -> float:
    """Run generated code and the reference on the same random inputs; return the max error."""
    inputs, expected = case if case is not None else verification_case(graph)
    actual = CODEGENS[target].Executable(graph, kernels).run(inputs)
    try:
        return max((max_error(expected[k], actual[k]) for k in expected), default=0.0)
    except VerificationFailed:
        # an ill-conditioned model (a softmax over huge logits) turns float32 rounding into large
        # output differences; check the program's logic by running both sides in float64 instead
        wide, wide_inputs = _widened(graph), {k: _widen(v) for k, v in inputs.items()}
        oracle = run_graph(wide, wide_inputs)
        program = CODEGENS[target].Executable(wide, kernels).run(wide_inputs)
        return max((max_error(oracle[k], program[k]) for k in oracle), default=0.0)


def _widen(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float64) if array.dtype == np.float32 else array


def _widened(graph: Graph) -> Graph:
    """The graph computed in float64 wherever it computes in float32."""
    nodes = [
        replace(node, dtype="float64") if node.dtype == "float32" and node.op is not Op.INPUT else node
        for node in graph.nodes
    ]
    inputs = [replace(nodes[i], dtype="float64") if nodes[i].dtype == "float32" else nodes[i] for i in graph.inputs]
    for i, node in zip(graph.inputs, inputs):
        nodes[i] = node
    weights = {k: _widen(v) for k, v in graph.weights.items()}
    return Graph(nodes, graph.inputs, graph.outputs, weights, graph.size_limits)


def max_error(expected: np.ndarray, actual: np.ndarray, tolerance: float = PRECISION_TOLERANCE[EXPORTED]) -> float:
    """The largest absolute difference; VerificationFailed past `tolerance` times the largest
    expected magnitude (or 1), or where integers or non-finite values differ."""
    if expected.shape != actual.shape:
        raise VerificationFailed(f"shape {actual.shape} differs from reference {expected.shape}")
    if not is_float(expected.dtype.name):
        if not np.array_equal(expected, actual):
            raise VerificationFailed("integer outputs differ from the reference")
        return 0.0
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    finite = np.isfinite(e)
    infinite = np.isinf(e)
    if not np.array_equal(np.isnan(e), np.isnan(a)) or not np.array_equal(e[infinite], a[infinite]):
        raise VerificationFailed("non-finite outputs differ from the reference")
    err = float(np.max(np.abs(e[finite] - a[finite]), initial=0.0))
    scale = float(np.max(np.abs(e[finite]), initial=1.0))
    if err > tolerance * max(scale, 1.0):
        raise VerificationFailed(f"max error {err:.3g} against the reference")
    return err


__all__ = ["VerificationFailed", "max_error", "sample_inputs", "verification_case", "verify"]
