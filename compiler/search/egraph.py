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

Steps 2-5 repeat while they lower the cost, up to budget.max_rounds. Any failure or an exhausted
budget returns the best graph found so far, at worst the input graph: optimize never raises for a
valid graph. The result is deterministic: the program text is, and so is egglog on one thread.
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
from compiler.ir import Graph, Node, Op, view_shape
from compiler.search.passes import (
    GraphWriter,
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


_SPAN = bindings.RustSpan(__file__, 0, 0)
# seeding value facts reads every element of a weight; bigger weights get none
_MAX_FACT_ELEMENTS = 1 << 16

_UNARY_TERMS = {Op.RECIP: "Recip", Op.LOG2: "Log2", Op.EXP2: "Exp2", Op.SQRT: "Sqrt", Op.SIN: "Sin"}
_BINARY_TERMS = {Op.ADD: "Add", Op.MUL: "Mul", Op.MOD: "Mod", Op.LESS_THAN: "Lt"}
_TERM_OPS = (
    {v: k for k, v in _UNARY_TERMS.items()}
    | {v: k for k, v in _BINARY_TERMS.items()}
    | {"CMul": Op.MUL, "CAdd": Op.ADD, "SumR": Op.SUM_REDUCE, "MaxR": Op.MAX_REDUCE}
)


def optimize(graph: Graph, budget: SearchBudget = SearchBudget()) -> tuple[Graph, dict[str, Any]]:
    started = time.perf_counter()
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
        best = _python_passes(graph, report)
        check_graph(best, graph)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the input graph, by contract
        best = graph
        report["fallback"] = f"python passes: {type(exc).__name__}: {exc}"
    for _ in range(budget.max_rounds):
        if report["fallback"] is not None or time.perf_counter() >= deadline:
            break
        round_report: dict[str, Any] = {}
        report["rounds"].append(round_report)
        try:
            candidate = _egraph_round(best, budget, deadline, report, round_report)
            candidate = _python_passes(candidate, report)
            check_graph(candidate, graph)
        except Exception as exc:  # noqa: BLE001 - keep the best graph so far, by contract
            report["fallback"] = f"e-graph round: {type(exc).__name__}: {exc}"
            break
        if program_cost(candidate) >= program_cost(best):
            break
        best = candidate
    report["nodes_after"] = len(best.nodes)
    report["cost_after"] = program_cost(best)
    report["seconds"]["total"] = time.perf_counter() - started
    return best, _plain(report)


def _python_passes(graph: Graph, report: dict[str, Any]) -> Graph:
    t0 = time.perf_counter()
    graph = canonicalize_layout(graph, report["layout_rules"])
    t1 = time.perf_counter()
    graph = fold_constants(graph, report["folding"])
    # folding can leave a view of a view (the view of a folded view's source)
    graph = canonicalize_layout(graph, report["layout_rules"])
    report["seconds"]["layout"] += t1 - t0
    report["seconds"]["fold"] += time.perf_counter() - t1
    return graph


# ---- one e-graph round ------------------------------------------------------------------------


def _egraph_round(
    graph: Graph, budget: SearchBudget, deadline: float, report: dict[str, Any], round_report: dict[str, Any]
) -> Graph:
    t0 = time.perf_counter()
    views: dict[tuple, int] = {}
    egraph = bindings.EGraph()
    egraph.parse_and_run_program(ruleset_program())
    egraph.parse_and_run_program(dtype_facts())
    egraph.parse_and_run_program(_graph_program(graph, views))
    enodes = {"initial": _count_enodes(egraph)}
    stopped: dict[str, str] = {}
    t1 = time.perf_counter()
    for stage in STAGES:
        stopped[stage.name] = _run_stage(egraph, stage.rulesets, budget, deadline, report["rules"])
        enodes[stage.name] = _count_enodes(egraph)
    t2 = time.perf_counter()
    termdag, root, cost = _extract(egraph)
    t3 = time.perf_counter()
    rebuilt = _rebuild(termdag, root, graph, {v: k for k, v in views.items()})
    t4 = time.perf_counter()
    round_report.update(enodes=enodes, stopped=stopped, extracted_cost=cost)
    seconds = report["seconds"]
    seconds["egraph_build"] += t1 - t0
    seconds["egraph_run"] += t2 - t1
    seconds["extract"] += t3 - t2
    seconds["rebuild"] += t4 - t3
    return rebuilt


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


def _graph_program(graph: Graph, views: dict[tuple, int]) -> str:
    """One let per node, then the seeded facts, then the outputs as one Cons list."""
    const = constant_valued(graph)
    lines = []
    for i, node in enumerate(graph.nodes):
        lines.append(f"(let $n{i} {_term(i, node, const, graph, views)})")
    for i, node in enumerate(graph.nodes):
        lines.extend(_seed_facts(i, node, const[i], graph))
    lines.append("(let $o0 (Nil))")
    for k, (_, i) in enumerate(reversed(graph.outputs)):
        lines.append(f"(let $o{k + 1} (Cons $n{i} $o{k}))")
    lines.append(f"(let $outs $o{len(graph.outputs)})")
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


def _seed_facts(i: int, node: Node, const: bool, graph: Graph) -> list[str]:
    name = f"$n{i}"
    facts = [f"(IsConst {name})"] if const else []
    if node.op is not Op.CONSTANT:
        return facts
    facts.append(f"(Materialized {name})")
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


def _rebuild(termdag: bindings.TermDag, root: int, graph: Graph, views: dict[int, tuple]) -> Graph:
    writer = GraphWriter(graph.weights)
    inputs = [writer.add(graph.nodes[i]) for i in graph.inputs]
    built: dict[int, Any] = {}
    for term_id in _postorder(termdag, root):
        term = termdag.get(term_id)
        if isinstance(term, bindings.TermLit):
            built[term_id] = term.value.value
        elif isinstance(term, bindings.TermApp) and term.name not in ("Cons", "Nil"):
            args = [built[a] for a in term.args]
            built[term_id] = writer.add(_node(term.name, args, writer.nodes, graph, views))
    outputs = []
    term = termdag.get(root)
    while isinstance(term, bindings.TermApp) and term.name == "Cons":
        outputs.append(built[term.args[0]])
        term = termdag.get(term.args[1])
    if len(outputs) != len(graph.outputs):
        raise ValueError("extracted a different number of outputs")
    names = [name for name, _ in graph.outputs]
    return writer.finish(inputs, list(zip(names, outputs)), graph.size_limits)


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


def _node(name: str, args: list[Any], nodes: list[Node], graph: Graph, views: dict[int, tuple]) -> Node:
    """The IR node of one extracted term; shapes are inferred and checked, never trusted."""
    if name == "Leaf":
        return graph.nodes[args[0]]
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
        return Node(Op.GATHER, (data, index), shape[:axis] + nodes[index].shape + shape[axis + 1 :], dtype, axis)
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
