"""ONNX frontend: parses and validates a model, then lowers each node to primitive IR.

Every op type we accept has one lowering function in LOWERINGS. A graph that uses any other op
type is refused before lowering starts, with all the missing op types listed at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import onnx
import onnx.shape_inference
import onnx.version_converter
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from compiler.errors import InvalidModel, UnsupportedModel
from compiler.frontends import onnx_ops  # noqa: F401  (registers the lowerings)
from compiler.frontends.onnx_checks import ONNX_DOMAINS, check_graph
from compiler.frontends.onnx_context import COMPUTED_AS, ELEM_TYPES, LOWERINGS, Context
from compiler.frontends.onnx_fold import fold_numeric, fold_symbolic, shape_of
from compiler.frontends.onnx_ops.control import renamed_node
from compiler.ir import Graph, GraphBuilder
from compiler.shape import Dim, ShapeError, SymDim, numel, parse_dim

MIN_OPSET = 7
# older models are converted to this opset first
UPGRADE_TO_OPSET = 13


def parse_model(data: bytes) -> onnx.ModelProto:
    """Bytes to a validated ModelProto; every malformation becomes InvalidModel."""
    if not data:
        raise InvalidModel("the file is empty")
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidModel(f"not a valid ONNX model (protobuf decoding failed: {exc})") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.opset_import:
        raise InvalidModel("not a valid ONNX model (no IR version, graph or opset import)")
    check_graph(model)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise InvalidModel(f"invalid ONNX graph: {first_line}") from None
    if not model.graph.output:
        raise InvalidModel("the ONNX graph declares no outputs")
    return model


def missing_ops(model: onnx.ModelProto) -> list[str]:
    """Op types with neither a lowering nor a function body we can expand."""
    missing = set()
    opset = _opset(model)
    for node in model.graph.node:
        if node.domain not in ONNX_DOMAINS:
            missing.add(f"{node.domain}.{node.op_type}")
        elif (
            node.op_type not in LOWERINGS
            and node.op_type not in FOLDED
            and not _has_function(node.op_type, opset)
        ):
            missing.add(node.op_type)
    return sorted(missing)


def onnx_to_graph(model: onnx.ModelProto, dims: Mapping[str, str] | None = None) -> Graph:
    """`dims`: symbols of the declared inputs that stand for an expression of others, as a
    decoder's total_sequence_length is past_sequence_length + sequence_length (symbol -> text);
    by default, that one relation wherever the inputs carry a KV cache (kv_layout.decoder_dims)."""
    if dims is None:
        from compiler.kv_layout import decoder_dims, onnx_specs

        dims = decoder_dims(onnx_specs(model)[0])
    substitutions = {_symbol_name(name): parse_dim(text) for name, text in (dims or {}).items()}
    opset = _opset(model)
    if opset < MIN_OPSET:
        model = _upgrade(model, opset)
        opset = _opset(model)
    types = _declared_types(model)
    ctx = Context(GraphBuilder(), opset, declared_types=types)
    graph = model.graph
    for tensor in graph.initializer:
        ctx.bind_constant(tensor.name, numpy_helper.to_array(tensor))
    for value in graph.input:
        if value.name not in ctx.consts:
            shape, dtype = _value_type(value, substitutions)
            node_id = ctx.b.input(value.name, shape, dtype)
            if dtype in COMPUTED_AS:
                node_id = ctx.b.cast(node_id, COMPUTED_AS[dtype])
            ctx.env[value.name] = node_id
    lowering = _Lowering(ctx, types, missing_ops(model), _read_names(graph))
    ctx.lower_nodes = lowering.lower_all
    lowering.lower_all(graph.node)
    result = []
    for out in graph.output:
        if out.name not in ctx.env and out.name not in ctx.consts and out.name not in ctx.symbolic:
            raise InvalidModel(f"graph output {out.name!r} is produced by no node")
        node_id = ctx.lookup(out.name)
        if ELEM_TYPES.get(types.get(out.name, 0)) in COMPUTED_AS:
            node_id = ctx.b.cast(node_id, ELEM_TYPES[types[out.name]])
        result.append((out.name, node_id))
    return ctx.b.finish(result)


# ops the driver itself evaluates at compile time (a tensor's shape is always known)
FOLDED = frozenset({"Shape", "Size"})


def _naming(exc: UnsupportedModel, node: onnx.NodeProto) -> UnsupportedModel:
    """The refusal with the refusing node's name, so a user finds it in a graph of thousands."""
    if not node.name or any("(node " in m for m in exc.missing):
        return exc
    return UnsupportedModel([f"{m} (node {node.name!r})" for m in exc.missing])


