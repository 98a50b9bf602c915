"""The kernel IR: what the search hands to a renderer, with nothing device-specific in it.

A `Program` is a list of buffers and a list of kernels run in order. A kernel is either a
`LoopKernel` (a loop nest over the output's index space, optionally reducing over extra axes,
whose body is one value expression of loads) or a `GemmCall` (a batched matrix multiply a
library or generated code performs). Index expressions are affine forms over loop variables
(`Ix`) with coefficients that may be symbolic dims; anything non-affine (a division, a gathered
index) is an opaque `Atom` inside them. Renderers (C today, CUDA C later) turn these into source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compiler.shape import Dim, Shape, ShapeError, dim_add, dim_div, dim_mul, provably_le

# ---- index expressions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Atom:
    """A non-affine integer term: ("floordiv", Ix, Dim), ("mod", Ix, Dim), ("min", Ix, Ix),
    ("value", Expr, Dim) — a loaded value used as an index into an axis of that size (gather),
    wrapped when negative and clamped into the axis; ("flag", Expr) — a bool value as 0 or 1 (the
    choice of a select, which a gathered index 2*i + cond spells)."""

    op: str
    args: tuple


@dataclass(frozen=True, slots=True)
class Ix:
    """sum(coef * var) + const, where a var is a loop variable name or an Atom."""

    terms: tuple[tuple[str | Atom, Dim], ...] = ()
    const: Dim = 0

    @staticmethod
    def var(name: str | Atom) -> Ix:
        return Ix(((name, 1),), 0)

    @staticmethod
    def of(value: Dim) -> Ix:
        return Ix((), value)

    def __add__(self, other: Ix) -> Ix:
        merged: dict[str | Atom, Dim] = dict(self.terms)
        for var, coef in other.terms:
            merged[var] = dim_add(merged[var], coef) if var in merged else coef
        return Ix(_canonical(merged), dim_add(self.const, other.const))

    def scale(self, factor: Dim) -> Ix:
        if factor == 0:
            return Ix()
        return Ix(
            _canonical({v: dim_mul(c, factor) for v, c in self.terms}), dim_mul(self.const, factor)
        )

    def is_const(self) -> bool:
        return not self.terms


def _canonical(terms: dict[str | Atom, Dim]) -> tuple[tuple[str | Atom, Dim], ...]:
    return tuple(sorted(((v, c) for v, c in terms.items() if c != 0), key=lambda t: repr(t[0])))


def ix_max(ix: Ix, extents: dict[str, Dim]) -> Dim | None:
    """An upper bound of ix over the loops' ranges, or None when unknown (atoms, negative terms)."""
    total: Dim = ix.const
    for var, coef in ix.terms:
        if isinstance(coef, int) and coef < 0:
            return None
        if isinstance(var, Atom) and var.op == "flag":
            total = dim_add(total, coef)
        elif isinstance(var, str):
            total = dim_add(total, dim_mul(coef, dim_add(extents[var], -1)))
        else:
            return None
    return total


def ix_floordiv(ix: Ix, divisor: Dim, extents: dict[str, Dim]) -> Ix:
    if divisor == 1:
        return ix
    whole, _ = _split(ix, divisor, extents)
    if whole is not None:
        return whole
    factored = _common_factor(ix, divisor, extents)
    if factored is not None:
        factor, quotient, _ = factored
        return ix_floordiv(quotient, dim_div(divisor, factor), extents)
    return Ix.var(Atom("floordiv", (ix, divisor)))


def ix_mod(ix: Ix, divisor: Dim, extents: dict[str, Dim]) -> Ix:
    if divisor == 1:
        return Ix()
    whole, rest = _split(ix, divisor, extents)
    if whole is not None:
        return rest
    factored = _common_factor(ix, divisor, extents)
    if factored is not None:
        factor, quotient, remainder = factored
        return ix_mod(quotient, dim_div(divisor, factor), extents).scale(factor) + remainder
    top = ix_max(ix, extents)
    if top is not None and provably_le(dim_add(top, 1), divisor):
        return ix
    return Ix.var(Atom("mod", (ix, divisor)))


