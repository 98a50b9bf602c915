"""Composite operations spelled in primitive ops: what every frontend lowers to.

Each function takes a GraphBuilder and node ids and returns a node id. Broadcasting follows
NumPy. The choices here (exp as exp2, division as a reciprocal, max as a reduction over a
stacked pair) keep the IR to the primitive set; the search compiler later recognizes the
patterns again (matmul is a broadcast multiply followed by a sum), so each concept is spelled
once, here, and builds one pattern wherever it is used.

Sections: arithmetic; logic and comparison; order (max, min, abs, clamp); rounding; exponentials
and logarithms; trigonometric and hyperbolic functions; activations; powers and integer
division; bit operations; reductions; layout, matmul, convolution and pooling.

Integer arithmetic is exact: ADD and MUL on integers are taken modulo 2**bits (as NumPy and
two's-complement hardware do), so negation, subtraction and bitwise complements are exact
without any float round trip. Selections go through `where`, a gather, so inf and NaN in the
branch not taken never leak into the result. Where float formulas cancel (expm1, tanh, erfc,
cos near its zeros), a second form is selected so the result keeps its relative precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from compiler.dtypes import bits, is_float, is_signed_int, is_unsigned_int, lowest
from compiler.errors import UnsupportedModel
from compiler.ir import GraphBuilder, Op
from compiler.reference import apply_view
from compiler.shape import Dim, ShapeError, broadcast_shapes, dim_add, dim_mul, dim_sub, numel

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# ---- arithmetic ----------------------------------------------------------------------------


def broadcast_all(b: GraphBuilder, parts: Sequence[int]) -> list[int]:
    shape = b.shape(parts[0])
    for p in parts[1:]:
        shape = broadcast_shapes(shape, b.shape(p))
    return [b.broadcast_to(p, shape) for p in parts]


def broadcast_pair(b: GraphBuilder, x: int, y: int) -> tuple[int, int]:
    x, y = broadcast_all(b, [x, y])
    return x, y


def add(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.ADD, *broadcast_pair(b, x, y))


def mul(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.MUL, *broadcast_pair(b, x, y))


def scale(b: GraphBuilder, x: int, factor: float) -> int:
    return x if factor == 1 else b.binary(Op.MUL, x, b.scalar_like(factor, x))


def shift(b: GraphBuilder, x: int, offset: float) -> int:
    return x if offset == 0 else b.binary(Op.ADD, x, b.scalar_like(offset, x))


def neg(b: GraphBuilder, x: int) -> int:
    """-x, exact for floats and (modulo 2**bits) for every integer type, unsigned included."""
    dtype = b.dtype(x)
    minus_one = np.iinfo(dtype).max if is_unsigned_int(dtype) else -1
    return b.binary(Op.MUL, x, b.scalar_like(minus_one, x))


def one_minus(b: GraphBuilder, x: int) -> int:
    return shift(b, neg(b, x), 1.0)


def sub(b: GraphBuilder, x: int, y: int) -> int:
    """x - y, exact modulo 2**bits for integers (unsigned ones wrap); refused on bools."""
    if b.dtype(x) == "bool":
        raise UnsupportedModel(["Sub on bool tensors"])
    x, y = broadcast_pair(b, x, y)
    return b.binary(Op.ADD, x, neg(b, y))


def div(b: GraphBuilder, x: int, y: int) -> int:
    """x / y for floats, as x times the reciprocal of y; integers go through int_div."""
    if not is_float(b.dtype(x)):
        raise UnsupportedModel(["Div on integer tensors"])
    x, y = broadcast_pair(b, x, y)
    return b.binary(Op.MUL, x, b.unary(Op.RECIP, y))


def fmod(b: GraphBuilder, x: int, y: int) -> int:
    """The remainder with the sign of x, as C's fmod."""
    return b.binary(Op.MOD, *broadcast_pair(b, x, y))


def floor_mod(b: GraphBuilder, x: int, y: int) -> int:
    """The remainder with the sign of y, as Python's % (unsigned types: the plain remainder)."""
    x, y = broadcast_pair(b, x, y)
    r = b.binary(Op.MOD, x, y)
    if is_unsigned_int(b.dtype(x)):
        return r
    # a nonzero remainder whose sign differs from the divisor's moves by y
    zero = b.scalar_like(0, x)
    differ = logical_or(
        b,
        logical_and(b, less(b, r, zero), less(b, zero, y)),
        logical_and(b, less(b, zero, r), less(b, y, zero)),
    )
    return where(b, differ, b.binary(Op.ADD, r, y), r)


# ---- logic and comparison ------------------------------------------------------------------


def less(b: GraphBuilder, x: int, y: int) -> int:
    return b.binary(Op.LESS_THAN, *broadcast_pair(b, x, y))


def logical_not(b: GraphBuilder, cond: int) -> int:
    # False < True is the only true case, so c < True is not c
    cond = b.cast(cond, "bool")
    return b.binary(Op.LESS_THAN, cond, b.scalar_like(True, cond))


def _flags(b: GraphBuilder, conds: Sequence[int]) -> list[int]:
    """Conditions as broadcast uint8 zeros and ones."""
    return [b.cast(b.cast(c, "bool"), "uint8") for c in broadcast_all(b, conds)]


def logical_or(b: GraphBuilder, *conds: int) -> int:
    """Whether any condition holds: the sum of their 0/1 flags is nonzero."""
    flags = _flags(b, conds)
    total = flags[0]
    for f in flags[1:]:
        total = b.binary(Op.ADD, total, f)
    return b.cast(total, "bool")


