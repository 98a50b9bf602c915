"""The compile pipeline, a list of named stages over one IR per level:

    parse -> reference -> search (the e-graph) -> kernel IR -> render -> build -> verify
          -> search (extraction by measurement) -> artifact

    parse       compiler/frontends/onnx.py        ONNX to the primitive-op graph
    reference   compiler/verify.py                random inputs and the NumPy oracle's outputs
    search      compiler/search/extract.py        the e-graph's cheaper equivalent graph
    kernel IR   compiler/kernels/                 lowered, fused, in the compile's precision
    render      compiler/render/                  C or CUDA C, printed from the kernel IR
    build       compiler/devices.py               the C compiler, or NVRTC
    verify      compiler/candidates.py            each candidate run on its Device, checked
    measure     compiler/search/extract.py        candidates timed in turns, the fastest kept
                compiler/search/schedule.py       each kernel's schedule: the schedule e-graph's
                compiler/search/cuda_schedules.py alternatives, measured kernel by kernel on the GPU
    artifact    compiler/artifact.py              the parsed graph, the chosen program, a report

A cpu compile builds several whole-program candidates (generated C with BLAS calls or loop nests,
and the NumPy lowering) and keeps the fastest correct one; a GPU compile builds one CUDA program
whose kernels' schedules, on a GPU of the target's type, are chosen one by one by measurement. Every candidate is checked against the
reference run on the graph as parsed, so a wrong rewrite is caught; when no candidate of the
optimized graph is correct, the parsed graph's are built instead. The artifact keeps the parsed
graph (its signature, its hash, the NumPy program's nodes) and the chosen program's own constants
beside its weights. A caller may follow a compile as it goes through a `progress` callback (see
compiler/progress.py). The tuning constants are in compiler/tuning.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from compiler.artifact import Artifact, Signature
from compiler.candidates import build_native, cuda_program, numpy_candidate, verify_native
from compiler.codegen import CODEGENS, numpy_cpu
from compiler.devices import CpuDevice, cuda_device
from compiler.errors import UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.ir import Graph
from compiler.kernels.attention import attention_count
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import Program
from compiler.kernels.lower import NotNative, lower
from compiler.kernels.precision import NARROWED_ROLES, computed_in_float32, narrow_values
from compiler.memory import MemoryBudget, memory_terms
from compiler.progress import PHASES, Progress, Tracker
from compiler.quantize import MIN_QUANTIZED_ELEMENTS, quantization_error, quantize_weights
from compiler.reference import run_graph
from compiler.render.cuda import scheduled
from compiler.runnable import executable
from compiler.search.cpu_schedules import NAME as NATIVE_SEARCHED
from compiler.search.cpu_schedules import search_native
from compiler.search.cuda_schedules import product_schedules, search_cuda_schedule
from compiler.search.extract import candidate_report, choose, measure_candidates, measure_cases, search_graph
from compiler.search.schedule import KernelCache
from compiler.targets import (
    EXPORTED,
    GPU_TYPES,
    INT8,
    INT8_TOLERANCE,
    KNOWN_TARGETS,
    PRECISION_TOLERANCE,
    TF32,
    check_precision,
    is_gpu,
)
from compiler.tuning import CANDIDATES, KNOWN_CANDIDATES, SCHEDULE_SEARCH_SECONDS, SEARCH
from compiler.verify import VerificationFailed, sample_inputs, verification_case, verify

# part of every artifact key: bump it when compiled programs or signatures change meaning
COMPILER_VERSION = "0.8.15"


def compile_onnx(
    data: bytes,
    target: str = "cpu",
    candidates: Sequence[str] | None = None,
    search: bool | None = None,
    progress: Progress | None = None,
    precision: str = EXPORTED,
    memory_bytes: int | None = None,
    kernel_cache: KernelCache | None = None,
    search_seconds: float | None = None,
    dims: Mapping[str, str] | None = None,
) -> Artifact:
    """`dims`: input symbols that stand for expressions of others (onnx_to_graph)."""
    check_precision(target, precision)
    Tracker(progress, _wanted(candidates)).phase("parse")
    return compile_graph(
        load_graph(data, dims),
        target,
        candidates,
        search,
        progress,
        precision,
        memory_bytes,
        kernel_cache,
        search_seconds,
    )


def compile_graph(
    graph: Graph,
    target: str = "cpu",
    candidates: Sequence[str] | None = None,
    search: bool | None = None,
    progress: Progress | None = None,
    precision: str = EXPORTED,
    memory_bytes: int | None = None,
    kernel_cache: KernelCache | None = None,
    search_seconds: float | None = None,
) -> Artifact:
    """Candidates for the target, each verified against the reference and timed; the fastest
    correct one is kept. A candidate that cannot be built, disagrees, crashes or hangs is
    rejected, not the compile; the NumPy lowering needs nothing but NumPy and is always a
    candidate. `search` turns the search on or off (None: SEARCH); `progress` is told each
    phase as it begins (see Progress); `precision` is one of compiler.targets.PRECISIONS that the
    target offers (ValueError otherwise). `memory_bytes` is the compile's memory limit (None:
    none): a size whose run would pass it is not measured, and a model that passes it at its
    smallest size fails at once (MemoryBudget). `kernel_cache` keeps the schedule search's
    measured winners by kernel and device (None: every kernel measured); `search_seconds` bounds
    its measuring after every kernel's first alternative (None: SCHEDULE_SEARCH_SECONDS)."""
    seconds = SCHEDULE_SEARCH_SECONDS if search_seconds is None else search_seconds
    check_precision(target, precision)
    if precision == INT8:
        quantized, quantization = quantized_graph(graph)
        artifact = compile_graph(
            quantized, target, candidates, search, progress, EXPORTED, memory_bytes, kernel_cache, search_seconds
        )
        artifact.report["precision"] = quantization
        return artifact
    searching = SEARCH if search is None else search
    if is_gpu(target):
        return _compile_for_cuda(
            graph,
            target,
            searching,
            Tracker(progress, ("cuda",)),
            progress,
            precision,
            memory_bytes,
            kernel_cache,
            seconds,
        )
    if target not in CODEGENS:
        raise UnsupportedModel([f"target {target!r} (known: {', '.join(KNOWN_TARGETS)})"])
    wanted = _wanted(candidates)
    unknown = sorted(set(wanted) - set(KNOWN_CANDIDATES))
    if unknown:
        raise ValueError(f"unknown compile candidates {unknown}; known: {list(KNOWN_CANDIDATES)}")
    return _compile_for_cpu(
        graph, target, wanted, searching, Tracker(progress, wanted), memory_bytes, kernel_cache, seconds
    )


