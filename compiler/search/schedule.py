"""Schedules in the e-graph, extracted by measurement.

    space = schedule_space(kernels, tensor_cores)          the e-graph's alternatives per kernel
    found = extract_by_measurement(space, measure_round, ...)  each kernel's fastest, measured

1. Each kernel of a lowered program is a term (`KernelTerm`): what it computes (a product, an
   elementwise loop, a reduction), named by a signature that is the same for equal kernels of
   any model (its canonical text), with the facts its rules need (dtype, the libraries that can
   compute it, the program's tensor-core format).
2. Schedule rules (SCHEDULE_RULES, egglog) add equivalent alternatives to each kernel's e-class:
   tiles, tensor-core tiles, library calls, threads per block, a warp or a block per output row
   on a GPU; OpenBLAS, generated register tiles, windows read in place or by panels on the CPU.
   Every alternative of a kernel's e-class is read back (`extract` with variants), so the space
   is what the rules derived, nothing listed by hand.
3. Extraction is by measurement: whole programs are built in rounds, round r giving each kernel
   its r-th alternative, and each launch is timed on the device at every measuring size (one
   round measures one alternative of every kernel at once). Each kernel keeps the alternative
   with the least time, normalized per size so that batch 1 weighs as much as the largest batch.
   The caller then builds the winners as one program, verifies it and times it whole.
4. Winners are cached by (kernel signature, device fingerprint, measuring sizes, compiler
   version): a second model with the same kernels measures nothing for them.

The search is deterministic under its seed (which orders the alternatives after the default) and
bounded by a budget in seconds (round 0, every kernel's default, always runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Protocol

from egglog import bindings

from compiler.kernels.schedule import KINDS, SIZELESS, KernelSchedule

SCHEDULE_RULES = """
(datatype Kernel
    (Product String String)
    (Elementwise String)
    (Reduction String i64)
    (Attention String)
    (Tiled i64 Kernel)
    (TensorCoreTiled i64 Kernel)
    (LibraryCall String Kernel)
    (Threads i64 Kernel)
    (WarpRows i64 Kernel)
    (BlockRows i64 Kernel)
    (GeneratedTiles Kernel)
    (WindowRows Kernel)
    (GeneratedPanels Kernel)
    (TransposedTiles Kernel)
    (DirectWindows Kernel)
    (DepthwisePlanes Kernel)
    (DepthwiseRegisters Kernel)
    (ReductionLoops Kernel)
    (ReductionLoopsInside Kernel)
    (ReductionLoopsColumns Kernel)
    (DequantizedTiles Kernel))
(relation CudaTarget ())
(relation CpuTarget ())
(relation Windowed (String))
(relation LoopForm (String))
(relation WeightA (String))
(relation Depthwise (String))
(relation DirectConvolution (String))
(relation RegisterPlanes (String))
(relation Dequantized (String))
(relation CudaCores ())
(relation TensorCores (String))
(relation LibraryComputes (String String))
(ruleset schedule)
; a product: a block computes a square of C, staged through shared memory
(rule ((= k (Product sig dtype)) (CudaTarget) (CudaCores))
      ((union k (Tiled 64 k)) (union k (Tiled 128 k))) :ruleset schedule)
(rule ((= k (Product sig dtype)) (CudaTarget) (TensorCores format) (!= dtype "float32"))
      ((union k (Tiled 64 k)) (union k (Tiled 128 k))) :ruleset schedule)
; float32 products multiply on tensor cores where the program's precision allows it
(rule ((= k (Product sig "float32")) (CudaTarget) (TensorCores format))
      ((union k (TensorCoreTiled 64 k)) (union k (TensorCoreTiled 128 k))) :ruleset schedule)
(rule ((= k (Product sig dtype)) (LibraryComputes library sig))
      ((union k (LibraryCall library k))) :ruleset schedule)
(rule ((= k (Elementwise sig)) (CudaTarget))
      ((union k (Threads 256 k)) (union k (Threads 128 k)) (union k (Threads 512 k))) :ruleset schedule)
; a reduction: a warp per output (short rows) or a block per output (long rows)
(rule ((= k (Reduction sig extent)) (CudaTarget))
      ((union k (WarpRows 8 k)) (union k (BlockRows 256 k))) :ruleset schedule)
; the CPU: a float32 product in generated register tiles; a convolution's also with its windows
; read in place or computed a panel at a time
(rule ((= k (Product sig "float32")) (CpuTarget))
      ((union k (GeneratedTiles k))) :ruleset schedule)
