"""The search compiler's first stage: an egglog e-graph that removes work from a primitive graph.

    optimize(graph, budget) -> (graph, report)

1. Layout rules and constant folding run in Python (compiler/search/passes.py); the writer
   hash-conses, so duplicated nodes exist once.
2. The graph is written as egglog program text, one ``let`` per node, with value facts about the
   weights (all ones, all zeros, non-negative, magnitude bounds) seeded alongside.
3. The rule sets run in the order of rules.STAGES, one iteration at a time, each preceded by a
   bounded saturation of the ``facts`` analysis, until a stage stops changing the e-graph or the
   budget (iterations per stage, e-nodes, wall time) runs out.
4. The outputs are extracted together with egglog's DAG-aware greedy extractor, so a node shared
   by many readers is paid for once.
5. The extracted term DAG is rebuilt into a Graph (inputs and outputs as before), then layout and
   folding run again (folding turns the compile-time products of constants into weights).

Steps 2-5 repeat while they lower the cost and the Python passes found something new, up to
budget.max_rounds. Large graphs are cut into chunks of consecutive nodes, one e-graph each (DAG
extraction's memory is quadratic in a chain's length). Any failure or an exhausted budget returns
the best graph found so far, at worst the input graph: optimize never raises for a valid graph.
The result is deterministic: the program text is, and so is egglog on one thread.

The report (JSON-able):
    nodes_before, nodes_after, cost_before, cost_after   node counts and program_cost
    layout_rules    {Python layout rule: rewrites}
    folding         {"fold_weights_only": nodes folded into weights}
    rules           {rule set: {rule: matches}}; egglog counts matches, and a rule re-run by a
                    later stage counts its old matches again (a union that changes nothing)
    rounds          per e-graph round: chunks, copied_chunks (reached past the deadline),
                    enodes {"initial" and each stage: e-nodes after it, summed over chunks},
                    stopped {stage: {"saturated" | "iterations" | "enodes" | "time": chunks}},
                    extracted_cost
    seconds         layout, fold, egraph_build, egraph_run, extract, rebuild, total
    fallback        None, or why the search stopped early and kept the best graph so far
Counts include rounds whose result was not kept (it cost no less than the graph before it).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from egglog import bindings

from compiler.dtypes import is_float
from compiler.ir import Graph, GraphWriter, Node, Op, view_shape
from compiler.search.passes import (
    canonicalize_layout,
    check_graph,
    constant_valued,
    fold_constants,
    program_cost,
)
from compiler.search.rules import (
    ANALYSIS,
    COMPUTE_COST,
    RULESETS,
    STAGES,
    TERM_CONSTRUCTORS,
    TERM_COSTS,
    dtype_facts,
    ruleset_program,
)


@dataclass(frozen=True)
class SearchBudget:
    # rewrite iterations per stage (each after a bounded saturation of the analysis)
    max_iterations: int = 8
    # a stage stops once the e-graph holds more e-nodes than this
    max_enodes: int = 200_000
    # wall time for the whole of optimize; the e-graph is skipped or cut short past it
    max_seconds: float = 10.0
    # e-graph rounds, each followed by folding; a round that lowers no cost ends the search
    max_rounds: int = 2
    # runs of the analysis rule set before each rewrite iteration
    analysis_iterations: int = 6
    # nodes per e-graph: DAG extraction keeps, per e-class, the set of e-classes below it, so its
    # memory grows with the square of a chain's length (19k nodes in one e-graph took > 8 GB)
    chunk_nodes: int = 2048


_SPAN = bindings.RustSpan(__file__, 0, 0)
# the rules and dtype tables, loaded into every e-graph
_PRELUDE = ruleset_program() + "\n" + dtype_facts()
# seeding value facts reads every element of a weight; bigger weights get none
_MAX_FACT_ELEMENTS = 1 << 16

_UNARY_TERMS = {Op.RECIP: "Recip", Op.LOG2: "Log2", Op.EXP2: "Exp2", Op.SQRT: "Sqrt", Op.SIN: "Sin"}
_BINARY_TERMS = {Op.ADD: "Add", Op.MUL: "Mul", Op.MOD: "Mod", Op.LESS_THAN: "Lt"}
_TERM_OPS = (
    {v: k for k, v in _UNARY_TERMS.items()}
    | {v: k for k, v in _BINARY_TERMS.items()}
    | {"CMul": Op.MUL, "CAdd": Op.ADD, "SumR": Op.SUM_REDUCE, "MaxR": Op.MAX_REDUCE}
)


def optimize(
    graph: Graph, budget: SearchBudget = SearchBudget(), keep_weights: bool = False
) -> tuple[Graph, dict[str, Any]]:
    """An equivalent graph with less work (same inputs, outputs, shapes and dtypes) and a report
    of what ran; see the module docstring. With keep_weights the caller stores the input graph's
    weights whatever the search does (the compile pipeline keeps the parsed graph in the
    artifact): folding then frees none of them, so it never adds a copy of one (a reshaped
    weight would be stored twice)."""
    started = time.perf_counter()
    kept = frozenset(graph.weights) if keep_weights else frozenset()
    deadline = started + budget.max_seconds
    report: dict[str, Any] = {
        "nodes_before": len(graph.nodes),
        "cost_before": program_cost(graph),
        "layout_rules": Counter(),
        "folding": Counter(),
        "rules": {name: Counter() for name in RULESETS},
        "rounds": [],
        "seconds": Counter(),
        "fallback": None,
    }
    best = graph
    try:
        best = _python_passes(graph, report, kept)
        check_graph(best, graph)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure keeps the input graph, by contract
        best = graph
        report["fallback"] = f"python passes: {type(exc).__name__}: {exc}"
    for _ in range(budget.max_rounds):
        if report["fallback"] is not None or time.perf_counter() >= deadline:
            break
        round_report: dict[str, Any] = {}
        report["rounds"].append(round_report)
        try:
            candidate = _egraph_round(best, budget, deadline, report, round_report)
            python_rewrites = _total(report["layout_rules"]) + _total(report["folding"])
            candidate = _python_passes(candidate, report, kept)
            check_graph(candidate, graph)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic too (pyo3: a BaseException)
            report["fallback"] = f"e-graph round: {type(exc).__name__}: {exc}"
            break
        if program_cost(candidate) >= program_cost(best):
            break
        best = candidate
        # the e-graph saturates within a round: only a new fold or layout change gives another
        # round something new to match
        if _total(report["layout_rules"]) + _total(report["folding"]) == python_rewrites:
            break
    report["nodes_after"] = len(best.nodes)
    report["cost_after"] = program_cost(best)
    report["seconds"]["total"] = time.perf_counter() - started
    return best, _plain(report)


def _total(counts: Counter[str]) -> int:
    return sum(counts.values())


def _python_passes(graph: Graph, report: dict[str, Any], kept: frozenset[str] = frozenset()) -> Graph:
    t0 = time.perf_counter()
    graph = canonicalize_layout(graph, report["layout_rules"])
    t1 = time.perf_counter()
    graph = fold_constants(graph, report["folding"], kept)
    # folding can leave a view of a view (the view of a folded view's source)
    graph = canonicalize_layout(graph, report["layout_rules"])
    report["seconds"]["layout"] += t1 - t0
    report["seconds"]["fold"] += time.perf_counter() - t1
    return graph


# ---- one e-graph round ------------------------------------------------------------------------


@dataclass
class _Round:
    """State of one e-graph round: the graph being rewritten and the one being written."""

    graph: Graph
    writer: GraphWriter
    # node of `graph` -> its node in the writer, for every node already rewritten
    resolved: dict[int, int]
    const: list[bool]
    # node -> the last node reading it (graph outputs read at len(nodes))
    last_read: list[int]


def _egraph_round(
    graph: Graph, budget: SearchBudget, deadline: float, report: dict[str, Any], round_report: dict[str, Any]
) -> Graph:
    """Rewrites the graph chunk by chunk (consecutive nodes, budget.chunk_nodes at a time), each
    in its own e-graph, so time and memory grow linearly with the graph; a chunk reached after the
    deadline is copied unchanged."""
    writer = GraphWriter(graph.weights)
    last_read = list(range(len(graph.nodes)))
    for i, node in enumerate(graph.nodes):
        for s in node.srcs:
            last_read[s] = i
    for _, i in graph.outputs:
        last_read[i] = len(graph.nodes)
    state = _Round(
        graph,
        writer,
        {i: writer.add(graph.nodes[i]) for i in graph.inputs},
        constant_valued(graph),
        last_read,
    )
    round_report.update(
        chunks=0, copied_chunks=0, enodes=Counter(), stopped={s.name: Counter() for s in STAGES}
    )
    round_report["extracted_cost"] = 0
    for start in range(0, len(graph.nodes), budget.chunk_nodes):
        chunk = range(start, min(start + budget.chunk_nodes, len(graph.nodes)))
        if time.perf_counter() >= deadline:
            _copy(state, chunk)
            round_report["copied_chunks"] += 1
        else:
            _rewrite_chunk(state, chunk, budget, deadline, report, round_report)
            round_report["chunks"] += 1
    round_report["enodes"] = dict(round_report["enodes"])
    round_report["stopped"] = {name: dict(sorted(c.items())) for name, c in round_report["stopped"].items()}
    inputs = [state.resolved[i] for i in graph.inputs]
    return writer.finish(inputs, [(name, state.resolved[i]) for name, i in graph.outputs], graph.size_limits)


def _copy(state: _Round, chunk: range) -> None:
    for i in chunk:
        node = state.graph.nodes[i]
        srcs = tuple(state.resolved[s] for s in node.srcs)
        state.resolved[i] = state.writer.add(Node(node.op, srcs, node.shape, node.dtype, node.arg))


def _rewrite_chunk(
    state: _Round, chunk: range, budget: SearchBudget, deadline: float, report: dict, round_report: dict
) -> None:
    t0 = time.perf_counter()
    views: dict[tuple, int] = {}
    # the chunk's values read after it ends: its outputs
    outputs = [i for i in chunk if state.last_read[i] >= chunk.stop]
    egraph = bindings.EGraph()
    egraph.parse_and_run_program(_PRELUDE)
    egraph.parse_and_run_program(_chunk_program(state, chunk, outputs, views))
    enodes = round_report["enodes"]
    enodes["initial"] += _count_enodes(egraph)
    t1 = time.perf_counter()
    for stage in STAGES:
        reason = _run_stage(egraph, stage.rulesets, budget, deadline, report["rules"])
        round_report["stopped"][stage.name][reason] += 1
        enodes[stage.name] += _count_enodes(egraph)
    t2 = time.perf_counter()
    termdag, root, cost = _extract(egraph)
    round_report["extracted_cost"] += cost
    t3 = time.perf_counter()
    _rebuild(termdag, root, state, outputs, {v: k for k, v in views.items()})
    seconds = report["seconds"]
    seconds["egraph_build"] += t1 - t0
    seconds["egraph_run"] += t2 - t1
    seconds["extract"] += t3 - t2
    seconds["rebuild"] += time.perf_counter() - t3


def _run_stage(
    egraph: bindings.EGraph, rulesets: tuple[str, ...], budget: SearchBudget, deadline: float, counts: dict
) -> str:
    """Runs the stage's rule sets an iteration at a time; returns why it stopped."""
    analysis = f"(run-schedule (repeat {budget.analysis_iterations} (run {ANALYSIS})))"
    rewrite = "(run-schedule " + " ".join(f"(run {name})" for name in rulesets) + ")"
    owner = {rule.name: rs.name for rs in RULESETS.values() for rule in rs.rules}
    for _ in range(budget.max_iterations):
        if time.perf_counter() >= deadline:
            return "time"
        if _count_enodes(egraph) > budget.max_enodes:
            return "enodes"
        egraph.parse_and_run_program(analysis)
        (output,) = egraph.parse_and_run_program(rewrite)
        run = output.report
        for rule, matches in sorted(run.num_matches_per_rule.items()):
            if rule in owner and matches:
                counts[owner[rule]][rule] += matches
        if not run.updated:
            return "saturated"
    return "iterations"


