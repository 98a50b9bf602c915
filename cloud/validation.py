"""Turning a request's inputs into arrays that match a model's signature.

Inputs come as nested JSON lists (/v1), or as a shape with the elements in row-major order,
flat JSON values or raw little-endian bytes (/v2). Every mismatch is an InvalidInput naming the
input and the expected signature. Shapes are checked (rank, fixed dims, each symbol's size and
limit, one size per symbol across inputs, element counts of inputs and outputs, working memory)
the same way for both before any array is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from cloud.errors import InvalidInput, InvalidRequest, PayloadTooLarge
from cloud.settings import Settings
from compiler import Signature, TensorSpec
from compiler.dtypes import is_float, kind, numpy_dtype
from compiler.memory import peak_bytes
from compiler.shape import evaluate_shape, shape_to_json, symbols_of


def describe(spec: TensorSpec) -> str:
    dims = ", ".join(str(d) for d in shape_to_json(spec.shape))
    return f"{spec.name}: {spec.dtype}[{dims}]"


def describe_signature(signature: Signature) -> str:
    return "; ".join(describe(s) for s in signature.inputs)


def symbol_limits(signature: Signature, settings: Settings) -> dict[str, int]:
    """The largest size a request may give each symbolic dimension of the model's inputs."""
    limits = {}
    for symbol in sorted(set().union(*(symbols_of(s.shape) for s in signature.inputs))):
        if symbol in settings.dim_limits:
            limits[symbol] = settings.dim_limits[symbol]
        # the signature's batch symbol, or one named so when outputs do not lead with it
        elif symbol in (signature.batch_symbol, "batch"):
            limits[symbol] = settings.max_batch_dim
        else:
            limits[symbol] = settings.max_sequence_dim
        # the model's own bound (a position table of 64 rows) may be tighter than the service's
        limits[symbol] = min(limits[symbol], signature.size_limits.get(symbol, limits[symbol]))
    return _fit_memory(signature, limits, settings.max_request_memory_bytes)


