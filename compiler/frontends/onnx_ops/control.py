"""Lowerings of the control-flow ops Scan, If and Loop, by unrolling their subgraphs at compile time.

Each use of a subgraph is an instance: every value the subgraph defines is renamed with a prefix
unique to the instance, its formal inputs are bound to the values of this step, and its nodes are
lowered into the enclosing context like any others (outer-scope names it reads stay as they are).
Anything whose unrolled form would not be exact (a run-time trip count, a run-time loop
condition, sequence values) is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx

from compiler import composite as C
from compiler.errors import InvalidModel, UnsupportedModel
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse
from compiler.ir import Op

# the most iterations a Loop is unrolled to
MAX_LOOP_ITERATIONS = 64

# a value of this step: known at compile time (an array, maybe symbolic) or an IR node id
Value = np.ndarray | int

_instances = itertools.count(1)


def _defined_names(graph: onnx.GraphProto) -> set[str]:
    """Names a graph defines in its own scope: formal inputs, initializers and node outputs."""
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    names.update(out for n in graph.node for out in n.output if out)
    return names


def _renamed_graph(graph: onnx.GraphProto, rename: dict[str, str]) -> onnx.GraphProto:
    """A nested graph whose free references to renamed outer values follow the renaming."""
    inner_rename = {k: v for k, v in rename.items() if k not in _defined_names(graph)}
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    del copy.node[:]
    copy.node.extend(renamed_node(n, inner_rename) for n in graph.node)
    for out in copy.output:
        out.name = inner_rename.get(out.name, out.name)
    return copy


def renamed_node(node: onnx.NodeProto, rename: dict[str, str]) -> onnx.NodeProto:
    """A copy of node reading and writing renamed values, also inside its nested graphs."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[:] = [rename.get(n, n) for n in node.input]
    copy.output[:] = [rename.get(n, n) for n in node.output]
    for attribute in copy.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            attribute.g.CopyFrom(_renamed_graph(attribute.g, rename))
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            graphs = [_renamed_graph(g, rename) for g in attribute.graphs]
            del attribute.graphs[:]
            attribute.graphs.extend(graphs)
    return copy


def _known_or_node(ctx: Context, name: str) -> Value:
    known = ctx.consts.get(name, ctx.symbolic.get(name))
    return known if known is not None else ctx.lookup(name)


def _bind(ctx: Context, name: str, value: Value) -> None:
    if isinstance(value, np.ndarray):
        ctx.bind_known(name, value)
    else:
        ctx.env[name] = value


def _run_instance(
    ctx: Context, node: onnx.NodeProto, graph: onnx.GraphProto, formals: Sequence[Value]
) -> list[str]:
    """Lowers one instance of `graph` with its formal inputs bound; the names of its outputs."""
    if len(formals) != len(graph.input):
        raise InvalidModel(f"{node.op_type} body takes {len(graph.input)} inputs, given {len(formals)}")
    if graph.sparse_initializer:
        raise refuse(node, "a body holding sparse initializers")
    prefix = f"{node.output[0] or node.op_type}/{node.op_type}{next(_instances)}/"
    rename = {name: prefix + name for name in _defined_names(graph)}
    for formal, value in zip(graph.input, formals):
        _bind(ctx, rename[formal.name], value)
    for tensor in graph.initializer:
        ctx.bind_constant(rename[tensor.name], onnx.numpy_helper.to_array(tensor))
    assert ctx.lower_nodes is not None, "the driver sets lower_nodes"
    ctx.lower_nodes([renamed_node(n, rename) for n in graph.node])
    return [rename.get(out.name, out.name) for out in graph.output]


def _step_slice(ctx: Context, x: int, axis: int, index: int) -> int:
    """x[..., index, ...] along `axis`, the axis removed."""
    b = ctx.b
    shape = b.shape(x)
    bounds = tuple((index, index + 1, 1) if i == axis else (0, None, 1) for i in range(len(shape)))
    return b.reshape(b.view(x, ("slice", bounds)), shape[:axis] + shape[axis + 1 :])


def _stack(ctx: Context, node: onnx.NodeProto, parts: Sequence[int], axis: int) -> int:
    """The per-step values stacked along a new axis `axis` (may be negative, over the stacked rank)."""
    b = ctx.b
    shape, dtype = b.shape(parts[0]), b.dtype(parts[0])
    if any(b.shape(p) != shape or b.dtype(p) != dtype for p in parts):
        raise refuse(node, "per-step outputs whose shape or dtype changes between steps")
    axis %= len(shape) + 1
    return C.concat(b, [b.unsqueeze(p, axis) for p in parts], axis)