def _extract(egraph: bindings.EGraph) -> tuple[bindings.TermDag, int, int]:
    """The cheapest term DAG of all outputs together, by egglog's greedy DAG extractor. (The
    `extract` command would also render the term as text: exponential in a residual stream.)"""
    sort, value = egraph.eval_expr(bindings.Var(_SPAN, "$outs"))
    model = bindings.DagCostModel(0, _enode_cost, _no_cost, _no_cost)
    termdag, results = bindings.extract_best_with_dag_cost_model(
        egraph, [(sort, value)], model, extractor="greedy-dag"
    )
    if results[0] is None:
        raise ValueError("the outputs have no extractable term")
    cost, root = results[0]
    return termdag, root, cost


def _enode_cost(name: str, args: list) -> int:
    return TERM_COSTS.get(name, COMPUTE_COST)


def _no_cost(name: str, value: object) -> int:
    return 0


def _count_enodes(egraph: bindings.EGraph) -> int:
    (sizes,) = egraph.parse_and_run_program("(print-size)")
    return sum(size for name, size in sizes.sizes if name in TERM_CONSTRUCTORS)


# ---- graph -> egglog text ---------------------------------------------------------------------


def _chunk_program(state: _Round, chunk: range, outputs: list[int], views: dict[tuple, int]) -> str:
    """One let per node (values from earlier chunks are leaves), the seeded facts, and the
    chunk's outputs as one Cons list."""
    graph, const = state.graph, state.const
    outside = sorted({s for i in chunk for s in graph.nodes[i].srcs if s < chunk.start})
    lines = [f"(let $n{i} (Leaf {i}))" for i in outside]
    lines += [f"(let $n{i} {_term(i, graph.nodes[i], const, graph, views)})" for i in chunk]
    for i in [*outside, *chunk]:
        lines.extend(_seed_facts(i, graph.nodes[i], graph))
    lines.append("(let $o0 (Nil))")
    for k, i in enumerate(reversed(outputs)):
        lines.append(f"(let $o{k + 1} (Cons $n{i} $o{k}))")
    lines.append(f"(let $outs $o{len(outputs)})")
    return "\n".join(lines)


