"""The CUDA schedule search: each kernel's schedule comes from the schedule e-graph
(compiler.search.schedule) and is extracted by measurement on a GPU of the target's type.

    found = search_cuda_schedule(program, graph, case, tolerance, device, progress, budget, cache)

For each form of the program (attention as one kernel where the kernel rules found it, and as
the kernels lowering spelled, where there is one to fuse) the kernels' terms go into the schedule
e-graph; rounds of whole programs are built, verified and every launch timed at each measuring
size; each kernel keeps its fastest alternative; the winners are built as one program, verified
and timed whole (a round that did better whole is kept instead). The faster form wins. On a
device that does not measure (the CPU emulation of a compile worker without that GPU) every
kernel takes its first alternative, built and verified, unmeasured, and the report says so.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler.backends.cublas import CublasUnavailable
from compiler.backends.cuda import CudaBuildFailed
from compiler.candidates import CudaCandidate, cuda_candidate
from compiler.devices import CudaDevice
from compiler.ir import Graph
from compiler.kernels.ir import AttentionCall, GemmCall, Program
from compiler.kernels.schedule import KernelSchedule
from compiler.memory import MemoryBudget
from compiler.progress import Progress, Tracker
from compiler.render.cuda import DEFAULT_SCHEDULE, CudaRenderer, CudaSchedule, library_gemm, scheduled
from compiler.search.extract import measure_cases
from compiler.search.schedule import (
    Extraction,
    KernelCache,
    KernelTerm,
    RoundFailed,
    extract_by_measurement,
    schedule_space,
)
from compiler.shape import numel
from compiler.tuning import SCHEDULE_SEARCH_SECONDS, SCHEDULE_SEARCH_SEED
from compiler.verify import VerificationFailed

_FAILURES = (CudaBuildFailed, VerificationFailed, CublasUnavailable)


@dataclass
class CudaSearch:
    """The chosen candidate (its program closed: the artifact keeps binaries), every candidate
    built, and the search's report."""

    chosen: CudaCandidate
    built: list[CudaCandidate] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)


def kernel_terms(program: Program, library: bool) -> list[KernelTerm]:
    """Each kernel of the program as the schedule e-graph sees it: its family, a signature that is
    the same for an equal kernel of any program (the hash of the CUDA text it renders to, buffers
    numbered by position, with its grid), and the libraries that can compute it."""
    renderer = CudaRenderer(program, DEFAULT_SCHEDULE)
    terms = []
    for number, kernel in enumerate(program.kernels):
        text, _, grid, threads = renderer.cuda_kernel(kernel, number)
        dtypes = sorted({b.dtype for b in program.buffers})
        signature = hashlib.sha256(f"{text}|{grid}|{threads}|{dtypes}|{program.tensor_cores}".encode()).hexdigest()[:24]
        if isinstance(kernel, GemmCall):
            libraries = ("cublas",) if library and library_gemm(program, kernel) is not None else ()
            terms.append(KernelTerm(number, "product", signature, kernel.dtype, libraries=libraries))
        elif isinstance(kernel, AttentionCall):
            terms.append(KernelTerm(number, "attention", signature))
        elif kernel.reduce is None:
            terms.append(KernelTerm(number, "elementwise", signature))
        else:
            extent = numel(kernel.reduce[1])
            terms.append(KernelTerm(number, "reduction", signature, extent=extent if isinstance(extent, int) else 0))
    return terms


