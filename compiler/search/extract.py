"""The search as the pipeline runs it: the e-graph rewrites the graph into a cheaper equivalent
(search_graph), then extraction by measurement picks among the verified candidates.

    program_graph, report = search_graph(graph, enabled)      # compiler/search/egraph.py
    cases = measure_cases(graph, verify_inputs, budget)        # the sizes candidates are timed at
    measuring = measure_candidates(found, cases, rejected)     # in turns (measure.round_robin)
    best = choose(found)

A candidate's timer runs it once on a size's inputs: on its Device (compiler/devices.py) for
generated C, in this process for the NumPy lowering.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler.artifact import Signature
from compiler.ir import Graph
from compiler.memory import MemoryBudget, halvings, input_symbols
from compiler.progress import Tracker
from compiler.reference import run_graph
from compiler.search import measure
from compiler.search.egraph import optimize
from compiler.search.measure import CandidateFailed
from compiler.shape import ShapeError
from compiler.tuning import (
    FAR_BEHIND,
    MAX_LARGE_RUN_S,
    MEASURE_BUDGET_S,
    MEASURE_LARGE_SYMBOL_SIZE,
    MEASURE_MIN_REPEATS,
    MEASURE_REPEATS,
    MEASURE_REQUEST_SEQUENCE,
    MEASURE_SYMBOL_SIZE,
    NUMPY_MARGIN,
    SEARCH_BUDGET,
    VERIFY_SYMBOL_SIZE,
)
from compiler.verify import sample_inputs

# ---- the e-graph ---------------------------------------------------------------------------------


def search_graph(graph: Graph, enabled: bool) -> tuple[Graph, dict[str, Any]]:
    """The graph the candidates are built from (the e-graph's cheaper equivalent, or the graph
    itself), and what the search did, compact for the report."""
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


# ---- extraction by measurement -------------------------------------------------------------------


@dataclass
class Candidate:
    """A verified program of a cpu compile: generated C loaded in the helper process, or the NumPy
    lowering."""

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
    # seconds one run takes on the inputs of a size (label, inputs): on the CpuDevice for
    # generated C (the helper process), here for the NumPy program
    timer: Callable[[str, dict[str, np.ndarray]], float] | None = None


def candidate_report(c: Candidate) -> dict[str, Any]:
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


def measure_cases(
    graph: Graph, verify_inputs: dict[str, np.ndarray], budget: MemoryBudget | None = None
) -> list[tuple[str, dict[str, np.ndarray]]]:
    """The inputs candidates are timed on, by size label: the small size (the verification case
    when the model does not allow it), a request's size (MEASURE_REQUEST_SEQUENCE), then the large
    one, each where the model's limits let it differ from those before. Integer inputs are all 0:
    always a valid index, whatever the indexed axis. A size that does not fit the `budget` is
    replaced by a smaller one (the small size down to 1, the large down to half), or left out."""
    budget = budget or MemoryBudget(graph, [], None)
    small_size = budget.largest(halvings(MEASURE_SYMBOL_SIZE), "the small measuring size")
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
        for s in input_symbols(graph)
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


def measure_candidates(
    found: list[Candidate],
    cases: list[tuple[str, dict[str, np.ndarray]]],
    rejected: dict[str, str],
    tracker: Tracker | None = None,
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
    tracker = tracker or Tracker(None, ())

    def run_timed(c: Candidate, label: str, inputs: dict[str, np.ndarray]) -> float:
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
            # the size alone is dropped: a request's sequence past a model's position table fails
            # where the next size (every symbol at 32) runs, and must still be raced there
            notes.append(f"size {label} dropped: " + "; ".join(f"{n} {why}" for n, why in errors.items()))
            for c in found:
                c.ms_by_size.pop(label, None)
            continue
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


def choose(found: list[Candidate]) -> Candidate:
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


__all__ = ["Candidate", "candidate_report", "choose", "measure_candidates", "measure_cases", "search_graph"]