def _term(i: int, node: Node, const: list[bool], graph: Graph, views: dict[tuple, int]) -> str:
    op, d = node.op, f'"{node.dtype}"'
    srcs = [f"$n{s}" for s in node.srcs]
    if op in (Op.INPUT, Op.CONSTANT, Op.IOTA):
        return f"(Leaf {i})"
    if op in _UNARY_TERMS:
        return f"({_UNARY_TERMS[op]} {d} {srcs[0]})"
    if op in _BINARY_TERMS:
        a, b = node.srcs
        if op in (Op.ADD, Op.MUL) and const[b] and not const[a]:
            srcs.reverse()  # constant first: the rules match one operand order
        return f"({_BINARY_TERMS[op]} {d} {srcs[0]} {srcs[1]})"
    if op is Op.CAST:
        return f'(Cast {d} "{graph.nodes[node.srcs[0]].dtype}" {srcs[0]})'
    if op in (Op.SUM_REDUCE, Op.MAX_REDUCE):
        mask = sum(1 << a for a in node.arg)
        return f"({'SumR' if op is Op.SUM_REDUCE else 'MaxR'} {d} {srcs[0]} {mask})"
    if op is Op.GATHER:
        return f"(Gather {d} {srcs[0]} {srcs[1]} {int(node.arg)})"
    if op is Op.VIEW:
        key = views.setdefault((node.arg, graph.nodes[node.srcs[0]].shape), len(views))
        return f'(View {d} {srcs[0]} "{node.arg[0]}" {key})'
    raise ValueError(f"no e-graph term for {op}")