(rule ((= k (Product sig "float32")) (CpuTarget) (Windowed sig))
      ((union k (WindowRows k)) (union k (GeneratedPanels k))) :ruleset schedule)
; a product whose A is a weight also computed transposed (C^T = B^T A^T), A packed at compile
; time: a small image's few positions then run along the register tile's rows
(rule ((= k (Product sig "float32")) (CpuTarget) (WeightA sig))
      ((union k (TransposedTiles k))) :ruleset schedule)
; a convolution's product whose A is its weight also computed transposed from its windows in place:
; the input rows a task reads copied channels innermost, a tile of positions by output channels
(rule ((= k (Product sig "float32")) (CpuTarget) (DirectConvolution sig))
      ((union k (DirectWindows k))) :ruleset schedule)
; a depthwise convolution's product also plane by plane: each input plane padded and split by
; phase into cache, every output row one vector loop summing the taps
(rule ((= k (Product sig "float32")) (CpuTarget) (Depthwise sig))
      ((union k (DepthwisePlanes k))) :ruleset schedule)
; one whose input and output planes each fit a vector register also a plane a register, each tap
; a permutation of the plane
(rule ((= k (Product sig "float32")) (CpuTarget) (Depthwise sig) (RegisterPlanes sig))
      ((union k (DepthwiseRegisters k))) :ruleset schedule)
; a matrix-vector product (a depthwise convolution's, a dense layer's at one row) also as its
; reduction loop, which reads its operands in place: the reduced loops around the output row,
; each element's sum inside it, or the reduced loops around blocks of the row's columns, a thread's
; each (so is a product by int8 weights, which the loop widens as it reads them)
(rule ((= k (Product sig dtype)) (CpuTarget) (LoopForm sig))
      ((union k (ReductionLoops k)) (union k (ReductionLoopsInside k)) (union k (ReductionLoopsColumns k)))
      :ruleset schedule)
; a product by an int8 weight also with B widened a strip at a time into the register tiles' layout,
; once for all of A's rows
(rule ((= k (Product sig "float32")) (CpuTarget) (Dequantized sig))
      ((union k (DequantizedTiles k))) :ruleset schedule)
"""

# the most alternatives read back per kernel (the rules derive at most five today)
MAX_VARIANTS = 32
# a reduced extent at most this long defaults to a warp per output (as measured before the search)
WARP_ROWS_DEFAULT_MAX = 1024

_SPAN = bindings.RustSpan(__file__, 0, 0)


@dataclass(frozen=True)
class KernelTerm:
    """One kernel of a program as the schedule e-graph sees it."""

    number: int
    # "product" | "elementwise" | "reduction" | "attention"
    family: str
    # the same for equal kernels of any program: a hash of its canonical text (what a renderer
    # prints in the default schedule, buffers numbered by position) and its sizes
    signature: str
    dtype: str = "float32"
    # a reduction's reduced extent, 0 where symbolic
    extent: int = 0
    # the libraries that can compute it (a product cuBLAS takes as it stands)
    libraries: tuple[str, ...] = ()
    # a convolution's product whose B is its windows (the CPU reads them in place or by panels)
    windowed: bool = False
    # a product that can also run as its reduction loop (GemmCall.loops)
    loop_form: bool = False
    # a product whose A is a whole weight, shared by the batch (it can run transposed, A packed)
    weight_a: bool = False
    # a depthwise convolution's product (it can run plane by plane)
    depthwise: bool = False
    # a 2-D convolution's product whose A is its weight (it can run from its windows in place, transposed)
    direct: bool = False
    # a depthwise one whose input and output planes each fit a vector register
    register_planes: bool = False
    # a product whose B widens an integer weight (compiler.render.c.widens_integer_panels)
    dequantized: bool = False

    @property
    def term(self) -> str:
        if self.family == "product":
            return f'(Product "{self.signature}" "{self.dtype}")'
        if self.family == "elementwise":
            return f'(Elementwise "{self.signature}")'
        if self.family == "reduction":
            return f'(Reduction "{self.signature}" {self.extent})'
        return f'(Attention "{self.signature}")'

    def default(self, alternatives: Sequence[KernelSchedule]) -> KernelSchedule:
        """The alternative tried first: a 64-square tile (on tensor cores where there are), else
        a library call; 256 threads; a warp per output of a short known row. The others are
        tried in the seed's order."""
        wanted = {
            "product": (("tensor-core-tiled", 64), ("tiled", 64), ("library", 0)),
            "elementwise": (("threads", 256),),
            "reduction": (("warp-rows", 8),) if 0 < self.extent <= WARP_ROWS_DEFAULT_MAX else (("block-rows", 256),),
        }.get(self.family, ())
        for kind, size in wanted:
            for alternative in alternatives:
                if (alternative.kind, alternative.size) == (kind, size):
                    return alternative
        return alternatives[0]


