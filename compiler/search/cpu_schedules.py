"""The CPU schedule search: each product's schedule (OpenBLAS, generated register tiles, a
convolution's windows read in place or by panels) comes from the schedule e-graph
(compiler.search.schedule) and is extracted by measurement on this CPU.

    candidates, report = search_native(program, graph, case, cases, device, tracker, cache, version)

Rounds of whole programs are rendered with every kernel timed (render's `profile`), built, run on
the verification case and timed kernel by kernel at each measuring size in the helper process;
each product keeps its fastest alternative, and the winners are built as one program (without
the timing), verified, and become the "native-searched" candidate that the whole-program race
(against the loop nests and the NumPy lowering) measures like any other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from compiler.backends import native_cpu
from compiler.devices import CpuDevice
from compiler.errors import CompilerError
from compiler.ir import Graph
from compiler.kernels.attention import attention_count, fuse_attention
from compiler.kernels.ir import GemmCall, Program
from compiler.kernels.ir_walk import exclusive_feeders
from compiler.kernels.schedule import KernelSchedule
from compiler.progress import Tracker
from compiler.render.c import (
    ATTENTION_HEAD_MAX,
    CRenderer,
    depthwise_of,
    direct_windows,
    prepack_weights,
    register_planes,
    render,
    transposed_packable,
    widens_integer_panels,
)
from compiler.search.extract import Candidate
from compiler.search.measure import CandidateFailed
from compiler.search.schedule import (
    KernelCache,
    KernelTerm,
    RoundFailed,
    extract_by_measurement,
    schedule_space,
)
from compiler.tuning import (
    MAX_LARGE_RUN_S,
    SCHEDULE_MEASURE_PASSES,
    SCHEDULE_SEARCH_SECONDS,
    SCHEDULE_SEARCH_SEED,
)
from compiler.verify import VerificationFailed, max_error

NAME = "native-searched"
# the same with each attention one online-softmax kernel (compiler.kernels.attention)
NAME_ATTENTION = "native-searched-attention"
# a schedule kind -> how the C renderer runs the product (compiler.render.c.GEMM_KINDS)
GEMM_KIND = {"library": "blas", "generated-tiles": "tiled", "window-rows": "mixed", "generated-panels": "panels",
             "transposed-tiles": "transposed", "direct-windows": "direct", "depthwise-planes": "depthwise",
             "depthwise-registers": "depthwise-registers", "loops": "loops",
             "loops-inside": "loops-inside", "loops-columns": "loops-columns", "dequantized-tiles": "dequantized"}
# the products whose weight is packed at compile time: the generated ones
_PACKED = frozenset({"generated-tiles", "window-rows", "generated-panels"})


def kernel_terms(program: Program) -> list[KernelTerm]:
    """The program's products as the schedule e-graph sees them (its loops have no alternatives on
    the CPU yet): a signature from the C they render to in OpenBLAS form (and as their reduction
    loop, where they have one), buffers numbered by position, whether B is a convolution's
    windows, and whether there is a loop form."""
    renderer = CRenderer(program)
    looped = CRenderer(program, gemm={n: "loops" for n, k in enumerate(program.kernels) if isinstance(k, GemmCall) and k.loops is not None})
    terms = []
    for number, kernel in enumerate(program.kernels):
        if not isinstance(kernel, GemmCall):
            continue
        text = renderer.kernel(number, kernel) + (looped.kernel(number, kernel) if kernel.loops is not None else "")
        text = _buffers_by_position(re.sub(r"\bk\d+\b", "kN", text))
        dtypes = [program.buffers[b].dtype for b in (kernel.a, kernel.b, kernel.c)]
        weight_a, depthwise = transposed_packable(program, kernel), depthwise_of(kernel) is not None
        signature = hashlib.sha256(f"{text}|{dtypes}|{weight_a}|{depthwise}".encode()).hexdigest()[:24]
        libraries = ("openblas",) if kernel.dtype in ("float32", "float64") else ()
        terms.append(KernelTerm(
            number, "product", signature, kernel.dtype, libraries=libraries, windowed=kernel.b_panels is not None,
            loop_form=kernel.loops is not None, weight_a=weight_a, depthwise=depthwise,
            dequantized=widens_integer_panels(program, kernel), register_planes=register_planes(kernel) is not None,
            direct=direct_windows(program, kernel) is not None,
        ))
    return terms


def _elements(inputs: dict[str, np.ndarray]) -> int:
    return max(1, sum(int(x.size) for x in inputs.values()))


def _buffers_by_position(text: str) -> str:
    """The text with its buffers b<id> renumbered in order of first appearance."""
    positions: dict[str, str] = {}
    return re.sub(r"\bb(\d+)\b", lambda m: positions.setdefault(m[1], f"b{len(positions)}"), text)


def search_native(
    program: Program, graph: Graph, case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]], cases: list,
    device: CpuDevice, tracker: Tracker, cache: KernelCache | None = None, version: str = "",
    seconds: float = SCHEDULE_SEARCH_SECONDS, seed: int = SCHEDULE_SEARCH_SEED,
) -> tuple[list[Candidate], dict[str, Any]]:
    """The searched candidates (loaded on `device`, within its session) and the search's report:
    the program with each product as extracted, and where it has attention the same with each
    attention fused (NAME_ATTENTION); none (the report says why) where the program has no product
    to choose for, or no round ran."""
    space = schedule_space(kernel_terms(program), None, seed, target="cpu")
    if not any(len(a) > 1 for a in space.alternatives.values()):
        return [], {"space": space.report(), "skipped": "no product with more than one schedule"}
    verify_inputs, expected = case
    timed_cases = cases or [("verify", verify_inputs)]
    # a product's time includes the kernels that pack its operands for it alone: its loop form
    # makes them dead (they are then not run), so the forms compare whole
    feeders = {term.number: exclusive_feeders(program, term.number) for term in space.kernels}
    rounds: list[str] = []

    def measure_round(choices: dict[int, KernelSchedule]) -> dict[int, dict[str, float]]:
        name = f"{NAME}-round{len(rounds)}"
        try:
            loaded, _ = _built(program, graph, choices, name, device, tracker, profile=True)
            tracker.phase("verify", name)
            outputs = device.run(loaded, verify_inputs)
            for output, value in outputs.items():  # (max_error raises where an output disagrees)
                max_error(expected[output], value)
            tracker.searched(name)
            by_kernel: dict[int, dict[str, float]] = {}
            first_run_s = 0.0
            for size, (label, inputs) in enumerate(timed_cases):
                if size > 0 and first_run_s * _elements(inputs) / _elements(timed_cases[0][1]) > MAX_LARGE_RUN_S:
                    continue  # a run there would take long: the whole-program race skips it too
                try:
                    kernel_seconds = device.profile(loaded, inputs, len(program.kernels))
                except CandidateFailed as exc:
                    if exc.crashed or size == 0:
                        raise
                    continue  # a larger size this program does not run (as the whole-program race skips it)
                for number, seconds_run in enumerate(kernel_seconds):
                    by_kernel.setdefault(number, {})[label] = seconds_run * 1000.0
                for number, feeding in feeders.items():
                    by_kernel[number][label] += sum(kernel_seconds[f] for f in feeding) * 1000.0
                if size == 0:
                    first_run_s = sum(kernel_seconds)
        except (CompilerError, CandidateFailed, VerificationFailed) as exc:
            raise RoundFailed(str(getattr(exc, "reason", exc))) from None
        finally:
            rounds.append(name)
        return by_kernel

    builds = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="schedule-build")

    def prebuild(planned: list[dict[int, KernelSchedule]]) -> list:
        # every round's C compiled in round order, a build per core (each lands in native_cpu's
        # cache); measuring waits for all of them, or for the budget (no compiler may share the
        # cores with a round being timed), then for the round's own
        deadline = time.perf_counter() + seconds
        futures = [builds.submit(_build_quietly, _rendered(program, choices, profile=True)[1]) for choices in planned]

        def wait_for(future) -> None:
            concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.perf_counter()))
            future.result()

        return [lambda future=future: wait_for(future) for future in futures]

    try:
        extraction = extract_by_measurement(
            space, measure_round, seconds, cache, device.fingerprint, [label for label, _ in timed_cases], version,
            prebuild, SCHEDULE_MEASURE_PASSES,
        )
    except RoundFailed as exc:
        return [], {"space": space.report(), "error": str(exc)}
    finally:
        builds.shutdown(wait=False, cancel_futures=True)  # (rounds the budget left unmeasured)
    choices = extraction.choices
    products = Counter(alternative.label for alternative in choices.values())
    report = {**extraction.report, "products": dict(sorted(products.items()))}
    try:
        candidate = _verified(program, graph, choices, NAME, device, tracker, case)
    except (CompilerError, CandidateFailed, VerificationFailed) as exc:
        return [], {**extraction.report, "error": str(getattr(exc, "reason", exc))}
    # attention's form: the same program with each attention one online-softmax kernel (the rules
    # of compiler.search.kernel_rules find them), its other products as chosen; the race measures both
    fused = fuse_attention(program, ATTENTION_HEAD_MAX)
    if fused is program:
        return [candidate], report
    report["attention"] = {"fused": attention_count(fused)}
    try:
        return [candidate, _verified(fused, graph, _carried(program, fused, choices), NAME_ATTENTION, device, tracker, case)], report
    except (CompilerError, CandidateFailed, VerificationFailed) as exc:
        report["attention"]["error"] = str(getattr(exc, "reason", exc))
        return [candidate], report


def _verified(
    program: Program, graph: Graph, choices: dict[int, KernelSchedule], name: str, device: CpuDevice, tracker: Tracker,
    case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> Candidate:
    """The program with each product as chosen, built, loaded, verified on the case: a candidate
    of the race (raises where it fails to build, run or verify)."""
    verify_inputs, expected = case
    loaded, built = _built(program, graph, choices, name, device, tracker, profile=False)
    tracker.phase("verify", name)
    outputs = device.run(loaded, verify_inputs)
    error = max((max_error(expected[k], v) for k, v in outputs.items()), default=0.0)
    kernel, binaries, weights, stats = built
    candidate = Candidate(name, [kernel], binaries, weights, error, stats)
    candidate.timer = lambda label, inputs, loaded=loaded: device.time(loaded, inputs)
    return candidate


def _carried(program: Program, fused: Program, choices: dict[int, KernelSchedule]) -> dict[int, KernelSchedule]:
    """The choices for `program`'s kernels renumbered as they stand in `fused` (which keeps the
    kernels it does not replace, the same objects, in order)."""
    number = {id(kernel): n for n, kernel in enumerate(program.kernels)}
    return {
        n: choices[number[id(kernel)]] for n, kernel in enumerate(fused.kernels)
        if id(kernel) in number and number[id(kernel)] in choices
    }


def _rendered(program: Program, choices: dict[int, KernelSchedule], profile: bool) -> tuple[Program, str]:
    """The program with the chosen products' weights packed, and its C with each product as chosen."""
    kinds = {number: GEMM_KIND[choice.kind] for number, choice in choices.items()}
    packed = {number for number, choice in choices.items() if choice.kind in _PACKED}
    transposed = {number for number, choice in choices.items() if choice.kind in ("transposed-tiles", "direct-windows")}
    rendered = prepack_weights(program, only=packed, transposed=transposed) if packed or transposed else program
    return rendered, render(rendered, profile=profile, gemm=kinds)