def _seed_facts(i: int, node: Node, graph: Graph) -> list[str]:
    if node.op is not Op.CONSTANT:
        return []
    name = f"$n{i}"
    facts = [f"(Materialized {name})"]
    value = graph.weights[node.arg]
    if value.size == 0 or value.size > _MAX_FACT_ELEMENTS:
        return facts
    wide = value.astype(np.float64)
    if np.all(wide == 1):
        facts.append(f"(IsOne {name})")
    if np.all(wide == 0):
        facts.append(f"(IsZero {name})")
    if not np.any(wide < 0):
        facts.append(f"(NonNeg {name})")
    if is_float(node.dtype) and np.all(np.isfinite(wide)):
        magnitude = np.abs(wide)
        largest, smallest = float(magnitude.max()), float(magnitude.min())
        # |x| <= 2**hi, and |x| >= 2**lo for every element (only when none is zero)
        hi = _log2_ceil(largest) if largest > 0 else -2000
        facts.append(f"(set (mag-hi {name}) {hi})")
        if smallest > 0:
            facts.append(f"(set (mag-lo {name}) {math.frexp(smallest)[1] - 1})")
    return facts


def _log2_ceil(x: float) -> int:
    mantissa, exponent = math.frexp(x)
    return exponent - 1 if mantissa == 0.5 else exponent


# ---- extracted terms -> graph ----------------------------------------------------------------