def search_cuda_schedule(
    program: Program, graph: Graph, case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], tolerance: float,
    device: CudaDevice, progress: Progress | None, budget: MemoryBudget | None = None,
    cache: KernelCache | None = None, seconds: float = SCHEDULE_SEARCH_SECONDS, seed: int = SCHEDULE_SEARCH_SEED,
    version: str = "",
) -> CudaSearch:
    """See the module's docstring; `version` is the compiler's (part of the cache's key). Raises
    VerificationFailed where no form's program runs correctly."""
    began = time.perf_counter()
    fused_program = scheduled(program, DEFAULT_SCHEDULE)
    # form -> whether attention runs as one kernel; a form names its schedules (cuda-round0...)
    forms = {"cuda": True}
    if fused_program is not program:
        forms["cuda-unfused-attention"] = False
    tracker = Tracker(progress, list(forms))
    cases = measure_cases(graph, case[0], budget) if device.measures else []
    built: list[CudaCandidate] = []
    finals: list[CudaCandidate] = []
    forms_report: dict[str, Any] = {}
    for form, fused in forms.items():
        form_program = fused_program if fused else program
        space = schedule_space(kernel_terms(form_program, device.measures and device.has_cublas), form_program.tensor_cores, seed)
        if not device.measures:
            schedule = CudaSchedule(f"{form}-default", fused_attention=fused, choices=tuple(sorted(space.default().items())))
            try:
                finals.append(cuda_candidate(program, schedule, graph, case, tolerance, device, cases, tracker))
            except _FAILURES as exc:
                built.append(CudaCandidate(schedule, error=str(exc)))
                forms_report[form] = {"space": space.report(), "error": str(exc)}
                continue
            forms_report[form] = {"space": space.report(), "unmeasured": f"{device.name} does not measure: every kernel's first alternative"}
            break  # (unmeasured, the first form that runs is the program)
        rounds: list[CudaCandidate] = []
        attempts = [0]  # (rounds tried in this form, failed ones too: each names its schedule)

        def measure_round(
            choices: dict[int, KernelSchedule], form: str = form, fused: bool = fused, rounds: list = rounds, attempts: list = attempts,
        ) -> dict[int, dict[str, float]]:
            schedule = CudaSchedule(f"{form}-round{attempts[0]}", fused_attention=fused, choices=tuple(sorted(choices.items())))
            attempts[0] += 1
            try:
                candidate = cuda_candidate(program, schedule, graph, case, tolerance, device, cases, tracker, profile=True)
            except _FAILURES as exc:
                built.append(CudaCandidate(schedule, error=str(exc)))
                raise RoundFailed(str(exc)) from None
            candidate.loaded.close()
            candidate.loaded = None
            rounds.append(candidate)
            built.append(candidate)
            return _by_kernel(candidate.kernel_ms_by_size)

        remaining = max(0.0, seconds - (time.perf_counter() - began)) / (len(forms) - list(forms).index(form))
        try:
            extraction = extract_by_measurement(
                space, measure_round, remaining, cache, device.fingerprint, [label for label, _ in cases], version,
            )
        except RoundFailed as exc:
            forms_report[form] = {"space": space.report(), "error": str(exc)}
            continue
        final = _final(program, form, fused, extraction, rounds, graph, case, tolerance, device, cases, tracker, built)
        forms_report[form] = {**extraction.report, "chosen_round": final.schedule.name}
        finals.append(final)
    if not finals:
        raise VerificationFailed(
            f"no CUDA schedule ran correctly: {'; '.join(f'{c.schedule.name}: {c.error}' for c in built if c.error)}"
        )
    timed_sizes = set.intersection(*(set(c.device_ms) for c in finals)) if device.measures else set()
    chosen = min(finals, key=lambda c: sum(c.device_ms[size] for size in timed_sizes))
    for candidate in finals:
        if candidate.loaded is not None:
            candidate.loaded.close()
            candidate.loaded = None
    report = {"forms": forms_report, "chosen": chosen.schedule.name, "seconds": round(time.perf_counter() - began, 4)}
    return CudaSearch(chosen, built + finals, report)


def _final(
    program: Program, form: str, fused: bool, extraction: Extraction, rounds: list[CudaCandidate], graph: Graph,
    case, tolerance: float, device: CudaDevice, cases: list, tracker: Tracker, built: list[CudaCandidate],
) -> CudaCandidate:
    """The winners as one program, verified and timed whole; where it fails, or a round's program
    was faster whole (kernels that overlap or share caches), that round's choices instead."""
    schedule = CudaSchedule(f"{form}-searched", fused_attention=fused, choices=tuple(sorted(extraction.choices.items())))
    try:
        final = cuda_candidate(program, schedule, graph, case, tolerance, device, cases, tracker)
    except _FAILURES as exc:
        built.append(CudaCandidate(schedule, error=str(exc)))
        final = None
    timed = [c for c in rounds if c.device_ms]
    best_round = min(timed, key=lambda c: sum(c.device_ms.values()), default=None)
    if best_round is not None and (final is None or sum(best_round.device_ms.values()) < sum(final.device_ms.get(s, float("inf")) for s in best_round.device_ms)):
        if final is not None:
            final.loaded.close()
            final.loaded = None
            built.append(final)
        return cuda_candidate(program, best_round.schedule, graph, case, tolerance, device, cases, tracker)
    if final is None:
        raise VerificationFailed(f"the searched schedule and every round failed ({form})")
    return final


def _by_kernel(kernel_ms_by_size: dict[str, list[float | None]]) -> dict[int, dict[str, float]]:
    """{size: [ms of each kernel]} as {kernel: {size: ms}}, without kernels that did not run."""
    by_kernel: dict[int, dict[str, float]] = {}
    for size, kernel_ms in kernel_ms_by_size.items():
        for number, ms in enumerate(kernel_ms):
            if ms is not None:
                by_kernel.setdefault(number, {})[size] = ms
    return by_kernel


def product_schedules(program: Program, schedule: CudaSchedule) -> dict[str, int]:
    """How many products each schedule computes ("tile64", "tc-tile128", "cublas"...)."""
    counts = Counter(
        (schedule.of(n) or KernelSchedule("tiled", schedule.product_tile)).label
        for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)
    )
    return dict(sorted(counts.items()))


__all__ = ["CudaSearch", "kernel_terms", "product_schedules", "search_cuda_schedule"]