def quantized_graph(graph: Graph) -> tuple[Graph, dict[str, Any]]:
    """The graph with weight-only int8 products (compiler.quantize) and the precision report: its
    error against the float graph on the verification inputs, refused (VerificationFailed) past
    INT8_TOLERANCE; the compiled program is then verified against the quantized graph."""
    quantized, report = quantize_weights(graph)
    if not report["weights"]:
        why = (
            f"precision {INT8!r}: no weight to quantize (it takes float32 matrix-product weights of at least "
            f"{MIN_QUANTIZED_ELEMENTS} elements); use precision {EXPORTED!r}"
        )
        raise UnsupportedModel([why])
    inputs, expected = verification_case(graph)
    errors = quantization_error(expected, run_graph(quantized, inputs))
    worst = max(errors.values(), default=0.0)
    if worst > INT8_TOLERANCE:
        raise VerificationFailed(
            f"int8 weights change the outputs by {worst:.3g} of their largest magnitude, more than the "
            f"{INT8_TOLERANCE} allowed; compile with precision {EXPORTED!r}"
        )
    return quantized, {
        "chosen": INT8,
        "tolerance": INT8_TOLERANCE,
        "error_vs_float": round(worst, 6),
        "errors_vs_float": {name: round(e, 6) for name, e in errors.items()},
        "quantized_weights": report["weights"],
        "weight_bytes_before": report["bytes_before"],
        "weight_bytes_after": report["bytes_after"],
        "kept_float": report["kept_float"],
        "products": "int8 weights with per-channel float32 scales, widened inside the product kernels",
    }