def logical_and(b: GraphBuilder, *conds: int) -> int:
    """Whether every condition holds: the product of their 0/1 flags is nonzero."""
    flags = _flags(b, conds)
    product = flags[0]
    for f in flags[1:]:
        product = b.binary(Op.MUL, product, f)
    return b.cast(product, "bool")


def logical_xor(b: GraphBuilder, p: int, q: int) -> int:
    p, q = _flags(b, [p, q])
    total = b.binary(Op.ADD, p, q)
    return b.cast(b.binary(Op.MOD, total, b.scalar_like(2, total)), "bool")


def as_number(b: GraphBuilder, cond: int, like: int) -> int:
    """A condition as 0 or 1 in the dtype of `like`."""
    return b.cast(cond, b.dtype(like))


def is_nan(b: GraphBuilder, x: int) -> int:
    # NaN is the only value neither below +inf nor above -inf
    return logical_not(
        b, logical_or(b, less(b, x, b.scalar_like(np.inf, x)), less(b, b.scalar_like(-np.inf, x), x))
    )


def is_finite(b: GraphBuilder, x: int) -> int:
    return logical_and(b, less(b, b.scalar_like(-np.inf, x), x), less(b, x, b.scalar_like(np.inf, x)))


def in_range(b: GraphBuilder, x: int, low: float, high: float) -> int:
    """low <= x < high."""
    return logical_and(
        b, logical_not(b, less(b, x, b.scalar_like(low, x))), less(b, x, b.scalar_like(high, x))
    )


def equal(b: GraphBuilder, x: int, y: int) -> int:
    """x == y as IEEE has it (NaN equals nothing): neither is below the other and neither is NaN."""
    x, y = broadcast_pair(b, x, y)
    differ = [less(b, x, y), less(b, y, x)]
    if is_float(b.dtype(x)):
        differ += [is_nan(b, x), is_nan(b, y)]
    return logical_not(b, logical_or(b, *differ))


def where(b: GraphBuilder, cond: int, x: int, y: int) -> int:
    """cond ? x : y, as a gather from the interleaved pair: inf and NaN pass through untouched
    (-0.0 comes out as +0.0, the interleaving adds zeros)."""
    shape = broadcast_shapes(broadcast_shapes(b.shape(cond), b.shape(x)), b.shape(y))
    x, y = b.broadcast_to(x, shape), b.broadcast_to(y, shape)
    if b.dtype(x) != b.dtype(y):
        raise ShapeError(f"Where branches differ in dtype: {b.dtype(x)} vs {b.dtype(y)}")
    count = numel(shape)
    pairs = b.reshape(stack_last(b, [y, x]), (dim_mul(count, 2),))
    flat_cond = b.reshape(b.cast(b.broadcast_to(cond, shape), "int64"), (count,))
    index = b.binary(Op.ADD, scale(b, b.iota(count), 2), flat_cond)
    return b.reshape(b.gather(pairs, index, 0), shape)


# ---- order: max, min, abs, sign, clamp -----------------------------------------------------


def reverse_order(b: GraphBuilder, x: int) -> int:
    """An exact order-reversing bijection, so min(x) = reverse(max(reverse(x))).

    Floats are negated; integers get their bits flipped (~x = -x - 1 in wrapping arithmetic,
    exact at the type's minimum, where negation would overflow; also BitwiseNot); bools are
    negated.
    """
    dtype = b.dtype(x)
    if dtype == "bool":
        return logical_not(b, x)
    if is_float(dtype):
        return neg(b, x)
    all_ones = np.iinfo(dtype).max if is_unsigned_int(dtype) else -1
    return b.binary(Op.ADD, neg(b, x), b.scalar_like(all_ones, x))


def stack_last(b: GraphBuilder, parts: Sequence[int]) -> int:
    """Stack same-shaped tensors along a new last axis (zero padding plus addition)."""
    return concat(b, [b.unsqueeze(p, -1) for p in parts], axis=-1)


def maximum(b: GraphBuilder, *parts: int) -> int:
    """Element-wise maximum; MAX_REDUCE propagates NaN, as ONNX Max does (a zero comes out +0.0)."""
    parts = tuple(broadcast_all(b, parts))
    if len(parts) == 1:
        return parts[0]
    return b.reduce(Op.MAX_REDUCE, stack_last(b, parts), [-1])


def minimum(b: GraphBuilder, *parts: int) -> int:
    """Element-wise minimum, exact for every dtype, as the maximum of order-reversed values (so a
    float zero comes out -0.0)."""
    return reverse_order(b, maximum(b, *(reverse_order(b, p) for p in parts)))


def absolute(b: GraphBuilder, x: int) -> int:
    return x if is_unsigned_int(b.dtype(x)) else maximum(b, x, neg(b, x))


def sign(b: GraphBuilder, x: int) -> int:
    zero = b.scalar_like(0, x)
    positive, negative = less(b, zero, x), less(b, x, zero)
    if is_unsigned_int(b.dtype(x)):
        return as_number(b, positive, x)
    if is_float(b.dtype(x)):
        # keeps NaN by falling through to x itself (a zero comes out +0.0: see where)
        rest = where(b, positive, b.scalar_like(1, x), x)
        return where(b, negative, b.scalar_like(-1, x), rest)
    return sub(b, as_number(b, positive, x), as_number(b, negative, x))


def clamp(b: GraphBuilder, x: int, low: float, high: float) -> int:
    """x limited to [low, high] by maximum and minimum: NaN stays NaN, a zero comes out -0.0."""
    return minimum(b, maximum(b, x, b.scalar_like(low, x)), b.scalar_like(high, x))


