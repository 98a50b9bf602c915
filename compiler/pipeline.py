"""The compile pipeline, top to bottom: parse, search, lower, generate for the target, verify,
measure.

A cpu compile runs the search (compiler/search: an e-graph that removes work) on the parsed
graph, lowers the result to native candidates (generated C with BLAS calls, with loop nests
only), builds them, and loads, verifies and times each in a helper process
(compiler/search/measure.py), so one that crashes or hangs is rejected, not the compile. Every
candidate is checked against the reference interpreter run on the graph as parsed, so a wrong
rewrite is caught; when no candidate of the optimized graph is correct, the parsed graph's are
built instead. The NumPy lowering of the parsed graph is the candidate that needs nothing but
NumPy. The artifact keeps the parsed graph (its signature, its hash, the NumPy program's nodes)
and the chosen program's own constants beside its weights. A caller may follow a compile as it
goes through a `progress` callback (see PHASES).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from compiler.artifact import Artifact, Signature
from compiler.backends import native_cpu
from compiler.backends.cublas import CublasUnavailable
from compiler.backends.cuda import CudaBuildFailed, CudaProgram, compile_cuda, kernel_record
from compiler.codegen import numpy_cpu
from compiler.dtypes import is_float, numpy_dtype
from compiler.errors import CompilerError, UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.ir import Graph, Op
from compiler.kernels.attention import attention_count
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import GemmCall, LoopKernel, Program
from compiler.kernels.lower import NotNative, lower
from compiler.kernels.precision import (
    NARROWED_ROLES,
    computed_in_float32,
    narrow_storage,
    narrow_values,
    tf32_products,
    with_interface_dtypes,
)
from compiler.memory import memory_terms, peak_bytes
from compiler.reference import bind_symbols, run_graph
from compiler.render.c import prepack_weights, render
from compiler.render.cuda import (
    DEFAULT_SCHEDULE,
    GEMM_TILE,
    LIBRARY_TILE,
    SCHEDULES,
    CudaSchedule,
    CudaSource,
    library_gemm,
    render_cuda,
    scheduled,
)
from compiler.search import SearchBudget, measure, optimize
from compiler.search.measure import CandidateFailed
from compiler.shape import ShapeError, SymDim, evaluate
from compiler.targets import (
    EXPORTED,
    GPU_TYPES,
    KNOWN_TARGETS,
    PRECISION_TOLERANCE,
    TF32,
    check_precision,
    is_gpu,
)

# target name -> code generator module (generate(graph) -> kernels, Executable)
CODEGENS = {numpy_cpu.TARGET: numpy_cpu}
# part of every artifact key: bump it when compiled programs or signatures change meaning
COMPILER_VERSION = "0.7.0"
VERIFY_SYMBOL_SIZE = 3
# the programs a cpu compile builds, verifies and times: generated C with BLAS calls, the same with
# convolutions' panel products generated where A is small, or all of them (both built only where
# there are some), with loop nests only, and the NumPy lowering. Which panel product wins depends
# on the CPU: on an AVX2 EPYC the small CNN's 14x14 layers ran 50 GFLOP/s generated against 28 in
# OpenBLAS (A packed again per narrow panel), while ResNet-50's 7x7 layers ran faster in OpenBLAS
CANDIDATES = ("native-blas", "native-mixed", "native-panels", "native-loops", "numpy")
# every candidate the pipeline can build; "native-tiled" (every product generated, products of two
# activations too) is opt-in through the compile_candidates setting: it ties native-mixed on the
# transformer benchmarks (BERT 50.3 against 50.7 ms) and loses on ResNet-50's 7x7 layers
KNOWN_CANDIDATES = ("native-blas", "native-mixed", "native-panels", "native-tiled", "native-loops", "numpy")
# whether cpu compiles run the search before lowering (compile_graph's `search` overrides), and
# its budget: the benchmark models (MiniLM-shaped BERT, GPT-2-style decoder, ResNet-style CNN,
# ResNet-50) take 0.1-0.6 s of it on a shared 2-core machine
SEARCH = True
SEARCH_BUDGET = SearchBudget(max_seconds=10.0)
# candidates are timed with every symbol at the small size, then at the large one (a full batch)
# when the model allows it, several candidates are close and a run there is quick
MEASURE_SYMBOL_SIZE = 8
MEASURE_LARGE_SYMBOL_SIZE = 32
# and at a request's size: the batch symbol 1, every other (a sequence) this long, within the
# model's limits; every symbol at 8 is a batch of 8 sequences of 8 tokens, which no request is
MEASURE_REQUEST_SEQUENCE = 128
# per size: a warm-up run, then rounds (each candidate once) until each has the minimum and the
# budget (per candidate) has passed, or the maximum
MEASURE_MIN_REPEATS = 3
MEASURE_REPEATS = 7
MEASURE_BUDGET_S = 0.75
# a candidate this many times slower than the best is timed no more (after two runs) and is out
# of the race once the small size is timed
FAR_BEHIND = 4.0
# the large size is skipped when a run there would take longer than this (scaled from the small)
MAX_LARGE_RUN_S = 0.25
# the NumPy lowering is chosen over generated C only when it is this many times faster
NUMPY_MARGIN = 1.25
# the phases a compile tells its `progress` callback as each begins (lower, build and verify
# come once per candidate): reading the ONNX graph, running the reference on the verification
# inputs, the e-graph search, lowering to kernels, building generated C, checking a candidate
# against the reference, timing the candidates
PHASES = ("parse", "reference", "search", "lower", "build", "verify", "measure")
# called with {"phase": one of PHASES, "candidates_total": candidates asked for,
# "candidates_measured": candidates timed so far, "candidate": the one worked on, when there is
# one}; it runs in the compile's thread, so it should return at once and must not raise
Progress = Callable[[dict[str, Any]], None]


class VerificationFailed(CompilerError):
    """The generated program disagrees with the reference interpreter: a compiler bug."""


def compile_onnx(
    data: bytes,
    target: str = "cpu",
    candidates: Sequence[str] | None = None,
    search: bool | None = None,
    progress: Progress | None = None,
    precision: str = EXPORTED,
    memory_bytes: int | None = None,
) -> Artifact:
    check_precision(target, precision)
    _Tracker(progress, _wanted(candidates)).phase("parse")
    return compile_graph(load_graph(data), target, candidates, search, progress, precision, memory_bytes)


def _wanted(candidates: Sequence[str] | None) -> tuple[str, ...]:
    return CANDIDATES if candidates is None else tuple(candidates)


class _Tracker:
    """Tells `progress` (when there is one) what the compile is doing: see Progress."""

    def __init__(self, progress: Progress | None, wanted: Sequence[str]) -> None:
        self._progress = progress
        self._state: dict[str, Any] = {"phase": None, "candidates_total": len(wanted), "candidates_measured": 0}
        self._timed: set[str] = set()

    def phase(self, phase: str, candidate: str | None = None) -> None:
        self._state["phase"] = phase
        self._state.pop("candidate", None)
        if candidate is not None:
            self._state["candidate"] = candidate
        if self._progress is not None:
            self._progress(dict(self._state))

    def timed(self, candidate: str) -> None:
        self._timed.add(candidate)
        self._state["candidates_measured"] = len(self._timed)
        self.phase("measure", candidate)


# a loop-nest candidate doing more multiply-adds than this at the measuring size is not timed:
# it would lose to the library call by orders of magnitude and take seconds to find out
MAX_LOOP_FLOPS = 5e7


@dataclass
class _Candidate:
    name: str
    kernels: list[dict[str, Any]]
    binaries: dict[str, bytes]
    weights: dict[str, np.ndarray]
    max_error: float
    stats: dict[str, Any] = field(default_factory=dict)
    # median ms per measured size (by its label), and the score they give (None: not timed)
    ms_by_size: dict[str, float] = field(default_factory=dict)
    ms: float | None = None
    runs: int = 0
    # slower than the best by FAR_BEHIND at the small size: not timed further, never chosen
    behind: bool = False
    # seconds one run takes on the inputs of a size (label, inputs): in the helper process for
    # generated C (which holds the inputs by label), here for the NumPy program
    timer: Callable[[str, dict[str, np.ndarray]], float] | None = None


@dataclass
class _Built:
    """A native candidate built for this CPU, before it is loaded and verified."""

    name: str
    layout: dict[str, Any]
    weights: dict[str, np.ndarray]
    library: bytes
    source: str
    stats: dict[str, Any]


def compile_graph(
    graph: Graph,
    target: str = "cpu",
    candidates: Sequence[str] | None = None,
    search: bool | None = None,
    progress: Progress | None = None,
    precision: str = EXPORTED,
    memory_bytes: int | None = None,
) -> Artifact:
    """Candidates for the target, each verified against the reference and timed; the fastest
    correct one is kept. A candidate that cannot be built, disagrees, crashes or hangs is
    rejected, not the compile; the NumPy lowering needs nothing but NumPy and is always a
    candidate. `search` turns the search on or off (None: SEARCH); `progress` is told each
    phase as it begins (see Progress); `precision` is one of compiler.targets.PRECISIONS that the
    target offers (ValueError otherwise). `memory_bytes` is the compile's memory limit (None:
    none): a size whose run would pass it is not measured, and a model that passes it at its
    smallest size fails at once (MemoryBudget)."""
    check_precision(target, precision)
    if is_gpu(target):
        return _compile_cuda(graph, target, search, progress, precision, memory_bytes)
    if target not in CODEGENS:
        raise UnsupportedModel([f"target {target!r} (known: {', '.join(KNOWN_TARGETS)})"])
    started = time.perf_counter()
    wanted = _wanted(candidates)
    unknown = sorted(set(wanted) - set(KNOWN_CANDIDATES))
    if unknown:
        raise ValueError(f"unknown compile candidates {unknown}; known: {list(KNOWN_CANDIDATES)}")
    tracker = _Tracker(progress, wanted)
    native = target == "cpu" and any(name.startswith("native") for name in wanted)
    tracker.phase("lower", "numpy")
    numpy_kernels = CODEGENS[target].generate(graph)
    terms = memory_terms(graph, numpy_kernels)
    budget = MemoryBudget(graph, terms, memory_bytes)
    budget.check_smallest()
    tracker.phase("reference")
    verify_inputs, expected = verification_case(graph, budget)
    cases = _measure_cases(graph, verify_inputs, budget) if len(wanted) > 1 else []
    found: list[_Candidate] = []
    rejected: dict[str, str] = {}
    measuring: dict[str, Any] = {}
    search_report: dict[str, Any] = {"skipped": "no native candidate"}
    if "numpy" in wanted or not native:
        tracker.phase("verify", "numpy")
        found.append(_numpy_candidate(graph, numpy_kernels, target, verify_inputs, expected))
    if native:
        searching = SEARCH if search is None else search
        if searching:
            tracker.phase("search")
        program_graph, search_report = _search(graph, searching)
        loop_inputs = cases[0][1] if cases else verify_inputs
        built, rejected = _build_native(program_graph, wanted, loop_inputs, tracker)
        with measure.session() as runner:  # (one compile at a time uses the helper process)
            runner.put_inputs("verify", verify_inputs)
            natives = _verify_native(runner, built, expected, rejected, tracker)
            if not natives and program_graph is not graph:
                search_report["used"] = "parsed graph"
                search_report["why"] = "no candidate of the optimized graph passed: " + "; ".join(
                    f"{name}: {why}" for name, why in rejected.items()
                )
                built, rejected = _build_native(graph, wanted, loop_inputs, tracker)
                natives = _verify_native(runner, built, expected, rejected, tracker)
            found = natives + found
            if len(found) > 1 and cases:
                measuring = _measure(runner, found, cases, rejected, tracker)
                measuring["notes"] = budget.notes + measuring["notes"]
    if not found:  # every native candidate failed and NumPy was not asked for: it is the fallback
        tracker.phase("verify", "numpy")
        found.append(_numpy_candidate(graph, numpy_kernels, target, verify_inputs, expected))
    best = _choose(found)
    program_weights = {k: v for k, v in best.weights.items() if k not in graph.weights}
    report = {
        "compiler_version": COMPILER_VERSION,
        "strategy": "measured candidates",
        "chosen": best.name,
        "candidates": [_candidate_report(c) for c in found],
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


def _compile_cuda(
    graph: Graph, target: str, search: bool | None, progress: Progress | None, precision: str = EXPORTED,
    memory_bytes: int | None = None,
) -> Artifact:
    """The graph as one CUDA program for the GPU type `target`: searched and lowered as for the
    CPU, rendered as CUDA C, compiled by NVRTC to PTX and a cubin for the type's compute
    capability, and verified against the reference: on this machine's GPU when it is of that
    type's compute capability (then also timed, by CUDA events, at the measuring sizes), else in
    the CPU emulation, untimed (a compile worker needs no GPU); the report says which. On a GPU
    every schedule that can differ (CudaSchedule: product tiles, attention fused or not) is built,
    verified and timed, its kernels also one by one, then a schedule giving each product its
    fastest tile where the tiles' winners differ; the fastest is kept. Elsewhere the default one."""
    started = time.perf_counter()
    gpu = GPU_TYPES[target]
    tracker = _Tracker(progress, ("cuda",))
    terms = memory_terms(graph, numpy_cpu.generate(graph))
    budget = MemoryBudget(graph, terms, memory_bytes)
    budget.check_smallest()
    tracker.phase("reference")
    verify_inputs, expected = verification_case(graph, budget)
    searching = SEARCH if search is None else search
    if searching:
        tracker.phase("search")
    exported_narrow = narrow_values(graph)
    # a graph exported in a narrow float computes in float32 and stores in its format (below)
    computed = computed_in_float32(graph) if exported_narrow else graph
    program_graph, search_report = _search(computed, searching)
    tracker.phase("lower", "cuda")
    try:
        program = fuse(lower(program_graph))
    except NotNative as exc:
        raise UnsupportedModel([f"{exc} on {target}"]) from None
    if exported_narrow is not None:
        program = with_interface_dtypes(program, graph)
        if precision in (EXPORTED, TF32):
            precision = exported_narrow
    if precision == TF32:
        program = tf32_products(program)
    elif precision != EXPORTED:
        program = narrow_storage(program, precision)
    driver = _gpu_of_arch(gpu.arch)
    verified_on = f"{driver.name} ({driver.arch})" if driver is not None else "cpu emulation"
    tolerance = PRECISION_TOLERANCE[precision]
    try:
        chosen, built = _race_cuda_schedules(
            program, gpu.arch, graph, (verify_inputs, expected), tolerance, driver, progress, budget
        )
    finally:
        if driver is not None:
            driver.close()  # (its stream, and cuBLAS's handle and workspace)
    rendered, kernel, binaries, max_error = chosen.rendered, chosen.kernel, chosen.binaries, chosen.max_error
    build_seconds = sum(c.build_seconds for c in built)
    measuring: dict[str, Any] = {"skipped": f"no {target} GPU where this compiled: the default schedule, not timed"}
    if driver is not None:
        measuring = {"device_ms_by_size": {c.schedule.name: c.device_ms or c.error for c in built}}
        if budget.notes:
            measuring["notes"] = budget.notes
    program_weights = {k: v for k, v in program.weights.items() if k not in graph.weights}
    chosen_program = scheduled(program, chosen.schedule)
    tiles = _product_tiles(chosen_program, chosen.schedule)
    precision_report = _precision_report(program, precision, tolerance)
    if "cublas" in tiles:  # (where the chosen schedule put them: what it multiplies with there)
        operands = "float32" if precision == EXPORTED else precision
        precision_report["library_products"] = f"{tiles['cublas']} on cuBLAS (cublasGemmStridedBatchedEx): {operands} operands, float32 sums"
    report = {
        "compiler_version": COMPILER_VERSION,
        "strategy": "one generated program, " + ("its schedule chosen by device time" if driver else "in the default schedule"),
        "chosen": chosen.schedule.name,
        "target": {"name": target, "arch": gpu.arch, "memory_bytes": gpu.memory_bytes},
        "verified_on": verified_on,
        "precision": precision_report,
        "measuring": measuring,
        "search": search_report,
        "ir_nodes": len(graph.nodes),
        "kernels": len(rendered.launches),
        # attentions run as one kernel each (online softmax), and the products by tile, in the
        # chosen schedule
        "fused_attention": attention_count(chosen_program),
        "product_tiles": tiles,
        "functions": len({launch.kernel for launch in rendered.launches if launch.library is None}),
        "build_seconds": round(build_seconds, 4),
        "weights_bytes": int(sum(w.nbytes for w in [*graph.weights.values(), *program_weights.values()])),
        "seconds": round(time.perf_counter() - started, 4),
        "verify_max_abs_error": max_error,
    }
    signature = Signature.of(graph, terms)
    return Artifact(
        target, graph.content_hash(), signature, graph, [kernel], report, binaries, program_weights,
    )