class _Lowering:
    """Lowers nodes one by one: fold what is known, lower what we can, expand ONNX functions."""

    def __init__(self, ctx: Context, types: dict[str, int], missing: list[str], read: set[str]) -> None:
        self.ctx = ctx
        # every value name some node, subgraph or graph output reads
        self.read = read
        self.types = types
        self.missing = missing
        self.expansions = 0

    def lower_all(self, nodes) -> None:
        for node in nodes:
            self.lower(node)

    def lower(self, node: onnx.NodeProto) -> None:
        ctx = self.ctx
        try:
            if self._fold(node):
                return
            if node.domain in ONNX_DOMAINS and node.op_type in LOWERINGS:
                outputs = LOWERINGS[node.op_type](ctx, node)
            else:
                self._expand(node)
                return
        except ShapeError as exc:
            raise InvalidModel(f"node {node.name or node.op_type!r} ({node.op_type}): {exc}") from None
        except UnsupportedModel as exc:
            raise _naming(exc, node) from None
        for index, name in enumerate(node.output):
            if name and index >= len(outputs):
                if name in self.read:
                    raise UnsupportedModel([f"{node.op_type} with output {index} ({name!r}) in use"])
                continue
            if name:
                ctx.env[name] = self._rounded(name, outputs[index])

    def _rounded(self, name: str, node_id: int) -> int:
        """Values the model declares in a narrow format are rounded to it after every op, like ONNX does."""
        declared = ELEM_TYPES.get(self.types.get(name, 0))
        b = self.ctx.b
        if declared in COMPUTED_AS and b.dtype(node_id) == COMPUTED_AS[declared]:
            return b.cast(b.cast(node_id, declared), COMPUTED_AS[declared])
        return node_id

    def _fold(self, node: onnx.NodeProto) -> bool:
        """Binds the outputs of a node computable at compile time; False when it must be lowered."""
        ctx = self.ctx
        if node.domain not in ONNX_DOMAINS:
            return False
        if node.op_type in ("Shape", "Size") and node.input:
            known = ctx.known(node, 0)
            shape = known.shape if known is not None else ctx.b.shape(ctx.value(node, 0))
            if node.op_type == "Shape":
                ctx.bind_known(node.output[0], shape_of(node, shape, ctx.opset))
            else:
                ctx.bind_known(node.output[0], np.array(numel(shape), dtype=object))
            return True
        args = [ctx.known(node, i) for i in range(len(node.input))]
        if any(a is None for i, a in enumerate(args) if node.input[i]):
            return False
        if any(a is not None and a.dtype == object for a in args):
            outputs = fold_symbolic(node, args, ctx.opset)
        else:
            outputs = fold_numeric(node, args, ctx.opset)
        if outputs is None:
            return False
        for name, array in zip(node.output, outputs):
            if name:
                ctx.bind_known(name, np.asarray(array))
        return True

    def _expand(self, node: onnx.NodeProto) -> None:
        """Lowers an op that ONNX defines as a function by lowering its body instead."""
        ctx = self.ctx
        body = self._function_body(node)
        if body is None:
            raise UnsupportedModel(sorted(set(self.missing) | {_qualified(node)}))
        self.expansions += 1
        prefix = f"{node.output[0]}/{node.op_type}{self.expansions}/"
        saved_opset = ctx.opset
        ctx.opset = next((o.version for o in body.opset_import if o.domain in ONNX_DOMAINS), ctx.opset)
        try:
            for inner in _instantiate(node, body, prefix):
                self.lower(inner)
        finally:
            ctx.opset = saved_opset

    def _function_body(self, node: onnx.NodeProto) -> onnx.FunctionProto | None:
        if node.domain not in ONNX_DOMAINS:
            return None
        try:
            schema = onnx.defs.get_schema(node.op_type, self.ctx.opset, "")
        except onnx.defs.SchemaError:
            return None
        if schema.has_function:
            return schema.function_body
        if not schema.has_context_dependent_function:
            return None
        input_types = [self._type_proto(name).SerializeToString() for name in node.input]
        try:
            raw = schema.get_context_dependent_function(node.SerializeToString(), input_types)
        except Exception:  # noqa: BLE001  the builder rejects attribute combinations it lacks
            return None
        body = onnx.FunctionProto()
        body.ParseFromString(raw)
        return body if body.node else None  # an empty body means the builder declined

    def _type_proto(self, name: str) -> onnx.TypeProto:
        ctx = self.ctx
        if not name:
            return onnx.TypeProto()
        known = ctx.consts.get(name, ctx.symbolic.get(name))
        shape = known.shape if known is not None else ctx.b.shape(ctx.lookup(name))
        if name in self.types:
            elem = self.types[name]
        elif known is not None:
            elem = (
                helper.np_dtype_to_tensor_dtype(known.dtype)
                if known.dtype != object
                else onnx.TensorProto.INT64
            )
        else:
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(ctx.b.dtype(ctx.lookup(name))))
        # some bodies depend on the rank (RotaryEmbedding), so the shape goes along
        dims = [d if isinstance(d, int) else str(d) for d in shape]
        return helper.make_tensor_type_proto(elem, dims)