def relu(b: GraphBuilder, x: int) -> int:
    # max over (x, 0) keeps relu(-inf) = 0 and propagates NaN, unlike x * (x > 0)
    zero_padded = b.view(b.unsqueeze(x, -1), ("pad", ((0, 0),) * len(b.shape(x)) + ((0, 1),), 0))
    return b.reduce(Op.MAX_REDUCE, zero_padded, [-1])


# ---- rounding (floats) ---------------------------------------------------------------------


def trunc(b: GraphBuilder, x: int) -> int:
    frac = b.binary(Op.MOD, x, b.scalar_like(1.0, x))  # exact; NaN for +-inf
    frac = where(b, is_nan(b, frac), b.scalar_like(0.0, x), frac)
    return sub(b, x, frac)


def floor(b: GraphBuilder, x: int) -> int:
    t = trunc(b, x)
    return sub(b, t, as_number(b, less(b, x, t), x))


def ceil(b: GraphBuilder, x: int) -> int:
    t = trunc(b, x)
    return add(b, t, as_number(b, less(b, t, x), x))


def round_half_even(b: GraphBuilder, x: int) -> int:
    f = floor(b, x)
    frac = sub(b, x, f)  # exact except just below zero, where it rounds up towards 1
    half = b.scalar_like(0.5, x)
    odd = logical_not(b, equal(b, b.binary(Op.MOD, f, b.scalar_like(2.0, x)), b.scalar_like(0.0, x)))
    up = logical_or(b, less(b, half, frac), logical_and(b, equal(b, frac, half), odd))
    return add(b, f, as_number(b, up, x))


# ---- exponentials and logarithms -----------------------------------------------------------


def exp(b: GraphBuilder, x: int) -> int:
    return b.unary(Op.EXP2, scale(b, x, LOG2_E))


def log(b: GraphBuilder, x: int) -> int:
    return scale(b, b.unary(Op.LOG2, x), LN_2)


def sqrt(b: GraphBuilder, x: int) -> int:
    return b.unary(Op.SQRT, x)


def pow_positive(b: GraphBuilder, x: int, exponent: float) -> int:
    """x ** exponent for x > 0 and a compile-time exponent, as exp2(exponent * log2 x)."""
    return b.unary(Op.EXP2, scale(b, b.unary(Op.LOG2, x), exponent))


def horner(b: GraphBuilder, z: int, coefficients: Sequence[float]) -> int:
    """Polynomial in z, coefficients from the highest degree down."""
    acc = b.scalar_like(coefficients[0], z)
    for c in coefficients[1:]:
        acc = shift(b, b.binary(Op.MUL, acc, z), c)
    return acc


# below this |x|, a short Taylor series beats formulas that cancel (error under 1e-10)
_SMALL = 0.125


def expm1(b: GraphBuilder, x: int) -> int:
    """exp(x) - 1 without the cancellation near 0."""
    series = b.binary(Op.MUL, x, horner(b, x, [1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0]))
    small = less(b, absolute(b, x), b.scalar_like(_SMALL, x))
    return where(b, small, series, shift(b, exp(b, x), -1.0))


def _log_twice(b: GraphBuilder, x: int) -> int:
    return shift(b, log(b, x), LN_2)


# ---- error function, trigonometric and hyperbolic functions --------------------------------

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


def erf(b: GraphBuilder, x: int) -> int:
    x = clamp(b, x, -4.0, 4.0)
    z = b.binary(Op.MUL, x, x)
    num = b.binary(Op.MUL, x, horner(b, z, _ERF_NUM))
    return clamp(b, div(b, num, horner(b, z, _ERF_DEN)), -1.0, 1.0)


# Numerical Recipes' erfcc: erfc(z) for z >= 0 with a relative error below 1.2e-7 everywhere
_ERFC_POLY = (
    0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
    0.37409196, 1.00002368, -1.26551223,
)  # fmt: skip


def erfc_nonnegative(b: GraphBuilder, z: int) -> int:
    """erfc(z) for z >= 0, accurate relative to its (tiny) value."""
    t = b.unary(Op.RECIP, shift(b, scale(b, z, 0.5), 1.0))
    exponent = sub(b, horner(b, t, _ERFC_POLY), b.binary(Op.MUL, z, z))
    return b.binary(Op.MUL, t, exp(b, exponent))


def _with_sign_of(b: GraphBuilder, magnitude: int, x: int) -> int:
    sign = shift(b, scale(b, as_number(b, less(b, x, b.scalar_like(0.0, x)), x), -2.0), 1.0)
    return b.binary(Op.MUL, magnitude, sign)


def atan(b: GraphBuilder, x: int) -> int:
    """Cephes atanf: reduce |x| to [-tan(pi/8), tan(pi/8)], then an odd polynomial."""
    a = absolute(b, x)
    big = less(b, b.scalar_like(2.414213562373095, x), a)  # tan(3pi/8)
    mid = less(b, b.scalar_like(0.4142135623730950, x), a)  # tan(pi/8)
    moderate = div(b, add(b, a, b.scalar_like(-1.0, x)), add(b, a, b.scalar_like(1.0, x)))
    t = where(b, big, neg(b, b.unary(Op.RECIP, a)), where(b, mid, moderate, a))
    offset = scale(b, add(b, as_number(b, big, x), as_number(b, mid, x)), math.pi / 4)
    z = b.binary(Op.MUL, t, t)
    poly = horner(b, z, (8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1))
    r = add(b, offset, add(b, b.binary(Op.MUL, b.binary(Op.MUL, poly, z), t), t))
    return _with_sign_of(b, r, x)


