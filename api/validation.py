"""Turning a request's inputs into arrays that match a model's signature.

Inputs come as nested JSON lists (/v1), or as a shape with the elements in row-major order,
flat JSON values or raw little-endian bytes (/v2). Every mismatch is an InvalidInput naming the
input and the expected signature. Shapes are checked (rank, fixed dims, each symbol's size and
limit, one size per symbol across inputs, element counts of inputs and outputs, working memory)
the same way for both before any array is allocated.

Values follow one rule on both routes, JSON or binary (see InputRules): numbers only (booleans
only for bool inputs, and bool inputs only true or false), each within its dtype's range, and no
NaN or infinity unless the request sets parameters.allow_non_finite. Errors name the element.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import ml_dtypes
import numpy as np
import pydantic_core

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


# the request parameter (/v1 and /v2 alike) that lets NaN and infinities through
ALLOW_NON_FINITE = "allow_non_finite"
_NON_FINITE_REFUSED = f"NaN and infinities are refused unless the request sets parameters.{ALLOW_NON_FINITE} to true"
# how JSON writes what it has no numbers for: bare tokens (Python's json) or strings (our outputs)
_NON_FINITE_STRINGS = frozenset({"NaN", "Infinity", "-Infinity"})
# the Python types of JSON elements that numpy may convert at once, by the kind of the dtype
_PLAIN_TYPES = {"f": frozenset({int, float}), "i": frozenset({int}), "u": frozenset({int}), "b": frozenset({bool})}
# the array kinds that conversion leaves for each kind of dtype (object: ints past 64 bits)
_PLAIN_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}
# the array the slow path (element by element) builds, by the kind of the dtype
_ELEMENT_DTYPES = {"f": np.float64, "i": object, "u": object, "b": bool}


class NonFiniteToken(float):
    """NaN, Infinity or -Infinity written as such in a request's JSON, told apart from a number
    too large for a float64 (1e999), which json also reads as infinity."""


def loads(raw: bytes | str) -> Any:
    """A request's JSON, with its non-finite tokens as NonFiniteToken."""
    try:
        # jiter: 3x json's speed; refusing the tokens leaves infinity to mean a number past float64
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError:
        pass
    # NaN or Infinity in the body, or no JSON at all: json tells tokens apart, and says what is wrong
    return json.loads(raw, parse_constant=NonFiniteToken)


@dataclass(frozen=True)
class InputRules:
    """What a request allows beyond plain numbers in range."""

    # NaN, Infinity and -Infinity in float inputs (parameters.allow_non_finite)
    allow_non_finite: bool = False


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
        body = loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict) or not body["inputs"]:
        raise InvalidRequest('inputs: the body must be {"inputs": {"<input name>": <nested list>, ...}}')
    rules = _v1_rules(body.get("parameters", {}))
    return decode_inputs(signature, body["inputs"], max_elements, limits, max_memory_bytes, rules)


def _v1_rules(parameters: Any) -> InputRules:
    """/v1's `parameters`: the one it knows, a boolean; a misspelt name is refused, not ignored."""
    if not isinstance(parameters, dict):
        raise InvalidRequest(f'parameters: must be an object such as {{"{ALLOW_NON_FINITE}": true}}')
    unknown = sorted(set(parameters) - {ALLOW_NON_FINITE})
    if unknown:
        raise InvalidRequest(f"parameters: unknown parameter {unknown[0]!r}; /v1 takes {ALLOW_NON_FINITE!r}")
    allow = parameters.get(ALLOW_NON_FINITE, False)
    if not isinstance(allow, bool):
        raise InvalidRequest(f"parameters.{ALLOW_NON_FINITE}: must be true or false, got {_shown(allow)}")
    return InputRules(allow_non_finite=allow)


def decode_inputs(
    signature: Signature,
    raw: Mapping[str, Any],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None = None,
    rules: InputRules = InputRules(),
) -> DecodedInputs:
    """Arrays by input name from nested lists, and the rows along the batch dimension.

    `limits` gives the largest size of each symbolic dimension (see symbol_limits).
    """
    return _decode(signature, raw, _claimed_shape, _convert, max_elements, limits, max_memory_bytes, rules)


def decode_flat_inputs(
    signature: Signature,
    tensors: Mapping[str, FlatTensor],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None = None,
    rules: InputRules = InputRules(),
) -> DecodedInputs:
    """Arrays by input name from shapes and row-major elements, checked like decode_inputs."""
    return _decode(signature, tensors, _flat_shape, _from_flat, max_elements, limits, max_memory_bytes, rules)


