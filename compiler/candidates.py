"""Candidate programs, from the searched graph to verified programs on a Device
(compiler/devices.py): lowered to the kernel IR, rendered, built, loaded, verified against the
reference (and, for CUDA, timed: the schedule race in compiler/search/cuda_schedules.py).

    cpu:   build_native -> verify_native (generated C on the CpuDevice), numpy_candidate
    cuda:  cuda_program (the kernel IR in the compile's precision) -> cuda_candidate per schedule
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler.backends import native_cpu
from compiler.backends.cuda import CudaProgram, kernel_record
from compiler.codegen import CODEGENS
from compiler.devices import CpuDevice, CudaDevice
from compiler.errors import CompilerError, UnsupportedModel
from compiler.ir import Graph
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import GemmCall, LoopKernel, Program
from compiler.kernels.lower import NotNative, lower
from compiler.kernels.precision import narrow_storage, tf32_products, with_interface_dtypes
from compiler.progress import Tracker
from compiler.reference import bind_symbols
from compiler.render.c import prepack_weights, render
from compiler.render.cuda import CudaSchedule, CudaSource, render_cuda, scheduled
from compiler.search import measure
from compiler.search.extract import Candidate
from compiler.search.measure import CandidateFailed
from compiler.shape import ShapeError, evaluate
from compiler.targets import EXPORTED, TF32
from compiler.tuning import MAX_LOOP_FLOPS, MEASURE_MIN_REPEATS, MEASURE_REPEATS
from compiler.verify import VerificationFailed, max_error, verify

# ---- cpu: generated C and the NumPy lowering -----------------------------------------------------


@dataclass
class _Built:
    """A native candidate built for this CPU, before it is loaded and verified."""

    name: str
    layout: dict[str, Any]
    weights: dict[str, np.ndarray]
    binaries: dict[str, bytes]
    source: str
    stats: dict[str, Any]


def build_native(
    graph: Graph, wanted: Sequence[str], measure_inputs: dict[str, np.ndarray], device: CpuDevice, tracker: Tracker
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
        tracker.phase("build", name)
        try:
            binaries = device.build(source)
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
        built.append(_Built(name, layout, program.weights, binaries, source, stats))
    return built, rejected


def verify_native(
    device: CpuDevice,
    built: list[_Built],
    case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
    rejected: dict[str, str],
    tracker: Tracker,
) -> list[Candidate]:
    """The built candidates that load on the CPU device and match the reference on the
    verification case; the others go to `rejected` with the reason."""
    verify_inputs, expected = case
    found = []
    for b in built:
        tracker.phase("verify", b.name)
        kernel = {"kind": "native", "layout": b.layout, "source": b.source, "fingerprint": native_cpu.cpu_fingerprint()}
        try:
            program = device.load(b.name, kernel, b.weights, b.binaries)
            outputs = device.run(program, verify_inputs)
            error = max((max_error(expected[k], v) for k, v in outputs.items()), default=0.0)
        except CandidateFailed as exc:
            rejected[b.name] = exc.reason
            continue
        except VerificationFailed as exc:
            rejected[b.name] = f"disagrees with the reference: {exc}"
            continue
        candidate = Candidate(b.name, [kernel], b.binaries, b.weights, error, b.stats)
        candidate.timer = lambda label, inputs, program=program: device.time(program, inputs)
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


def numpy_candidate(
    graph: Graph, kernels: list[dict[str, Any]], target: str, inputs: dict[str, np.ndarray], expected: dict
) -> Candidate:
    """The NumPy lowering of the graph, verified against the reference; timed in this process."""
    program = CODEGENS[target].Executable(graph, kernels)
    error = verify(graph, kernels, target, (inputs, expected))
    candidate = Candidate("numpy", kernels, {}, {}, error, {"kernels": len(kernels)})
    candidate.timer = lambda label, inputs: _timed(program.run, inputs)
    return candidate


def _timed(run: Callable[[dict[str, np.ndarray]], Any], inputs: dict[str, np.ndarray]) -> float:
    began = time.perf_counter()
    try:
        run(inputs)
    except Exception as exc:  # noqa: BLE001 - reported like a native candidate's failure
        raise CandidateFailed(f"raised {type(exc).__name__}: {exc}") from None
    return time.perf_counter() - began


# ---- cuda ----------------------------------------------------------------------------------------


def cuda_program(program_graph: Graph, graph: Graph, exported_narrow: str | None, precision: str, target: str) -> tuple[Program, str]:
    """The searched graph as one fused kernel-IR program in the compile's precision, and that
    precision: a graph exported in a narrow float (`exported_narrow`, computed in float32 since)
    keeps its interface dtypes and stores in its format unless another narrow one is asked for."""
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
    return program, precision


@dataclass
class CudaCandidate:
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
    # by measuring size: the median device ms of each kernel, its launches run one by one (the
    # schedule search's per-kernel measurement)
    kernel_ms_by_size: dict[str, list[float | None]] = field(default_factory=dict)
    error: str | None = None


def cuda_candidate(
    program: Program, schedule: CudaSchedule, graph: Graph,
    case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], tolerance: float, device: CudaDevice, cases: list, tracker: Tracker,
    profile: bool = False,
) -> CudaCandidate:
    """The program rendered in `schedule`, built by NVRTC, run on the verification inputs as a GPU
    runtime loads it (arena, launch plan) on `device` (this machine's GPU of the target's compute
    capability, or the emulation), then timed at each of `cases` (given where the device measures);
    with `profile`, each kernel also at each size, its launches run one by one."""
    verify_inputs, expected = case
    program = scheduled(program, schedule)
    rendered = render_cuda(program, schedule)
    tracker.phase("build", schedule.name)
    began = time.perf_counter()
    binaries = device.build(rendered.source)
    build_seconds = time.perf_counter() - began
    kernel = kernel_record(program, rendered, device.arch, graph.size_limits)
    tracker.phase("verify", schedule.name)
    loaded = device.load(schedule.name, kernel, program.weights, binaries)
    try:
        try:
            outputs = device.run(loaded, verify_inputs)
        except CompilerError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing run is the generated program's failure
            raise VerificationFailed(f"the CUDA program ({schedule.name}) failed on {device.name}: {exc}") from None
        error = max((max_error(expected[k], v, tolerance) for k, v in outputs.items()), default=0.0)
        device_ms, kernel_ms_by_size = {}, {}
        if cases:
            tracker.timed(schedule.name)
            for label, inputs in cases:
                seconds = []
                try:
                    for _ in range(MEASURE_REPEATS + 1):  # the first captures the CUDA graph
                        seconds.append(device.time(loaded, inputs))
                except (IndexError, ShapeError):
                    continue  # a size the model does not take (positions past its table): not timed
                device_ms[label] = round(measure.median_ms(seconds[1:]), 4)
                if profile:  # each kernel's time at this size, for the per-kernel choice
                    runs = [device.profile(loaded, inputs) for _ in range(MEASURE_MIN_REPEATS)]
                    kernel_ms_by_size[label] = _kernel_ms(
                        rendered, program, [None if run[0] is None else measure.median_ms(list(run)) for run in zip(*runs)]
                    )
    except BaseException:
        loaded.close()  # (its device memory, on a GPU compile worker)
        raise
    return CudaCandidate(schedule, rendered, kernel, binaries, loaded, build_seconds, error, device_ms, kernel_ms_by_size)


def _kernel_ms(rendered: CudaSource, program: Program, launch_ms: list[float | None]) -> list[float | None]:
    """Each kernel's median device ms from its launches' (a product on cuBLAS with an epilogue
    is two launches); None for a kernel none of whose launches ran."""
    kernel_ms: list[float | None] = [None] * len(program.kernels)
    for launch, ms in zip(rendered.launches, launch_ms):
        if ms is not None:
            kernel_ms[launch.kernel_number] = (kernel_ms[launch.kernel_number] or 0.0) + ms
    return kernel_ms


__all__ = ["CudaCandidate", "build_native", "cuda_candidate", "cuda_program", "numpy_candidate", "verify_native"]