def _split(ix: Ix, divisor: Dim, extents: dict[str, Dim]) -> tuple[Ix | None, Ix]:
    """(ix // divisor, ix % divisor) when ix = divisor*q + r with 0 <= r < divisor provably."""
    quotient: dict[str | Atom, Dim] = {}
    rest: dict[str | Atom, Dim] = {}
    for var, coef in ix.terms:
        try:
            quotient[var] = dim_div(coef, divisor)
        except (ShapeError, ZeroDivisionError):
            rest[var] = coef
    const_q: Dim = 0
    const_r: Dim = ix.const
    try:
        const_q, const_r = dim_div(ix.const, divisor), 0
    except (ShapeError, ZeroDivisionError):
        pass
    remainder = Ix(_canonical(rest), const_r)
    top = ix_max(remainder, extents)
    if top is None or (isinstance(const_r, int) and const_r < 0) or not provably_le(dim_add(top, 1), divisor):
        return None, ix
    return Ix(_canonical(quotient), const_q), remainder


def _common_factor(ix: Ix, divisor: Dim, extents: dict[str, Dim]) -> tuple[int, Ix, Ix] | None:
    """(g, q, r) with ix = g*q + r, 0 <= r < g provably and g dividing the divisor: then
    ix // divisor = q // (divisor / g) and ix % divisor = g * (q % (divisor / g)) + r (an
    interleaving's 2*i + flag read through a reshape by symbolic sizes)."""
    for factor in sorted({c for _, c in ix.terms if isinstance(c, int) and c > 1}, reverse=True):
        try:
            dim_div(divisor, factor)
        except (ShapeError, ZeroDivisionError):
            continue
        quotient, remainder = _split(ix, factor, extents)
        if quotient is not None and quotient.terms:
            return factor, quotient, remainder
    return None


# ---- value expressions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    buffer: int
    index: Ix


@dataclass(frozen=True, slots=True)
class Guarded:
    """value where every (index, size) pair has 0 <= index < size, else fill (padding)."""

    guards: tuple[tuple[Ix, Dim], ...]
    value: Expr
    fill: Any
    dtype: str


@dataclass(frozen=True, slots=True)
class Const:
    value: Any
    dtype: str


@dataclass(frozen=True, slots=True)
class IndexValue:
    """A loop index as a value (iota)."""

    index: Ix
    dtype: str


@dataclass(frozen=True, slots=True)
class Apply:
    """op is a primitive op name (log2, exp2, sin, sqrt, recip, add, mul, mod, less_than) or
    "cast"; `dtype` is the result's."""

    op: str
    args: tuple
    dtype: str


Expr = Load | Guarded | Const | IndexValue | Apply


# ---- kernels and programs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    id: int
    dtype: str
    shape: Shape
    # "input" | "output" | "weight" | "temp" | "panel" (an operand computed in pieces: Panels)
    role: str
    # the input or output name, or the weight key
    name: str = ""


@dataclass(frozen=True)
class Let:
    """A value an elementwise loop computes at each element before its own (vertically fused
    loops): the expressions after it read `buffer` at their own element as this local value, and
    it is stored into `buffer` only where `store` (another kernel reads it, or it is an output)."""

    buffer: int
    value: Expr
    store: bool


@dataclass(frozen=True)
class LoopKernel:
    """out[o...] = value(o...), or with `reduce`: out[o...] = reduce over r... of value(o..., r...).
    Loop variables are named o0.. (output axes, row-major into `out`) and r0.. (reduced axes)."""

    out: int
    shape: Shape
    value: Expr
    # ("sum" | "max", extents of r0..)
    reduce: tuple[str, Shape] | None = None
    # which node of the primitive graph this computes (for reports)
    node: int = -1
    # values computed first at each element (elementwise loops only; compiler.kernels.fusion)
    lets: tuple[Let, ...] = ()

    @property
    def values(self) -> tuple[Expr, ...]:
        """Every expression the loop evaluates at an element: its lets', then its own."""
        return (*(let.value for let in self.lets), self.value)


@dataclass(frozen=True)
class Panels:
    """A product's B operand that is never stored whole (an implicit GEMM): `kernel` computes it,
    shaped [the batch axes B has..., k axes..., n axes...], and a renderer materializes it a
    block of columns (leading n axis) at a time into scratch that stays in cache, multiplying each
    block as it goes. A convolution's windows (im2col, 9x its input for 3x3) are the case."""

    kernel: LoopKernel
    # the call's batch axes that B has, in order: its kernel's leading loops
    batch_axes: tuple[int, ...]
    # how many axes of the kernel's shape after those are k's (the rest are n's)
    k_axes: int