def asin(b: GraphBuilder, x: int) -> int:
    # (1 - x)(1 + x) keeps precision near |x| = 1, unlike 1 - x*x
    one_minus_square = b.binary(Op.MUL, one_minus(b, x), shift(b, x, 1.0))
    return atan(b, div(b, x, sqrt(b, one_minus_square)))


def acos(b: GraphBuilder, x: int) -> int:
    ratio = div(b, one_minus(b, x), shift(b, x, 1.0))
    return scale(b, atan(b, sqrt(b, ratio)), 2.0)


def _near_cos_zero(b: GraphBuilder, x: int) -> tuple[int, int]:
    """(cos x as 1 - 2 sin^2(x/2), whether x is near a zero of cos)

    The first form needs no shifted argument, so huge |x| stays as accurate as SIN itself, but
    its absolute error becomes a large relative one near the zeros of cos.
    """
    half_sine = b.unary(Op.SIN, scale(b, x, 0.5))
    cos = shift(b, scale(b, b.binary(Op.MUL, half_sine, half_sine), -2.0), 1.0)
    return cos, less(b, absolute(b, cos), b.scalar_like(0.5, x))


def cos(b: GraphBuilder, x: int) -> int:
    cosine, near_zero = _near_cos_zero(b, x)
    # sin(2x) / (2 sin x) is accurate relative to cos where sin x is near +-1
    double = div(b, b.unary(Op.SIN, scale(b, x, 2.0)), scale(b, b.unary(Op.SIN, x), 2.0))
    return where(b, near_zero, double, cosine)


def tan(b: GraphBuilder, x: int) -> int:
    cosine, near_pole = _near_cos_zero(b, x)
    sine = b.unary(Op.SIN, x)
    # near the poles 2 sin^2 x / sin 2x keeps its relative accuracy
    pole = div(b, scale(b, b.binary(Op.MUL, sine, sine), 2.0), b.unary(Op.SIN, scale(b, x, 2.0)))
    return where(b, near_pole, pole, div(b, sine, cosine))


def sinh(b: GraphBuilder, x: int) -> int:
    return scale(b, sub(b, expm1(b, x), expm1(b, neg(b, x))), 0.5)


def cosh(b: GraphBuilder, x: int) -> int:
    return scale(b, add(b, exp(b, x), exp(b, neg(b, x))), 0.5)


def tanh(b: GraphBuilder, x: int) -> int:
    """tanh accurate relative to its value everywhere (the ONNX Tanh op); see tanh_by_sigmoid."""
    # tanh|x| = -t / (t + 2) with t = expm1(-2|x|) in (-1, 0]: no overflow, no cancellation
    t = expm1(b, scale(b, absolute(b, x), -2.0))
    return _with_sign_of(b, neg(b, div(b, t, shift(b, t, 2.0))), x)


def tanh_by_sigmoid(b: GraphBuilder, x: int) -> int:
    """tanh as 2 sigmoid(2x) - 1: cheaper, accurate only in absolute terms (recurrent gates)."""
    return shift(b, scale(b, sigmoid(b, scale(b, x, 2.0)), 2.0), -1.0)


# beyond this, sqrt(x^2 +- 1) is |x| to double precision (and x^2 may overflow float32)
_HUGE = 1e8


def asinh(b: GraphBuilder, x: int) -> int:
    # odd symmetry: log(|x| + sqrt(x^2 + 1)) has no cancellation for |x|
    a = absolute(b, x)
    moderate = log(b, add(b, a, sqrt(b, shift(b, b.binary(Op.MUL, a, a), 1.0))))
    magnitude = where(b, less(b, b.scalar_like(_HUGE, x), a), _log_twice(b, a), moderate)
    return where(b, less(b, x, b.scalar_like(0.0, x)), neg(b, magnitude), magnitude)


def acosh(b: GraphBuilder, x: int) -> int:
    # sqrt(x-1) sqrt(x+1) is NaN below 1 and precise near 1
    root = b.binary(Op.MUL, sqrt(b, shift(b, x, -1.0)), sqrt(b, shift(b, x, 1.0)))
    moderate = log(b, add(b, x, root))
    return where(b, less(b, b.scalar_like(_HUGE, x), x), _log_twice(b, x), moderate)


def atanh(b: GraphBuilder, x: int) -> int:
    ratio = div(b, shift(b, x, 1.0), one_minus(b, x))
    return scale(b, log(b, ratio), 0.5)


# ---- activations (floats) ------------------------------------------------------------------


def sigmoid(b: GraphBuilder, x: int) -> int:
    return b.unary(Op.RECIP, shift(b, exp(b, neg(b, x)), 1.0))


def _positive(b: GraphBuilder, x: int) -> int:
    return less(b, b.scalar_like(0.0, x), x)


def softplus(b: GraphBuilder, x: int) -> int:
    # relu(x) + log(1 + exp(-|x|)): no overflow for large x
    tail = log(b, shift(b, exp(b, neg(b, absolute(b, x))), 1.0))
    return add(b, relu(b, x), tail)


def softsign(b: GraphBuilder, x: int) -> int:
    return div(b, x, shift(b, absolute(b, x), 1.0))


def mish(b: GraphBuilder, x: int) -> int:
    # tanh(softplus(x)) = u(u+2) / (u(u+2) + 2) with u = e^x: no cancellation for negative x;
    # the ratio is exactly 1 from x = 15 on, and capping x there keeps u finite
    u = exp(b, minimum(b, x, b.scalar_like(15.0, x)))
    n = b.binary(Op.MUL, u, shift(b, u, 2.0))
    return b.binary(Op.MUL, x, div(b, n, shift(b, n, 2.0)))