def _wanted(candidates: Sequence[str] | None) -> tuple[str, ...]:
    return CANDIDATES if candidates is None else tuple(candidates)


def _compile_for_cpu(
    graph: Graph,
    target: str,
    wanted: Sequence[str],
    searching: bool,
    tracker: Tracker,
    memory_bytes: int | None,
    kernel_cache: KernelCache | None = None,
    search_seconds: float = SCHEDULE_SEARCH_SECONDS,
) -> Artifact:
    """The stages for the CPU: the NumPy lowering (which also sizes the memory budget), then for
    the generated C the search, lowering, rendering and building of each candidate, verified and
    timed on the CpuDevice (a helper process); the fastest correct candidate is kept."""
    started = time.perf_counter()
    native = target == "cpu" and any(name.startswith("native") for name in wanted)
    tracker.phase("lower", "numpy")
    numpy_kernels = CODEGENS[target].generate(graph)
    terms = memory_terms(graph, numpy_kernels)
    budget = MemoryBudget(graph, terms, memory_bytes)
    budget.check_smallest()
    # reference
    tracker.phase("reference")
    case = verification_case(graph, budget)
    # the sizes candidates are timed at: also where the searched program is the one asked for, whose
    # schedule search measures at them and may add a form of it (attention fused) to race
    cases = measure_cases(graph, case[0], budget) if len(wanted) > 1 or NATIVE_SEARCHED in wanted else []
    found, rejected, measuring = [], {}, {}
    search_report: dict[str, Any] = {"skipped": "no native candidate"}
    if "numpy" in wanted or not native:
        tracker.phase("verify", "numpy")
        found.append(numpy_candidate(graph, numpy_kernels, target, *case))
    if native:
        # search (the e-graph), then kernel IR -> render -> build
        if searching:
            tracker.phase("search")
        program_graph, search_report = search_graph(graph, searching)
        device = CpuDevice()
        loop_inputs = cases[0][1] if cases else case[0]
        built, rejected = build_native(program_graph, wanted, loop_inputs, device, tracker)
        with device.session():
            # verify; then the products' schedules searched (native-searched), on the searched graph
            natives = verify_native(device, built, case, rejected, tracker)
            natives = _with_searched(
                natives,
                program_graph,
                graph,
                case,
                cases,
                device,
                tracker,
                (kernel_cache, search_seconds),
                wanted,
                rejected,
                search_report,
            )
            if not natives and program_graph is not graph:
                search_report["used"] = "parsed graph"
                search_report["why"] = "no candidate of the optimized graph passed: " + "; ".join(
                    f"{name}: {why}" for name, why in rejected.items()
                )
                built, rejected = build_native(graph, wanted, loop_inputs, device, tracker)
                natives = verify_native(device, built, case, rejected, tracker)
                natives = _with_searched(
                    natives,
                    graph,
                    graph,
                    case,
                    cases,
                    device,
                    tracker,
                    (kernel_cache, search_seconds),
                    wanted,
                    rejected,
                    search_report,
                )
            found = natives + found
            # search (extraction by measurement): the candidates raced whole
            if len(found) > 1 and cases:
                measuring = measure_candidates(found, cases, rejected, tracker)
                measuring["notes"] = budget.notes + measuring["notes"]
    if not found:  # every native candidate failed and NumPy was not asked for: it is the fallback
        tracker.phase("verify", "numpy")
        found.append(numpy_candidate(graph, numpy_kernels, target, *case))
    best = choose(found)
    # artifact
    program_weights = {k: v for k, v in best.weights.items() if k not in graph.weights}
    report = {
        "compiler_version": COMPILER_VERSION,
        "strategy": "measured candidates",
        "chosen": best.name,
        "candidates": [candidate_report(c) for c in found],
        "rejected": rejected,
        "measuring": measuring,
        "search": search_report,
        "ir_nodes": len(graph.nodes),
        "kernels": best.stats.get("kernels", len(numpy_kernels)),
        "fused_contractions": sum(k["kind"] == "einsum" for k in numpy_kernels),
        "weights_bytes": int(sum(w.nbytes for w in [*graph.weights.values(), *program_weights.values()])),
        "seconds": round(time.perf_counter() - started, 4),
        "verify_max_abs_error": best.max_error,
    }
    signature = Signature.of(graph, terms)
    return Artifact(
        target, graph.content_hash(), signature, graph, best.kernels, report, best.binaries, program_weights
    )


