"""Where a decoder graph keeps its KV cache: the inputs and outputs that carry it, found by name
and shape as `optimum-onnx` and `torch.onnx.export` of a `transformers` model with a cache
name them. A graph that cannot be mapped is refused with the input (or output) that breaks it.

    input_ids        [batch, seq]                       int64
    attention_mask   [batch, past + seq]                int64   (optional)
    position_ids     [batch, seq]                       int64   (optional)
    past_key_values.{i}.key / .value   [batch, kv_heads, past, head_dim]
    use_cache_branch [1] or []                          bool    (optional: optimum's merged decoder)
    logits           [batch, seq, vocab]
    present.{i}.key / .value           [batch, kv_heads, past + seq, head_dim]

A merged decoder (optimum's decoder_model_merged.onnx) takes `use_cache_branch` and chooses with
an If between its with-past and no-past decoders. The service always takes the with-past branch
(the first step runs with zero-length past tensors): `bind_cache_branch` fixes the input to True
before the graph is compiled, the If is inlined, and the input is gone from the program. That is
right only when the with-past branch was traced for prompts of any length: the upload check
(registry.bundle.check_merged_branches) runs both branches on a prompt and refuses a merged decoder
whose branches disagree (optimum 1.x's --legacy merge traces the with-past one at one new token).

Plain data over TensorSpecs: the gateway checks an upload with it, the runtime lays out its
cache blocks with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compiler.artifact import TensorSpec
from compiler.errors import UnsupportedModel
from compiler.shape import SymDim

# past_key_values.0.key (optimum, torch with names given), past_key_values_0_key (sanitised names)
_PAST = re.compile(r"^past_key_values[._](\d+)[._](key|value)$")
_PRESENT = re.compile(r"^present[._](\d+)[._](key|value)$")
IDS, MASK, POSITIONS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"
CACHE_BRANCH = "use_cache_branch"
# a paged decode graph's inputs (paged_decode_graph): each layer's pools and the past's slots
KV_SLOTS = "kv_slots"
POOL_SLOTS = "kv_pool_slots"  # the pools' first axis: num_blocks * block_size


def pool_input(layer: int, part: str) -> str:
    """The name of a layer's key ("key") or value ("value") pool in a paged decode graph."""
    return f"kv_pool.{layer}.{part}"


@dataclass(frozen=True)
class CacheLayout:
    """The cache's shape per layer and which graph tensor carries each part of it."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    vocab: int
    past_keys: tuple[str, ...]  # input names, one per layer
    past_values: tuple[str, ...]
    present_keys: tuple[str, ...]  # output names, one per layer
    present_values: tuple[str, ...]
    mask_input: str | None  # attention_mask, when the graph takes one
    position_input: str | None  # position_ids, when the graph takes one
    # use_cache_branch, when the graph is a merged decoder: bound to True before it is compiled
    cache_branch_input: str | None = None

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one cache block: keys and values of `block_size` tokens over every layer."""
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(self.dtype, 4)
        return 2 * self.layers * self.kv_heads * block_size * self.head_dim * itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "vocab": self.vocab,
            "past_keys": list(self.past_keys),
            "past_values": list(self.past_values),
            "present_keys": list(self.present_keys),
            "present_values": list(self.present_values),
            "mask_input": self.mask_input,
            "position_input": self.position_input,
            **({"cache_branch_input": self.cache_branch_input} if self.cache_branch_input else {}),
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> CacheLayout:
        return CacheLayout(
            layers=int(data["layers"]),
            kv_heads=int(data["kv_heads"]),
            head_dim=int(data["head_dim"]),
            dtype=str(data["dtype"]),
            vocab=int(data["vocab"]),
            past_keys=tuple(data["past_keys"]),
            past_values=tuple(data["past_values"]),
            present_keys=tuple(data["present_keys"]),
            present_values=tuple(data["present_values"]),
            mask_input=data.get("mask_input"),
            position_input=data.get("position_input"),
            cache_branch_input=data.get("cache_branch_input"),
        )


def _refuse(problem: str) -> UnsupportedModel:
    return UnsupportedModel([f"not a decoder with a KV cache this service can serve: {problem}"])


def _static(spec: TensorSpec, axis: int, what: str) -> int:
    dim = spec.shape[axis]
    if not isinstance(dim, int):
        raise _refuse(f"{spec.name!r} has a symbolic {what} ({dim}); it must be a fixed size")
    return dim