def _race_cuda_schedules(
    program: Program, arch: str, graph: Graph, case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], tolerance: float,
    driver, progress: Progress | None, budget: MemoryBudget | None = None,
) -> tuple[_CudaCandidate, list[_CudaCandidate]]:
    """The fastest schedule that verified, and every candidate built. Schedules are compared by
    measurement, so only on a GPU of the target's type (`driver`); elsewhere the default one is
    built and verified in the emulation. The candidates' programs are closed (the chosen one's
    too: the artifact keeps its binaries, not its device memory)."""
    schedules = _cuda_schedules(program, driver.has_cublas) if driver is not None else [DEFAULT_SCHEDULE]
    cases = _measure_cases(graph, case[0], budget) if driver is not None else []
    tracker = _Tracker(progress, [schedule.name for schedule in schedules])
    built: list[_CudaCandidate] = []
    for schedule in schedules:
        try:
            built.append(_cuda_candidate(program, schedule, arch, graph, case, tolerance, driver, cases, tracker))
        except (CudaBuildFailed, VerificationFailed, CublasUnavailable) as exc:
            if len(schedules) == 1:
                raise
            built.append(_CudaCandidate(schedule, error=str(exc)))
    # each product in the tile that measured fastest for it, where the tiles' winners differ
    mixed = _per_kernel_schedule(program, built)
    if mixed is not None:
        try:
            built.append(_cuda_candidate(program, mixed, arch, graph, case, tolerance, driver, cases, tracker))
        except (CudaBuildFailed, VerificationFailed, CublasUnavailable) as exc:
            built.append(_CudaCandidate(mixed, error=str(exc)))
    racing = [c for c in built if c.error is None]
    if not racing:
        raise VerificationFailed(f"no CUDA schedule ran correctly: {'; '.join(f'{c.schedule.name}: {c.error}' for c in built)}")
    # compared at the sizes every candidate ran (a size the model does not take ran on none)
    timed_sizes = set.intersection(*(set(c.device_ms) for c in racing))
    chosen = min(racing, key=lambda c: sum(c.device_ms[size] for size in timed_sizes))
    for candidate in built:
        if candidate.loaded is not None:
            candidate.loaded.close()
    return chosen, built


