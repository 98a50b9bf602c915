"""Structural checks on an ONNX graph, run before onnx.checker (which can be slow or crash on these).

Each problem is refused with a message naming the offending node, tensor or value:
external data, tensors whose dims are absurd or disagree with their data, empty or duplicate
names, nodes out of topological order, cycles, dangling reads, outputs that name nothing, and
absurd declared input dims (InvalidModel); then nodes outside the ONNX domain, model-local
functions and sparse initializers (UnsupportedModel). Subgraph bodies (If/Loop/Scan) are only
searched for tensors here; their lowering refuses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from math import prod

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from compiler.errors import InvalidModel, UnsupportedModel
from compiler.frontends.onnx_context import ELEM_TYPES

ONNX_DOMAINS = ("", "ai.onnx")
# the most elements one tensor or one declared input may claim
MAX_ELEMENTS = 2**31
SELF_CONTAINED = "external data is not supported: upload the model as one self-contained .onnx file"


def check_graph(model: onnx.ModelProto) -> None:
    """Raises InvalidModel or UnsupportedModel for the first problem found; returns None otherwise."""
    for where, tensor in _tensors(model):
        _check_tensor(where, tensor)
    graph = model.graph
    _check_declared_dims(graph)
    producers = _check_names(graph)
    _check_reads(graph, producers)
    _check_supported(model)


def node_label(index: int, node: onnx.NodeProto) -> str:
    """`node 'name' (Op)`, or `node #index (Op)` for an unnamed node."""
    return f"node {node.name!r} ({node.op_type})" if node.name else f"node #{index} ({node.op_type})"


# -- tensors: initializers, Constant values, sparse tensors, anything inside subgraphs and functions --


def _tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    yield from _graph_tensors(model.graph, "")
    for function in model.functions:
        prefix = f"in function {function.domain}.{function.name}: "
        for index, node in enumerate(function.node):
            yield from _node_tensors(index, node, prefix)


def _graph_tensors(graph: onnx.GraphProto, prefix: str) -> Iterator[tuple[str, TensorProto]]:
    for tensor in graph.initializer:
        yield f"{prefix}initializer {tensor.name!r}", tensor
    for sparse in graph.sparse_initializer:
        yield from _sparse_parts(f"{prefix}sparse initializer {sparse.values.name!r}", sparse)
    for index, node in enumerate(graph.node):
        yield from _node_tensors(index, node, prefix)


def _node_tensors(index: int, node: onnx.NodeProto, prefix: str) -> Iterator[tuple[str, TensorProto]]:
    for attr in node.attribute:
        where = f"{prefix}attribute {attr.name!r} of {node_label(index, node)}"
        if attr.type == AttributeProto.TENSOR:
            yield where, attr.t
        elif attr.type == AttributeProto.TENSORS:
            for tensor in attr.tensors:
                yield where, tensor
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            yield from _sparse_parts(where, attr.sparse_tensor)
        elif attr.type == AttributeProto.SPARSE_TENSORS:
            for sparse in attr.sparse_tensors:
                yield from _sparse_parts(where, sparse)
        elif attr.type == AttributeProto.GRAPH:
            yield from _graph_tensors(attr.g, f"{where}, subgraph: ")
        elif attr.type == AttributeProto.GRAPHS:
            for subgraph in attr.graphs:
                yield from _graph_tensors(subgraph, f"{where}, subgraph: ")


def _sparse_parts(where: str, sparse: onnx.SparseTensorProto) -> Iterator[tuple[str, TensorProto]]:
    # densifying allocates the claimed dims, so they are bounded like a dense tensor's
    _check_dims(where, list(sparse.dims))
    yield f"{where} (values)", sparse.values
    yield f"{where} (indices)", sparse.indices


def _check_tensor(where: str, tensor: TensorProto) -> None:
    if tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data):
        raise InvalidModel(f"{where} refers to external data; {SELF_CONTAINED}")
    if tensor.HasField("segment"):
        raise UnsupportedModel([f"segmented tensor ({where})"])
    if tensor.data_type == TensorProto.UNDEFINED:
        raise InvalidModel(f"{where} has no element type")
    count = _check_dims(where, list(tensor.dims))
    dtype = ELEM_TYPES.get(tensor.data_type)
    if dtype is None:
        return  # an element type we do not compute with is refused where it is used
    if tensor.HasField("raw_data"):
        expected = count * np.dtype(dtype).itemsize
        if len(tensor.raw_data) != expected:
            raise InvalidModel(
                f"{where} has {len(tensor.raw_data)} bytes of data but its dims {list(tensor.dims)} "
                f"of {dtype} need {expected}"
            )
        return
    values = len(getattr(tensor, helper.tensor_dtype_to_field(tensor.data_type)))
    if values != count:
        raise InvalidModel(f"{where} has {values} values but its dims {list(tensor.dims)} need {count}")


def _check_dims(where: str, dims: list[int]) -> int:
    if any(d < 0 for d in dims):
        raise InvalidModel(f"{where} has a negative dimension in {dims}")
    count = prod(dims)
    if count > MAX_ELEMENTS:
        raise InvalidModel(f"{where} claims {count} elements (dims {dims}), more than the limit of 2**31")
    return count


# -- declared types of graph inputs, outputs and intermediate values --


def _check_declared_dims(graph: onnx.GraphProto) -> None:
    for kind, values in (("graph input", graph.input), ("graph output", graph.output), ("value", graph.value_info)):
        for value in values:
            if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
                continue
            dims = value.type.tensor_type.shape.dim
            for axis, dim in enumerate(dims):
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    raise InvalidModel(f"{kind} {value.name!r} declares dimension {axis} as {dim.dim_value}")
            static = prod(d.dim_value for d in dims if d.HasField("dim_value"))
            if kind == "graph input" and static > MAX_ELEMENTS:
                raise InvalidModel(
                    f"graph input {value.name!r} declares {static} elements in its fixed dimensions, "
                    "more than the limit of 2**31"
                )


# -- names: every value is defined once, read after it is defined, and the graph has no cycle --


def _check_names(graph: onnx.GraphProto) -> dict[str, int]:
    """The index of the node producing each node output."""
    inputs: set[str] = set()
    for value in graph.input:
        if not value.name:
            raise InvalidModel("a graph input has an empty name")
        if value.name in inputs:
            raise InvalidModel(f"graph input {value.name!r} is declared twice")
        inputs.add(value.name)
    initializers: set[str] = set()
    for tensor in graph.initializer:
        if not tensor.name:
            raise InvalidModel("an initializer has an empty name")
        if tensor.name in initializers:
            raise InvalidModel(f"initializer {tensor.name!r} is declared twice")
        initializers.add(tensor.name)
    producers: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if not name:
                continue  # an optional output left unused
            if name in producers:
                first = producers[name]
                raise InvalidModel(
                    f"value {name!r} is written twice: by {node_label(first, graph.node[first])} "
                    f"and by {node_label(index, node)}"
                )
            if name in initializers:
                raise InvalidModel(f"{node_label(index, node)} writes {name!r}, which is also an initializer")
            if name in inputs:
                raise InvalidModel(f"{node_label(index, node)} writes {name!r}, which is also a graph input")
            producers[name] = index
    outputs: set[str] = set()
    for value in graph.output:
        if not value.name:
            raise InvalidModel("a graph output has an empty name")
        if value.name in outputs:
            raise InvalidModel(f"graph output {value.name!r} is declared twice")
        outputs.add(value.name)
    return producers


def _check_reads(graph: onnx.GraphProto, producers: dict[str, int]) -> None:
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    # a sparse initializer defines its name too; it is refused as unsupported later
    defined |= {s.values.name for s in graph.sparse_initializer}
    # cycles first: in a cycle some read comes before its definition, and the cycle is the real problem
    cycle = _find_cycle(graph, producers, defined)
    if cycle:
        steps = [node_label(cycle[0], graph.node[cycle[0]])]
        for writer, reader in zip(cycle, cycle[1:]):
            value = next(n for n in graph.node[reader].input if producers.get(n) == writer)
            steps.append(f"writes {value!r} read by {node_label(reader, graph.node[reader])}")
        raise InvalidModel("the graph has a cycle: " + ", which ".join(steps))
    for index, node in enumerate(graph.node):
        for name in node.input:
            if not name or name in defined:
                continue  # an empty name is an optional input left out
            if name in producers:
                later = producers[name]
                raise InvalidModel(
                    f"{node_label(index, node)} reads {name!r} before it is defined (by "
                    f"{node_label(later, graph.node[later])}); ONNX requires nodes in topological order"
                )
            raise InvalidModel(
                f"{node_label(index, node)} reads {name!r}, which no initializer, graph input or node defines"
            )
        defined.update(name for name in node.output if name)
    for value in graph.output:
        if value.name not in defined:
            raise InvalidModel(f"graph output {value.name!r} is produced by no node, input or initializer")


def _find_cycle(graph: onnx.GraphProto, producers: dict[str, int], defined: set[str]) -> list[int]:
    """Node indices around one cycle in data-flow order (first repeated at the end), or []."""
    # node -> the nodes whose outputs it reads
    reads = [
        sorted({producers[n] for n in node.input if n and n not in defined and n in producers})
        for node in graph.node
    ]
    state = [0] * len(reads)  # 0 unvisited, 1 on the current path, 2 done
    for start in range(len(reads)):
        if state[start]:
            continue
        # iterative depth-first search: graphs can be deeper than Python's recursion limit
        path, pending = [start], [iter(reads[start])]
        state[start] = 1
        while path:
            nxt = next(pending[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                pending.pop()
            elif state[nxt] == 1:
                # each path node reads the next one, and the last reads nxt: reversed, data flows
                return [nxt, *reversed(path[path.index(nxt) :])]
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                pending.append(iter(reads[nxt]))
    return []


# -- well-formed, but not something we compile --


def _check_supported(model: onnx.ModelProto) -> None:
    newest = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ONNX_DOMAINS and opset.version > newest:
            # ops of an unknown opset would be lowered with the semantics of an older one
            raise UnsupportedModel([f"opset {opset.version} (the newest this service knows is {newest})"])
    if model.functions:
        names = ", ".join(f"{f.domain}.{f.name}" for f in model.functions)
        raise UnsupportedModel([f"model-local functions ({names})"])
    if model.graph.sparse_initializer:
        raise UnsupportedModel([f"sparse initializer {s.values.name!r}" for s in model.graph.sparse_initializer])
    foreign = {f"{n.domain}.{n.op_type} (domain {n.domain!r})" for n in model.graph.node if n.domain not in ONNX_DOMAINS}
    if foreign:
        raise UnsupportedModel(sorted(foreign))
