"""The compile pipeline, top to bottom: parse, lower, generate for the target, verify."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from compiler.artifact import Artifact, Signature
from compiler.codegen import numpy_cpu
from compiler.dtypes import is_float, numpy_dtype
from compiler.errors import CompilerError, UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.ir import Graph, Op
from compiler.memory import memory_terms
from compiler.reference import run_graph
from compiler.shape import SymDim

# target name -> code generator module (generate(graph) -> kernels, Executable)
CODEGENS = {numpy_cpu.TARGET: numpy_cpu}
# part of every artifact key: bump it when compiled programs or signatures change meaning
COMPILER_VERSION = "0.2.0"
VERIFY_SYMBOL_SIZE = 3


class VerificationFailed(CompilerError):
    """The generated program disagrees with the reference interpreter: a compiler bug."""


def compile_onnx(data: bytes, target: str = "cpu") -> Artifact:
    return compile_graph(load_graph(data), target)


def compile_graph(graph: Graph, target: str = "cpu") -> Artifact:
    if target not in CODEGENS:
        raise UnsupportedModel([f"target {target!r} (known: {', '.join(sorted(CODEGENS))})"])
    started = time.perf_counter()
    kernels = CODEGENS[target].generate(graph)
    generated = time.perf_counter()
    max_error = verify(graph, kernels, target)
    report = {
        "compiler_version": COMPILER_VERSION,
        "strategy": "direct lowering",
        "ir_nodes": len(graph.nodes),
        "kernels": len(kernels),
        "fused_contractions": sum(k["kind"] == "einsum" for k in kernels),
        "weights_bytes": int(sum(w.nbytes for w in graph.weights.values())),
        "codegen_seconds": round(generated - started, 6),
        "verify_seconds": round(time.perf_counter() - generated, 6),
        "verify_max_abs_error": max_error,
    }
    signature = Signature.of(graph, memory_terms(graph, kernels))
    return Artifact(target, graph.content_hash(), signature, graph, kernels, report)


def sample_inputs(graph: Graph, seed: int = 0, int_high: int = 3) -> dict[str, np.ndarray]:
    """Random inputs for every signature input, with each symbol set to a small size."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for name, shape, dtype in graph.input_specs():
        concrete = tuple(VERIFY_SYMBOL_SIZE if isinstance(d, SymDim) else d for d in shape)
        if is_float(dtype):
            inputs[name] = rng.standard_normal(concrete).astype(numpy_dtype(dtype))
        elif dtype == "bool":
            inputs[name] = rng.random(concrete) < 0.5
        else:
            inputs[name] = rng.integers(0, int_high, concrete).astype(numpy_dtype(dtype))
    return inputs


def verify(graph: Graph, kernels: list, target: str) -> float:
    """Run generated code and the reference on the same random inputs; return the max error."""
    inputs = sample_inputs(graph)
    try:
        expected = run_graph(graph, inputs)
    except IndexError:
        # integer inputs used as indices may be out of range at random; index 0 is always valid
        inputs = sample_inputs(graph, int_high=1)
        expected = run_graph(graph, inputs)
    actual = CODEGENS[target].Executable(graph, kernels).run(inputs)
    try:
        return max((_max_error(expected[k], actual[k]) for k in expected), default=0.0)
    except VerificationFailed:
        # an ill-conditioned model (a softmax over huge logits) turns float32 rounding into large
        # output differences; check the program's logic by running both sides in float64 instead
        wide, wide_inputs = _widened(graph), {k: _widen(v) for k, v in inputs.items()}
        oracle = run_graph(wide, wide_inputs)
        program = CODEGENS[target].Executable(wide, kernels).run(wide_inputs)
        return max((_max_error(oracle[k], program[k]) for k in oracle), default=0.0)


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


def _max_error(expected: np.ndarray, actual: np.ndarray) -> float:
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
    if err > 1e-3 * max(scale, 1.0):
        raise VerificationFailed(f"max error {err:.3g} against the reference")
    return err


def executable(artifact: Artifact):
    return CODEGENS[artifact.target].Executable(artifact.graph, artifact.kernels)

