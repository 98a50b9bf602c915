"""Lowerings of element-wise math, comparison, logic and bit ops.

The math itself (erf, trigonometry, rounding, activations, powers, bit planes...) is spelled in
compiler.composite; this module checks dtypes, reads attributes with their ONNX defaults and
picks the composite. float16 math that takes several roundings is done in float32 and rounded
once at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from compiler import composite as C
from compiler.dtypes import bits, is_float, is_unsigned_int
from compiler.frontends.onnx_context import Context, attrs, float_input, lowers, refuse, text
from compiler.ir import GraphBuilder, Op
from compiler.shape import broadcast_shapes

# ---- unary ops -----------------------------------------------------------------------------

Unary = Callable[[GraphBuilder, int, dict], int]


def _plain(fn: Callable[[GraphBuilder, int], int]) -> Unary:
    return lambda b, x, a: fn(b, x)


# float-only ops; float16 inputs are computed in float32 and rounded once
_FLOAT_UNARY: dict[str, Unary] = {
    "Sigmoid": _plain(C.sigmoid),
    "Tanh": _plain(C.tanh),
    "Exp": _plain(C.exp),
    "Log": _plain(C.log),
    "Sqrt": _plain(C.sqrt),
    "Reciprocal": _plain(lambda b, x: b.unary(Op.RECIP, x)),
    "Sin": _plain(lambda b, x: b.unary(Op.SIN, x)),
    "Cos": _plain(C.cos),
    "Tan": _plain(C.tan),
    "Asin": _plain(C.asin),
    "Acos": _plain(C.acos),
    "Atan": _plain(C.atan),
    "Sinh": _plain(C.sinh),
    "Cosh": _plain(C.cosh),
    "Asinh": _plain(C.asinh),
    "Acosh": _plain(C.acosh),
    "Atanh": _plain(C.atanh),
    "Erf": _plain(C.erf),
    "Softplus": _plain(C.softplus),
    "Softsign": _plain(C.softsign),
    "Mish": _plain(C.mish),
    "Floor": _plain(C.floor),
    "Ceil": _plain(C.ceil),
    "Round": _plain(C.round_half_even),
    "Elu": lambda b, x, a: C.elu(b, x, a.get("alpha", 1.0)),
    "Selu": lambda b, x, a: C.selu(
        b, x, a.get("alpha", 1.67326319217681884765625), a.get("gamma", 1.05070102214813232421875)
    ),
    "Celu": lambda b, x, a: C.celu(b, x, a.get("alpha", 1.0)),
    "LeakyRelu": lambda b, x, a: C.leaky_relu(b, x, a.get("alpha", 0.01)),
    "ThresholdedRelu": lambda b, x, a: C.thresholded_relu(b, x, a.get("alpha", 1.0)),
    "HardSigmoid": lambda b, x, a: C.hard_sigmoid(b, x, a.get("alpha", 0.2), a.get("beta", 0.5)),
    "HardSwish": _plain(C.hard_swish),
    "Swish": lambda b, x, a: C.swish(b, x, a.get("alpha", 1.0)),
    "Gelu": lambda b, x, a: C.gelu(b, x, text(a.get("approximate", b"none"))),
    "Shrink": lambda b, x, a: C.shrink(b, x, a.get("lambd", 0.5), a.get("bias", 0.0)),
}

# ops exact on floats and signed integers (and, for Abs and Sign, unsigned ones)
_NUMERIC_UNARY: dict[str, Unary] = {
    "Relu": _plain(C.relu),
    "Neg": _plain(C.neg),
    "Abs": _plain(C.absolute),
    "Sign": _plain(C.sign),
}


def _in_float32(b: GraphBuilder, x: int, fn: Callable[[int], int]) -> int:
    if b.dtype(x) != "float16":
        return fn(x)
    return b.cast(fn(b.cast(x, "float32")), "float16")


@lowers(*_FLOAT_UNARY)
def _float_unary(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = float_input(ctx, node)
    a = attrs(node)
    if node.op_type == "Gelu" and a.get("approximate", b"none") not in (b"none", b"tanh"):
        raise refuse(node, f"approximate={a['approximate']!r}")
    return [_in_float32(b, x, lambda v: _FLOAT_UNARY[node.op_type](b, v, a))]


@lowers(*_NUMERIC_UNARY)
def _numeric_unary(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = ctx.value(node, 0)
    dtype = b.dtype(x)
    if dtype == "bool" or (is_unsigned_int(dtype) and node.op_type in ("Neg", "Relu")):
        raise refuse(node, f"{dtype} input")
    return [_NUMERIC_UNARY[node.op_type](b, x, attrs(node))]


@lowers("PRelu")
def _prelu(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [C.prelu(ctx.b, float_input(ctx, node), ctx.value(node, 1))]


# ---- arithmetic ----------------------------------------------------------------------------


def _check_numeric(node: onnx.NodeProto, *dtypes: str) -> None:
    if any(d == "bool" for d in dtypes):
        raise refuse(node, "bool inputs")


@lowers("Add", "Sub", "Mul", "Div")
def _arithmetic(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = ctx.value(node, 0), ctx.value(node, 1)
    dtype = b.dtype(x)
    _check_numeric(node, dtype, b.dtype(y))
    if node.op_type == "Add":
        return [C.add(b, x, y)]
    if node.op_type == "Sub":
        return [C.sub(b, x, y)]
    if node.op_type == "Mul":
        return [C.mul(b, x, y)]
    if is_float(dtype):
        return [_in_float32(b, x, lambda v: C.div(b, v, b.cast(y, b.dtype(v))))]
    if bits(dtype) > 32:
        raise refuse(node, f"{dtype} inputs (exact 64-bit integer division)")
    return [C.int_div(b, x, y)]


@lowers("Mod")
def _mod(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x, y = ctx.value(node, 0), ctx.value(node, 1)
    _check_numeric(node, b.dtype(x))
    return [(C.fmod if attrs(node).get("fmod", 0) else C.floor_mod)(b, x, y)]


def _present(ctx: Context, node: onnx.NodeProto) -> list[int]:
    """The values of the inputs that are given (variadic ops may skip some)."""
    return [ctx.value(node, i) for i in range(len(node.input)) if node.input[i]]


@lowers("Max", "Min")
def _max_min(ctx: Context, node: onnx.NodeProto) -> list[int]:
    parts = _present(ctx, node)
    _check_numeric(node, *(ctx.b.dtype(p) for p in parts))
    return [(C.maximum if node.op_type == "Max" else C.minimum)(ctx.b, *parts)]


@lowers("Sum", "Mean")
def _sum_mean(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    parts = C.broadcast_all(b, _present(ctx, node))
    if not is_float(b.dtype(parts[0])):
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
        low = b.scalar_like(a["min"], x) if "min" in a else None
        high = b.scalar_like(a["max"], x) if "max" in a else None
    else:
        low, high = ctx.optional(node, 1), ctx.optional(node, 2)
    if low is not None:
        x = C.maximum(b, x, low)
    if high is not None:
        x = C.minimum(b, x, high)
    return [x]


# ---- Pow -----------------------------------------------------------------------------------


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
    if exponent is not None and (exponent >= 0 or is_float(b.dtype(x))):
        power = C.power_by_squaring(b, x, abs(exponent))
        if exponent < 0:
            power = _in_float32(b, power, lambda v: b.unary(Op.RECIP, v))
        return [b.broadcast_to(power, shape)]
    if is_float(b.dtype(x)):
        return [_in_float32(b, x, lambda v: C.float_power(b, v, y))]
    if is_float(b.dtype(y)):
        raise refuse(node, "an integer base and a floating-point exponent")
    return [C.int_power(b, x, y)]


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
        return [C.equal(b, x, y)]
    if node.op_type in ("Less", "Greater"):
        return [C.less(b, x, y)]
    return [C.logical_or(b, C.less(b, x, y), C.equal(b, x, y))]


_LOGIC = {"And": C.logical_and, "Or": C.logical_or, "Xor": C.logical_xor}


@lowers(*_LOGIC)
def _logic(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [_LOGIC[node.op_type](ctx.b, *_comparison_inputs(ctx, node))]


@lowers("Not")
def _logical_not(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [C.logical_not(ctx.b, ctx.value(node, 0))]


@lowers("Where")
def _where(ctx: Context, node: onnx.NodeProto) -> list[int]:
    cond, x, y = (ctx.value(node, i) for i in range(3))
    return [C.where(ctx.b, cond, x, y)]


@lowers("IsNaN")
def _is_nan(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [C.is_nan(ctx.b, float_input(ctx, node))]


@lowers("IsInf")
def _is_inf(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    x = float_input(ctx, node)
    a = attrs(node)
    largest = np.finfo(b.dtype(x)).max
    checks = []
    if a.get("detect_positive", 1):
        checks.append(C.less(b, b.scalar_like(largest, x), x))
    if a.get("detect_negative", 1):
        checks.append(C.less(b, x, b.scalar_like(-largest, x)))
    if not checks:
        return [C.less(b, x, x)]  # all False
    return [C.logical_or(b, *checks)]


# ---- bit operations ------------------------------------------------------------------------


def _integer_inputs(ctx: Context, node: onnx.NodeProto) -> tuple[int, int]:
    x, y = _comparison_inputs(ctx, node)
    dtype = ctx.b.dtype(x)
    if is_float(dtype) or dtype == "bool":
        raise refuse(node, f"{dtype} inputs")
    return x, y


_BITWISE = {"BitwiseAnd": C.bitwise_and, "BitwiseOr": C.bitwise_or, "BitwiseXor": C.bitwise_xor}


@lowers(*_BITWISE)
def _bitwise(ctx: Context, node: onnx.NodeProto) -> list[int]:
    return [_BITWISE[node.op_type](ctx.b, *_integer_inputs(ctx, node))]


@lowers("BitwiseNot")
def _bitwise_not(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x = ctx.value(node, 0)
    dtype = ctx.b.dtype(x)
    if is_float(dtype) or dtype == "bool":
        raise refuse(node, f"{dtype} input")
    # the bitwise complement is the integers' order reversal
    return [C.reverse_order(ctx.b, x)]


@lowers("BitShift")
def _bit_shift(ctx: Context, node: onnx.NodeProto) -> list[int]:
    x, y = _integer_inputs(ctx, node)
    direction = attrs(node).get("direction", b"")
    if direction == b"LEFT":
        return [C.shift_left(ctx.b, x, y)]
    if direction == b"RIGHT":
        return [C.shift_right(ctx.b, x, y)]
    raise refuse(node, f"direction={direction!r}")