def _build_quietly(source: str) -> None:
    """Builds into the cache; a failure is the round's, reported when it is measured."""
    with contextlib.suppress(CompilerError):
        native_cpu.build(source)


def _built(
    program: Program, graph: Graph, choices: dict[int, KernelSchedule], name: str, device: CpuDevice, tracker: Tracker,
    profile: bool,
) -> tuple[str, tuple[dict[str, Any], dict[str, bytes], dict[str, np.ndarray], dict[str, Any]]]:
    """The program rendered with each product as `choices` says, built and loaded on `device`."""
    began = time.perf_counter()
    rendered, source = _rendered(program, choices, profile)
    tracker.phase("build", name)
    binaries = device.build(source)
    layout = native_cpu.describe(rendered, graph.size_limits)
    kernel = {"kind": "native", "layout": layout, "source": source, "fingerprint": native_cpu.cpu_fingerprint()}
    loaded = device.load(name, kernel, rendered.weights, binaries)
    stats = {
        "kernels": len(rendered.kernels),
        "gemm_calls": sum(isinstance(k, GemmCall) for k in rendered.kernels),
        "fused_epilogues": sum(isinstance(k, GemmCall) and k.epilogue is not None for k in rendered.kernels),
        "build_seconds": round(time.perf_counter() - began, 4),
    }
    return loaded, (kernel, binaries, dict(rendered.weights), stats)


__all__ = ["NAME", "NAME_ATTENTION", "kernel_terms", "search_native"]
