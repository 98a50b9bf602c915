"""The compile pipeline's candidates: the search runs before lowering and is checked against the
parsed graph; native candidates are verified and timed in a helper process, so one that is
wrong, crashes or hangs is rejected and the compile goes on; the choice between generated C and
the NumPy lowering is made in turns, at two sizes, with a margin."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest

from compiler import Artifact, candidates, compile_graph, compile_onnx, executable, pipeline, tuning
from compiler.artifact import Signature
from compiler.backends import native_cpu
from compiler.frontends.onnx import load_graph
from compiler.ir import GraphBuilder, Op, SymDim
from compiler.kernels.ir import GemmCall
from compiler.memory import memory_terms
from compiler.reference import run_graph
from compiler.render.c import render as real_render
from compiler.search import extract, measure
from compiler.search.measure import CandidateFailed
from compiler.search.rules import FOLD_SLACK_BYTES
from tests.onnx_models import mlp

N = SymDim.named("n")
ENTRY = "int lc_run(const int64_t *S, void **B) {\n"
SEGFAULT = "    { volatile int *lc_null = 0; *lc_null = 1; }\n"
HANG = "    for (;;) { __asm__ volatile(\"\"); }\n"


def removable_work_graph():
    """x * 1 + 0, summed over its last axis, then a contraction with a weight: the search removes
    the identities; the contraction gives a BLAS and a loop-only candidate."""
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", (N, 4), "float32")
    y = b.binary(Op.ADD, b.scalar_like(0, x), b.binary(Op.MUL, x, b.scalar_like(1, x)))
    w = b.constant(rng.standard_normal((4, 6)).astype(np.float32))
    product = b.binary(Op.MUL, b.expand(b.reshape(y, (N, 4, 1)), (N, 4, 6)), b.broadcast_to(w, (N, 4, 6)))
    z = b.reduce(Op.SUM_REDUCE, product, [1])
    return b.finish([("z", b.unary(Op.SQRT, b.binary(Op.MUL, z, z)))])


def assert_matches_reference(artifact: Artifact, graph, sizes=(1, 5)) -> None:
    program = executable(artifact)
    for size in sizes:
        inputs = pipeline.sample_inputs(graph, seed=size, symbol_size=size)
        want = run_graph(graph, inputs)
        got = program.run(inputs)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


def broken_render(statement: str, only_blas: bool = True):
    """The real renderer with `statement` at the top of lc_run (of BLAS programs only, or all)."""

    def render(program, *args, **kwargs):
        source = real_render(program, *args, **kwargs)
        if only_blas and not any(isinstance(k, GemmCall) for k in program.kernels):
            return source
        assert ENTRY in source, "the entry point's signature changed: update the test"
        return source.replace(ENTRY, ENTRY + statement)

    return render


# ---- the search in the pipeline --------------------------------------------------------------


def test_the_search_runs_before_lowering_and_reports_what_it_did() -> None:
    graph = removable_work_graph()
    artifact = compile_graph(graph, "cpu", ("native-blas",))
    assert artifact.report["chosen"] == "native-blas", artifact.report["rejected"]
    search = artifact.report["search"]
    assert search["used"] == "optimized graph"
    assert search["nodes_after"] < search["nodes_before"] == len(graph.nodes)
    assert search["cost_after"] < search["cost_before"]
    assert sum(sum(counts.values()) for counts in search["rules"].values()) >= 2
    assert search["rounds"] and {"initial", "simplify"} <= set(search["rounds"][0]["enodes"])
    assert search["seconds"]["total"] > 0
    assert search["fallback"] is None
    assert len(json.dumps(artifact.report)) < 4000
    # the artifact keeps the parsed graph: its signature, hash and memory terms
    assert artifact.graph is graph and artifact.graph_hash == graph.content_hash()
    numpy_kernels = pipeline.CODEGENS["cpu"].generate(graph)
    assert artifact.signature == Signature.of(graph, memory_terms(graph, numpy_kernels))
    assert_matches_reference(artifact, graph)
    loaded = Artifact.from_files(artifact.to_files().__getitem__)
    assert_matches_reference(loaded, graph)


def test_the_search_keeps_the_parsed_graphs_weights_single() -> None:
    """The artifact stores the parsed graph's weights: folding adds no reshaped copy of one (only
    results of at most FOLD_SLACK_BYTES)."""
    artifact = compile_onnx(mlp(n_in=64, hidden=128, n_out=32).SerializeToString(), candidates=("native-blas",))
    stored = sum(w.nbytes for w in artifact.graph.weights.values())
    assert all(w.nbytes <= FOLD_SLACK_BYTES for w in artifact.program_weights.values())
    assert artifact.report["weights_bytes"] < 1.05 * stored


def test_the_search_can_be_turned_off(monkeypatch) -> None:
    graph = removable_work_graph()
    assert compile_graph(graph, "cpu", ("native-blas",), search=False).report["search"] == {"skipped": "turned off"}
    monkeypatch.setattr(pipeline, "SEARCH", False)
    artifact = compile_graph(graph, "cpu", ("native-blas",))
    assert artifact.report["search"] == {"skipped": "turned off"}
    assert_matches_reference(artifact, graph)


def test_numpy_only_compiles_skip_the_search() -> None:
    artifact = compile_graph(removable_work_graph(), "cpu", ("numpy",))
    assert artifact.report["search"] == {"skipped": "no native candidate"}


def test_a_wrong_rewrite_is_caught_and_the_parsed_graph_compiled_instead(monkeypatch) -> None:
    real_optimize = extract.optimize

    def wrong_optimize(graph, *args, **kwargs):
        optimized, report = real_optimize(graph, *args, **kwargs)
        nodes = list(optimized.nodes)
        i = next(i for i, n in enumerate(nodes) if n.op is Op.SQRT)
        nodes[i] = dataclasses.replace(nodes[i], op=Op.EXP2)  # a "rewrite" that changes the values
        return dataclasses.replace(optimized, nodes=nodes), report

    monkeypatch.setattr(extract, "optimize", wrong_optimize)
    graph = removable_work_graph()
    artifact = compile_graph(graph, "cpu", ("native-blas",))
    assert artifact.report["chosen"] == "native-blas"
    search = artifact.report["search"]
    assert search["used"] == "parsed graph"
    assert "native-blas: disagrees with the reference" in search["why"]
    assert artifact.report["rejected"] == {}
    assert_matches_reference(artifact, graph)


# ---- isolation -------------------------------------------------------------------------------


def test_a_segfaulting_candidate_is_rejected_and_another_kept(monkeypatch) -> None:
    monkeypatch.setattr(candidates, "render", broken_render(SEGFAULT))
    graph = removable_work_graph()
    artifact = compile_graph(graph, "cpu", ("native-blas", "native-loops"))
    assert artifact.report["rejected"]["native-blas"] == "crashed with signal 11 (SIGSEGV)"
    assert artifact.report["chosen"] == "native-loops"
    assert_matches_reference(artifact, graph)


def test_a_hanging_candidate_is_rejected_after_the_timeout(monkeypatch) -> None:
    monkeypatch.setattr(candidates, "render", broken_render(HANG))
    monkeypatch.setattr(measure, "REQUEST_TIMEOUT_S", 2.0)
    graph = removable_work_graph()
    started = time.perf_counter()
    artifact = compile_graph(graph, "cpu", ("native-blas", "native-loops"))
    assert artifact.report["rejected"]["native-blas"] == "timed out after 2 s"
    assert artifact.report["chosen"] == "native-loops"
    assert time.perf_counter() - started < 30
    assert_matches_reference(artifact, graph)


def test_when_every_native_candidate_crashes_the_numpy_lowering_is_kept(monkeypatch) -> None:
    monkeypatch.setattr(candidates, "render", broken_render(SEGFAULT, only_blas=False))
    graph = removable_work_graph()
    artifact = compile_graph(graph, "cpu", ("native-blas",))
    assert artifact.report["chosen"] == "numpy"
    assert artifact.report["rejected"]["native-blas"] == "crashed with signal 11 (SIGSEGV)"
    # the optimized graph's candidate crashed first, then the parsed graph's
    assert "native-blas: crashed with signal 11" in artifact.report["search"]["why"]
    assert_matches_reference(artifact, graph)


def _tiny_library(body: str) -> bytes:
    return native_cpu.build(f"#include <stdint.h>\n{ENTRY}{body}    return 0;\n}}\n")


EMPTY_LAYOUT = {"size_limits": {}, "buffers": [], "slots": {}, "symbols": []}


def test_the_runner_survives_crashes_and_hangs_and_reloads_what_it_needs(monkeypatch) -> None:
    monkeypatch.setattr(measure, "REQUEST_TIMEOUT_S", 2.0)
    with measure.session() as runner:
        runner.put_inputs("none", {})
        runner.load("good", EMPTY_LAYOUT, {}, _tiny_library(""))
        runner.load("segv", EMPTY_LAYOUT, {}, _tiny_library(SEGFAULT))
        runner.load("hang", EMPTY_LAYOUT, {}, _tiny_library(HANG))
        assert runner.run("good", "none") == {}
        with pytest.raises(CandidateFailed) as crashed:
            runner.run("segv", "none")
        assert crashed.value.crashed and crashed.value.reason == "crashed with signal 11 (SIGSEGV)"
        assert runner.time("good", "none") >= 0  # a new helper, with "good" loaded again
        with pytest.raises(CandidateFailed) as hung:
            runner.time("hang", "none")
        assert hung.value.crashed and hung.value.reason == "timed out after 2 s"
        assert runner.run("good", "none") == {}
        # a Python error (here: an input the program reads is missing) keeps the helper
        pid = runner._helper.process.pid
        needs_x = {**EMPTY_LAYOUT, "buffers": [{"dtype": "float32", "shape": [2], "role": "input", "name": "x"}]}
        runner.load("needs-x", needs_x, {}, _tiny_library(""))
        with pytest.raises(CandidateFailed) as raised:
            runner.run("needs-x", "none")
        assert not raised.value.crashed and raised.value.reason == "raised KeyError: 'x'"
        assert runner.run("good", "none") == {} and runner._helper.process.pid == pid


def test_the_helper_exits_when_its_parent_dies_mid_run(tmp_path: Path) -> None:
    library = tmp_path / "hang.so"
    library.write_bytes(_tiny_library(HANG))
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from compiler.search import measure
        runner = measure.Runner()
        runner.put_inputs("none", {{}})
        runner.load("hang", {EMPTY_LAYOUT!r}, {{}}, Path({str(library)!r}).read_bytes())
        runner._helper.send(("time", "hang", "none"))
        print(runner._helper.process.pid, flush=True)
        os._exit(0)
        """
    )
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), "the helper outlived its parent"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_candidates_are_isolated_inside_the_compile_sandbox(tmp_path) -> None:
    """The sandbox's child is a daemonic multiprocessing process: the helper is started with
    subprocess, which it may do."""
    from worker.sandbox import Sandbox

    sandbox = Sandbox(timeout_s=120, memory_bytes=4 * 1024**3, candidates=("native-blas", "numpy"), search=False)
    events: list[dict] = []
    graph = tmp_path / "mlp.onnx"
    graph.write_bytes(mlp().SerializeToString())
    artifact = sandbox.compile(1, graph, "cpu", progress=events.append)
    report = artifact.report
    assert report["search"] == {"skipped": "turned off"}
    assert {c["name"] for c in report["candidates"]} == {"native-blas", "numpy"}, report["rejected"]
    assert all(c["ms_by_size"] for c in report["candidates"])
    assert report["chosen"] == "native-blas"
    # the child's progress reaches the parent's callback: every phase but the search, which is
    # off (each new phase is sent at once)
    assert events[0]["phase"] == "parse" and events[-1]["phase"] == "measure"
    assert {e["phase"] for e in events} == set(pipeline.PHASES) - {"search"}
    assert all(e["candidates_total"] == 2 for e in events)