@dataclass
class _CudaCandidate:
    """One schedule of a CUDA program, built and verified (and timed, on a GPU), or why not."""

    schedule: CudaSchedule
    rendered: CudaSource | None = None
    kernel: dict[str, Any] | None = None
    binaries: dict[str, bytes] = field(default_factory=dict)
    loaded: CudaProgram | None = None
    build_seconds: float = 0.0
    max_error: float = 0.0
    # median device ms by measuring size (on a GPU only)
    device_ms: dict[str, float] = field(default_factory=dict)
    # median device ms of each launch, the kernels launched one by one at the largest size
    launch_ms: list[float | None] = field(default_factory=list)
    error: str | None = None


def _cuda_schedules(program: Program, library: bool) -> list[CudaSchedule]:
    """The schedules worth comparing: they differ in products and in attention, so one where
    there are no products, attention left unfused only where there is one to fuse, and products
    on cuBLAS only where the `library` loads and some product can run there."""
    if not any(isinstance(k, GemmCall) for k in program.kernels):
        return [DEFAULT_SCHEDULE]
    fused = scheduled(program, DEFAULT_SCHEDULE)
    attention = fused is not program
    on_library = library and any(library_gemm(fused, k) is not None for k in fused.kernels)
    return [
        s for s in SCHEDULES.values()
        if (s.fused_attention or attention) and (s.product_tile != LIBRARY_TILE or on_library)
    ]


