"""The compile pipeline, top to bottom: parse, lower, generate for the target, verify."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from compiler.artifact import Artifact, Signature
from compiler.backends import native_cpu
from compiler.codegen import numpy_cpu
from compiler.dtypes import is_float, numpy_dtype
from compiler.errors import CompilerError, UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.ir import Graph, Op
from compiler.kernels.ir import GemmCall, LoopKernel
from compiler.kernels.lower import NotNative, lower
from compiler.memory import memory_terms
from compiler.reference import bind_symbols, run_graph
from compiler.render.c import render
from compiler.shape import ShapeError, SymDim, evaluate

# target name -> code generator module (generate(graph) -> kernels, Executable)
CODEGENS = {numpy_cpu.TARGET: numpy_cpu}
# part of every artifact key: bump it when compiled programs or signatures change meaning
COMPILER_VERSION = "0.3.0"
VERIFY_SYMBOL_SIZE = 3
# the programs a cpu compile builds, verifies and times: generated C with BLAS calls, generated C
# with loop nests only, and the NumPy lowering
CANDIDATES = ("native-blas", "native-loops", "numpy")
# candidates are timed with every symbol at this size, a few runs each within the budget
MEASURE_SYMBOL_SIZE = 8
MEASURE_REPEATS = 7
MEASURE_BUDGET_S = 1.0


class VerificationFailed(CompilerError):
    """The generated program disagrees with the reference interpreter: a compiler bug."""


def compile_onnx(data: bytes, target: str = "cpu", candidates: Sequence[str] | None = None) -> Artifact:
    return compile_graph(load_graph(data), target, candidates)


# a loop-nest candidate doing more multiply-adds than this at the measuring size is not timed:
# it would lose to the library call by orders of magnitude and take seconds to find out
MAX_LOOP_FLOPS = 5e7


def compile_graph(graph: Graph, target: str = "cpu", candidates: Sequence[str] | None = None) -> Artifact:
    """Candidates for the target, each verified against the reference and timed; the fastest
    correct one is kept. A candidate that cannot be built or disagrees is rejected, not the
    compile; the NumPy lowering needs nothing but NumPy and is always a candidate."""
    if target not in CODEGENS:
        raise UnsupportedModel([f"target {target!r} (known: {', '.join(sorted(CODEGENS))})"])
    started = time.perf_counter()
    numpy_kernels = CODEGENS[target].generate(graph)
    verify_inputs, expected = verification_case(graph)
    # integer inputs all 0: always a valid index, whatever the indexed axis (timing does not care)
    measure_inputs = sample_inputs(graph, seed=1, int_high=1, symbol_size=MEASURE_SYMBOL_SIZE)
    try:
        run_graph(graph, measure_inputs) if graph.size_limits else None
    except (ShapeError, IndexError):
        measure_inputs = verify_inputs  # sizes the model does not allow together: time the small case
    wanted = CANDIDATES if candidates is None else tuple(candidates)
    candidates: list[_Candidate] = []
    rejected: dict[str, str] = {}
    if target == "cpu" and any(name.startswith("native") for name in wanted):
        candidates, rejected = _native_candidates(graph, wanted, verify_inputs, expected, measure_inputs)
    if "numpy" in wanted or not candidates:
        numpy_program = CODEGENS[target].Executable(graph, numpy_kernels)
        max_error = verify(graph, numpy_kernels, target, (verify_inputs, expected))
        numpy_ms = _median_ms(numpy_program.run, measure_inputs) if candidates else 0.0
        stats = {"kernels": len(numpy_kernels)}
        candidates.append(_Candidate("numpy", numpy_kernels, {}, {}, max_error, numpy_ms, stats))
    best = min(candidates, key=lambda c: c.ms)
    program_weights = {k: v for k, v in best.weights.items() if k not in graph.weights}
    report = {
        "compiler_version": COMPILER_VERSION,
        "strategy": "measured candidates",
        "chosen": best.name,
        "candidates": [
            {"name": c.name, "median_ms": round(c.ms, 4), "max_abs_error": c.max_error, **c.stats} for c in candidates
        ],
        "rejected": rejected,
        "measured_at_symbol_size": MEASURE_SYMBOL_SIZE,
        "ir_nodes": len(graph.nodes),
        "kernels": best.stats.get("kernels", len(numpy_kernels)),
        "fused_contractions": sum(k["kind"] == "einsum" for k in numpy_kernels),
        "weights_bytes": int(sum(w.nbytes for w in [*graph.weights.values(), *program_weights.values()])),
        "seconds": round(time.perf_counter() - started, 4),
        "verify_max_abs_error": best.max_error,
    }
    signature = Signature.of(graph, memory_terms(graph, numpy_kernels))
    return Artifact(
        target, graph.content_hash(), signature, graph, best.kernels, report, best.binaries, program_weights
    )


@dataclass
class _Candidate:
    name: str
    kernels: list[dict[str, Any]]
    binaries: dict[str, bytes]
    weights: dict[str, np.ndarray]
    max_error: float
    ms: float
    stats: dict[str, Any] = field(default_factory=dict)


def _native_candidates(
    graph: Graph,
    wanted: Sequence[str],
    inputs: dict[str, np.ndarray],
    expected: dict[str, np.ndarray],
    measure_inputs: dict[str, np.ndarray],
) -> tuple[list[_Candidate], dict[str, str]]:
    """Generated C with contractions as BLAS calls, and (where there are contractions) with
    every kernel a generated loop nest: the two whole-program choices measured today."""
    found, rejected = [], {}
    for name, use_gemm in (("native-blas", True), ("native-loops", False)):
        if name not in wanted:
            continue
        began = time.perf_counter()
        try:
            program = lower(graph, use_gemm=use_gemm)
        except NotNative as exc:
            rejected["native"] = f"not expressible natively: {exc}"
            break
        gemms = sum(isinstance(k, GemmCall) for k in program.kernels)
        if not use_gemm and "native-blas" in wanted and not any(c.stats["gemm_calls"] for c in found):
            break  # no contraction: the loop-only program is the one already built
        if not use_gemm and len(wanted) > 1 and _loop_flops(program, measure_inputs, graph) > MAX_LOOP_FLOPS:
            rejected[name] = "not measured: its loop nests do far more work than the library calls"
            continue
        source = render(program)
        try:
            library = native_cpu.build(source)
        except CompilerError as exc:
            rejected[name] = str(exc)
            continue
        built = time.perf_counter()
        layout = native_cpu.describe(program, graph.size_limits)
        runner = native_cpu.NativeProgram(layout, program.weights, library)
        try:
            max_error = max((_max_error(expected[k], v) for k, v in runner.run(inputs).items()), default=0.0)
        except VerificationFailed as exc:
            rejected[name] = f"disagrees with the reference: {exc}"
            continue
        kernel = {
            "kind": "native",
            "layout": layout,
            "source": source,
            "fingerprint": native_cpu.cpu_fingerprint(),
        }
        stats = {
            "kernels": len(program.kernels),
            "gemm_calls": gemms,
            "build_seconds": round(built - began, 4),
        }
        ms = _median_ms(runner.run, measure_inputs)
        found.append(_Candidate(name, [kernel], {"program.so": library}, program.weights, max_error, ms, stats))
    return found, rejected


def _loop_flops(program: Any, inputs: dict[str, np.ndarray], graph: Graph) -> float:
    """Multiply-adds the loop nests do at the measuring size (reductions count their extent)."""
    bindings = bind_symbols(graph, inputs)
    total = 0.0
    for kernel in program.kernels:
        if isinstance(kernel, LoopKernel):
            work = float(np.prod([evaluate(d, bindings) for d in kernel.shape]))
            if kernel.reduce is not None:
                work *= float(np.prod([evaluate(d, bindings) for d in kernel.reduce[1]]))
            total += work
    return total


def _median_ms(run: Callable[[dict[str, np.ndarray]], Any], inputs: dict[str, np.ndarray]) -> float:
    """Median of a few timed runs after one warm-up, within MEASURE_BUDGET_S."""
    run(inputs)
    times: list[float] = []
    deadline = time.perf_counter() + MEASURE_BUDGET_S
    while len(times) < MEASURE_REPEATS and (len(times) < 3 or time.perf_counter() < deadline):
        began = time.perf_counter()
        run(inputs)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def verification_case(graph: Graph) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random inputs and the reference's outputs for them."""
    inputs = sample_inputs(graph)
    try:
        return inputs, run_graph(graph, inputs)
    except IndexError:
        # integer inputs used as indices may be out of range at random; index 0 is always valid
        inputs = sample_inputs(graph, int_high=1)
        return inputs, run_graph(graph, inputs)


def sample_inputs(
    graph: Graph, seed: int = 0, int_high: int = 3, symbol_size: int = VERIFY_SYMBOL_SIZE
) -> dict[str, np.ndarray]:
    """Random inputs for every signature input, with each symbol set to a small size."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for name, shape, dtype in graph.input_specs():
        concrete = tuple(
            min(symbol_size, graph.size_limits.get(d.as_symbol() or "", symbol_size)) if isinstance(d, SymDim) else d
            for d in shape
        )
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
    if artifact.kernels and artifact.kernels[0].get("kind") == "native":
        return native_cpu.load(artifact.kernels[0], artifact.all_weights(), artifact.binaries.get("program.so"))
    return CODEGENS[artifact.target].Executable(artifact.graph, artifact.kernels)