def _read_names(graph: onnx.GraphProto) -> set[str]:
    names = {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                names |= _read_names(sub)
    return names


def _qualified(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ONNX_DOMAINS else f"{node.domain}.{node.op_type}"


def _has_function(op_type: str, opset: int) -> bool:
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return schema.has_function or schema.has_context_dependent_function


def _instantiate(node: onnx.NodeProto, body: onnx.FunctionProto, prefix: str) -> list[onnx.NodeProto]:
    """The function's nodes with formal names bound to the call's values and attributes."""
    rename = dict(zip(body.input, list(node.input) + [""] * len(body.input)))
    rename.update(zip(body.output, list(node.output) + [""] * len(body.output)))
    given = {a.name: a for a in node.attribute}
    defaults = {a.name: a for a in body.attribute_proto}
    scope = {k: v for k, v in rename.items() if v}
    scope.update({o: prefix + o for inner in body.node for o in inner.output if o and o not in scope})
    nodes = []
    for inner in body.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.input[:] = [rename.get(n, prefix + n) if n else "" for n in inner.input]
        copy.output[:] = [rename.get(n, prefix + n) if n else "" for n in inner.output]
        del copy.attribute[:]
        for attribute in inner.attribute:
            if attribute.ref_attr_name:
                source = given.get(attribute.ref_attr_name, defaults.get(attribute.ref_attr_name))
                if source is None:
                    continue  # an optional attribute the call leaves out
                bound = onnx.AttributeProto()
                bound.CopyFrom(source)
                bound.name = attribute.name
                copy.attribute.append(bound)
            else:
                copy.attribute.append(attribute)
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in copy.attribute):
            # nested graphs (a Scan body) read the function's values by their outer names
            copy = renamed_node(copy, scope)
        nodes.append(copy)
    return nodes


def _declared_types(model: onnx.ModelProto) -> dict[str, int]:
    """ONNX element type of every value the model declares or shape inference can tell."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001  inference is a hint; lowering checks types itself
        inferred = model.graph
    types = {}
    for value in [*inferred.value_info, *inferred.input, *inferred.output, *model.graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    return types


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), 0)


def _upgrade(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Old opsets are converted with onnx.version_converter rather than lowered twice."""
    model = _channel_slopes(model)
    try:
        return onnx.version_converter.convert_version(model, UPGRADE_TO_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors and more
        raise UnsupportedModel([f"opset {opset}, which could not be converted ({exc})"]) from None


def _channel_slopes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Before opset 7 a 1-D PRelu slope is per channel (axis 1); the converter leaves it 1-D."""
    ranks = {}
    for value in [*onnx.shape_inference.infer_shapes(model).graph.value_info, *model.graph.input]:
        if value.type.tensor_type.HasField("shape"):
            ranks[value.name] = len(value.type.tensor_type.shape.dim)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    weights = {t.name: t for t in fixed.graph.initializer}
    declared = {v.name: v for v in fixed.graph.input}
    for node in fixed.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2 or node.input[1] not in weights:
            continue
        slope, rank = weights[node.input[1]], ranks.get(node.input[0], 0)
        if len(slope.dims) == 1 and slope.dims[0] > 1 and rank > 2:
            slope.dims[:] = [slope.dims[0]] + [1] * (rank - 2)
            if slope.name in declared:  # IR 3 also lists initializers as graph inputs
                declared[slope.name].CopyFrom(
                    helper.make_tensor_value_info(slope.name, slope.data_type, list(slope.dims))
                )
    return fixed


def load_graph(data: bytes, dims: Mapping[str, str] | None = None) -> Graph:
    return onnx_to_graph(parse_model(data), dims)


def _symbol_name(raw: str | bytes) -> str:
    if isinstance(raw, bytes):  # protobuf hands back a string field that is not UTF-8 as bytes
        raw = raw.decode("utf-8", "replace")
    cleaned = re.sub(r"[^0-9A-Za-z_]", "_", raw)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"d_{cleaned}"


def _value_type(
    value: onnx.ValueInfoProto, substitutions: Mapping[str, Dim] | None = None
) -> tuple[tuple[Dim, ...], str]:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise UnsupportedModel([f"non-tensor graph input {value.name!r}"])
    dtype = ELEM_TYPES.get(tensor_type.elem_type)
    if dtype is None:
        name = onnx.TensorProto.DataType.Name(tensor_type.elem_type)
        raise UnsupportedModel([f"input {value.name!r} of element type {name}"])
    if not tensor_type.HasField("shape"):
        raise UnsupportedModel([f"input {value.name!r} without a declared rank"])
    shape: list[Dim] = []
    for axis, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif dim.dim_param:
            name = _symbol_name(dim.dim_param)
            shape.append((substitutions or {}).get(name) or SymDim.named(name))
        else:
            shape.append(SymDim.named(_symbol_name(f"{value.name}_{axis}")))
    return tuple(shape), dtype