@dataclass(frozen=True)
class Epilogue:
    """An elementwise loop the product applies to its own output, block by block as it writes it
    (bias, activation, residual add): C[t, i, j] = value, where loads index by the variables `t`
    (the flat batch index), `i` (C's row) and `j` (C's column), and C's own element, read at
    t*m*n + i*n + j, holds the product's sum when the epilogue runs."""

    value: Expr
    # the primitive node the fused loop computed (for reports)
    node: int = -1
    # the fused loop's own lets, indexed like `value`
    lets: tuple[Let, ...] = ()

    @property
    def values(self) -> tuple[Expr, ...]:
        """Every expression the epilogue evaluates at an element: its lets', then its own."""
        return (*(let.value for let in self.lets), self.value)


@dataclass(frozen=True)
class GemmCall:
    """For each batch index: C[m, n] = sum_k A[m, k] * B[k, n] (alpha 1, beta 0), row-major.
    A is stored [m, k] (or [k, m] when trans_a) with its batch offsets `a_batch_strides`, one per
    batch axis (0 where A is shared across that axis); likewise B; C is contiguous."""

    a: int
    b: int
    c: int
    batch: Shape
    m: Dim
    n: Dim
    k: Dim
    trans_a: bool
    trans_b: bool
    a_batch_strides: tuple[Dim, ...]
    b_batch_strides: tuple[Dim, ...]
    dtype: str
    node: int = -1
    # B computed a block of columns at a time (buffer `b` is then a "panel": never allocated)
    b_panels: Panels | None = None
    # row strides of A and B where they are not the packed ones (k or m for A, n or k for B): an
    # operand read in place from rows of a wider buffer
    lda: Dim | None = None
    ldb: Dim | None = None
    # B is a weight stored in a renderer's packed layout (its panels, packed at compile time), not
    # as rows: set by the renderer's own pass over a lowered program, never by lowering
    packed_b: bool = False
    # A is a weight stored transposed in that packed layout (pack_weight(A^T)): the product is
    # computed as C^T = B^T A^T (lc_sgemm_t); set by the same pass, for the schedules that ask for it
    packed_a: bool = False
    # an elementwise loop fused into the product (compiler.kernels.epilogue); C is then its output
    epilogue: Epilogue | None = None
    # the same product as a reduction loop over its operands where the graph has them (windows
    # read in place, nothing packed) writing C: a schedule may run it instead of the call (a
    # matrix-vector product, whose operands a GEMM's blocking reuses nothing of); None: no such form
    loops: LoopKernel | None = None


@dataclass(frozen=True)
class AttentionCall:
    """Attention as one kernel: for each batch index t and query row i,
    out[t, i, :] = sum_j softmax_j(score(t, i, j)) * V[t, j, :], the softmax taken as
    exp2(log2_scale * (score - max)) / sum, which a renderer computes online, a block of keys
    at a time (running max and sum), so the scores never reach memory. It replaces the kernels
    that spelled it (compiler.kernels.attention): `scores` is the product Q K^T (its A is Q, its B
    K, its C the scores' buffer, now never stored), `values` the product P V (its B is V, its C
    the output), and `score` the max reduction's value over those scores, in that loop's
    variables (o0.. batch axes, then the query row; r0 the key), where a load of `scores.c`
    stands for the product's sum at (t, i, j): the scale and the mask applied to it."""

    scores: GemmCall
    values: GemmCall
    score: Expr
    log2_scale: float
    node: int = -1
    # a row with no finite score (all masked out, or a NaN) is zeros, not NaN: the softmax that
    # torch exports, where(isnan(p), 0, p), normalized before the product with V
    empty_rows_zero: bool = False

    @property
    def out(self) -> int:
        return self.values.c


Kernel = LoopKernel | GemmCall | AttentionCall


@dataclass
class Program:
    buffers: list[Buffer]
    kernels: list[Kernel]
    # symbols the program reads at run time, in the order the entry point receives them
    symbols: list[str]
    # temp buffer id -> arena slot; slots are shared by temps whose lifetimes do not overlap
    slots: dict[int, int] = field(default_factory=dict)
    # every weight a buffer names: the graph's, and operands repacked for a library call
    weights: dict[str, Any] = field(default_factory=dict)
    # the input format of the program's float32 products on tensor cores (float16, bfloat16,
    # tf32), or None: products in their own dtype (compiler.kernels.precision)
    tensor_cores: str | None = None

    def buffer(self, i: int) -> Buffer:
        return self.buffers[i]