def elu(b: GraphBuilder, x: int, alpha: float) -> int:
    return where(b, _positive(b, x), x, scale(b, expm1(b, x), alpha))


def selu(b: GraphBuilder, x: int, alpha: float, gamma: float) -> int:
    return scale(b, elu(b, x, alpha), gamma)


def celu(b: GraphBuilder, x: int, alpha: float) -> int:
    negative = scale(b, expm1(b, scale(b, x, 1.0 / alpha)), alpha)
    return where(b, _positive(b, x), x, negative)


def leaky_relu(b: GraphBuilder, x: int, alpha: float) -> int:
    return where(b, _positive(b, x), x, scale(b, x, alpha))


def prelu(b: GraphBuilder, x: int, slope: int) -> int:
    """leaky_relu with a slope tensor (broadcast to x)."""
    slope = b.broadcast_to(slope, b.shape(x))
    return where(b, _positive(b, x), x, b.binary(Op.MUL, x, slope))


def thresholded_relu(b: GraphBuilder, x: int, alpha: float) -> int:
    above = less(b, b.scalar_like(alpha, x), x)
    return where(b, above, x, b.scalar_like(0.0, x))


def hard_sigmoid(b: GraphBuilder, x: int, alpha: float, beta: float) -> int:
    # min(relu(y), 1): clamp to [0, 1] with relu's pattern for the lower bound
    y = shift(b, scale(b, x, alpha), beta)
    return minimum(b, relu(b, y), b.scalar_like(1.0, y))


def hard_swish(b: GraphBuilder, x: int) -> int:
    return b.binary(Op.MUL, x, hard_sigmoid(b, x, 1.0 / 6, 0.5))


def swish(b: GraphBuilder, x: int, alpha: float) -> int:
    return b.binary(Op.MUL, x, sigmoid(b, scale(b, x, alpha)))


def gelu(b: GraphBuilder, x: int, approximate: str) -> int:
    """x Phi(x), exactly ("none", through erfc) or with the tanh approximation ("tanh")."""
    if approximate == "tanh":
        inner = add(b, x, scale(b, b.binary(Op.MUL, b.binary(Op.MUL, x, x), x), 0.044715))
        # 0.5 (1 + tanh y) = sigmoid(2y), which keeps its precision where it is tiny
        return b.binary(Op.MUL, x, sigmoid(b, scale(b, inner, 2 * math.sqrt(2.0 / math.pi))))
    if approximate != "none":
        raise ValueError(f"approximate={approximate!r}")
    # 1 + erf(x / sqrt 2) = erfc(-x / sqrt 2), taken from erfc directly where it is small
    tail = erfc_nonnegative(b, scale(b, absolute(b, x), 1.0 / math.sqrt(2.0)))
    factor = where(b, less(b, x, b.scalar_like(0.0, x)), tail, shift(b, neg(b, tail), 2.0))
    return scale(b, b.binary(Op.MUL, x, factor), 0.5)


def shrink(b: GraphBuilder, x: int, lambd: float, bias: float) -> int:
    below = less(b, x, b.scalar_like(-lambd, x))
    above = less(b, b.scalar_like(lambd, x), x)
    inner = where(b, above, shift(b, x, -bias), b.scalar_like(0.0, x))
    return where(b, below, shift(b, x, bias), inner)


# ---- powers and integer division -----------------------------------------------------------


def power_by_squaring(b: GraphBuilder, x: int, n: int) -> int:
    """x**n for a compile-time n >= 0 (exact modulo 2**bits for integers); ones for n == 0."""
    result = None
    square = x
    while n:
        if n & 1:
            result = square if result is None else b.binary(Op.MUL, result, square)
        n >>= 1
        if n:
            square = b.binary(Op.MUL, square, square)
    return b.scalar_like(1, x) if result is None else result


def int_power(b: GraphBuilder, x: int, y: int) -> int:
    """x**y for integer x and y >= 0, by squaring over every bit of y: exact modulo 2**bits."""
    x, y = broadcast_pair(b, x, y)
    value_bits = bits(b.dtype(y)) - (1 if is_signed_int(b.dtype(y)) else 0)
    one = b.scalar_like(1, x)
    result, square = one, x
    for i in range(value_bits):
        if i == value_bits - 1:
            bit = logical_not(b, less(b, y, b.scalar_like(2**i, y)))
        else:
            low = b.binary(Op.MOD, y, b.scalar_like(2 ** (i + 1), y))
            bit = logical_not(b, less(b, low, b.scalar_like(2**i, y)))
        # factor = 1 + bit * (square - 1)
        factor = b.binary(Op.ADD, one, b.binary(Op.MUL, as_number(b, bit, x), sub(b, square, one)))
        result = b.binary(Op.MUL, result, factor)
        if i < value_bits - 1:
            square = b.binary(Op.MUL, square, square)
    return result