def _product_tiles(program: Program, schedule: CudaSchedule) -> dict[str, int]:
    """How many products each tile size computes ("64", "128"), or cuBLAS ("cublas")."""
    tiles = Counter(
        "cublas" if schedule.tile_of(n) == LIBRARY_TILE and library_gemm(program, k) is not None
        else str(schedule.tile_of(n) or GEMM_TILE)
        for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)
    )
    return dict(sorted(tiles.items(), key=lambda item: (item[0] == "cublas", item[0].isdigit() and int(item[0]))))


def _per_kernel_schedule(program: Program, built: list[_CudaCandidate]) -> CudaSchedule | None:
    """A schedule giving each product the tile whose kernel measured fastest for it (the
    candidates of one tile each, attention fused, timed kernel by kernel), or None where one tile
    won them all (that schedule is already built) or there was nothing to compare."""
    uniform = [c for c in built if c.error is None and c.launch_ms and c.schedule.fused_attention and not c.schedule.product_tiles]
    if len({c.schedule.product_tile for c in uniform}) < 2:
        return None
    tiles = []
    for number, kernel in enumerate(scheduled(program, uniform[0].schedule).kernels):
        timed = [(c.launch_ms[number], c.schedule.product_tile) for c in uniform if c.launch_ms[number] is not None]
        if isinstance(kernel, GemmCall) and timed:
            tiles.append((number, min(timed)[1]))
    if len({tile for _, tile in tiles}) < 2:
        return None
    base = DEFAULT_SCHEDULE
    return CudaSchedule("cuda-per-kernel", base.product_tile, True, tuple((n, t) for n, t in tiles if t != base.product_tile))