@dataclass
class ScheduleSpace:
    kernels: list[KernelTerm]
    # kernel number -> its alternatives, the default first
    alternatives: dict[int, list[KernelSchedule]]
    enodes: int = 0
    seconds: float = 0.0

    @property
    def programs(self) -> int:
        """How many whole programs the space holds (one alternative per kernel)."""
        return prod(len(a) for a in self.alternatives.values())

    def default(self) -> dict[int, KernelSchedule]:
        return {n: alternatives[0] for n, alternatives in self.alternatives.items()}

    def report(self) -> dict[str, Any]:
        programs = self.programs
        return {
            "kernels": len(self.kernels),
            "searched_kernels": sum(len(a) > 1 for a in self.alternatives.values()),
            "alternatives": sum(len(a) for a in self.alternatives.values()),
            # (as text past 10^15: JSON readers lose integers beyond 2^53)
            "programs": programs if programs < 10**15 else f"{float(programs):.3g}",
            "enodes": self.enodes,
            "seconds": round(self.seconds, 4),
        }


def schedule_space(kernels: Sequence[KernelTerm], tensor_cores: str | None, seed: int = 0, target: str = "cuda") -> ScheduleSpace:
    """Every kernel's schedule alternatives as the rules derive them: the kernels' terms and
    facts are written into an e-graph, SCHEDULE_RULES run to saturation, and each kernel's e-class
    is read back whole. Kernels of one signature are one term (a model's repeated layers share
    an e-class)."""
    began = time.perf_counter()
    egraph = bindings.EGraph()
    if target not in ("cuda", "cpu"):
        raise ValueError(f"schedule target must be 'cuda' or 'cpu', not {target!r}")
    facts = [SCHEDULE_RULES, "(CudaTarget)" if target == "cuda" else "(CpuTarget)"]
    facts.append("(CudaCores)" if tensor_cores is None else f'(TensorCores "{tensor_cores}")')
    names: dict[str, str] = {}  # term -> its let
    for kernel in kernels:
        for library in kernel.libraries:
            facts.append(f'(LibraryComputes "{library}" "{kernel.signature}")')
        if kernel.windowed:
            facts.append(f'(Windowed "{kernel.signature}")')
        if kernel.loop_form:
            facts.append(f'(LoopForm "{kernel.signature}")')
        if kernel.weight_a:
            facts.append(f'(WeightA "{kernel.signature}")')
        if kernel.depthwise:
            facts.append(f'(Depthwise "{kernel.signature}")')
        if kernel.direct:
            facts.append(f'(DirectConvolution "{kernel.signature}")')
        if kernel.register_planes:
            facts.append(f'(RegisterPlanes "{kernel.signature}")')
        if kernel.dequantized:
            facts.append(f'(Dequantized "{kernel.signature}")')
        if kernel.term not in names:
            names[kernel.term] = f"$k{len(names)}"
            facts.append(f"(let {names[kernel.term]} {kernel.term})")
    facts.append("(run-schedule (saturate (run schedule)))")
    egraph.parse_and_run_program("\n".join(facts))
    (sizes,) = egraph.parse_and_run_program("(print-size)")
    enodes = sum(size for _, size in sizes.sizes)
    variants = {}
    for term, name in names.items():
        (output,) = egraph.parse_and_run_program(f"(extract {name} {MAX_VARIANTS})")
        variants[term] = sorted({s for s in (_schedule_of(output.termdag, t) for t in output.terms) if s is not None})
    alternatives = {}
    for kernel in kernels:
        found = variants[kernel.term]
        if not found:
            continue
        first = kernel.default(found)
        rest = [a for a in found if a != first]
        random.Random(f"{seed}:{kernel.signature}").shuffle(rest)
        alternatives[kernel.number] = [first, *rest]
    return ScheduleSpace(list(kernels), alternatives, enodes, time.perf_counter() - began)