def float_power(b: GraphBuilder, x: int, y: int) -> int:
    """x**y for float x: exp2(y log2|x|) with the sign and the special cases of C's pow."""
    int_exponent = not is_float(b.dtype(y))
    yf = b.cast(y, b.dtype(x))
    x, yf = broadcast_pair(b, x, yf)
    y = b.broadcast_to(y, b.shape(x))
    zero, one = b.scalar_like(0.0, x), b.scalar_like(1.0, x)
    magnitude = b.unary(Op.EXP2, b.binary(Op.MUL, yf, b.unary(Op.LOG2, absolute(b, x))))
    largest = np.finfo(b.dtype(x)).max
    if int_exponent:
        integral = b.scalar_like(True, b.cast(y, "bool"))
        odd = b.cast(b.binary(Op.MOD, y, b.scalar_like(2, y)), "bool")
    else:
        whole = equal(b, b.binary(Op.MOD, yf, one), zero)
        integral = logical_or(b, whole, less(b, b.scalar_like(largest, x), absolute(b, yf)))
        odd = equal(b, absolute(b, b.binary(Op.MOD, yf, b.scalar_like(2.0, x))), one)
    below_zero = less(b, x, zero)
    # the sign bit, -0.0 included (its reciprocal is -inf)
    sign_bit = logical_or(b, below_zero, less(b, b.unary(Op.RECIP, x), zero))
    signed = where(b, logical_and(b, sign_bit, odd), neg(b, magnitude), magnitude)
    finite_negative = logical_and(b, below_zero, less(b, b.scalar_like(-np.inf, x), x))
    nan = b.scalar_like(np.nan, x)
    result = where(b, logical_and(b, finite_negative, logical_not(b, integral)), nan, signed)
    # pow(x, 0), pow(1, y) and pow(-1, +-inf) are 1 even where y or x is NaN
    infinite_y = less(b, b.scalar_like(largest, x), absolute(b, yf))
    minus_one_infinite = logical_and(b, equal(b, x, neg(b, one)), infinite_y)
    return where(b, logical_or(b, equal(b, yf, zero), equal(b, x, one), minus_one_infinite), one, result)


def int_div(b: GraphBuilder, x: int, y: int) -> int:
    """Integer division truncating toward zero, exact for types of up to 32 bits.

    x - fmod(x, y) is an exact multiple of y; dividing it in float64 leaves an error far below
    0.5, so rounding to the nearest integer recovers the quotient. A zero divisor is replaced by
    one (the result is undefined in ONNX) so no NaN is ever cast to an integer.
    """
    dtype = b.dtype(x)
    x, y = broadcast_pair(b, b.cast(x, "int64"), b.cast(y, "int64"))
    y = add(b, y, as_number(b, equal(b, y, b.scalar_like(0, y)), y))
    multiple = sub(b, x, b.binary(Op.MOD, x, y))
    approx = div(b, b.cast(multiple, "float64"), b.cast(y, "float64"))
    away = shift(b, neg(b, as_number(b, less(b, approx, b.scalar_like(0.0, approx)), approx)), 0.5)
    return b.cast(b.cast(add(b, approx, away), "int64"), dtype)


# ---- bit operations (integers) -------------------------------------------------------------


def _powers_of_two(dtype: str) -> np.ndarray:
    width = bits(dtype)
    return np.array([1 << i for i in range(width)], dtype=f"uint{width}")


def _bit_planes(b: GraphBuilder, x: int) -> int:
    """The bits of an integer tensor, least significant first, as bools along a new last axis.

    Bit i is set when x mod 2**(i+1) >= 2**i (on the unsigned view); the top bit compares x
    itself, since 2**bits does not fit the type.
    """
    width = bits(b.dtype(x))
    unsigned = b.unsqueeze(b.cast(x, f"uint{width}"), -1)
    shape = b.shape(unsigned)[:-1]
    powers = _powers_of_two(b.dtype(x))
    moduli = b.broadcast_to(b.constant(powers[1:]), (*shape, width - 1))
    low = b.binary(Op.MOD, b.expand(unsigned, (*shape, width - 1)), moduli)
    low = concat(b, [low, unsigned], axis=-1)
    return logical_not(b, less(b, low, b.constant(powers)))


def _from_bit_planes(b: GraphBuilder, planes: int, dtype: str) -> int:
    powers = b.constant(_powers_of_two(dtype))
    weighted = b.binary(Op.MUL, b.cast(planes, b.dtype(powers)), b.broadcast_to(powers, b.shape(planes)))
    return b.cast(b.reduce(Op.SUM_REDUCE, weighted, [-1]), dtype)


def _bitwise(b: GraphBuilder, combine: Callable[..., int], x: int, y: int) -> int:
    x, y = broadcast_pair(b, x, y)
    return _from_bit_planes(b, combine(b, _bit_planes(b, x), _bit_planes(b, y)), b.dtype(x))


def bitwise_and(b: GraphBuilder, x: int, y: int) -> int:
    return _bitwise(b, logical_and, x, y)


def bitwise_or(b: GraphBuilder, x: int, y: int) -> int:
    return _bitwise(b, logical_or, x, y)


def bitwise_xor(b: GraphBuilder, x: int, y: int) -> int:
    return _bitwise(b, logical_xor, x, y)


def _shift_amount(b: GraphBuilder, y: int, width: int) -> int:
    """y as int64, with every y outside [0, width) replaced by width."""
    amount = b.cast(y, "int64")
    return where(b, in_range(b, y, 0, width), amount, b.scalar_like(width, amount))


def shift_left(b: GraphBuilder, x: int, y: int) -> int:
    """x * 2**y modulo 2**bits; a shift of bits or more (or a negative one) gives 0."""
    x, y = broadcast_pair(b, x, y)
    width = bits(b.dtype(x))
    powers = _powers_of_two(b.dtype(x)).astype(b.dtype(x))  # wraps to the sign bit where signed
    table = b.constant(np.concatenate([powers, np.zeros(1, dtype=b.dtype(x))]))
    return b.binary(Op.MUL, x, b.gather(table, _shift_amount(b, y, width), 0))