def _decode[Given](
    signature: Signature,
    given: Mapping[str, Given],
    shape_of: Callable[[TensorSpec, Given], tuple[int, ...]],
    convert: Callable[[TensorSpec, Given, tuple[int, ...], InputRules], np.ndarray],
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None,
    rules: InputRules,
) -> DecodedInputs:
    """Names, then shapes and sizes, are checked before `convert` makes any array."""
    check_input_names(signature, given)
    shapes = {s.name: shape_of(s, given[s.name]) for s in signature.inputs}
    rows = _check_sizes(signature, shapes, max_elements, limits, max_memory_bytes)
    arrays = {s.name: convert(s, given[s.name], shapes[s.name], rules) for s in signature.inputs}
    return DecodedInputs(arrays, rows)


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
    shape = _first_shape(value)
    if len(shape) != len(spec.shape):
        leaf = _first_leaf(value)
        if not _is_number(leaf):
            # {"x": "hello"}: the value is the problem, not its rank
            at = f" element [{', '.join('0' * len(shape))}]" if shape else ""
            raise InvalidInput(
                f"input {spec.name!r}{at} is {_shown(leaf)} where numbers are expected; expected {describe(spec)}"
            )
    return _checked_rank(spec, shape)


def _first_shape(value: Any) -> tuple[int, ...]:
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return tuple(shape)


def _first_leaf(value: Any) -> Any:
    while isinstance(value, list) and value:
        value = value[0]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | list) or (isinstance(value, str) and value in _NON_FINITE_STRINGS)


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


def _convert(spec: TensorSpec, value: Any, shape: tuple[int, ...], rules: InputRules) -> np.ndarray:
    return _json_array(spec, value, rules)