def _with_searched(
    natives: list,
    program_graph: Graph,
    graph: Graph,
    case,
    cases: list,
    device: CpuDevice,
    tracker: Tracker,
    searching: tuple[KernelCache | None, float],
    wanted: Sequence[str],
    rejected: dict[str, str],
    search_report: dict[str, Any],
) -> list:
    """The verified native candidates with the native-searched ones first (the products as
    extracted, and the same with attention fused where the program has it), where wanted and
    found (compiler/search/cpu_schedules.py; its report goes under the search's "schedule")."""
    if NATIVE_SEARCHED not in wanted:
        return natives
    tracker.phase("lower", NATIVE_SEARCHED)
    try:
        program = fuse(lower(program_graph, use_gemm=True))
    except NotNative as exc:
        rejected[NATIVE_SEARCHED] = f"not expressible natively: {exc}"
        return natives
    kernel_cache, seconds = searching
    searched, search_report["schedule"] = search_native(
        program, graph, case, cases, device, tracker, kernel_cache, COMPILER_VERSION, seconds
    )
    if not searched:
        rejected[NATIVE_SEARCHED] = search_report["schedule"].get("error") or search_report["schedule"].get(
            "skipped", ""
        )
        return natives
    return [*searched, *natives]


def _compile_for_cuda(
    graph: Graph,
    target: str,
    searching: bool,
    tracker: Tracker,
    progress: Progress | None,
    precision: str,
    memory_bytes: int | None,
    kernel_cache: KernelCache | None = None,
    search_seconds: float = SCHEDULE_SEARCH_SECONDS,
) -> Artifact:
    """The stages for the GPU type `target`: searched and lowered as for the CPU, rendered as
    CUDA C, compiled by NVRTC to PTX and a cubin for the type's compute capability, and verified
    against the reference on its CudaDevice: this machine's GPU when it is of that compute
    capability (then each kernel's schedule is extracted by measurement from the schedule
    e-graph, compiler/search/cuda_schedules.py), else the CPU emulation, every kernel in its
    first alternative, untimed (the report says so: a compile worker without that GPU may be
    allowed to ship it)."""
    started = time.perf_counter()
    gpu = GPU_TYPES[target]
    terms = memory_terms(graph, numpy_cpu.generate(graph))
    budget = MemoryBudget(graph, terms, memory_bytes)
    budget.check_smallest()
    # reference
    tracker.phase("reference")
    case = verification_case(graph, budget)
    # search (the e-graph): a graph exported in a narrow float computes in float32 and stores in its format
    if searching:
        tracker.phase("search")
    exported_narrow = narrow_values(graph)
    program_graph, search_report = search_graph(
        computed_in_float32(graph) if exported_narrow else graph, searching
    )
    # kernel IR
    tracker.phase("lower", "cuda")
    program, precision = cuda_program(program_graph, graph, exported_narrow, precision, target)
    # render -> build -> verify -> search (each kernel's schedule, by measurement), on the device
    device = cuda_device(gpu.arch)
    tolerance = PRECISION_TOLERANCE[precision]
    try:
        found = search_cuda_schedule(
            program,
            graph,
            case,
            tolerance,
            device,
            progress,
            budget,
            kernel_cache,
            search_seconds,
            version=COMPILER_VERSION,
        )
    finally:
        device.close()
    chosen, built = found.chosen, found.built
    # artifact
    measuring: dict[str, Any] = {
        "skipped": f"no {target} GPU where this compiled: every kernel's first schedule, not timed"
    }
    if device.measures:
        measuring = {"device_ms_by_size": {c.schedule.name: c.device_ms or c.error for c in built}}
        if budget.notes:
            measuring["notes"] = budget.notes
    program_weights = {k: v for k, v in program.weights.items() if k not in graph.weights}
    chosen_program = scheduled(program, chosen.schedule)
    products = product_schedules(chosen_program, chosen.schedule)
    precision_report = _precision_report(program, precision, tolerance)
    if "cublas" in products:  # (where the chosen schedule put them: what it multiplies with there)
        operands = "float32" if precision == EXPORTED else precision
        precision_report["library_products"] = (
            f"{products['cublas']} on cuBLAS (cublasGemmStridedBatchedEx): {operands} operands, float32 sums"
        )
    report = {
        "compiler_version": COMPILER_VERSION,
        "strategy": "one generated program, "
        + (
            "each kernel's schedule chosen by device time"
            if device.measures
            else "every kernel in its first schedule, unmeasured"
        ),
        "chosen": chosen.schedule.name,
        "target": {"name": target, "arch": gpu.arch, "memory_bytes": gpu.memory_bytes},
        "verified_on": device.name,
        "precision": precision_report,
        "measuring": measuring,
        "search": {**search_report, "schedule": found.report},
        "ir_nodes": len(graph.nodes),
        "kernels": len(chosen.rendered.launches),
        # attentions run as one kernel each (online softmax), and the products by schedule
        "fused_attention": attention_count(chosen_program),
        "product_tiles": products,
        "functions": len({launch.kernel for launch in chosen.rendered.launches if launch.library is None}),
        "build_seconds": round(sum(c.build_seconds for c in built), 4),
        "weights_bytes": int(sum(w.nbytes for w in [*graph.weights.values(), *program_weights.values()])),
        "seconds": round(time.perf_counter() - started, 4),
        "verify_max_abs_error": chosen.max_error,
    }
    signature = Signature.of(graph, terms)
    return Artifact(
        target,
        graph.content_hash(),
        signature,
        graph,
        [chosen.kernel],
        report,
        chosen.binaries,
        program_weights,
    )


