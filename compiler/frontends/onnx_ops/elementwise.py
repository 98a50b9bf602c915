"""Lowerings of element-wise math, comparison and logic ops.

Everything is spelled in primitives. Integer arithmetic is exact: ADD and MUL on integers are
taken modulo 2**bits (as NumPy and two's-complement hardware do), so subtraction and bitwise
complements are exact without any float round trip. Selections go through composite.where, a
gather, so inf and NaN in the branch not taken never leak into the result. float16 math that
takes several roundings is done in float32 and rounded once at the end. Where float formulas
cancel (expm1, tanh, erfc, cos near its zeros), a second form is selected so the result keeps
its relative precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx

from compiler import composite as C
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse
from compiler.ir import GraphBuilder, Op
from compiler.shape import broadcast_shapes, dim_mul, numel

# ---- dtype classes -------------------------------------------------------------------------


def _is_float(dtype: str) -> bool:
    return dtype.startswith("float")


def _is_signed(dtype: str) -> bool:
    return dtype.startswith("int")


def _is_unsigned(dtype: str) -> bool:
    return dtype.startswith("uint")


def _bits(dtype: str) -> int:
    return np.dtype(dtype).itemsize * 8


# ---- broadcasting and constants ------------------------------------------------------------


def _broadcast_all(b: GraphBuilder, parts: Sequence[int]) -> list[int]:
    shape = b.shape(parts[0])
    for p in parts[1:]:
        shape = broadcast_shapes(shape, b.shape(p))
    return [b.broadcast_to(p, shape) for p in parts]


def _full(b: GraphBuilder, value: float, like: int) -> int:
    return b.scalar_like(value, like)


def _add(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.ADD, *C.broadcast_pair(b, x, y))


def _mul(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.MUL, *C.broadcast_pair(b, x, y))


def _fmod(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.MOD, *C.broadcast_pair(b, x, y))


def _negate(b: GraphBuilder, x: int) -> int:
    """-x, exact for floats and (modulo 2**bits) for every integer type."""
    dtype = b.dtype(x)
    minus_one = np.iinfo(dtype).max if _is_unsigned(dtype) else -1
    return b.binary(Op.MUL, x, _full(b, minus_one, x))


def _sub(b: GraphBuilder, x: int, y: int) -> int:
    x, y = C.broadcast_pair(b, x, y)
    return b.binary(Op.ADD, x, _negate(b, y))


def _recip_mul(b: GraphBuilder, x: int, y: int) -> int:
    x, y = C.broadcast_pair(b, x, y)
    return b.binary(Op.MUL, x, b.unary(Op.RECIP, y))


# ---- booleans and comparisons --------------------------------------------------------------


def _any(b: GraphBuilder, *conds: int) -> int:
    counts = [b.cast(c, "uint8") for c in _broadcast_all(b, conds)]
    total = counts[0]
    for c in counts[1:]:
        total = b.binary(Op.ADD, total, c)
    return b.cast(total, "bool")


def _all(b: GraphBuilder, *conds: int) -> int:
    return C.logical_not(b, _any(b, *(C.logical_not(b, c) for c in conds)))


def _xor(b: GraphBuilder, x: int, y: int) -> int:
    x, y = C.broadcast_pair(b, b.cast(x, "uint8"), b.cast(y, "uint8"))
    total = b.binary(Op.ADD, x, y)
    return b.cast(b.binary(Op.MOD, total, _full(b, 2, total)), "bool")


def _isnan(b: GraphBuilder, x: int) -> int:
    # every number but NaN is below +inf or above -inf
    return C.logical_not(b, _any(b, C.less(b, x, _full(b, np.inf, x)), C.less(b, _full(b, -np.inf, x), x)))


def _eq(b: GraphBuilder, x: int, y: int) -> int:
    x, y = C.broadcast_pair(b, x, y)
    differ = [C.less(b, x, y), C.less(b, y, x)]
    if _is_float(b.dtype(x)):
        differ += [_isnan(b, x), _isnan(b, y)]
    return C.logical_not(b, _any(b, *differ))


def _as_number(b: GraphBuilder, cond: int, like: int) -> int:
    """A boolean as 0 or 1 in the dtype of `like`."""
    return b.cast(cond, b.dtype(like))


def _where(b: GraphBuilder, cond: int, x: int, y: int) -> int:
    return C.where(b, cond, x, y)


# ---- max, min, abs -------------------------------------------------------------------------


def _flip(b: GraphBuilder, x: int) -> int:
    """An exact order-reversing bijection: -x for floats, the bitwise complement for integers."""
    dtype = b.dtype(x)
    if _is_float(dtype):
        return C.neg(b, x)
    all_ones = np.iinfo(dtype).max if _is_unsigned(dtype) else -1
    return b.binary(Op.ADD, _negate(b, x), _full(b, all_ones, x))


def _max(b: GraphBuilder, parts: Sequence[int]) -> int:
    """Element-wise maximum; MAX_REDUCE propagates NaN as ONNX Max does."""
    parts = _broadcast_all(b, parts)
    if len(parts) == 1:
        return parts[0]
    return b.reduce(Op.MAX_REDUCE, C.stack_last(b, parts), [-1])


def _min(b: GraphBuilder, parts: Sequence[int]) -> int:
    return _flip(b, _max(b, [_flip(b, p) for p in parts]))


def _abs(b: GraphBuilder, x: int) -> int:
    return x if _is_unsigned(b.dtype(x)) else _max(b, [x, _negate(b, x)])


def _sign(b: GraphBuilder, x: int) -> int:
    positive = _as_number(b, C.less(b, _full(b, 0, x), x), x)
    if _is_unsigned(b.dtype(x)):
        return positive
    if _is_float(b.dtype(x)):
        # keeps NaN (and the sign of zero) by falling through to x itself
        rest = _where(b, C.less(b, _full(b, 0, x), x), _full(b, 1, x), x)
        return _where(b, C.less(b, x, _full(b, 0, x)), _full(b, -1, x), rest)
    return _sub(b, positive, _as_number(b, C.less(b, x, _full(b, 0, x)), x))


# ---- rounding ------------------------------------------------------------------------------


def _trunc(b: GraphBuilder, x: int) -> int:
    frac = b.binary(Op.MOD, x, _full(b, 1.0, x))  # exact; NaN for +-inf
    frac = _where(b, _isnan(b, frac), _full(b, 0.0, x), frac)
    return _sub(b, x, frac)


def _floor(b: GraphBuilder, x: int) -> int:
    t = _trunc(b, x)
    return _sub(b, t, _as_number(b, C.less(b, x, t), x))


def _ceil(b: GraphBuilder, x: int) -> int:
    t = _trunc(b, x)
    return _add(b, t, _as_number(b, C.less(b, t, x), x))


def _round_half_even(b: GraphBuilder, x: int) -> int:
    f = _floor(b, x)
    frac = _sub(b, x, f)  # exact except just below zero, where it rounds up towards 1
    half = _full(b, 0.5, x)
    odd = C.logical_not(b, _eq(b, b.binary(Op.MOD, f, _full(b, 2.0, x)), _full(b, 0.0, x)))
    up = _any(b, C.less(b, half, frac), _all(b, _eq(b, frac, half), odd))
    return _add(b, f, _as_number(b, up, x))


# ---- transcendental functions --------------------------------------------------------------


def _horner(b: GraphBuilder, z: int, coefficients: Sequence[float]) -> int:
    """Polynomial in z, coefficients from the highest degree down."""
    acc = _full(b, coefficients[0], z)
    for c in coefficients[1:]:
        acc = C.shift(b, b.binary(Op.MUL, acc, z), c)
    return acc


def _exp(b: GraphBuilder, x: int) -> int:
    return C.exp(b, x)


# below this |x|, a short Taylor series beats formulas that cancel (error under 1e-10)
_SMALL = 0.125


def _expm1(b: GraphBuilder, x: int) -> int:
    """exp(x) - 1 without the cancellation near 0."""
    series = b.binary(Op.MUL, x, _horner(b, x, [1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0]))
    small = C.less(b, _abs(b, x), _full(b, _SMALL, x))
    return _where(b, small, series, C.shift(b, _exp(b, x), -1.0))


def _with_sign_of(b: GraphBuilder, magnitude: int, x: int) -> int:
    sign = C.shift(b, C.scale(b, _as_number(b, C.less(b, x, _full(b, 0.0, x)), x), -2.0), 1.0)
    return b.binary(Op.MUL, magnitude, sign)


def _log(b: GraphBuilder, x: int) -> int:
    return C.log(b, x)


def _sqrt(b: GraphBuilder, x: int) -> int:
    return b.unary(Op.SQRT, x)


# rational approximation of erf on [-4, 4] (as in XLA and Eigen), max abs error about 4e-7
_ERF_NUM = (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
    -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
    -1.60960333262415e-02,
)  # fmt: skip
_ERF_DEN = (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
    -7.37332916720468e-03, -1.42647390514189e-02,
)  # fmt: skip


def _clamp(b: GraphBuilder, x: int, low: float, high: float) -> int:
    return _min(b, [_max(b, [x, _full(b, low, x)]), _full(b, high, x)])


def _erf(b: GraphBuilder, x: int) -> int:
    x = _clamp(b, x, -4.0, 4.0)
    z = b.binary(Op.MUL, x, x)
    num = b.binary(Op.MUL, x, _horner(b, z, _ERF_NUM))
    return _clamp(b, _recip_mul(b, num, _horner(b, z, _ERF_DEN)), -1.0, 1.0)


# Numerical Recipes' erfcc: erfc(z) for z >= 0 with a relative error below 1.2e-7 everywhere
_ERFC_POLY = (
    0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
    0.37409196, 1.00002368, -1.26551223,
)  # fmt: skip


def _erfc_nonnegative(b: GraphBuilder, z: int) -> int:
    t = b.unary(Op.RECIP, C.shift(b, C.scale(b, z, 0.5), 1.0))
    exponent = _sub(b, _horner(b, t, _ERFC_POLY), b.binary(Op.MUL, z, z))
    return b.binary(Op.MUL, t, _exp(b, exponent))


def _atan(b: GraphBuilder, x: int) -> int:
    """Cephes atanf: reduce |x| to [-tan(pi/8), tan(pi/8)], then an odd polynomial."""
    a = _abs(b, x)
    big = C.less(b, _full(b, 2.414213562373095, x), a)  # tan(3pi/8)
    mid = C.less(b, _full(b, 0.4142135623730950, x), a)  # tan(pi/8)
    moderate = _recip_mul(b, _add(b, a, _full(b, -1.0, x)), _add(b, a, _full(b, 1.0, x)))
    t = _where(b, big, C.neg(b, b.unary(Op.RECIP, a)), _where(b, mid, moderate, a))
    offset = C.scale(b, _add(b, _as_number(b, big, x), _as_number(b, mid, x)), math.pi / 4)
    z = b.binary(Op.MUL, t, t)
    poly = _horner(b, z, (8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1))
    r = _add(b, offset, _add(b, b.binary(Op.MUL, b.binary(Op.MUL, poly, z), t), t))
    return _with_sign_of(b, r, x)


def _one_minus_square(b: GraphBuilder, x: int) -> int:
    # (1 - x)(1 + x) keeps precision near |x| = 1, unlike 1 - x*x
    return b.binary(Op.MUL, C.shift(b, C.neg(b, x), 1.0), C.shift(b, x, 1.0))


def _asin(b: GraphBuilder, x: int) -> int:
    return _atan(b, _recip_mul(b, x, _sqrt(b, _one_minus_square(b, x))))


def _acos(b: GraphBuilder, x: int) -> int:
    ratio = _recip_mul(b, C.shift(b, C.neg(b, x), 1.0), C.shift(b, x, 1.0))
    return C.scale(b, _atan(b, _sqrt(b, ratio)), 2.0)


def _near_cos_zero(b: GraphBuilder, x: int) -> tuple[int, int]:
    """(cos x as 1 - 2 sin^2(x/2), whether x is near a zero of cos)

    The first form needs no shifted argument, so huge |x| stays as accurate as SIN itself, but
    its absolute error becomes a large relative one near the zeros of cos.
    """
    half_sine = b.unary(Op.SIN, C.scale(b, x, 0.5))
    cos = C.shift(b, C.scale(b, b.binary(Op.MUL, half_sine, half_sine), -2.0), 1.0)
    return cos, C.less(b, _abs(b, cos), _full(b, 0.5, x))


def _cos(b: GraphBuilder, x: int) -> int:
    cos, near_zero = _near_cos_zero(b, x)
    # sin(2x) / (2 sin x) is accurate relative to cos where sin x is near +-1
    double = _recip_mul(b, b.unary(Op.SIN, C.scale(b, x, 2.0)), C.scale(b, b.unary(Op.SIN, x), 2.0))
    return _where(b, near_zero, double, cos)


def _tan(b: GraphBuilder, x: int) -> int:
    cos, near_pole = _near_cos_zero(b, x)
    sine = b.unary(Op.SIN, x)
    # near the poles 2 sin^2 x / sin 2x keeps its relative accuracy
    pole = _recip_mul(b, C.scale(b, b.binary(Op.MUL, sine, sine), 2.0), b.unary(Op.SIN, C.scale(b, x, 2.0)))
    return _where(b, near_pole, pole, _recip_mul(b, sine, cos))


def _sinh(b: GraphBuilder, x: int) -> int:
    return C.scale(b, _sub(b, _expm1(b, x), _expm1(b, C.neg(b, x))), 0.5)


def _cosh(b: GraphBuilder, x: int) -> int:
    return C.scale(b, _add(b, _exp(b, x), _exp(b, C.neg(b, x))), 0.5)


# beyond this, sqrt(x^2 +- 1) is |x| to double precision (and x^2 may overflow float32)
_HUGE = 1e8


def _log_twice(b: GraphBuilder, x: int) -> int:
    return C.shift(b, _log(b, x), math.log(2.0))


def _asinh(b: GraphBuilder, x: int) -> int:
    # odd symmetry: log(|x| + sqrt(x^2 + 1)) has no cancellation for |x|
    a = _abs(b, x)
    moderate = _log(b, _add(b, a, _sqrt(b, C.shift(b, b.binary(Op.MUL, a, a), 1.0))))
    magnitude = _where(b, C.less(b, _full(b, _HUGE, x), a), _log_twice(b, a), moderate)
    return _where(b, C.less(b, x, _full(b, 0.0, x)), C.neg(b, magnitude), magnitude)


def _acosh(b: GraphBuilder, x: int) -> int:
    # sqrt(x-1) sqrt(x+1) is NaN below 1 and precise near 1
    root = b.binary(Op.MUL, _sqrt(b, C.shift(b, x, -1.0)), _sqrt(b, C.shift(b, x, 1.0)))
    moderate = _log(b, _add(b, x, root))
    return _where(b, C.less(b, _full(b, _HUGE, x), x), _log_twice(b, x), moderate)


def _atanh(b: GraphBuilder, x: int) -> int:
    ratio = _recip_mul(b, C.shift(b, x, 1.0), C.shift(b, C.neg(b, x), 1.0))
    return C.scale(b, _log(b, ratio), 0.5)


def _tanh(b: GraphBuilder, x: int) -> int:
    # tanh|x| = -t / (t + 2) with t = expm1(-2|x|) in (-1, 0]: no overflow, no cancellation
    t = _expm1(b, C.scale(b, _abs(b, x), -2.0))
    return _with_sign_of(b, C.neg(b, _recip_mul(b, t, C.shift(b, t, 2.0))), x)


def _softplus(b: GraphBuilder, x: int) -> int:
    # relu(x) + log(1 + exp(-|x|)): no overflow for large x
    tail = _log(b, C.shift(b, _exp(b, C.neg(b, _abs(b, x))), 1.0))
    return _add(b, C.relu(b, x), tail)


def _softsign(b: GraphBuilder, x: int) -> int:
    return _recip_mul(b, x, C.shift(b, _abs(b, x), 1.0))


def _mish(b: GraphBuilder, x: int) -> int:
    # tanh(softplus(x)) = u(u+2) / (u(u+2) + 2) with u = e^x: no cancellation for negative x;
    # the ratio is exactly 1 from x = 15 on, and capping x there keeps u finite
    u = _exp(b, _min(b, [x, _full(b, 15.0, x)]))
    n = b.binary(Op.MUL, u, C.shift(b, u, 2.0))
    return b.binary(Op.MUL, x, _recip_mul(b, n, C.shift(b, n, 2.0)))


def _positive(b: GraphBuilder, x: int) -> int:
    return C.less(b, _full(b, 0.0, x), x)


def _elu(b: GraphBuilder, x: int, a: dict) -> int:
    alpha = a.get("alpha", 1.0)
    return _where(b, _positive(b, x), x, C.scale(b, _expm1(b, x), alpha))


def _selu(b: GraphBuilder, x: int, a: dict) -> int:
    alpha = a.get("alpha", 1.67326319217681884765625)
    gamma = a.get("gamma", 1.05070102214813232421875)
    return C.scale(b, _elu(b, x, {"alpha": alpha}), gamma)


def _celu(b: GraphBuilder, x: int, a: dict) -> int:
    alpha = a.get("alpha", 1.0)
    negative = C.scale(b, _expm1(b, C.scale(b, x, 1.0 / alpha)), alpha)
    return _where(b, _positive(b, x), x, negative)


def _leaky_relu(b: GraphBuilder, x: int, a: dict) -> int:
    return _where(b, _positive(b, x), x, C.scale(b, x, a.get("alpha", 0.01)))


def _thresholded_relu(b: GraphBuilder, x: int, a: dict) -> int:
    above = C.less(b, _full(b, a.get("alpha", 1.0), x), x)
    return _where(b, above, x, _full(b, 0.0, x))


def _clamp01(b: GraphBuilder, x: int) -> int:
    return _min(b, [C.relu(b, x), _full(b, 1.0, x)])


def _hard_sigmoid(b: GraphBuilder, x: int, a: dict) -> int:
    return _clamp01(b, C.shift(b, C.scale(b, x, a.get("alpha", 0.2)), a.get("beta", 0.5)))


def _hard_swish(b: GraphBuilder, x: int) -> int:
    return b.binary(Op.MUL, x, _hard_sigmoid(b, x, {"alpha": 1.0 / 6, "beta": 0.5}))


def _swish(b: GraphBuilder, x: int, a: dict) -> int:
    return b.binary(Op.MUL, x, C.sigmoid(b, C.scale(b, x, a.get("alpha", 1.0))))


def _gelu(b: GraphBuilder, x: int, a: dict) -> int:
    approximate = a.get("approximate", b"none")
    if isinstance(approximate, bytes):
        approximate = approximate.decode()
    if approximate == "tanh":
        inner = _add(b, x, C.scale(b, b.binary(Op.MUL, b.binary(Op.MUL, x, x), x), 0.044715))
        # 0.5 (1 + tanh y) = sigmoid(2y), which keeps its precision where it is tiny
        return b.binary(Op.MUL, x, C.sigmoid(b, C.scale(b, inner, 2 * math.sqrt(2.0 / math.pi))))
    if approximate != "none":
        raise ValueError(f"approximate={approximate!r}")
    # 1 + erf(x / sqrt 2) = erfc(-x / sqrt 2), taken from erfc directly where it is small
    tail = _erfc_nonnegative(b, C.scale(b, _abs(b, x), 1.0 / math.sqrt(2.0)))
    factor = _where(b, C.less(b, x, _full(b, 0.0, x)), tail, C.shift(b, C.neg(b, tail), 2.0))
    return C.scale(b, b.binary(Op.MUL, x, factor), 0.5)


def _shrink(b: GraphBuilder, x: int, a: dict) -> int:
    lambd, bias = a.get("lambd", 0.5), a.get("bias", 0.0)
    below = C.less(b, x, _full(b, -lambd, x))
    above = C.less(b, _full(b, lambd, x), x)
    inner = _where(b, above, C.shift(b, x, -bias), _full(b, 0.0, x))
    return _where(b, below, C.shift(b, x, bias), inner)


# ---- unary ops -----------------------------------------------------------------------------

Unary = Callable[[GraphBuilder, int, dict], int]


def _plain(fn: Callable[[GraphBuilder, int], int]) -> Unary:
    return lambda b, x, a: fn(b, x)


# float-only ops; float16 inputs are computed in float32 and rounded once
_FLOAT_UNARY: dict[str, Unary] = {
    "Sigmoid": _plain(C.sigmoid),
    "Tanh": _plain(_tanh),
    "Exp": _plain(_exp),
    "Log": _plain(_log),
    "Sqrt": _plain(_sqrt),
    "Reciprocal": _plain(lambda b, x: b.unary(Op.RECIP, x)),
    "Sin": _plain(lambda b, x: b.unary(Op.SIN, x)),
    "Cos": _plain(_cos),
    "Tan": _plain(_tan),
    "Asin": _plain(_asin),
    "Acos": _plain(_acos),
    "Atan": _plain(_atan),
    "Sinh": _plain(_sinh),
    "Cosh": _plain(_cosh),
    "Asinh": _plain(_asinh),
    "Acosh": _plain(_acosh),
    "Atanh": _plain(_atanh),
    "Erf": _plain(_erf),
    "Softplus": _plain(_softplus),
    "Softsign": _plain(_softsign),
    "Mish": _plain(_mish),
    "Floor": _plain(_floor),
    "Ceil": _plain(_ceil),
    "Round": _plain(_round_half_even),
    "Elu": _elu,
    "Selu": _selu,
    "Celu": _celu,
    "LeakyRelu": _leaky_relu,
    "ThresholdedRelu": _thresholded_relu,
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _plain(_hard_swish),
    "Swish": _swish,
    "Gelu": _gelu,
    "Shrink": _shrink,
}

# ops exact on floats and signed integers (and, for Abs and Sign, unsigned ones)
_NUMERIC_UNARY: dict[str, Unary] = {
    "Relu": _plain(C.relu),
    "Neg": _plain(_negate),
    "Abs": _plain(_abs),
    "Sign": _plain(_sign),
}


def _in_float32(b: GraphBuilder, x: int, fn: Callable[[int], int]) -> int:
    if b.dtype(x) != "float16":
        return fn(x)
    return b.cast(fn(b.cast(x, "float32")), "float16")


@lowers(*_FLOAT_UNARY)
def _float_unary(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if not _is_float(b.dtype(x)):
        raise refuse(node, f"{b.dtype(x)} input")
    a = attrs(node)
    if node.op_type == "Gelu" and a.get("approximate", b"none") not in (b"none", b"tanh"):
        raise refuse(node, f"approximate={a['approximate']!r}")
    return [_in_float32(b, x, lambda v: _FLOAT_UNARY[node.op_type](b, v, a))]


@lowers(*_NUMERIC_UNARY)
def _numeric_unary(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    dtype = b.dtype(x)
    if dtype == "bool" or (_is_unsigned(dtype) and node.op_type in ("Neg", "Relu")):
        raise refuse(node, f"{dtype} input")
    return [_NUMERIC_UNARY[node.op_type](b, x, attrs(node))]


@lowers("PRelu")
def _prelu(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, slope = ctx.value(node, 0), ctx.value(node, 1)
    if not _is_float(b.dtype(x)):
        raise refuse(node, f"{b.dtype(x)} input")
    slope = b.broadcast_to(slope, b.shape(x))
    return [_where(b, _positive(b, x), x, b.binary(Op.MUL, x, slope))]


# ---- arithmetic ----------------------------------------------------------------------------


def _check_numeric(node: onnx.NodeProto, *dtypes: str) -> None:
    if any(d == "bool" for d in dtypes):
        raise refuse(node, "bool inputs")


def _div_int(b: GraphBuilder, x: int, y: int) -> int:
    """Integer division truncating toward zero, exact for types of up to 32 bits.

    x - fmod(x, y) is an exact multiple of y; dividing it in float64 leaves an error far below
    0.5, so rounding to the nearest integer recovers the quotient. A zero divisor is replaced by
    one (the result is undefined in ONNX) so no NaN is ever cast to an integer.
    """
    dtype = b.dtype(x)
    x, y = C.broadcast_pair(b, b.cast(x, "int64"), b.cast(y, "int64"))
    y = _add(b, y, _as_number(b, _eq(b, y, _full(b, 0, y)), y))
    multiple = _sub(b, x, b.binary(Op.MOD, x, y))
    approx = _recip_mul(b, b.cast(multiple, "float64"), b.cast(y, "float64"))
    away = C.shift(b, C.neg(b, _as_number(b, C.less(b, approx, _full(b, 0.0, approx)), approx)), 0.5)
    return b.cast(b.cast(_add(b, approx, away), "int64"), dtype)


@lowers("Add", "Sub", "Mul", "Div")
def _arithmetic(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = ctx.value(node, 0), ctx.value(node, 1)
    dtype = b.dtype(x)
    _check_numeric(node, dtype, b.dtype(y))
    if node.op_type == "Add":
        return [_add(b, x, y)]
    if node.op_type == "Sub":
        return [_sub(b, x, y)]
    if node.op_type == "Mul":
        return [_mul(b, x, y)]
    if _is_float(dtype):
        return [_in_float32(b, x, lambda v: _recip_mul(b, v, b.cast(y, b.dtype(v))))]
    if _bits(dtype) > 32:
        raise refuse(node, f"{dtype} inputs (exact 64-bit integer division)")
    return [_div_int(b, x, y)]


@lowers("Mod")
def _mod(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = ctx.value(node, 0), ctx.value(node, 1)
    _check_numeric(node, b.dtype(x))
    x, y = C.broadcast_pair(b, x, y)
    r = b.binary(Op.MOD, x, y)
    if attrs(node).get("fmod", 0) or _is_unsigned(b.dtype(x)):
        return [r]
    # Python-style: a nonzero remainder whose sign differs from the divisor's moves by y
    zero = _full(b, 0, x)
    differ = _any(
        b,
        _all(b, C.less(b, r, zero), C.less(b, zero, y)),
        _all(b, C.less(b, zero, r), C.less(b, y, zero)),
    )
    return [_where(b, differ, b.binary(Op.ADD, r, y), r)]


@lowers("Max", "Min")
def _max_min(ctx: Context, node: onnx.NodeProto) -> list[int]:
    parts = [ctx.value(node, i) for i in range(len(node.input)) if node.input[i]]
    _check_numeric(node, *(ctx.b.dtype(p) for p in parts))
    return [(_max if node.op_type == "Max" else _min)(ctx.b, parts)]


@lowers("Sum", "Mean")
def _sum_mean(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    parts = _broadcast_all(b, [ctx.value(node, i) for i in range(len(node.input)) if node.input[i]])
    if not _is_float(b.dtype(parts[0])):
        raise refuse(node, f"{b.dtype(parts[0])} inputs")
    total = parts[0]
    for p in parts[1:]:
        total = b.binary(Op.ADD, total, p)
    if node.op_type == "Mean":
        total = C.scale(b, total, 1.0 / len(parts))
    return [total]


@lowers("Clip")
def _clip(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    _check_numeric(node, b.dtype(x))
    if ctx.opset < 11:
        a = attrs(node)
        low = _full(b, a["min"], x) if "min" in a else None
        high = _full(b, a["max"], x) if "max" in a else None
    else:
        low, high = ctx.optional(node, 1), ctx.optional(node, 2)
    if low is not None:
        x = _max(b, [x, low])
    if high is not None:
        x = _min(b, [x, high])
    return [x]


# ---- Pow -----------------------------------------------------------------------------------


def _power_by_squaring(b: GraphBuilder, x: int, n: int) -> int:
    """x**n for a compile-time n >= 0, in x's dtype (exact modulo 2**bits for integers)."""
    result = C.power_by_squaring(b, x, n)
    return _full(b, 1, x) if result is None else result