def _per_layer(
    specs: Sequence[TensorSpec], pattern: re.Pattern[str], kind: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    keys: dict[int, str] = {}
    values: dict[int, str] = {}
    for spec in specs:
        match = pattern.match(spec.name)
        if match:
            (keys if match.group(2) == "key" else values)[int(match.group(1))] = spec.name
    layers = max([*keys, *values], default=-1) + 1
    if layers == 0:
        raise _refuse(f"the graph has no {kind} tensors (named {pattern.pattern.strip('^$')})")
    for layer in range(layers):
        for part, found in (("key", keys), ("value", values)):
            if layer not in found:
                raise _refuse(
                    f"the {kind} of layer {layer} has no {part} (layers 0..{layers - 1} each need a key and a value)"
                )
    return tuple(keys[i] for i in range(layers)), tuple(values[i] for i in range(layers))


def find_cache_layout(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> CacheLayout:
    """The graph's cache layout, or UnsupportedModel naming the input or output it cannot map."""
    by_input = {spec.name: spec for spec in inputs}
    by_output = {spec.name: spec for spec in outputs}
    if IDS not in by_input:
        raise _refuse(f"it has no input named {IDS!r} (its inputs: {', '.join(by_input)})")
    ids = by_input[IDS]
    if len(ids.shape) != 2 or not ids.dtype.startswith("int"):
        raise _refuse(
            f"{IDS!r} must be [batch, sequence] integers, not {list(map(str, ids.shape))} {ids.dtype}"
        )
    if LOGITS not in by_output:
        raise _refuse(f"it has no output named {LOGITS!r} (its outputs: {', '.join(by_output)})")
    logits = by_output[LOGITS]
    if len(logits.shape) != 3:
        raise _refuse(f"{LOGITS!r} must be [batch, sequence, vocab], not {list(map(str, logits.shape))}")
    vocab = _static(logits, 2, "vocabulary size")
    past_keys, past_values = _per_layer(inputs, _PAST, "past_key_values inputs")
    present_keys, present_values = _per_layer(outputs, _PRESENT, "present outputs")
    if len(present_keys) != len(past_keys):
        raise _refuse(
            f"it takes the past of {len(past_keys)} layers but returns the present of {len(present_keys)}"
        )
    branch = by_input.get(CACHE_BRANCH)
    if branch is not None and (branch.dtype != "bool" or tuple(branch.shape) not in ((), (1,))):
        raise _refuse(
            f"{CACHE_BRANCH!r} (a merged decoder's choice of branch) must be a bool of shape [1], "
            f"not {list(map(str, branch.shape))} {branch.dtype}"
        )
    known = {IDS, MASK, POSITIONS, CACHE_BRANCH, *past_keys, *past_values}
    for spec in inputs:
        if spec.name not in known:
            raise _refuse(f"input {spec.name!r} is not one a decoder step can be given")
    first = by_input[past_keys[0]]
    if len(first.shape) != 4:
        raise _refuse(
            f"{first.name!r} must be [batch, kv_heads, past, head_dim], not {list(map(str, first.shape))}"
        )
    kv_heads = _static(first, 1, "head count")
    head_dim = _static(first, 3, "head size")
    for name in (*past_keys, *past_values):
        spec = by_input[name]
        if (
            len(spec.shape) != 4
            or spec.shape[1] != kv_heads
            or spec.shape[3] != head_dim
            or spec.dtype != first.dtype
        ):
            raise _refuse(
                f"{name!r} is {list(map(str, spec.shape))} {spec.dtype}, unlike {first.name!r} "
                f"([batch, {kv_heads}, past, {head_dim}] {first.dtype})"
            )
    for name in (*present_keys, *present_values):
        spec = by_output[name]
        if len(spec.shape) != 4 or spec.shape[1] not in (kv_heads,) or spec.shape[3] != head_dim:
            raise _refuse(
                f"output {name!r} is {list(map(str, spec.shape))}, not [batch, {kv_heads}, past + seq, {head_dim}]"
            )
    if not first.dtype.startswith(("float", "bfloat")):
        raise _refuse(f"{first.name!r} holds {first.dtype}; the cache must be floating point")
    return CacheLayout(
        layers=len(past_keys),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=first.dtype,
        vocab=vocab,
        past_keys=past_keys,
        past_values=past_values,
        present_keys=present_keys,
        present_values=present_values,
        mask_input=MASK if MASK in by_input else None,
        position_input=POSITIONS if POSITIONS in by_input else None,
        cache_branch_input=CACHE_BRANCH if branch is not None else None,
    )


def decoder_dims(inputs: Sequence[TensorSpec]) -> dict[str, str]:
    """The symbol relation a decoder's declared inputs leave implicit: the attention mask spans
    the past and the new tokens (total_sequence_length = past_sequence_length + sequence_length).
    Without it the compiler treats the three as independent sizes; empty when the mask is
    already declared as the sum or the graph has no mask. The past's length is its third axis,
    or `kv_slots`' second in a paged decode graph (paged_decode_graph)."""
    by_name = {spec.name: spec for spec in inputs}
    mask, ids = by_name.get(MASK), by_name.get(IDS)
    past = next((spec for spec in inputs if _PAST.match(spec.name)), None)
    slots = by_name.get(KV_SLOTS)
    if past is not None and len(past.shape) == 4:
        past_dim = past.shape[2]
    elif slots is not None and len(slots.shape) == 2:
        past_dim = slots.shape[1]
    else:
        return {}
    if mask is None or ids is None or len(mask.shape) != 2 or len(ids.shape) != 2:
        return {}
    total, past_len = (d.as_symbol() if isinstance(d, SymDim) else None for d in (mask.shape[1], past_dim))
    seq_dim = ids.shape[1]
    seq = seq_dim.as_symbol() if isinstance(seq_dim, SymDim) else seq_dim  # 1 in a decode step's graph
    if total is None or past_len is None or seq is None or len({total, past_len, str(seq)}) < 3:
        return {}
    return {total: f"{past_len} + {seq}"}


def bind_cache_branch(model, branch: bool = True) -> bool:
    """Makes a merged decoder (an onnx.ModelProto taking `use_cache_branch`) its with-past
    decoder, in place: each If on the input is replaced by its then-branch's nodes (with an
    Identity from each branch output to the If's of another name), the branch's initializers and value_info move
    to the graph, and the input becomes an initializer holding True (for any other reader), so
    the compiled program takes no such input. The with-past branch serves the first step too,
    with zero-length past tensors. Inlining here rather than leaving a known condition to the
    compiler's If lowering keeps the branch's values visible to the graph's shape inference,
    which the lowering reads dtypes from. False when the graph takes no `use_cache_branch`;
    UnsupportedModel when it is not a bool of one element or is not the condition of an If.

    `branch=False` binds it to False instead: the else-branch, the no-past decoder (its past
    inputs stay declared, unread), which the upload check runs as the reference for a prompt."""
    from onnx import TensorProto, helper

    index = next((i for i, v in enumerate(model.graph.input) if v.name == CACHE_BRANCH), None)
    if index is None:
        return False
    graph = model.graph
    tensor = graph.input[index].type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    if tensor.elem_type != TensorProto.BOOL or shape not in ([], [1]):
        raise _refuse(
            f"{CACHE_BRANCH!r} (a merged decoder's choice of branch) must be a bool of shape [1], "
            f"not {shape} of onnx type {tensor.elem_type}"
        )
    branches = [node for node in graph.node if node.op_type == "If" and node.input[0] == CACHE_BRANCH]
    if not branches:
        raise _refuse(
            f"{CACHE_BRANCH!r} is the condition of no If node (a merged decoder chooses its branch with one)"
        )
    side, label = ("then_branch", "then-branch") if branch else ("else_branch", "else-branch")
    defined = {t.name for t in graph.initializer}
    nodes = []
    for node in graph.node:
        if node not in branches:
            nodes.append(node)
            continue
        chosen = next(a.g for a in node.attribute if a.name == side)
        if chosen.input or chosen.sparse_initializer or len(chosen.output) != len(node.output):
            raise _refuse(f"the If on {CACHE_BRANCH!r} ({node.name!r}) has a {label} that cannot be inlined")
        for initializer in chosen.initializer:
            if initializer.name in defined:
                raise _refuse(f"the {label} of {node.name!r} redefines {initializer.name!r}")
            defined.add(initializer.name)
            graph.initializer.append(initializer)
        graph.value_info.extend(chosen.value_info)
        nodes.extend(chosen.node)
        nodes.extend(
            helper.make_node("Identity", [inner.name], [outer], name=f"{node.name}/{outer}")
            for inner, outer in zip(chosen.output, node.output)
            if outer and outer != inner.name  # optimum's branches write the If's outputs' names
        )
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.input[index]
    graph.initializer.append(helper.make_tensor(CACHE_BRANCH, TensorProto.BOOL, shape, [bool(branch)]))
    return True


def decode_step_graph(model) -> bool:
    """Makes an onnx.ModelProto the decode phase's graph, in place: the new tokens' dimension
    (input_ids' second) is 1 wherever an input or output declares it, so the compiler searches
    the products of one token per sequence, and a merged decoder's `use_cache_branch` is bound
    to True (bind_cache_branch). False when there is no such symbol to fix."""
    bind_cache_branch(model)
    return _fix_ids_dimension(model, 1)


def one_sequence_graph(model) -> bool:
    """Makes a decode step's onnx.ModelProto (after decode_step_graph) take one sequence, in
    place: the batch dimension (input_ids' first) is 1 wherever an input or output declares it,
    so the search measures and picks the products' forms for a single stream (a matrix-vector
    loop reading an int8 weight in place, say), which the batch's program trades for the forms
    best at many rows. False when there is no such symbol to fix."""
    return _fix_ids_dimension(model, 0)


def _fix_ids_dimension(model, axis: int) -> bool:
    """The symbol of input_ids' `axis` set to 1 wherever an input or output declares it; False
    when input_ids is not [batch, seq] or that axis has no symbol."""
    ids = next((v for v in model.graph.input if v.name == IDS), None)
    if ids is None or len(ids.type.tensor_type.shape.dim) != 2:
        return False
    symbol = ids.type.tensor_type.shape.dim[axis].dim_param
    if not symbol:
        return False
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == symbol:
                dim.dim_value = 1  # clears dim_param (a oneof)
    return True


def paged_decode_graph(model, layout: CacheLayout) -> None:
    """Makes a decoder's onnx.ModelProto read its past from the paged KV cache, in place (after
    decode_step_graph, for the decode program). Each layer's past input becomes a read of its
    pools, `kv_pool.L.key` / `.value` [kv_pool_slots, kv_heads, head_dim], the whole cache of
    the layer as the runtime holds it (runtime.kv_cache), at `kv_slots` [batch, past] (int64:
    the flat slot, block * block_size + slot, of each past position of each row; padding points
    at any slot, hidden by the attention mask):

        past = Transpose(Gather(pool, kv_slots, axis=0), perm=[0, 2, 1, 3])

    and each present output, the Concat of the past and the new tokens along the past's axis,
    returns the new tokens' keys or values only, [batch, kv_heads, seq, head_dim], which the
    runtime writes into the pool: the past never leaves the pool. UnsupportedModel naming the
    output whose present is not such a Concat (the caller keeps the unpaged program)."""
    from onnx import TensorProto, helper

    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    declared = {value.name: value for value in graph.input}
    ids = declared.get(IDS)
    if ids is None or len(ids.type.tensor_type.shape.dim) != 2:
        raise _refuse(f"it has no input {IDS!r} of shape [batch, sequence]")
    new_tokens = ids.type.tensor_type.shape.dim[1]
    pasts = (*layout.past_keys, *layout.past_values)
    presents = (*layout.present_keys, *layout.present_values)
    missing = [name for name in pasts if name not in declared]
    if missing:
        raise _refuse(f"it takes no past input {missing[0]!r}")
    new_of = {present: _new_tokens_of(present, past, producers) for past, present in zip(pasts, presents)}
    first = declared[pasts[0]].type.tensor_type
    batch, past_length = first.shape.dim[0], first.shape.dim[2]

    def dim_of(dim) -> str | int | None:
        return dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else None)  # None: unnamed

    # the runtime holds a bfloat16 cache in float32 (NumPy has no bfloat16): the pools are
    # declared as it holds them, so that the program reads them without a conversion
    pool_type = TensorProto.FLOAT if first.elem_type == TensorProto.BFLOAT16 else first.elem_type
    readers = []
    for layer in range(layout.layers):
        for part, past in (("key", layout.past_keys[layer]), ("value", layout.past_values[layer])):
            pool = pool_input(layer, part)
            graph.input.append(
                helper.make_tensor_value_info(pool, pool_type, [POOL_SLOTS, layout.kv_heads, layout.head_dim])
            )
            read = f"{pool}/read"
            readers.append(helper.make_node("Gather", [pool, KV_SLOTS], [read], axis=0, name=read))
            if pool_type != first.elem_type:
                readers.append(
                    helper.make_node(
                        "Cast", [read], [f"{read}/cast"], to=first.elem_type, name=f"{read}/cast"
                    )
                )
                read = f"{read}/cast"
            # the consumers of the past read the transposed gather under the past's name
            readers.append(
                helper.make_node("Transpose", [read], [past], perm=[0, 2, 1, 3], name=f"{pool}/past")
            )
    graph.input.append(
        helper.make_tensor_value_info(KV_SLOTS, TensorProto.INT64, [dim_of(batch), dim_of(past_length)])
    )
    kept = [value for value in graph.input if value.name not in set(pasts)]
    del graph.input[:]
    graph.input.extend(kept)
    with_past = {present: f"{present}/with_past" for present in presents}
    for node in graph.node:  # the Concats still feed attention, under another name
        node.input[:] = [with_past.get(name, name) for name in node.input]
        node.output[:] = [with_past.get(name, name) for name in node.output]
    for value in graph.value_info:
        if value.name in with_past:
            value.name = with_past[value.name]
    returns = [
        helper.make_node("Identity", [new_of[present]], [present], name=f"{present}/new_tokens")
        for present in presents
    ]
    nodes = [*readers, *graph.node, *returns]
    del graph.node[:]
    graph.node.extend(nodes)
    for value in graph.output:
        if value.name in with_past:
            value.type.tensor_type.shape.dim[2].CopyFrom(new_tokens)


def _new_tokens_of(present: str, past: str, producers: dict) -> str:
    """The new tokens' part of the Concat that makes `present` from `past` (through Identity
    nodes and one-input Concats, which torch.onnx.export leaves), or UnsupportedModel naming it."""

    def source(name: str):
        node = producers.get(name)
        while node is not None and (
            node.op_type == "Identity" or (node.op_type == "Concat" and len(node.input) == 1)
        ):
            name = node.input[0]
            node = producers.get(name)
        return name, node

    _, concat = source(present)
    axis = None
    if concat is not None and concat.op_type == "Concat":
        axis = next((a.i for a in concat.attribute if a.name == "axis"), None)
    if concat is None or concat.op_type != "Concat" or len(concat.input) != 2 or axis not in (2, -2):
        made = "a graph input" if concat is None else f"a {concat.op_type} ({concat.name!r})"
        raise _refuse(
            f"output {present!r} is made by {made}, not a Concat of the past and the new tokens "
            "along the past's axis, so its decode program cannot read the paged cache"
        )
    if source(concat.input[0])[0] != past:
        raise _refuse(
            f"output {present!r} is a Concat whose first operand is not the past {past!r}, "
            "so its decode program cannot read the paged cache"
        )
    return concat.input[1]


def onnx_specs(model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The declared inputs and outputs of an onnx.ModelProto as TensorSpecs (symbols by their
    declared names), for checking an upload before it is compiled."""
    from compiler.frontends.onnx_context import ELEM_TYPES

    def spec(value) -> TensorSpec:
        tensor = value.type.tensor_type
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else SymDim.named(d.dim_param or f"{value.name}_{axis}")
            for axis, d in enumerate(tensor.shape.dim)
        )
        return TensorSpec(
            value.name, shape, ELEM_TYPES.get(tensor.elem_type, f"onnx type {tensor.elem_type}")
        )

    initializers = {t.name for t in model.graph.initializer}
    return [spec(v) for v in model.graph.input if v.name not in initializers], [
        spec(v) for v in model.graph.output
    ]


__all__ = [
    "CACHE_BRANCH",
    "KV_SLOTS",
    "POOL_SLOTS",
    "CacheLayout",
    "bind_cache_branch",
    "decode_step_graph",
    "decoder_dims",
    "find_cache_layout",
    "one_sequence_graph",
    "onnx_specs",
    "paged_decode_graph",
    "pool_input",
]
