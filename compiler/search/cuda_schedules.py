"""The CUDA schedule race: on a GPU of the target's type, every schedule that can differ
(CudaSchedule: product tiles, attention fused or not, products on cuBLAS) is built, verified and
timed, its kernels also one by one, then a schedule giving each product its fastest tile where the
tiles' winners differ; the fastest is kept. On the emulation, the default schedule alone.

    chosen, built = race_cuda_schedules(program, graph, case, tolerance, device, progress, budget)
"""

from __future__ import annotations

import numpy as np

from compiler.backends.cublas import CublasUnavailable
from compiler.backends.cuda import CudaBuildFailed
from compiler.candidates import CudaCandidate, cuda_candidate
from compiler.devices import CudaDevice
from compiler.ir import Graph
from compiler.kernels.ir import GemmCall, Program
from compiler.memory import MemoryBudget
from compiler.progress import Progress, Tracker
from compiler.render.cuda import DEFAULT_SCHEDULE, LIBRARY_TILE, SCHEDULES, CudaSchedule, library_gemm, scheduled
from compiler.search.extract import measure_cases
from compiler.verify import VerificationFailed


def race_cuda_schedules(
    program: Program, graph: Graph, case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], tolerance: float,
    device: CudaDevice, progress: Progress | None, budget: MemoryBudget | None = None,
) -> tuple[CudaCandidate, list[CudaCandidate]]:
    """The fastest schedule that verified, and every candidate built. Schedules are compared by
    measurement, so only on a device that measures (a GPU of the target's type); on the emulation
    the default one is built and verified. The candidates' programs are closed (the chosen one's
    too: the artifact keeps its binaries, not its device memory)."""
    schedules = _cuda_schedules(program, device.has_cublas) if device.measures else [DEFAULT_SCHEDULE]
    cases = measure_cases(graph, case[0], budget) if device.measures else []
    tracker = Tracker(progress, [schedule.name for schedule in schedules])
    built: list[CudaCandidate] = []
    for schedule in schedules:
        try:
            built.append(cuda_candidate(program, schedule, graph, case, tolerance, device, cases, tracker))
        except (CudaBuildFailed, VerificationFailed, CublasUnavailable) as exc:
            if len(schedules) == 1:
                raise
            built.append(CudaCandidate(schedule, error=str(exc)))
    # each product in the tile that measured fastest for it, where the tiles' winners differ
    mixed = _per_kernel_schedule(program, built)
    if mixed is not None:
        try:
            built.append(cuda_candidate(program, mixed, graph, case, tolerance, device, cases, tracker))
        except (CudaBuildFailed, VerificationFailed, CublasUnavailable) as exc:
            built.append(CudaCandidate(mixed, error=str(exc)))
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


def _per_kernel_schedule(program: Program, built: list[CudaCandidate]) -> CudaSchedule | None:
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


__all__ = ["race_cuda_schedules"]