def _int_power(b: GraphBuilder, x: int, y: int) -> int:
    """x**y for integer x and y >= 0, by squaring over every bit of y: exact modulo 2**bits."""
    x, y = C.broadcast_pair(b, x, y)
    value_bits = _bits(b.dtype(y)) - (1 if _is_signed(b.dtype(y)) else 0)
    one = _full(b, 1, x)
    result, square = one, x
    for i in range(value_bits):
        if i == value_bits - 1:
            bit = C.logical_not(b, C.less(b, y, _full(b, 2**i, y)))
        else:
            low = b.binary(Op.MOD, y, _full(b, 2 ** (i + 1), y))
            bit = C.logical_not(b, C.less(b, low, _full(b, 2**i, y)))
        # factor = 1 + bit * (square - 1)
        factor = b.binary(Op.ADD, one, b.binary(Op.MUL, _as_number(b, bit, x), _sub(b, square, one)))
        result = b.binary(Op.MUL, result, factor)
        if i < value_bits - 1:
            square = b.binary(Op.MUL, square, square)
    return result


def _float_power(b: GraphBuilder, x: int, y: int) -> int:
    """x**y for float x: exp2(y log2|x|) with the sign and the special cases of C's pow."""
    int_exponent = not _is_float(b.dtype(y))
    yf = b.cast(y, b.dtype(x))
    x, yf = C.broadcast_pair(b, x, yf)
    y = b.broadcast_to(y, b.shape(x))
    zero, one = _full(b, 0.0, x), _full(b, 1.0, x)
    magnitude = b.unary(Op.EXP2, b.binary(Op.MUL, yf, b.unary(Op.LOG2, _abs(b, x))))
    if int_exponent:
        integral = _full(b, True, b.cast(y, "bool"))
        odd = b.cast(b.binary(Op.MOD, y, _full(b, 2, y)), "bool")
    else:
        whole = _eq(b, b.binary(Op.MOD, yf, one), zero)
        integral = _any(b, whole, C.less(b, _full(b, np.finfo(b.dtype(x)).max, x), _abs(b, yf)))
        odd = _eq(b, _abs(b, b.binary(Op.MOD, yf, _full(b, 2.0, x))), one)
    below_zero = C.less(b, x, zero)
    # the sign bit, -0.0 included (its reciprocal is -inf)
    sign_bit = _any(b, below_zero, C.less(b, b.unary(Op.RECIP, x), zero))
    signed = _where(b, _all(b, sign_bit, odd), C.neg(b, magnitude), magnitude)
    finite_negative = _all(b, below_zero, C.less(b, _full(b, -np.inf, x), x))
    result = _where(b, _all(b, finite_negative, C.logical_not(b, integral)), _full(b, np.nan, x), signed)
    # pow(x, 0), pow(1, y) and pow(-1, +-inf) are 1 even where y or x is NaN
    infinite_y = C.less(b, _full(b, np.finfo(b.dtype(x)).max, x), _abs(b, yf))
    minus_one_infinite = _all(b, _eq(b, x, C.neg(b, one)), infinite_y)
    return _where(b, _any(b, _eq(b, yf, zero), _eq(b, x, one), minus_one_infinite), one, result)