def test_the_compile_tells_its_progress_phase_by_phase() -> None:
    events: list[dict] = []
    wanted = ("native-blas", "native-loops", "numpy")
    artifact = compile_onnx(mlp().SerializeToString(), "cpu", wanted, search=True, progress=events.append)
    firsts = list(dict.fromkeys(e["phase"] for e in events))
    assert firsts == ["parse", "lower", "reference", "verify", "search", "build", "measure"]
    built = [e["candidate"] for e in events if e["phase"] == "build"]
    assert built == ["native-blas", "native-loops"]
    measured = [e for e in events if e["phase"] == "measure"]
    assert [e["candidates_measured"] for e in measured] == sorted(e["candidates_measured"] for e in measured)
    assert measured[-1]["candidates_measured"] == len(artifact.report["candidates"]) == 3
    assert all(e["candidates_total"] == 3 for e in events)


def test_the_sandbox_child_sends_a_new_phase_at_once_and_the_rest_at_most_every_interval(monkeypatch) -> None:
    from worker import sandbox

    sent: list[tuple] = []
    clock = [100.0]
    monkeypatch.setattr(sandbox.time, "monotonic", lambda: clock[0])
    child = sandbox._ProgressSender(types.SimpleNamespace(send=sent.append))
    for phase, at in (("build", 0.0), ("build", 0.1), ("verify", 0.15), ("verify", 0.3), ("verify", 0.45)):
        clock[0] = 100.0 + at
        child({"phase": phase, "at": at})
    assert sent == [("progress", {"phase": p, "at": at}) for p, at in (("build", 0.0), ("verify", 0.15), ("verify", 0.45))]