def _normalized_axis(node: onnx.NodeProto, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise InvalidModel(f"{node.op_type} axis {axis} is out of range for rank {rank}")
    return axis % rank


# ---- Scan -------------------------------------------------------------------------------------


def _scan_steps(
    ctx: Context,
    node: onnx.NodeProto,
    body: onnx.GraphProto,
    states: list[Value],
    scan_inputs: list[int],
    axes: Sequence[int],
    directions: Sequence[int],
) -> tuple[list[Value], list[list[int]]]:
    """Unrolls the body over the scan inputs: the final states and each scan output's steps."""
    b = ctx.b
    axes = [_normalized_axis(node, a, len(b.shape(x))) for a, x in zip(axes, scan_inputs)]
    lengths = {b.shape(x)[a] for a, x in zip(axes, scan_inputs)}
    if len(lengths) != 1:
        raise InvalidModel(f"Scan inputs of different sequence lengths {sorted(map(str, lengths))}")
    if not lengths:
        raise InvalidModel("Scan without scan inputs")
    length = lengths.pop()
    if not isinstance(length, int):
        raise refuse(node, f"a symbolic sequence length {length}")
    if length == 0:
        raise refuse(node, "an empty sequence")
    steps: list[list[int]] = [[] for _ in range(len(body.output) - len(states))]
    for t in range(length):
        elements = [
            _step_slice(ctx, x, axis, length - 1 - t if reverse else t)
            for x, axis, reverse in zip(scan_inputs, axes, directions)
        ]
        outputs = _run_instance(ctx, node, body, [*states, *elements])
        states = [_known_or_node(ctx, name) for name in outputs[: len(states)]]
        for collected, name in zip(steps, outputs[len(states) :]):
            collected.append(ctx.lookup(name))
    return states, steps


def _scan_outputs(
    ctx: Context, node: onnx.NodeProto, steps: list[list[int]], axes: Sequence[int], directions: Sequence[int]
) -> list[int]:
    return [
        _stack(ctx, node, parts[::-1] if reverse else parts, axis)
        for parts, axis, reverse in zip(steps, axes, directions)
    ]


@lowers("Scan")
def _scan(ctx: Context, node: onnx.NodeProto) -> list[int]:
    a = attrs(node)
    body = a["body"]
    num_scan = a["num_scan_inputs"]
    if ctx.opset < 9:
        return _scan_batched(ctx, node, body, num_scan)
    num_states = len(node.input) - num_scan
    num_outputs = len(body.output) - num_states
    if num_states < 0 or num_outputs < 0 or not all(node.input):
        raise InvalidModel("Scan with inputs that do not match num_scan_inputs and its body")
    states = [_known_or_node(ctx, name) for name in node.input[:num_states]]
    scan_inputs = [ctx.value(node, i) for i in range(num_states, len(node.input))]
    final, steps = _scan_steps(
        ctx,
        node,
        body,
        states,
        scan_inputs,
        a.get("scan_input_axes", [0] * num_scan),
        a.get("scan_input_directions", [0] * num_scan),
    )
    stacked = _scan_outputs(
        ctx,
        node,
        steps,
        a.get("scan_output_axes", [0] * num_outputs),
        a.get("scan_output_directions", [0] * num_outputs),
    )
    return [*_as_nodes(ctx, node, final), *stacked]


def _as_nodes(ctx: Context, node: onnx.NodeProto, values: Sequence[Value]) -> list[int]:
    """IR nodes for step values, known ones bound to fresh names so ctx.lookup materializes them."""
    prefix = f"{node.output[0] or node.op_type}/{node.op_type}{next(_instances)}/result"
    names = [f"{prefix}{i}" for i in range(len(values))]
    for name, value in zip(names, values):
        _bind(ctx, name, value)
    return [ctx.lookup(name) for name in names]


def _scan_batched(ctx: Context, node: onnx.NodeProto, body: onnx.GraphProto, num_scan: int) -> list[int]:
    """Opset 8 Scan: axis 0 of every input is a batch, each batch row scanned along axis 1."""
    b = ctx.b
    num_states = len(node.input) - 1 - num_scan
    states = [ctx.value(node, i) for i in range(1, 1 + num_states)]
    scan_inputs = [ctx.value(node, i) for i in range(1 + num_states, len(node.input))]
    directions = attrs(node).get("directions", [0] * num_scan)
    if any(directions):
        raise refuse(node, "reverse directions (opset 8)")
    if not scan_inputs:
        raise InvalidModel("Scan without scan inputs")
    batch, steps = b.shape(scan_inputs[0])[:2]
    if node.input[0] and np.any(ctx.const(node, 0, "sequence_lens") != steps):
        raise refuse(node, "sequence_lens shorter than the sequence (opset 8)")
    if not isinstance(batch, int):
        raise refuse(node, f"a symbolic batch size {batch} (opset 8)")
    rows: list[list[int]] = []
    for row in range(batch):
        row_states: list[Value] = [_step_slice(ctx, s, 0, row) for s in states]
        row_inputs = [_step_slice(ctx, x, 0, row) for x in scan_inputs]
        final, per_step = _scan_steps(ctx, node, body, row_states, row_inputs, [0] * num_scan, directions)
        zeros = [0] * len(per_step)
        rows.append([*_as_nodes(ctx, node, final), *_scan_outputs(ctx, node, per_step, zeros, zeros)])
    return [_stack(ctx, node, list(column), 0) for column in zip(*rows)]


# ---- If -----------------------------------------------------------------------------------------


@lowers("If")
def _if(ctx: Context, node: onnx.NodeProto) -> list[int]:
    a = attrs(node)
    branches = a["then_branch"], a["else_branch"]
    known = ctx.known(node, 0)
    if known is not None:
        if known.size != 1:
            raise InvalidModel(f"If condition of {known.size} elements")
        chosen = branches[0] if bool(known.reshape(-1)[0]) else branches[1]
        return [ctx.lookup(name) for name in _run_instance(ctx, node, chosen, [])]
    first_new = len(ctx.b.nodes)
    try:
        outputs = [[ctx.lookup(n) for n in _run_instance(ctx, node, branch, [])] for branch in branches]
    except (InvalidModel, UnsupportedModel) as exc:
        raise refuse(node, f"a run-time condition and a branch that cannot be lowered ({exc})") from None
    if _may_index_out_of_range(ctx, first_new):
        raise refuse(
            node, "a run-time condition and a branch gathering at run-time indices (it may fail when untaken)"
        )
    b = ctx.b
    cond = ctx.value(node, 0)
    if b.dtype(cond) != "bool" or len(b.shape(cond)) > 1 or b.shape(cond) not in ((), (1,)):
        raise refuse(node, f"a condition of shape {list(b.shape(cond))} and dtype {b.dtype(cond)}")
    cond = b.reshape(cond, ())
    selected = []
    for then_value, else_value in zip(*outputs):
        if b.shape(then_value) != b.shape(else_value) or b.dtype(then_value) != b.dtype(else_value):
            raise refuse(node, "a run-time condition and branches whose outputs differ in shape or dtype")
        selected.append(C.where(b, cond, then_value, else_value))
    return selected


def _may_index_out_of_range(ctx: Context, first_new: int) -> bool:
    """Whether a node built since `first_new` gathers at indices that depend on run-time inputs."""
    nodes = ctx.b.nodes
    runtime: dict[int, bool] = {}

    def depends_on_input(i: int) -> bool:
        if i not in runtime:
            node = nodes[i]
            runtime[i] = node.op is Op.INPUT or any(depends_on_input(s) for s in node.srcs)
        return runtime[i]

    return any(n.op is Op.GATHER and depends_on_input(n.srcs[1]) for n in nodes[first_new:])


# ---- Loop ---------------------------------------------------------------------------------------


@lowers("Loop")
def _loop(ctx: Context, node: onnx.NodeProto) -> list[int]:
    body = attrs(node)["body"]
    trip_count = ctx.known(node, 0)
    if node.input[0] and trip_count is None:
        raise refuse(node, "a trip count computed at run time")
    if trip_count is not None:
        trip_count = int(trip_count.reshape(-1)[0])
        if trip_count > MAX_LOOP_ITERATIONS:
            raise refuse(node, f"a trip count of {trip_count} (unrolled up to {MAX_LOOP_ITERATIONS})")
    running = _known_condition(ctx, node, node.input[1] if len(node.input) > 1 else "", "condition input")
    carried = [_known_or_node(ctx, name) for name in node.input[2:]]
    num_scan = len(body.output) - 1 - len(carried)
    if num_scan < 0 or len(body.input) != 2 + len(carried):
        raise InvalidModel("Loop body does not match the loop-carried values")
    steps: list[list[int]] = [[] for _ in range(num_scan)]
    iteration = 0
    while running and (trip_count is None or iteration < trip_count):
        if iteration == MAX_LOOP_ITERATIONS:
            raise refuse(node, f"a condition still true after {MAX_LOOP_ITERATIONS} iterations")
        formals = [np.array(iteration, dtype=np.int64), np.array(True), *carried]
        outputs = _run_instance(ctx, node, body, formals)
        running = _known_condition(ctx, node, outputs[0], "body condition")
        carried = [_known_or_node(ctx, name) for name in outputs[1 : 1 + len(carried)]]
        for collected, name in zip(steps, outputs[1 + len(carried) :]):
            collected.append(ctx.lookup(name))
        iteration += 1
    if iteration == 0 and any(node.output[len(carried) :]):
        raise refuse(node, "no iterations and scan outputs in use (their shape is unknown)")
    stacked = [_stack(ctx, node, parts, 0) for parts in steps] if iteration else []
    return [*_as_nodes(ctx, node, carried), *stacked]


def _known_condition(ctx: Context, node: onnx.NodeProto, name: str, what: str) -> bool:
    if not name:
        return True
    known = ctx.consts.get(name)
    if known is None:
        raise refuse(node, f"a {what} computed at run time")
    return bool(known.reshape(-1)[0])
