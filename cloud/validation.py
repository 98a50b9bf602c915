"""Turning a request's JSON inputs into arrays that match a model's signature.

Every mismatch is an InvalidInput naming the input and the expected signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cloud.errors import InvalidInput
from compiler import Signature, TensorSpec
from compiler.shape import SymDim, shape_to_json


def describe(spec: TensorSpec) -> str:
    dims = ", ".join(str(d) for d in shape_to_json(spec.shape))
    return f"{spec.name}: {spec.dtype}[{dims}]"


def describe_signature(signature: Signature) -> str:
    return "; ".join(describe(s) for s in signature.inputs)


# JSON gives numbers, bools and nested lists; the kinds each declared dtype accepts
_ACCEPTED_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


def decode_inputs(
    signature: Signature,
    raw: Mapping[str, Any],
    max_elements: int,
    max_symbol_size: int,
) -> tuple[dict[str, np.ndarray], int]:
    """Arrays by input name, and the rows along the batch dimension (1 when there is none)."""
    expected = describe_signature(signature)
    names = {s.name for s in signature.inputs}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise InvalidInput(f"unknown input {unknown[0]!r}; the model expects {expected}")
    bindings: dict[str, int] = {}
    arrays: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        if spec.name not in raw:
            raise InvalidInput(f"missing input {spec.name!r}; the model expects {expected}")
        arrays[spec.name] = _decode_one(spec, raw[spec.name], bindings, max_elements, max_symbol_size)
    rows = bindings.get(signature.batch_symbol, 1) if signature.batch_symbol else 1
    return arrays, rows


def _decode_one(spec, value, bindings, max_elements, max_symbol_size) -> np.ndarray:
    want = describe(spec)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        raise InvalidInput(f"input {spec.name!r} is not a rectangular nested list; expected {want}") from None
    if array.dtype.kind not in _ACCEPTED_KINDS[np.dtype(spec.dtype).kind]:
        got = {"b": "booleans", "U": "strings", "O": "nulls or mixed values", "f": "floats"}.get(
            array.dtype.kind, str(array.dtype)
        )
        raise InvalidInput(f"input {spec.name!r} has {got} where {spec.dtype} is expected; expected {want}")
    if array.ndim != len(spec.shape):
        raise InvalidInput(f"input {spec.name!r} has rank {array.ndim}, expected {want}")
    if array.size > max_elements:
        raise InvalidInput(f"input {spec.name!r} has {array.size} elements, more than {max_elements}")
    for axis, (declared, size) in enumerate(zip(spec.shape, array.shape)):
        if isinstance(declared, SymDim):
            symbol = str(declared)
            if size < 1 or size > max_symbol_size:
                raise InvalidInput(
                    f"input {spec.name!r} dimension {axis} ({symbol}) is {size}; "
                    f"allowed 1 to {max_symbol_size}"
                )
            if bindings.setdefault(symbol, size) != size:
                raise InvalidInput(
                    f"input {spec.name!r} dimension {axis} ({symbol}) is {size} but "
                    f"{bindings[symbol]} in another input; expected {want}"
                )
        elif declared != size:
            raise InvalidInput(
                f"input {spec.name!r} dimension {axis} is {size}, expected {declared}; expected {want}"
            )
    with np.errstate(all="ignore"):
        converted = array.astype(spec.dtype)
    if spec.dtype.startswith("float") and not np.all(np.isfinite(converted[np.isfinite(array)])):
        raise InvalidInput(f"input {spec.name!r} has values that overflow {spec.dtype}")
    return converted