def _constant_exponent(ctx: Context, node: onnx.NodeProto) -> int | None:
    name = node.input[1]
    if name not in ctx.consts:
        return None
    values = np.unique(ctx.consts[name])
    if values.size != 1 or not np.isfinite(values[0]) or values[0] != int(values[0]):
        return None
    exponent = int(values[0])
    return exponent if abs(exponent) <= 64 else None


@lowers("Pow")
def _pow(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = ctx.value(node, 0), ctx.value(node, 1)
    _check_numeric(node, b.dtype(x), b.dtype(y))
    shape = broadcast_shapes(b.shape(x), b.shape(y))
    exponent = _constant_exponent(ctx, node)
    if exponent is not None and (exponent >= 0 or _is_float(b.dtype(x))):
        power = _power_by_squaring(b, x, abs(exponent))
        if exponent < 0:
            power = _in_float32(b, power, lambda v: b.unary(Op.RECIP, v))
        return [b.broadcast_to(power, shape)]
    if _is_float(b.dtype(x)):
        return [_in_float32(b, x, lambda v: _float_power(b, v, y))]
    if _is_float(b.dtype(y)):
        raise refuse(node, "an integer base and a floating-point exponent")
    return [_int_power(b, x, y)]


# ---- comparison and logic ------------------------------------------------------------------


def _comparison_inputs(ctx: Context, node: onnx.NodeProto) -> tuple[int, int]:
    x, y = ctx.value(node, 0), ctx.value(node, 1)
    if ctx.b.dtype(x) != ctx.b.dtype(y):
        raise refuse(node, f"inputs of dtypes {ctx.b.dtype(x)} and {ctx.b.dtype(y)}")
    return x, y


@lowers("Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Equal")
def _compare(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = _comparison_inputs(ctx, node)
    if node.op_type in ("Greater", "GreaterOrEqual"):
        x, y = y, x
    if node.op_type == "Equal":
        return [_eq(b, x, y)]
    if node.op_type in ("Less", "Greater"):
        return [C.less(b, x, y)]
    return [_any(b, C.less(b, x, y), _eq(b, x, y))]


@lowers("And", "Or", "Xor")
def _logic(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = _comparison_inputs(ctx, node)
    if node.op_type == "And":
        return [_all(b, x, y)]
    if node.op_type == "Or":
        return [_any(b, x, y)]
    return [_xor(b, x, y)]


@lowers("Not")
def _logical_not(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [C.logical_not(ctx.b, ctx.value(node, 0))]


@lowers("Where")
def _where_op(ctx: Context, node: onnx.NodeProto) -> list[int]:
    cond, x, y = (ctx.value(node, i) for i in range(3))
    return [_where(ctx.b, cond, x, y)]


@lowers("IsNaN")
def _is_nan(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if not _is_float(b.dtype(x)):
        raise refuse(node, f"{b.dtype(x)} input")
    return [_isnan(b, x)]


@lowers("IsInf")
def _is_inf(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    if not _is_float(b.dtype(x)):
        raise refuse(node, f"{b.dtype(x)} input")
    a = attrs(node)
    largest = np.finfo(b.dtype(x)).max
    checks = []
    if a.get("detect_positive", 1):
        checks.append(C.less(b, _full(b, largest, x), x))
    if a.get("detect_negative", 1):
        checks.append(C.less(b, x, _full(b, -largest, x)))
    if not checks:
        return [C.less(b, x, x)]  # all False
    return [_any(b, *checks)]


# ---- bit operations ------------------------------------------------------------------------


def _powers_of_two(dtype: str) -> np.ndarray:
    bits = _bits(dtype)
    return np.array([1 << i for i in range(bits)], dtype=f"uint{bits}")


def _bit_planes(b: GraphBuilder, x: int) -> int:
    """The bits of an integer tensor, least significant first, as bools along a new last axis.

    Bit i is set when x mod 2**(i+1) >= 2**i (on the unsigned view); the top bit compares x
    itself, since 2**bits does not fit the type.
    """
    bits = _bits(b.dtype(x))
    unsigned = b.unsqueeze(b.cast(x, f"uint{bits}"), -1)
    shape = b.shape(unsigned)[:-1]
    powers = _powers_of_two(b.dtype(x))
    moduli = b.broadcast_to(b.constant(powers[1:]), (*shape, bits - 1))
    low = b.binary(Op.MOD, b.expand(unsigned, (*shape, bits - 1)), moduli)
    low = C.concat(b, [low, unsigned], axis=-1)
    return C.logical_not(b, b.binary(Op.LESS_THAN, low, b.broadcast_to(b.constant(powers), b.shape(low))))


def _from_bit_planes(b: GraphBuilder, planes: int, dtype: str) -> int:
    powers = b.constant(_powers_of_two(dtype))
    weighted = b.binary(Op.MUL, b.cast(planes, b.dtype(powers)), b.broadcast_to(powers, b.shape(planes)))
    return b.cast(b.reduce(Op.SUM_REDUCE, weighted, [-1]), dtype)


def _integer_inputs(ctx: Context, node: onnx.NodeProto) -> tuple[int, int]:
    x, y = _comparison_inputs(ctx, node)
    dtype = ctx.b.dtype(x)
    if _is_float(dtype) or dtype == "bool":
        raise refuse(node, f"{dtype} inputs")
    return C.broadcast_pair(ctx.b, x, y)


@lowers("BitwiseAnd", "BitwiseOr", "BitwiseXor")
def _bitwise(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = _integer_inputs(ctx, node)
    combine = {"BitwiseAnd": _all, "BitwiseOr": _any, "BitwiseXor": _xor}[node.op_type]
    return [_from_bit_planes(b, combine(b, _bit_planes(b, x), _bit_planes(b, y)), b.dtype(x))]


@lowers("BitwiseNot")
def _bitwise_not(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    dtype = ctx.b.dtype(x)
    if _is_float(dtype) or dtype == "bool":
        raise refuse(node, f"{dtype} input")
    return [_flip(ctx.b, x)]


def _shift_amount(b: GraphBuilder, y: int, bits: int) -> int:
    """y as int64, with every y outside [0, bits) replaced by bits."""
    in_range = _all(b, C.less(b, y, _full(b, bits, y)), C.logical_not(b, C.less(b, y, _full(b, 0, y))))
    amount = b.cast(y, "int64")
    return _where(b, in_range, amount, _full(b, bits, amount))


def _shift_left(b: GraphBuilder, x: int, y: int) -> int:
    """x * 2**y modulo 2**bits; a shift of bits or more (or a negative one) gives 0."""
    bits = _bits(b.dtype(x))
    powers = _powers_of_two(b.dtype(x)).astype(b.dtype(x))  # wraps to the sign bit where signed
    table = b.constant(np.concatenate([powers, np.zeros(1, dtype=b.dtype(x))]))
    return b.binary(Op.MUL, x, b.gather(table, _shift_amount(b, y, bits), 0))


def _shift_right(b: GraphBuilder, x: int, y: int) -> int:
    """Bit j of the result is bit j + y of x: the sign bit (signed) or 0 (unsigned) past the top."""
    dtype = b.dtype(x)
    bits = _bits(dtype)
    planes = _bit_planes(b, x)
    shape = b.shape(x)
    count = numel(shape)
    source = C.add(b, b.unsqueeze(_shift_amount(b, y, bits), -1), b.iota(bits))
    top = _full(b, bits - 1, source)
    clamped = _where(b, C.less(b, top, source), top, source)
    rows = C.scale(b, b.reshape(b.iota(count), (*shape, 1)), bits)
    index = b.reshape(C.add(b, rows, clamped), (dim_mul(count, bits),))
    shifted = b.reshape(b.gather(b.reshape(planes, (dim_mul(count, bits),)), index, 0), b.shape(planes))
    if not _is_signed(dtype):
        shifted = _all(b, shifted, C.less(b, source, _full(b, bits, source)))
    return _from_bit_planes(b, shifted, dtype)


@lowers("BitShift")
def _bit_shift(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x, y = _integer_inputs(ctx, node)
    direction = attrs(node).get("direction", b"")
    if direction == b"LEFT":
        return [_shift_left(ctx.b, x, y)]
    if direction == b"RIGHT":
        return [_shift_right(ctx.b, x, y)]
    raise refuse(node, f"direction={direction!r}")