def _cuda_candidate(
    program: Program, schedule: CudaSchedule, arch: str, graph: Graph,
    case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], tolerance: float, driver, cases: list, tracker: _Tracker,
) -> _CudaCandidate:
    """The program rendered in `schedule`, built by NVRTC, run on the verification inputs as a GPU
    runtime loads it (arena, launch plan): on `driver`, this machine's GPU of the target's compute
    capability, then timed at each measuring size; else on the emulated device."""
    from compiler.backends.cuda_emulator import EmulatedDriver  # builds with the C++ compiler

    verify_inputs, expected = case
    program = scheduled(program, schedule)
    rendered = render_cuda(program, schedule)
    tracker.phase("build", schedule.name)
    began = time.perf_counter()
    ptx, cubin = compile_cuda(rendered.source, arch)
    build_seconds = time.perf_counter() - began
    kernel = kernel_record(program, rendered, arch, graph.size_limits)
    binaries = {"program.ptx": ptx, "program.cubin": cubin}
    tracker.phase("verify", schedule.name)
    where = f"{driver.name} ({driver.arch})" if driver is not None else "cpu emulation"
    loaded = CudaProgram(kernel, program.weights, binaries, driver or EmulatedDriver())
    try:
        try:
            outputs = loaded.run(verify_inputs)
        except CompilerError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing run is the generated program's failure
            raise VerificationFailed(f"the CUDA program ({schedule.name}) failed on {where}: {exc}") from None
        max_error = max((_max_error(expected[k], v, tolerance) for k, v in outputs.items()), default=0.0)
        device_ms, launch_ms = {}, []
        if cases:
            tracker.timed(schedule.name)
            for label, inputs in cases:
                seconds = []
                try:
                    for _ in range(MEASURE_REPEATS + 1):  # the first captures the CUDA graph
                        loaded.run(inputs)
                        seconds.append(loaded.last_device_seconds)
                except (IndexError, ShapeError):
                    continue  # a size the model does not take (positions past its table): not timed
                device_ms[label] = round(measure.median_ms(seconds[1:]), 4)
            if device_ms:  # each kernel's time at the largest size that ran, for a per-kernel choice
                largest = dict(cases)[list(device_ms)[-1]]
                runs = [loaded.profile(largest) for _ in range(MEASURE_MIN_REPEATS)]
                launch_ms = _kernel_ms(rendered, program, [None if run[0] is None else measure.median_ms(list(run)) for run in zip(*runs)])
    except BaseException:
        loaded.close()  # (its device memory, on a GPU compile worker)
        raise
    return _CudaCandidate(schedule, rendered, kernel, binaries, loaded, build_seconds, max_error, device_ms, launch_ms)


def _kernel_ms(rendered: CudaSource, program: Program, launch_ms: list[float | None]) -> list[float | None]:
    """Each kernel's median device ms from its launches' (a product on cuBLAS with an epilogue
    is two launches); None for a kernel none of whose launches ran."""
    kernel_ms: list[float | None] = [None] * len(program.kernels)
    for launch, ms in zip(rendered.launches, launch_ms):
        if ms is not None:
            kernel_ms[launch.kernel_number] = (kernel_ms[launch.kernel_number] or 0.0) + ms
    return kernel_ms


def _precision_report(program: Program, precision: str, tolerance: float) -> dict[str, Any]:
    """What the program stores and multiplies in, and the error verification allowed."""
    report: dict[str, Any] = {"chosen": precision, "tolerance": tolerance}
    if precision == EXPORTED:
        return {**report, "products": "CUDA cores, in the exported dtypes"}
    if precision == TF32:
        return {**report, "products": "tensor cores: tf32 operands, float32 sums (wmma 16x16x8); float32 storage"}
    floats = [b for b in program.buffers if b.role in NARROWED_ROLES and b.dtype in ("float32", precision)]
    return {
        **report,
        "products": f"tensor cores: {precision} operands, float32 sums (wmma 16x16x16)",
        "stored_narrow": sum(b.dtype == precision for b in floats),
        # temps computed from a constant beyond the format's range (an attention mask's minimum)
        "kept_float32": sum(b.dtype == "float32" for b in floats),
    }


def _gpu_of_arch(arch: str):
    """GPU 0 through the driver API when this machine has one of that compute capability."""
    from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable

    try:
        driver = CudaDriver(0)
    except CudaUnavailable:
        return None
    return driver if driver.arch == arch else None


def _candidate_report(c: _Candidate) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": c.name,
        "median_ms": None if c.ms is None else round(c.ms, 4),
        "max_abs_error": c.max_error,
        **c.stats,
    }
    if c.ms_by_size:
        entry["ms_by_size"] = {size: round(ms, 4) for size, ms in c.ms_by_size.items()}
        entry["runs"] = c.runs
    if c.behind:
        entry["behind"] = True
    return entry


# ---- search -----------------------------------------------------------------------------------