def _rebuild(
    termdag: bindings.TermDag, root: int, state: _Round, outputs: list[int], views: dict[int, tuple]
) -> None:
    """Writes the extracted terms of one chunk and records its outputs in state.resolved."""
    built: dict[int, Any] = {}
    for term_id in _postorder(termdag, root):
        term = termdag.get(term_id)
        if isinstance(term, bindings.TermLit):
            built[term_id] = term.value.value
        elif isinstance(term, bindings.TermApp) and term.name not in ("Cons", "Nil"):
            args = [built[a] for a in term.args]
            if term.name == "Leaf":
                (i,) = args
                built[term_id] = (
                    state.resolved[i] if i in state.resolved else state.writer.add(state.graph.nodes[i])
                )
            else:
                built[term_id] = state.writer.add(_node(term.name, args, state.writer.nodes, views))
    extracted = []
    term = termdag.get(root)
    while isinstance(term, bindings.TermApp) and term.name == "Cons":
        extracted.append(built[term.args[0]])
        term = termdag.get(term.args[1])
    if len(extracted) != len(outputs):
        raise ValueError("extracted a different number of outputs")
    for i, new in zip(outputs, extracted):
        old = state.graph.nodes[i]
        if state.writer.nodes[new].shape != old.shape or state.writer.nodes[new].dtype != old.dtype:
            raise ValueError(f"node {i} changed shape or dtype")
        state.resolved[i] = new


def _postorder(termdag: bindings.TermDag, root: int) -> list[int]:
    """Term ids reachable from root, children first, without recursion."""
    order: list[int] = []
    seen: set[int] = set()
    stack: list[tuple[int, bool]] = [(root, False)]
    while stack:
        term_id, expanded = stack.pop()
        if expanded:
            order.append(term_id)
            continue
        if term_id in seen:
            continue
        seen.add(term_id)
        stack.append((term_id, True))
        term = termdag.get(term_id)
        if isinstance(term, bindings.TermApp):
            stack.extend((a, False) for a in reversed(term.args) if a not in seen)
    return order


def _node(name: str, args: list[Any], nodes: list[Node], views: dict[int, tuple]) -> Node:
    """The IR node of one extracted term; shapes are inferred and checked, never trusted."""
    dtype, *rest = args
    if name == "Cast":
        source_dtype, x = rest
        if nodes[x].dtype != source_dtype:
            raise ValueError("cast source dtype mismatch")
        return Node(Op.CAST, (x,), nodes[x].shape, dtype)
    if name == "View":
        x, kind, key = rest
        transform, source_shape = views[key]
        if nodes[x].shape != source_shape or transform[0] != kind or nodes[x].dtype != dtype:
            raise ValueError("view source mismatch")
        return Node(Op.VIEW, (x,), view_shape(source_shape, transform), dtype, transform)
    if name == "Gather":
        data, index, axis = rest
        shape = nodes[data].shape
        return Node(
            Op.GATHER, (data, index), shape[:axis] + nodes[index].shape + shape[axis + 1 :], dtype, axis
        )
    op = _TERM_OPS[name]
    if op in (Op.SUM_REDUCE, Op.MAX_REDUCE):
        x, mask = rest
        axes = tuple(a for a in range(len(nodes[x].shape)) if mask >> a & 1)
        shape = tuple(d for a, d in enumerate(nodes[x].shape) if a not in axes)
        return Node(op, (x,), shape, dtype, axes)
    if len(rest) == 1:
        (x,) = rest
        return Node(op, (x,), nodes[x].shape, dtype)
    a, b = rest
    if nodes[a].shape != nodes[b].shape or nodes[a].dtype != nodes[b].dtype:
        raise ValueError(f"{name} operands differ in shape or dtype")
    if op is not Op.LESS_THAN and nodes[a].dtype != dtype:
        raise ValueError(f"{name} result dtype mismatch")
    return Node(op, (a, b), nodes[a].shape, dtype)


def _plain(report: dict[str, Any]) -> dict[str, Any]:
    """The report with Counters as sorted dicts and seconds rounded (JSON-able, stable keys)."""
    out = dict(report)
    out["layout_rules"] = dict(sorted(report["layout_rules"].items()))
    out["folding"] = dict(sorted(report["folding"].items()))
    out["rules"] = {name: dict(sorted(c.items())) for name, c in report["rules"].items()}
    out["seconds"] = {k: round(v, 6) for k, v in sorted(report["seconds"].items())}
    return out


__all__ = ["SearchBudget", "optimize"]