def shift_right(b: GraphBuilder, x: int, y: int) -> int:
    """Bit j of the result is bit j + y of x: the sign bit (signed) or 0 (unsigned) past the top."""
    x, y = broadcast_pair(b, x, y)
    dtype = b.dtype(x)
    width = bits(dtype)
    planes = _bit_planes(b, x)
    shape = b.shape(x)
    count = numel(shape)
    source = add(b, b.unsqueeze(_shift_amount(b, y, width), -1), b.iota(width))
    top = b.scalar_like(width - 1, source)
    clamped = where(b, less(b, top, source), top, source)
    rows = scale(b, b.reshape(b.iota(count), (*shape, 1)), width)
    index = b.reshape(add(b, rows, clamped), (dim_mul(count, width),))
    shifted = b.reshape(b.gather(b.reshape(planes, (dim_mul(count, width),)), index, 0), b.shape(planes))
    if not is_signed_int(dtype):
        shifted = logical_and(b, shifted, less(b, source, b.scalar_like(width, source)))
    return _from_bit_planes(b, shifted, dtype)


# ---- reductions ----------------------------------------------------------------------------


def keepdims(b: GraphBuilder, reduced: int, shape: Sequence[Dim], axes: Sequence[int]) -> int:
    rank = len(shape)
    norm = {a % rank for a in axes}
    return b.reshape(reduced, [1 if i in norm else d for i, d in enumerate(shape)])


def reduce_keep(b: GraphBuilder, op: Op, x: int, axes: Sequence[int]) -> int:
    shape = b.shape(x)
    return keepdims(b, b.reduce(op, x, axes), shape, axes)