def _search(graph: Graph, enabled: bool) -> tuple[Graph, dict[str, Any]]:
    """The graph the native candidates are built from, and what the search did (compact)."""
    if not enabled:
        return graph, {"skipped": "turned off"}
    try:
        optimized, full = optimize(graph, SEARCH_BUDGET, keep_weights=True)
    except Exception as exc:  # noqa: BLE001 - optimize promises not to raise; the compile goes on if it does
        return graph, {"skipped": f"the search failed: {type(exc).__name__}: {exc}"}
    report = {
        "nodes_before": full["nodes_before"],
        "nodes_after": full["nodes_after"],
        "cost_before": full["cost_before"],
        "cost_after": full["cost_after"],
        "layout_rules": full["layout_rules"],
        "folding": full["folding"],
        "rules": {name: counts for name, counts in full["rules"].items() if counts},
        "rounds": [
            {
                "enodes": r.get("enodes", {}),
                "chunks": r.get("chunks", 0),
                "copied_chunks": r.get("copied_chunks", 0),
                "stopped": {
                    stage: reasons for stage, reasons in r.get("stopped", {}).items() if set(reasons) != {"saturated"}
                },
            }
            for r in full["rounds"]
        ],
        "seconds": {phase: round(s, 3) for phase, s in full["seconds"].items()},
        "fallback": full["fallback"],
        "used": "optimized graph",
    }
    if _same_graph(optimized, graph):
        report["used"] = "parsed graph"
        report["why"] = "the search changed nothing"
        return graph, report
    return optimized, report


def _same_graph(a: Graph, b: Graph) -> bool:
    return a is b or (a.nodes == b.nodes and a.inputs == b.inputs and a.outputs == b.outputs)


# ---- candidates -------------------------------------------------------------------------------


def _numpy_candidate(
    graph: Graph, kernels: list[dict[str, Any]], target: str, inputs: dict[str, np.ndarray], expected: dict
) -> _Candidate:
    program = CODEGENS[target].Executable(graph, kernels)
    max_error = verify(graph, kernels, target, (inputs, expected))
    candidate = _Candidate("numpy", kernels, {}, {}, max_error, {"kernels": len(kernels)})
    candidate.timer = lambda label, inputs: _timed(program.run, inputs)
    return candidate


def _timed(run: Callable[[dict[str, np.ndarray]], Any], inputs: dict[str, np.ndarray]) -> float:
    began = time.perf_counter()
    try:
        run(inputs)
    except Exception as exc:  # noqa: BLE001 - reported like a native candidate's failure
        raise CandidateFailed(f"raised {type(exc).__name__}: {exc}") from None
    return time.perf_counter() - began


def _build_native(
    graph: Graph, wanted: Sequence[str], measure_inputs: dict[str, np.ndarray], tracker: _Tracker
) -> tuple[list[_Built], dict[str, str]]:
    """Generated C with contractions as OpenBLAS calls ("native-blas"), with convolutions' products
    and products by a weight (packed at compile time) generated, wide convolutions reading their
    windows in place ("native-mixed"), the same with every convolution's product generated
    ("native-panels"), with every product the generated tiled one ("native-tiled"), and (where
    there are contractions) with every kernel a generated loop nest
    ("native-loops"): the whole-program choices measured today."""
    built: list[_Built] = []
    rejected: dict[str, str] = {}
    lowered: dict[bool, Any] = {}
    for name, use_gemm, gemm in (
        ("native-blas", True, "blas"),
        ("native-mixed", True, "mixed"),
        ("native-panels", True, "panels"),
        ("native-tiled", True, "tiled"),
        ("native-loops", False, "blas"),
    ):
        if name not in wanted:
            continue
        began = time.perf_counter()
        if use_gemm not in lowered:
            tracker.phase("lower", name)
        try:
            program = lowered[use_gemm] if use_gemm in lowered else fuse(lower(graph, use_gemm=use_gemm))
        except NotNative as exc:
            rejected["native"] = f"not expressible natively: {exc}"
            break
        lowered[use_gemm] = program
        gemms = sum(isinstance(k, GemmCall) for k in program.kernels)
        if not use_gemm and len(wanted) > 1 and _loop_flops(program, measure_inputs, graph) > MAX_LOOP_FLOPS:
            rejected[name] = "not measured: its loop nests do far more work than the library calls"
            continue
        if gemm != "blas":  # the generated products read their weights packed at compile time
            program = prepack_weights(program)
        source = render(program, gemm=gemm)
        if any(b.source == source for b in built):
            continue  # the same program as one already built (no contraction, or no convolution's panels)
        measure.prestart()  # the helper process imports while the C compiler runs
        tracker.phase("build", name)
        try:
            library = native_cpu.build(source)
        except CompilerError as exc:
            rejected[name] = str(exc)
            continue
        stats = {
            "kernels": len(program.kernels),
            "gemm_calls": gemms,
            "fused_epilogues": sum(isinstance(k, GemmCall) and k.epilogue is not None for k in program.kernels),
            "build_seconds": round(time.perf_counter() - began, 4),
        }
        layout = native_cpu.describe(program, graph.size_limits)
        built.append(_Built(name, layout, program.weights, library, source, stats))
    return built, rejected


def _verify_native(
    runner: measure.Runner,
    built: list[_Built],
    expected: dict[str, np.ndarray],
    rejected: dict[str, str],
    tracker: _Tracker,
) -> list[_Candidate]:
    """The built candidates that load and match the reference (run on the inputs stored as
    "verify"), each in the helper process; the others go to `rejected` with the reason."""
    found = []
    for b in built:
        tracker.phase("verify", b.name)
        try:
            runner.load(b.name, b.layout, b.weights, b.library)
            outputs = runner.run(b.name, "verify")
            max_error = max((_max_error(expected[k], v) for k, v in outputs.items()), default=0.0)
        except CandidateFailed as exc:
            rejected[b.name] = exc.reason
            continue
        except VerificationFailed as exc:
            rejected[b.name] = f"disagrees with the reference: {exc}"
            continue
        kernel = {"kind": "native", "layout": b.layout, "source": b.source, "fingerprint": native_cpu.cpu_fingerprint()}
        candidate = _Candidate(b.name, [kernel], {"program.so": b.library}, b.weights, max_error, b.stats)
        candidate.timer = lambda label, inputs, name=b.name: runner.time(name, label)
        found.append(candidate)
    return found


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