def _from_flat(spec: TensorSpec, tensor: FlatTensor, shape: tuple[int, ...], rules: InputRules) -> np.ndarray:
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
        array = np.frombuffer(tensor.values, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
        return _checked_binary(spec, array, np.frombuffer(tensor.values, np.uint8), rules)
    array = _json_array(spec, tensor.values, rules)
    if array.size != count:
        raise InvalidInput(f"input {spec.name!r} has {array.size} values of data; shape [{dims}] needs {count}")
    return array.reshape(shape)


def _json_array(spec: TensorSpec, value: Any, rules: InputRules) -> np.ndarray:
    """JSON elements (nested lists, or one number) as an array of the input's dtype, in the
    shape they are nested in; an error names the first element that breaks the rules."""
    shape = _first_shape(value)
    dtype_kind = kind(spec.dtype)
    array = None
    # the common case at numpy's speed: elements of the plain types only (no bools among floats,
    # no tokens, strings or nulls), checked in one pass before numpy would coerce them
    if _leaf_types(value, len(shape)) <= _PLAIN_TYPES[dtype_kind]:
        try:
            array = np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            array = None
        if array is not None and array.size and array.dtype.kind not in _PLAIN_KINDS[dtype_kind]:
            array = None  # ints past 64 bits, or ints mixed so that numpy made floats of them
        if array is not None and dtype_kind == "f" and not np.all(np.isfinite(array)):
            array = None  # a number past float64 (1e999): the slow path names it
    if array is None:
        array = _elements(spec, value, shape, rules)
    if array.shape != shape:
        raise InvalidInput(f"input {spec.name!r} is not a rectangular nested list; expected {describe(spec)}")
    return _narrowed(spec, array)


def _leaf_types(value: Any, depth: int) -> frozenset[type]:
    """The types of the elements `depth` lists down; {list} stands for a ragged nesting."""
    level: Any = [value]
    for _ in range(depth):
        level = itertools.chain.from_iterable(level)
    try:
        return frozenset(map(type, level))
    except TypeError:  # a number where a list should be
        return frozenset({list})


def _elements(spec: TensorSpec, value: Any, shape: tuple[int, ...], rules: InputRules) -> np.ndarray:
    """The slow path, element by element: each checked against the rules, the first bad one named."""
    try:
        objects = np.asarray(value, dtype=object)
    except ValueError:
        objects = None
    if objects is None or objects.shape != shape:
        raise InvalidInput(f"input {spec.name!r} is not a rectangular nested list; expected {describe(spec)}")
    flat = objects.ravel().tolist()
    values = []
    for index, element in enumerate(flat):
        problem, number = _element(spec, element, rules)
        if problem:
            raise InvalidInput(f"input {spec.name!r}{_at(shape, index)} {problem}")
        values.append(number)
    # ints stay Python ints (object), so that _narrowed names one past 64 bits as it was sent
    return np.array(values, dtype=_ELEMENT_DTYPES[kind(spec.dtype)]).reshape(shape)


def _element(spec: TensorSpec, element: Any, rules: InputRules) -> tuple[str | None, Any]:
    """(what is wrong with one JSON element, None) or (None, its number)."""
    dtype_kind, dtype = kind(spec.dtype), spec.dtype
    non_finite = type(element) is NonFiniteToken or (type(element) is str and element in _NON_FINITE_STRINGS)
    if type(element) is bool:
        if dtype_kind == "b":
            return None, element
        return f"is {_shown(element)}: booleans are accepted only for bool inputs, this one is {dtype}", None
    if dtype_kind == "b":
        return f"is {_shown(element)}; a bool input takes true or false", None
    if non_finite:
        name = element if type(element) is str else _shown(element)
        if dtype_kind != "f":
            return f"is {name} where {dtype} integers are expected", None
        if not rules.allow_non_finite:
            return f"is {name}; {_NON_FINITE_REFUSED}", None
        return None, float(element)
    if type(element) is int:
        if dtype_kind != "f":
            return None, element
        try:
            return None, float(element)
        except OverflowError:
            return f"({_shown(element)}) is out of range for {dtype}", None
    if type(element) is float:
        if dtype_kind != "f":
            return f"is {_shown(element)} where {dtype} integers are expected", None
        if not math.isfinite(element):
            return f"is a number too large for any float, out of range for {dtype}", None
        return None, element
    return f"is {_shown(element)} where {dtype} numbers are expected", None


def _narrowed(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """The array in the input's dtype; a number outside the dtype's range is named, never
    wrapped (300 as an int8) or turned into infinity (1e39 as a float32)."""
    dtype = numpy_dtype(spec.dtype)
    if kind(spec.dtype) in "iu" and array.size:
        info = ml_dtypes.iinfo(dtype)
        outside = np.flatnonzero((array < info.min) | (array > info.max))
        if outside.size:
            index = int(outside[0])
            raise InvalidInput(
                f"input {spec.name!r}{_at(array.shape, index)} ({_shown(array.flat[index])}) is out of range for "
                f"{spec.dtype} ({info.min} to {info.max})"
            )
    with np.errstate(all="ignore"):
        converted = array.astype(dtype)
    if is_float(spec.dtype) and array.dtype.kind in "iuf":
        overflowed = np.flatnonzero(np.isfinite(array) & ~np.isfinite(converted))
        if overflowed.size:
            index = int(overflowed[0])
            raise InvalidInput(
                f"input {spec.name!r}{_at(array.shape, index)} ({array.flat[index]:g}) is out of range for "
                f"{spec.dtype} (largest magnitude {float(ml_dtypes.finfo(dtype).max):.8g})"
            )
    return converted


def _checked_binary(spec: TensorSpec, array: np.ndarray, raw: np.ndarray, rules: InputRules) -> np.ndarray:
    """Raw bytes hold values of the dtype by construction; the same rules on what they hold."""
    if kind(spec.dtype) == "b":
        bad = np.flatnonzero(raw > 1)
        if bad.size:
            index = int(bad[0])
            raise InvalidInput(
                f"input {spec.name!r}{_at(array.shape, index)} is the byte {raw[index]}; a bool input takes 0 or 1"
            )
    elif is_float(spec.dtype) and not rules.allow_non_finite:
        bad = np.flatnonzero(~np.isfinite(array))
        if bad.size:
            index = int(bad[0])
            name = _non_finite_name(array.flat[index])
            raise InvalidInput(f"input {spec.name!r}{_at(array.shape, index)} is {name}; {_NON_FINITE_REFUSED}")
    return array


def _non_finite_name(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _at(shape: tuple[int, ...], index: int) -> str:
    """ element [i, j]: where the flat `index` lies in `shape` (nothing for a scalar)."""
    if not shape:
        return ""
    return f" element [{', '.join(str(int(i)) for i in np.unravel_index(index, shape))}]"


def _shown(value: Any) -> str:
    """A JSON value as a message shows it: strings quoted and cut short, containers by kind."""
    if isinstance(value, NonFiniteToken):
        return _non_finite_name(value)
    if isinstance(value, str):
        return f"a string ({json.dumps(value[:40] + ('...' if len(value) > 40 else ''))})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return f"a number of {len(str(abs(value)))} digits"
    return json.dumps(value.item() if isinstance(value, np.generic) else value)
