"""The dtypes the IR carries, by name, and their NumPy types; the one place dtypes are tested.

Every lowering and composite asks is_float, is_signed_int, is_unsigned_int, bits, lowest and
highest here rather than matching dtype names itself.

The narrow storage formats NumPy lacks (bfloat16, the float8 and float4 formats, 4- and 2-bit
ints) come from ml_dtypes. Graphs only store values in them: arithmetic runs in a wider dtype
(see compiler.frontends.onnx_context.COMPUTED_AS).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

STANDARD = frozenset(
    {"float32", "float64", "float16", "int64", "int32", "int16", "int8"}
    | {"uint64", "uint32", "uint16", "uint8", "bool"}
)

NARROW_FLOATS = frozenset(
    {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"}
    | {"float8_e8m0fnu", "float4_e2m1fn"}
)
NARROW_INTS = frozenset({"int4", "int2"})
NARROW_UINTS = frozenset({"uint4", "uint2"})

DTYPES = STANDARD | NARROW_FLOATS | NARROW_INTS | NARROW_UINTS

_NUMPY = {name: np.dtype(name) for name in STANDARD} | {
    name: np.dtype(getattr(ml_dtypes, name)) for name in DTYPES - STANDARD
}


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of an IR dtype name; ValueError for a name the IR does not carry."""
    try:
        return _NUMPY[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def kind(name: str) -> str:
    """NumPy's kind letter ('f', 'i', 'u', 'b'), also for the ml_dtypes types NumPy calls 'V'."""
    if name in NARROW_FLOATS:
        return "f"
    if name in NARROW_INTS:
        return "i"
    if name in NARROW_UINTS:
        return "u"
    return numpy_dtype(name).kind


def is_float(name: str) -> bool:
    return name in DTYPES and kind(name) == "f"


def is_signed_int(name: str) -> bool:
    return name in DTYPES and kind(name) == "i"


def is_unsigned_int(name: str) -> bool:
    return name in DTYPES and kind(name) == "u"


def bits(name: str) -> int:
    """The width of the NumPy storage type (8 for the 4- and 2-bit formats, stored in a byte)."""
    return numpy_dtype(name).itemsize * 8


def lowest(name: str) -> float | int:
    """The bottom of a type's order: -inf for floats, the minimum for integers."""
    return -np.inf if is_float(name) else int(np.iinfo(numpy_dtype(name)).min)


def highest(name: str) -> float | int:
    """The top of a type's order: inf for floats, the maximum for integers."""
    return np.inf if is_float(name) else int(np.iinfo(numpy_dtype(name)).max)