# ---- timing and choice -----------------------------------------------------------------------


def _fake(name: str, ms: dict[str, float], calls: list[str] | None = None) -> extract.Candidate:
    candidate = extract.Candidate(name, [], {}, {}, 0.0)

    def timer(label, inputs):
        if calls is not None:
            calls.append(name)
        if ms.get(label) is None:
            raise CandidateFailed("crashed with signal 11 (SIGSEGV)", crashed=True)
        return ms[label] / 1000

    candidate.timer = timer
    return candidate


CASES = [("8", {"x": np.zeros((8, 4), np.float32)}), ("32", {"x": np.zeros((32, 4), np.float32)})]


def _choose(*candidates: extract.Candidate) -> tuple[str, dict, list]:
    found, rejected = list(candidates), {}
    report = extract.measure_candidates(found, CASES, rejected)
    return extract.choose(found).name, rejected, report["symbol_sizes"]


def test_numpy_wins_only_by_a_clear_margin() -> None:
    # 1.2x faster: within the margin, generated C is kept
    assert _choose(_fake("native-blas", {"8": 1.2, "32": 4.8}), _fake("numpy", {"8": 1.0, "32": 4.0}))[0] == (
        "native-blas"
    )
    # 2x faster: the NumPy lowering
    assert _choose(_fake("native-blas", {"8": 2.0, "32": 8.0}), _fake("numpy", {"8": 1.0, "32": 4.0}))[0] == "numpy"
    # between generated C programs, the faster one
    assert _choose(_fake("native-blas", {"8": 1.1, "32": 4.4}), _fake("native-loops", {"8": 1.0, "32": 4.0}))[0] == (
        "native-loops"
    )