def _fit_memory(signature: Signature, limits: dict[str, int], budget: int) -> dict[str, int]:
    """The limits, lowered until a request at all of them fits the memory budget, each time
    halving the symbol whose halving saves the most (a sequence under attention before the
    batch). A request below the limits is still checked against the budget by its own sizes."""
    if not signature.memory_terms or not limits:
        return limits
    limits = dict(limits)
    while (needed := peak_bytes(signature.memory_terms, limits)) > budget:
        halved = {s: {**limits, s: limits[s] // 2} for s in limits if limits[s] > 1}
        if not halved:
            break  # even the smallest request does not fit: each request is refused with the number
        # ties (a symmetric model) go to the non-batch, then the largest, so the limits shrink evenly
        symbol = min(
            halved,
            key=lambda s: (peak_bytes(signature.memory_terms, halved[s]), s == signature.batch_symbol, -limits[s]),
        )
        if peak_bytes(signature.memory_terms, halved[symbol]) >= needed:
            break
        limits = halved[symbol]
    return limits


# JSON gives numbers, bools and nested lists; the kinds each declared dtype accepts
_ACCEPTED_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


@dataclass
class DecodedInputs:
    # input name -> array of the input's dtype and a shape that fits the signature
    arrays: dict[str, np.ndarray]
    # the size of the batch dimension (1 when the model has none): the request's billed rows
    rows: int


@dataclass(frozen=True)
class FlatTensor:
    """An input given by its shape and its elements in row-major order."""

    shape: tuple[int, ...]
    # JSON values (a flat list, or nested as the shape says), or the raw little-endian bytes
    values: list[Any] | bytes


def decode_body(
    raw: bytes, signature: Signature, max_elements: int, limits: Mapping[str, int], max_memory_bytes: int | None
) -> DecodedInputs:
    """An inference body `{"inputs": {name: nested list}}` to arrays (see decode_inputs); a plain
    function of bytes, so a large body can be decoded in another process."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict) or not body["inputs"]:
        raise InvalidRequest('inputs: the body must be {"inputs": {"<input name>": <nested list>, ...}}')
    return decode_inputs(signature, body["inputs"], max_elements, limits, max_memory_bytes)


def decode_inputs(
    signature: Signature,
    raw: Mapping[str, Any],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None = None,
) -> DecodedInputs:
    """Arrays by input name from nested lists, and the rows along the batch dimension.

    `limits` gives the largest size of each symbolic dimension (see symbol_limits).
    """
    return _decode(signature, raw, _claimed_shape, _convert, max_elements, limits, max_memory_bytes)


def decode_flat_inputs(
    signature: Signature,
    tensors: Mapping[str, FlatTensor],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None = None,
) -> DecodedInputs:
    """Arrays by input name from shapes and row-major elements, checked like decode_inputs."""
    return _decode(signature, tensors, _flat_shape, _from_flat, max_elements, limits, max_memory_bytes)


def _decode[Given](
    signature: Signature,
    given: Mapping[str, Given],
    shape_of: Callable[[TensorSpec, Given], tuple[int, ...]],
    convert: Callable[[TensorSpec, Given, tuple[int, ...]], np.ndarray],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None,
) -> DecodedInputs:
    """Names, then shapes and sizes, are checked before `convert` makes any array."""
    check_input_names(signature, given)
    shapes = {s.name: shape_of(s, given[s.name]) for s in signature.inputs}
    rows = _check_sizes(signature, shapes, max_elements, limits, max_memory_bytes)
    return DecodedInputs({s.name: convert(s, given[s.name], shapes[s.name]) for s in signature.inputs}, rows)


def check_input_names(signature: Signature, names: Mapping[str, Any]) -> None:
    """Every input the model declares, and nothing else."""
    expected = describe_signature(signature)
    unknown = sorted(set(names) - {s.name for s in signature.inputs})
    if unknown:
        raise InvalidInput(f"unknown input {unknown[0]!r}; the model expects {expected}")
    missing = [s.name for s in signature.inputs if s.name not in names]
    if missing:
        raise InvalidInput(f"missing input {missing[0]!r}; the model expects {expected}")


def _check_sizes(
    signature: Signature,
    shapes: Mapping[str, tuple[int, ...]],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None,
) -> int:
    """Checks the inputs' shapes against the signature and the service's limits, before any
    array is allocated; returns the rows along the batch dimension (1 when there is none)."""
    bindings = _bind_symbols(signature, shapes, limits)
    for spec in signature.inputs:
        _check_elements(f"input {spec.name!r}", shapes[spec.name], max_elements)
    for spec in signature.outputs:
        if symbols_of(spec.shape) <= bindings.keys():
            _check_elements(f"output {spec.name!r}", evaluate_shape(spec.shape, bindings), max_elements)
    if max_memory_bytes is not None and signature.memory_terms:
        needed = peak_bytes(signature.memory_terms, bindings)
        if needed > max_memory_bytes:
            sizes = ", ".join(f"{k}={v}" for k, v in sorted(bindings.items()))
            raise PayloadTooLarge(
                f"this request ({sizes}) would need about {needed / 2**20:,.0f} MiB of working memory; "
                f"the limit is {max_memory_bytes / 2**20:,.0f} MiB"
            )
    return bindings.get(signature.batch_symbol, 1) if signature.batch_symbol else 1


def _claimed_shape(spec: TensorSpec, value: Any) -> tuple[int, ...]:
    """The shape a nested list claims along its first elements; np.asarray later proves it."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return _checked_rank(spec, tuple(shape))


def _flat_shape(spec: TensorSpec, tensor: FlatTensor) -> tuple[int, ...]:
    return _checked_rank(spec, tuple(tensor.shape))


def _checked_rank(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) != len(spec.shape):
        raise InvalidInput(f"input {spec.name!r} has rank {len(shape)}, expected {describe(spec)}")
    return shape


def _bind_symbols(
    signature: Signature, shapes: Mapping[str, tuple[int, ...]], limits: Mapping[str, int]
) -> dict[str, int]:
    """Each symbol's size, after checking fixed dims, limits and agreement between inputs."""
    bindings: dict[str, int] = {}
    # symbol -> (input, axis) that bound it, for the message when another input disagrees
    bound_by: dict[str, tuple[str, int]] = {}
    products = []
    for spec in signature.inputs:
        for axis, (declared, size) in enumerate(zip(spec.shape, shapes[spec.name])):
            where = f"input {spec.name!r} dimension {axis}"
            if isinstance(declared, int):
                if declared != size:
                    raise InvalidInput(f"{where} is {size}, expected {declared}; expected {describe(spec)}")
            elif declared.as_symbol() is None:
                products.append((where, declared, size, spec))
            else:
                symbol = declared.as_symbol()
                limit = limits[symbol]
                if size < 1 or size > limit:
                    raise InvalidInput(f"{where} ({symbol}) is {size}; allowed 1 to {limit}")
                if symbol in bindings and bindings[symbol] != size:
                    other, other_axis = bound_by[symbol]
                    raise InvalidInput(
                        f"symbol {symbol!r} is {size} in {where} but {bindings[symbol]} in input "
                        f"{other!r} dimension {other_axis}; one request gives each symbol one size"
                    )
                bindings[symbol] = size
                bound_by[symbol] = (spec.name, axis)
    # a product such as 2*seq is checked once its symbols are known from other dims
    for where, declared, size, spec in products:
        if not symbols_of([declared]) <= bindings.keys():
            raise InvalidInput(f"{where} ({declared}) is not fixed by any other dimension; expected {describe(spec)}")
        want = evaluate_shape([declared], bindings)[0]
        if want != size:
            raise InvalidInput(f"{where} ({declared}) is {size}, expected {want}; expected {describe(spec)}")
    return bindings


def _check_elements(what: str, shape: tuple[int, ...], max_elements: int) -> None:
    count = prod(shape)
    if count > max_elements:
        raise InvalidInput(f"{what} would have {count} elements, more than the limit of {max_elements}")


def _convert(spec: TensorSpec, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    want = describe(spec)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        array = None
    if array is None or array.shape != shape:
        raise InvalidInput(f"input {spec.name!r} is not a rectangular nested list; expected {want}")
    if array.dtype.kind not in _ACCEPTED_KINDS[kind(spec.dtype)]:
        got = {"b": "booleans", "U": "strings", "O": "nulls or mixed values", "f": "floats"}.get(
            array.dtype.kind, str(array.dtype)
        )
        raise InvalidInput(f"input {spec.name!r} has {got} where {spec.dtype} is expected; expected {want}")
    with np.errstate(all="ignore"):
        converted = array.astype(numpy_dtype(spec.dtype))
    if is_float(spec.dtype) and not np.all(np.isfinite(converted[np.isfinite(array)])):
        raise InvalidInput(f"input {spec.name!r} has values that overflow {spec.dtype}")
    return converted


def _from_flat(spec: TensorSpec, tensor: FlatTensor, shape: tuple[int, ...]) -> np.ndarray:
    count = prod(shape)
    dims = ", ".join(map(str, shape))
    if isinstance(tensor.values, bytes):
        dtype = numpy_dtype(spec.dtype)
        if len(tensor.values) != count * dtype.itemsize:
            raise InvalidInput(
                f"input {spec.name!r} has {len(tensor.values)} bytes of data; shape [{dims}] of {spec.dtype} "
                f"needs {count * dtype.itemsize}"
            )
        # astype copies into the machine's byte order and leaves the request's buffer behind
        return np.frombuffer(tensor.values, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    try:
        array = np.asarray(tensor.values)
    except (ValueError, TypeError):
        raise InvalidInput(f"input {spec.name!r}: data is not a list of {spec.dtype} values") from None
    if array.size != count:
        raise InvalidInput(f"input {spec.name!r} has {array.size} values of data; shape [{dims}] needs {count}")
    return _convert(spec, array.reshape(shape), shape)