def _precision_report(program: Program, precision: str, tolerance: float) -> dict[str, Any]:
    """What the program stores and multiplies in, and the error verification allowed."""
    report: dict[str, Any] = {"chosen": precision, "tolerance": tolerance}
    if precision == EXPORTED:
        return {**report, "products": "CUDA cores, in the exported dtypes"}
    if precision == TF32:
        return {
            **report,
            "products": "tensor cores: tf32 operands, float32 sums (wmma 16x16x8); float32 storage",
        }
    floats = [b for b in program.buffers if b.role in NARROWED_ROLES and b.dtype in ("float32", precision)]
    return {
        **report,
        "products": f"tensor cores: {precision} operands, float32 sums (wmma 16x16x16)",
        "stored_narrow": sum(b.dtype == precision for b in floats),
        # temps computed from a constant beyond the format's range (an attention mask's minimum)
        "kept_float32": sum(b.dtype == "float32" for b in floats),
    }


__all__ = [
    "CANDIDATES",
    "CODEGENS",
    "COMPILER_VERSION",
    "PHASES",
    "SEARCH",
    "MemoryBudget",
    "Progress",
    "VerificationFailed",
    "compile_graph",
    "compile_onnx",
    "executable",
    "sample_inputs",
    "verification_case",
    "verify",
]