def test_the_large_size_decides_when_the_small_one_is_close() -> None:
    chosen, _, sizes = _choose(_fake("native-blas", {"8": 1.3, "32": 2.0}), _fake("numpy", {"8": 1.0, "32": 100.0}))
    assert sizes == [8, 32] and chosen == "native-blas"


def test_the_large_size_is_skipped_when_a_run_there_would_be_slow() -> None:
    chosen, _, sizes = _choose(_fake("native-blas", {"8": 90.0, "32": 1.0}), _fake("numpy", {"8": 100.0}))
    assert sizes == [8] and chosen == "native-blas"


def test_candidates_are_timed_in_turns_and_a_crash_is_rejected() -> None:
    calls: list[str] = []
    found = [_fake("a", {"8": 1.0, "32": 1.0}, calls), _fake("b", {"8": 1.0, "32": 1.0}, calls)]
    extract.measure_candidates(found, CASES[:1], {})
    # a warm-up each, then rounds in which the first moves along
    assert calls[:6] == ["a", "b", "a", "b", "b", "a"]
    assert calls.count("a") == calls.count("b") == 1 + tuning.MEASURE_REPEATS
    found = [_fake("numpy", {"8": 1.0, "32": 1.0}), _fake("native-blas", {"8": None})]
    chosen, rejected, _ = _choose(*found)
    assert chosen == "numpy" and rejected == {"native-blas": "crashed with signal 11 (SIGSEGV)"}