# ---- memory -----------------------------------------------------------------------------------

# inputs are drawn as float64 and then narrowed: while one is drawn it needs about twice its
# float32 bytes more
_DRAW_OVERHEAD = 2


class MemoryBudget:
    """Whether the compile can run the graph at given symbol sizes within its memory limit (its
    process's address-space limit, which the compile sandbox sets; None: no limit): what the
    process holds now (the model's weights among it), the inputs at those sizes as they are
    drawn, and the peak of live values the program holds (compiler/memory.py). A size that
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
            concrete = [_sample_size(self.graph, d, sizes) if isinstance(d, SymDim) else int(d) for d in shape]
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
            over = self._over(_wanted_sizes(self.graph, size))
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
        need = self.need(_wanted_sizes(self.graph, 1))
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


# ---- measuring --------------------------------------------------------------------------------


def _measure_cases(
    graph: Graph, verify_inputs: dict[str, np.ndarray], budget: MemoryBudget | None = None
) -> list[tuple[str, dict[str, np.ndarray]]]:
    """The inputs candidates are timed on, by size label: the small size (the verification case
    when the model does not allow it), a request's size (MEASURE_REQUEST_SEQUENCE), then the large
    one, each where the model's limits let it differ from those before. Integer inputs are all 0:
    always a valid index, whatever the indexed axis. A size that does not fit the `budget` is
    replaced by a smaller one (the small size down to 1, the large down to half), or left out."""
    budget = budget or MemoryBudget(graph, [], None)
    small_size = budget.largest(_halvings(MEASURE_SYMBOL_SIZE), "the small measuring size")
    if small_size is None:
        return [(str(VERIFY_SYMBOL_SIZE), verify_inputs)]
    small = sample_inputs(graph, seed=1, int_high=1, symbol_size=small_size)
    try:
        run_graph(graph, small) if graph.size_limits else None
    except (ShapeError, IndexError):
        return [(str(VERIFY_SYMBOL_SIZE), verify_inputs)]  # sizes the model does not allow together
    cases = [(str(small_size), small)]
    batch = Signature.of(graph).batch_symbol
    request = {
        s: 1 if s == batch else min(MEASURE_REQUEST_SEQUENCE, graph.size_limits.get(s, MEASURE_REQUEST_SEQUENCE))
        for s in _input_symbols(graph)
    }
    request_label = ",".join(f"{s}={v}" for s, v in request.items())
    try:
        if budget.fits(request, f"size {request_label}"):
            served = sample_inputs(graph, seed=1, int_high=1, sizes=request)
            run_graph(graph, served) if graph.size_limits else None
            cases.append((request_label, served))
    except (ShapeError, IndexError):
        pass  # sizes the model does not allow together
    large_sizes = (MEASURE_LARGE_SYMBOL_SIZE, MEASURE_LARGE_SYMBOL_SIZE // 2)
    large_size = budget.largest([size for size in large_sizes if size > small_size], "the large measuring size")
    if large_size is not None:
        large = sample_inputs(graph, seed=1, int_high=1, symbol_size=large_size)
        cases.append((str(large_size), large))
    distinct: list[tuple[str, dict[str, np.ndarray]]] = []
    for label, inputs in cases:
        if not any(all(inputs[k].shape == seen[k].shape for k in inputs) for _, seen in distinct):
            distinct.append((label, inputs))
    return distinct


def _measure(
    runner: measure.Runner,
    found: list[_Candidate],
    cases: list[tuple[str, dict[str, np.ndarray]]],
    rejected: dict[str, str],
    tracker: _Tracker | None = None,
) -> dict[str, Any]:
    """Times the candidates in turns at each size (see compiler/search/measure.round_robin) and
    gives each its score: the geometric mean of its medians. A candidate that crashes or hangs is
    moved from `found` to `rejected`, and so is one that raises at the small size (the reference
    ran there); an error at the large size only drops that size. Returns the report's
    "measuring" section."""
    began = time.perf_counter()
    notes: list[str] = []
    sizes: list[str] = []
    by_name = {c.name: c for c in found}
    tracker = tracker or _Tracker(None, ())

    def run_timed(c: _Candidate, label: str, inputs: dict[str, np.ndarray]) -> float:
        seconds = c.timer(label, inputs)
        tracker.timed(c.name)
        return seconds

    tracker.phase("measure")

    def failed(name: str, exc: CandidateFailed) -> None:
        if exc.crashed or not sizes:  # (sizes is empty while the small size is being timed)
            rejected[name] = exc.reason if exc.crashed else f"{exc.reason} (at the measuring size)"
            found.remove(by_name[name])
        else:
            errors[name] = exc.reason

    for number, (label, inputs) in enumerate(cases):
        racing = [c for c in found if not c.behind]
        if len(racing) < 2:
            break
        if number > 0:
            ratio = _elements(inputs) / max(1, _elements(cases[0][1]))
            slowest = max(c.ms_by_size[sizes[0]] for c in racing) / 1000 * ratio
            if slowest > MAX_LARGE_RUN_S:
                notes.append(f"size {label} skipped: a run would take about {slowest:.2g} s")
                continue
        runner.put_inputs(label, inputs)
        errors: dict[str, str] = {}
        times = measure.round_robin(
            {c.name: (lambda c=c, label=label, inputs=inputs: run_timed(c, label, inputs)) for c in racing},
            MEASURE_BUDGET_S * len(racing),
            MEASURE_MIN_REPEATS,
            MEASURE_REPEATS,
            failed,
            FAR_BEHIND,
        )
        if errors:
            notes.append(f"size {label} dropped: " + "; ".join(f"{n} {why}" for n, why in errors.items()))
            for c in found:
                c.ms_by_size.pop(label, None)
            break
        sizes.append(label)
        for name, seconds in times.items():
            by_name[name].ms_by_size[label] = measure.median_ms(seconds)
            by_name[name].runs += len(seconds)
        if number == 0:
            timed = [c for c in found if label in c.ms_by_size]
            fastest = min((c.ms_by_size[label] for c in timed), default=0.0)
            for c in timed:
                c.behind = c.ms_by_size[label] > FAR_BEHIND * fastest
    for c in found:
        measured = [c.ms_by_size[s] for s in sizes if s in c.ms_by_size]
        if measured:
            c.ms = math.exp(sum(math.log(max(ms, 1e-6)) for ms in measured) / len(measured))
    return {
        # every symbol at one size ([8, 32]), or a request's sizes by symbol ("batch=1,seq=128")
        "symbol_sizes": [int(s) if s.isdigit() else s for s in sizes],
        "notes": notes,
        "seconds": round(time.perf_counter() - began, 4),
    }


def _elements(inputs: dict[str, np.ndarray]) -> int:
    return sum(int(a.size) for a in inputs.values())


def _choose(found: list[_Candidate]) -> _Candidate:
    """The fastest by score among the candidates in the race; the NumPy lowering only when it is
    NUMPY_MARGIN times faster than the best generated C (timing on a shared machine is noisy,
    and generated C's lead grows with the batch)."""
    if len(found) == 1:
        return found[0]
    racing = [c for c in found if not c.behind and c.ms is not None] or found
    native = [c for c in racing if c.name != "numpy"]
    best = min(native or racing, key=lambda c: math.inf if c.ms is None else c.ms)
    numpy = next((c for c in racing if c.name == "numpy"), None)
    if numpy is not None and native and None not in (numpy.ms, best.ms) and numpy.ms * NUMPY_MARGIN < best.ms:
        return numpy
    return best


def verification_case(
    graph: Graph, budget: MemoryBudget | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random inputs and the reference's outputs for them. Each symbol has its own size, so a
    program that reads one symbol for another (batch for seq) disagrees; all share one size only
    when the model does not run with different ones, or when distinct sizes do not fit the
    `budget` (then the largest size up to VERIFY_SYMBOL_SIZE that fits)."""
    budget = budget or MemoryBudget(graph, [], None)
    if budget.fits(_wanted_sizes(graph, VERIFY_SYMBOL_SIZE, distinct=True)):
        try:
            inputs = sample_inputs(graph, distinct=True)
            return inputs, run_graph(graph, inputs)
        except (ValueError, IndexError):  # (ShapeError is a ValueError)
            pass
    size = budget.largest(_halvings(VERIFY_SYMBOL_SIZE), "the verification size") or 1
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
    wanted = {**_wanted_sizes(graph, symbol_size, distinct), **(sizes or {})}
    inputs = {}
    for name, shape, dtype in specs:
        concrete = tuple(_sample_size(graph, d, wanted) if isinstance(d, SymDim) else d for d in shape)
        if is_float(dtype):
            inputs[name] = rng.standard_normal(concrete).astype(numpy_dtype(dtype))
        elif dtype == "bool":
            inputs[name] = rng.random(concrete) < 0.5
        else:
            inputs[name] = rng.integers(0, int_high, concrete).astype(numpy_dtype(dtype))
    return inputs


def _wanted_sizes(graph: Graph, symbol_size: int, distinct: bool = False) -> dict[str, int]:
    """Each input symbol at `symbol_size`, or with `distinct` at symbol_size, symbol_size + 1, ..."""
    return {name: symbol_size + (k if distinct else 0) for k, name in enumerate(_input_symbols(graph))}


def _halvings(size: int) -> list[int]:
    """size, size // 2, ... down to 1."""
    return [size >> k for k in range(size.bit_length())]


def _input_symbols(graph: Graph) -> list[str]:
    """The symbols (or compound dims) the inputs' shapes name, sorted."""
    return sorted({d.as_symbol() or str(d) for _, shape, _ in graph.input_specs() for d in shape if isinstance(d, SymDim)})


def _sample_size(graph: Graph, dim: SymDim, wanted: dict[str, int]) -> int:
    symbol = dim.as_symbol() or str(dim)
    return min(wanted[symbol], graph.size_limits.get(symbol, wanted[symbol]))


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


def _max_error(expected: np.ndarray, actual: np.ndarray, tolerance: float = PRECISION_TOLERANCE[EXPORTED]) -> float:
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


def executable(artifact: Artifact):
    if is_gpu(artifact.target):
        raise UnsupportedModel([f"running a {artifact.target} program here: it runs on a {artifact.target} GPU runtime"])
    if artifact.kernels and artifact.kernels[0].get("kind") == "native":
        return native_cpu.load(artifact.kernels[0], artifact.all_weights(), artifact.binaries.get("program.so"))
    return CODEGENS[artifact.target].Executable(artifact.graph, artifact.kernels)