def reduce_min(b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    """Minimum over `axes` (removed): the maximum of order-reversed values, exact for every dtype."""
    return reverse_order(b, b.reduce(Op.MAX_REDUCE, reverse_order(b, x), axes))


def element_count(b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    """How many elements each reduction over `axes` sees, as a scalar of x's dtype."""
    dims = [b.shape(x)[a] for a in axes]
    count = numel(dims)
    if isinstance(count, int):
        return b.constant(np.asarray(count, dtype=b.dtype(x)))
    # a symbolic count is summed from ones at run time
    ones = b.broadcast_to(b.constant(np.asarray(1, dtype=b.dtype(x))), tuple(dims))
    return b.reduce(Op.SUM_REDUCE, ones, range(len(dims)))


def mean(b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    """Mean over `axes` (removed): the sum times the reciprocal of the count."""
    return mul(b, b.reduce(Op.SUM_REDUCE, x, axes), b.unary(Op.RECIP, element_count(b, x, axes)))


def mean_keep(b: GraphBuilder, x: int, axes: Sequence[int]) -> int:
    """Mean over `axes` with those axes kept as size 1."""
    return keepdims(b, mean(b, x, axes), b.shape(x), axes)


def product_last(b: GraphBuilder, x: int) -> int:
    """Exact product over a static last axis (removed), as a tree of pairwise multiplications.

    Padding with ones (exact factors) evens out each round; an empty axis gives 1.
    """
    rank = len(b.shape(x))
    if b.shape(x)[-1] == 0:
        x = pad(b, x, [(0, 0)] * (rank - 1) + [(0, 1)], 1)
    while (n := b.shape(x)[-1]) > 1:
        if n % 2:
            x = pad(b, x, [(0, 0)] * (rank - 1) + [(0, 1)], 1)
        whole = ((0, None, 1),) * (rank - 1)
        evens = b.view(x, ("slice", (*whole, (0, None, 2))))
        odds = b.view(x, ("slice", (*whole, (1, None, 2))))
        x = b.binary(Op.MUL, evens, odds)
    return b.reshape(x, b.shape(x)[:-1])


def softmax(b: GraphBuilder, x: int, axis: int) -> int:
    shape = b.shape(x)
    peak = b.expand(reduce_keep(b, Op.MAX_REDUCE, x, [axis]), shape)
    e = exp(b, b.binary(Op.ADD, x, neg(b, peak)))
    total = b.expand(reduce_keep(b, Op.SUM_REDUCE, e, [axis]), shape)
    return b.binary(Op.MUL, e, b.unary(Op.RECIP, total))


# ---- layout, matmul, convolution and pooling -----------------------------------------------


def concat(b: GraphBuilder, parts: Sequence[int], axis: int) -> int:
    """Concatenate by padding each part with zeros to the full extent and adding."""
    rank = len(b.shape(parts[0]))
    axis %= rank
    sizes = [b.shape(p)[axis] for p in parts]
    total: Dim = 0
    for size in sizes:
        total = dim_add(total, size)
    result = None
    offset: Dim = 0
    for part, size in zip(parts, sizes):
        widths: list[tuple[Dim, Dim]] = [(0, 0)] * rank
        widths[axis] = (offset, dim_sub(dim_sub(total, offset), size))
        padded = b.view(part, ("pad", tuple(widths), 0))
        result = padded if result is None else b.binary(Op.ADD, result, padded)
        offset = dim_add(offset, size)
    assert result is not None
    return result


def pad(b: GraphBuilder, x: int, widths: Sequence[tuple[Dim, Dim]], value: float) -> int:
    if all(w == (0, 0) for w in widths):
        return x
    return b.view(x, ("pad", tuple(widths), value))


def axis_positions(b: GraphBuilder, shape: Sequence[Dim], axis: int) -> int:
    """An int64 tensor of `shape` holding each element's coordinate along `axis`."""
    ramp = b.reshape(b.iota(shape[axis]), [d if i == axis else 1 for i, d in enumerate(shape)])
    return b.expand(ramp, shape)


def flatten(b: GraphBuilder, x: int, axis: int) -> int:
    shape = b.shape(x)
    if axis < 0:
        axis += len(shape)
    return b.reshape(x, (numel(shape[:axis]), numel(shape[axis:])))


def matmul(b: GraphBuilder, x: int, y: int) -> int:
    """NumPy matmul semantics, including 1-D operands and broadcast batch dimensions."""
    x_vec, y_vec = len(b.shape(x)) == 1, len(b.shape(y)) == 1
    if x_vec:
        x = b.reshape(x, (1, *b.shape(x)))
    if y_vec:
        y = b.reshape(y, (*b.shape(y), 1))
    xs, ys = b.shape(x), b.shape(y)
    if xs[-1] != ys[-2]:
        raise ShapeError(f"matmul inner dimensions differ: {xs[-1]} vs {ys[-2]}")
    batch = broadcast_shapes(xs[:-2], ys[:-2])
    m, k, n = xs[-2], xs[-1], ys[-1]
    full = (*batch, m, k, n)
    xe = b.broadcast_to(b.unsqueeze(x, -1), full)
    ye = b.broadcast_to(b.unsqueeze(y, -3), full)
    out = b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, xe, ye), [-2])
    final = (*batch, *(() if x_vec else (m,)), *(() if y_vec else (n,)))
    return b.reshape(out, final)


def conv(
    b: GraphBuilder,
    x: int,
    w: int,
    bias: int | None,
    pads: Sequence[tuple[int, int]],
    strides: Sequence[int],
    dilations: Sequence[int],
    group: int,
) -> int:
    """N-d convolution [N, C, *S] x [OC, C/G, *K] as windows, a multiply and a sum."""
    xs, ws = b.shape(x), b.shape(w)
    nd = len(xs) - 2
    n, c = xs[0], xs[1]
    oc, cg, kernel = ws[0], ws[1], tuple(ws[2:])
    if not isinstance(c, int) or c != cg * group or oc % group:  # type: ignore[operator]
        raise ShapeError(f"Conv channels do not match: input {c}, weight {list(ws)}, group {group}")
    ocg = oc // group  # type: ignore[operator]
    padded = pad(b, x, [(0, 0), (0, 0), *pads], 0)
    windows = b.view(padded, ("window", tuple(range(2, 2 + nd)), kernel, tuple(strides), tuple(dilations)))
    out_spatial = b.shape(windows)[2 : 2 + nd]
    full = (n, group, ocg, cg, *out_spatial, *kernel)
    xw = b.reshape(windows, (n, group, 1, cg, *out_spatial, *kernel))
    ww = b.reshape(w, (1, group, ocg, cg, *([1] * nd), *kernel))
    prod = b.binary(Op.MUL, b.expand(xw, full), b.expand(ww, full))
    reduce_axes = [3, *range(4 + nd, 4 + 2 * nd)]
    out = b.reshape(b.reduce(Op.SUM_REDUCE, prod, reduce_axes), (n, oc, *out_spatial))
    if bias is not None:
        out = add(b, out, b.reshape(bias, (1, oc, *([1] * nd))))
    return out


def pool(
    b: GraphBuilder,
    x: int,
    kind: str,
    kernel: Sequence[int],
    pads: Sequence[tuple[int, int]],
    strides: Sequence[int],
    dilations: Sequence[int],
    count_include_pad: bool = False,
    ceil_extra: Sequence[int] | None = None,
) -> int:
    """Max or average pooling over the trailing len(kernel) axes.

    `ceil_extra` pads the end of each axis further (ceil_mode); that padding is never counted.
    """
    shape = b.shape(x)
    nd = len(kernel)
    lead = len(shape) - nd
    spatial = shape[lead:]
    if not all(isinstance(d, int) for d in spatial):
        raise UnsupportedModel(["pooling over symbolic spatial dimensions"])
    extra = list(ceil_extra or [0] * nd)
    widths = [(0, 0)] * lead + [(p[0], p[1] + e) for p, e in zip(pads, extra)]
    fill = lowest(b.dtype(x)) if kind == "max" else 0.0
    view = ("window", tuple(range(lead, lead + nd)), tuple(kernel), tuple(strides), tuple(dilations))
    windows = b.view(pad(b, x, widths, fill), view)
    window_axes = list(range(len(shape), len(shape) + nd))
    if kind == "max":
        return b.reduce(Op.MAX_REDUCE, windows, window_axes)
    total = b.reduce(Op.SUM_REDUCE, windows, window_axes)
    counts = _window_counts(spatial, kernel, pads, extra, strides, dilations, count_include_pad)
    inv = b.constant((1.0 / counts).astype(b.dtype(x)))
    return mul(b, total, inv)


def _window_counts(spatial, kernel, pads, extra, strides, dilations, include_pad) -> np.ndarray:
    """How many real (or, with include_pad, real plus user-padded) elements each window sees."""
    ones = np.ones(spatial, dtype=np.float64)
    nd = len(kernel)
    user_pads = [(p[0], p[1]) for p in pads]
    if include_pad:
        ones = np.pad(ones, user_pads, constant_values=1.0)
        user_pads = [(0, 0)] * nd
    padded = np.pad(ones, [(p[0], p[1]) for p in user_pads], constant_values=0.0)
    padded = np.pad(padded, [(0, e) for e in extra], constant_values=0.0)
    windows = apply_view(padded, ("window", tuple(range(nd)), kernel, strides, dilations), {})
    return windows.sum(axis=tuple(range(nd, 2 * nd)))