def test_a_candidate_far_behind_is_timed_no_more_after_two_runs() -> None:
    calls: list[str] = []
    found = [_fake("native-blas", {"8": 1.0}, calls), _fake("numpy", {"8": 10.0}, calls)]
    extract.measure_candidates(found, CASES[:1], {})
    assert calls.count("numpy") == 1 + 2 and calls.count("native-blas") == 1 + tuning.MEASURE_REPEATS
    assert extract.choose(found).name == "native-blas"
    assert [c.behind for c in found] == [False, True]


def test_a_helper_that_cannot_start_rejects_the_candidate(monkeypatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    runner = measure.Runner()
    with pytest.raises(CandidateFailed) as failed:
        runner.load("good", EMPTY_LAYOUT, {}, _tiny_library(""))
    assert failed.value.crashed and failed.value.reason.startswith("the measuring process could not start")


def test_a_timing_is_a_burst_of_runs_after_one_that_warms_up() -> None:
    class Program:
        def __init__(self) -> None:
            self.calls = 0

        def run(self, feed) -> None:
            # the first run after the helper waited is slow (threads asleep, caches cold)
            time.sleep(0.05 if self.calls == 0 else 0.001)
            self.calls += 1

    program = Program()
    seconds = measure._burst_seconds(program, {})
    assert program.calls >= 1 + measure.BURST_MIN_RUNS
    assert 0.0009 <= seconds < 0.01, seconds


def test_candidates_are_timed_at_a_requests_size_too() -> None:
    # a sequence model: every symbol at 8, then one request (batch 1) of sequence 128, then 32
    from benchmarks.models import bert_minilm, resnet_cnn

    graph = load_graph(bert_minilm(vocab=50, layers=1, hidden=32, heads=2, intermediate=64))
    cases = extract.measure_cases(graph, {})
    assert [label for label, _ in cases] == ["8", "batch=1,seq=128", "32"]
    assert cases[1][1]["input_ids"].shape == (1, 128)
    # a model with a batch alone: the request is a batch of one
    cnn = load_graph(resnet_cnn(classes=10))
    assert [label for label, _ in extract.measure_cases(cnn, {})] == ["8", "batch=1", "32"]


def test_a_size_too_slow_to_time_skips_only_itself() -> None:
    cases = [CASES[0], ("64", {"x": np.zeros((64, 4), np.float32)}), ("batch=1", {"x": np.zeros((1, 4), np.float32)})]
    found = [_fake("native-blas", {"8": 40.0, "64": 1.0, "batch=1": 5.0}), _fake("native-mixed", {"8": 50.0, "batch=1": 6.0})]
    report = extract.measure_candidates(found, cases, {})
    assert report["symbol_sizes"] == [8, "batch=1"]
    assert any("size 64 skipped" in note for note in report["notes"])


def test_a_size_a_candidate_cannot_run_is_dropped_and_the_next_size_still_races() -> None:
    # a request's sequence past the model's position table raises (not a crash) for every
    # candidate; the sizes after it still decide, not the smallest alone
    def raising(name: str, ms: dict[str, float]) -> extract.Candidate:
        candidate = _fake(name, ms)
        timer = candidate.timer

        def timed(label, inputs):
            if label == "batch=1,seq=128":
                raise CandidateFailed("IndexError: an index is out of bounds for the axis it selects from")
            return timer(label, inputs)

        candidate.timer = timed
        return candidate

    cases = [CASES[0], ("batch=1,seq=128", {"x": np.zeros((1, 4), np.float32)}), CASES[1]]
    found = [raising("native-searched", {"8": 1.0, "32": 10.0}), raising("native-searched-attention", {"8": 1.2, "32": 6.0})]
    report = extract.measure_candidates(found, cases, {})
    assert report["symbol_sizes"] == [8, 32]
    assert any(note.startswith("size batch=1,seq=128 dropped: ") for note in report["notes"])
    assert all("batch=1,seq=128" not in c.ms_by_size for c in found)
    assert extract.choose(found).name == "native-searched-attention"