def _schedule_of(termdag: bindings.TermDag, term_id: int) -> KernelSchedule | None:
    """The schedule a variant of a kernel's e-class spells, or None for the bare kernel."""
    term = termdag.get(term_id)
    if not isinstance(term, bindings.TermApp) or term.name not in KINDS:
        return None
    if KINDS[term.name] in SIZELESS:
        return KernelSchedule(KINDS[term.name])
    argument = termdag.get(term.args[0])
    value = argument.value.value
    kind = KINDS[term.name]
    return KernelSchedule(kind, library=value) if kind == "library" else KernelSchedule(kind, int(value))


# ---- extraction by measurement ----------------------------------------------------------------


class RoundFailed(Exception):
    """A round's program did not build, verify or run: the reason names the failure."""


# one round: each kernel's schedule -> each kernel's device ms by measuring size (kernels whose
# launches were not timed are absent); raises RoundFailed
MeasureRound = Callable[[dict[int, KernelSchedule]], dict[int, dict[str, float]]]


class KernelCache(Protocol):
    """Where measured winners are kept: the object store's `kernels/` prefix in the service, a
    directory in a local compile."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def put(self, key: str, record: dict[str, Any]) -> None: ...


class DirectoryKernelCache:
    """A KernelCache of JSON files in a directory (written whole, then renamed into place)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None  # absent or torn: measured again

    def put(self, key: str, record: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(record, file)
        os.replace(temporary, self.root / f"{key}.json")


def cache_key(kernel: KernelTerm, device: str, sizes: Sequence[str], version: str) -> str:
    """The cache's key of a kernel's winner: its term (signature and facts), the device's
    fingerprint, the sizes it was measured at and the compiler's version."""
    facts = [sorted(kernel.libraries), kernel.windowed, kernel.loop_form, kernel.weight_a, kernel.depthwise, kernel.register_planes, kernel.direct, kernel.dequantized]
    text = json.dumps([kernel.term, *facts, device, list(sizes), version])
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclass
class Extraction:
    """Each kernel's measured winner, and what the search did to find it."""

    choices: dict[int, KernelSchedule]
    report: dict[str, Any] = field(default_factory=dict)
    # per successful round: its choices and its summed kernel ms (a fallback if the winners'
    # program fails its whole-program check)
    rounds: list[tuple[dict[int, KernelSchedule], float]] = field(default_factory=list)


def extract_by_measurement(
    space: ScheduleSpace,
    measure_round: MeasureRound,
    budget_seconds: float,
    cache: KernelCache | None = None,
    device: str = "",
    sizes: Sequence[str] = (),
    version: str = "",
    prebuild: Callable[[list[dict[int, KernelSchedule]]], Sequence[Callable[[], None]] | None] | None = None,
    passes: int = 1,
) -> Extraction:
    """Each kernel's fastest alternative (see the module's docstring). Round 0 (every kernel's
    default, or its cached winner) must succeed: its RoundFailed propagates. A later round that
    fails marks the alternatives it tried as failed; a kernel's winner is the alternative with the
    least normalized time among those measured; a kernel that was never timed keeps its default.
    `prebuild`, when given, is handed every round's choices before the first is measured (so the
    caller can build them all at once, in parallel); it may return, per round, a wait for its
    build, called before the round is first measured and counted in the budget (so rounds are
    measured as their builds land, and builds slower than the budget cost rounds, not the search). With `passes` > 1 the rounds are measured
    again in turn, while the budget lasts, and each kernel keeps its least time at each size (on a
    shared machine noise only ever adds time)."""
    began = time.perf_counter()
    keys = {k.number: cache_key(k, device, sizes, version) for k in space.kernels if k.number in space.alternatives}
    fixed: dict[int, KernelSchedule] = {}
    cached: dict[int, dict[str, Any]] = {}
    if cache is not None:
        for number, key in keys.items():
            record = cache.get(key)
            if record is None:
                continue
            try:
                winner = KernelSchedule.from_label(record["chosen"])
            except (KeyError, ValueError, TypeError):
                continue
            if winner in space.alternatives[number]:
                fixed[number], cached[number] = winner, record
    searched = {n: a for n, a in space.alternatives.items() if n not in fixed and len(a) > 1}
    measured: dict[int, dict[KernelSchedule, dict[str, float]]] = {n: {} for n in space.alternatives}
    failed: dict[int, dict[KernelSchedule, str]] = {n: {} for n in space.alternatives}
    rounds_report = []
    extraction = Extraction({})
    depth = max((len(a) for a in searched.values()), default=1)
    planned = [
        ({**space.default(), **fixed, **{n: a[r] for n, a in searched.items() if r < len(a)}},
         {n: a[r] for n, a in searched.items() if r < len(a)})
        for r in range(depth)
    ]
    waits = prebuild([choices for choices, _ in planned]) if prebuild is not None else None
    failed_rounds: set[int] = set()
    totals: dict[int, float] = {}
    spent = False
    for p in range(passes if depth > 1 else 1):
        for r, (choices, trying) in enumerate(planned):
            if r in failed_rounds:
                continue
            if (r > 0 or p > 0) and time.perf_counter() - began >= budget_seconds:
                if p == 0:
                    rounds_report.append({"round": r, "skipped": "the search's budget was spent"})
                spent = True
                break
            round_began = time.perf_counter()
            if waits is not None and p == 0:
                waits[r]()
                if r > 0 and time.perf_counter() - began >= budget_seconds:
                    rounds_report.append({"round": r, "skipped": "the search's budget was spent while it was built"})
                    spent = True
                    break
            try:
                timings = measure_round(choices)
            except RoundFailed as exc:
                if r == 0 and p == 0:
                    raise
                failed_rounds.add(r)
                for number, alternative in trying.items():
                    failed[number][alternative] = str(exc)
                rounds_report.append({"round": r, "pass": p, "error": str(exc), "seconds": round(time.perf_counter() - round_began, 4)})
                continue
            for number, by_size in timings.items():
                if number in choices and by_size:
                    best = measured[number].setdefault(choices[number], {})
                    for size, ms in by_size.items():
                        best[size] = min(ms, best.get(size, ms))
            total = sum(sum(by_size.values()) for by_size in timings.values())
            totals[r] = min(total, totals.get(r, total))
            rounds_report.append({"round": r, "pass": p, "kernel_ms": round(total, 4), "seconds": round(time.perf_counter() - round_began, 4)})
        if spent:
            break
    extraction.rounds = [(planned[r][0], total) for r, total in sorted(totals.items()) if r not in failed_rounds]
    winners: dict[int, KernelSchedule] = {}
    kernels_report: dict[str, Any] = {}
    by_number = {k.number: k for k in space.kernels}
    for number, alternatives in space.alternatives.items():
        if number in fixed:
            winners[number] = fixed[number]
            kernels_report[str(number)] = {"term": by_number[number].term, "chosen": fixed[number].label, "cached": True, "measured": cached[number].get("measured", {})}
            continue
        timed = measured[number]
        winners[number] = _fastest(timed) if timed else alternatives[0]
        if len(alternatives) > 1 or timed:
            record = {
                "term": by_number[number].term,
                "chosen": winners[number].label,
                "measured": {a.label: _rounded(ms) for a, ms in timed.items()},
            }
            if failed[number]:
                record["failed"] = {a.label: why for a, why in failed[number].items()}
            kernels_report[str(number)] = record
            if cache is not None and timed and len(timed) + len(failed[number]) == len(alternatives):
                cache.put(keys[number], {"chosen": winners[number].label, "measured": record["measured"], "term": record["term"], "device": device})
    extraction.choices = winners
    extraction.report = {
        "space": space.report(),
        "budget_seconds": budget_seconds,
        "rounds": rounds_report,
        "cache": {"hits": len(fixed), "misses": len(searched)},
        "kernels": kernels_report,
        "seconds": round(time.perf_counter() - began, 4),
    }
    return extraction


def _fastest(timed: Mapping[KernelSchedule, dict[str, float]]) -> KernelSchedule:
    """The alternatives in the order tried, each challenging the fastest so far over the sizes
    both were measured at: the one with the least sum over those sizes of its time over the
    pair's best (each size weighs the same) stays; ties keep the earlier. Pairwise, a size some
    third alternative was not measured at (its rounds skipped the large size) still decides
    between the two that were: taken over every alternative at once, it was dropped for all."""
    alternatives = list(timed)
    fastest = alternatives[0]
    for challenger in alternatives[1:]:
        sizes = set(timed[fastest]) & set(timed[challenger])
        if not sizes:
            continue
        best = {size: min(timed[fastest][size], timed[challenger][size]) or 1e-9 for size in sizes}
        score = {a: sum(timed[a][size] / best[size] for size in sizes) for a in (fastest, challenger)}
        if score[challenger] < score[fastest]:
            fastest = challenger
    return fastest


def _rounded(by_size: Mapping[str, float]) -> dict[str, float]:
    return {size: round(ms, 5) for size, ms in by_size.items()}
