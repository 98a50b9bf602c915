"""Flat loops given back their axes: an elementwise loop over one flat index o0 whose loads
recover axes by division (o0 / (4*s*s), o0 % (s*s), (o0 / (s*s)) % 4: an attention bias
gathered into a flattened [batch * heads * seq * seq] value) runs over the shape those divisors
cut it into instead, [batch, 4, s*s], where every such index is affine again: no division per
element, and a last axis the C compiler vectorizes. Device-neutral (a pass over the kernel IR).

The divisors must form a chain (each divides the next, the last divides the loop's extent),
symbolic ones included; a loop whose indices still divide after the rewrite is left as it was.
"""

from __future__ import annotations

from dataclasses import replace

from compiler.kernels.ir import (
    Apply,
    Atom,
    Const,
    Expr,
    GemmCall,
    Guarded,
    IndexValue,
    Ix,
    Let,
    Load,
    LoopKernel,
    Program,
    ix_floordiv,
    ix_mod,
)
from compiler.kernels.ir_walk import lets_reads, walk
from compiler.shape import Dim, ShapeError, dim_div, dim_mul, evaluate

FLAT = "o0"
# symbol values at which divisors are ordered (two, so that a tie at one is not taken for equality)
_PROBES = (7, 13)


def delinearize(program: Program) -> Program:
    """The program with each flat elementwise loop that divides its index run over its axes,
    except a loop over a product's output: that is the form the attention rules match (a causal
    mask applied to the scores; compiler.search.kernel_rules)."""
    products = {k.c for k in program.kernels if isinstance(k, GemmCall)}
    kernels = [
        _delinearized(k) if isinstance(k, LoopKernel) and not (lets_reads(k) & products) else k for k in program.kernels
    ]
    if all(new is old for new, old in zip(kernels, program.kernels, strict=True)):
        return program
    return replace(program, kernels=kernels)


def _delinearized(kernel: LoopKernel) -> LoopKernel:
    if len(kernel.shape) != 1 or kernel.reduce is not None:
        return kernel
    cuts = _cuts(kernel)
    if not cuts:
        return kernel
    chain = _chain(cuts, kernel.shape[0])
    if chain is None:
        return kernel
    # axes outermost first: extent / chain[-1], ..., chain[1] / chain[0], chain[0]
    bounds = [kernel.shape[0], *reversed(chain), 1]
    shape = tuple(dim_div(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1))
    strides = bounds[1:]
    flat = Ix()
    for j, stride in enumerate(strides):
        flat = flat + Ix.var(f"o{j}").scale(stride)
    extents = {f"o{j}": d for j, d in enumerate(shape)}
    rewrite = _Rewrite(flat, extents)
    try:
        value = rewrite.expr(kernel.value)
        lets = tuple(Let(let.buffer, rewrite.expr(let.value), let.store) for let in kernel.lets)
    except _Refused:
        return kernel
    if any(_divides_loop_index(v) for v in (value, *(let.value for let in lets))):
        return kernel
    return replace(kernel, shape=shape, value=value, lets=lets)


def _cuts(kernel: LoopKernel) -> set[Dim]:
    """Where the loop's divisions cut its flat index: d for o0 / d and o0 % d, and d1 * d2 for
    (o0 / d1) % d2."""
    found: set[Dim] = set()
    flat = Ix.var(FLAT)
    for value in kernel.values:
        for e in walk(value):
            if not isinstance(e, Atom) or e.op not in ("floordiv", "mod"):
                continue
            operand, divisor = e.args
            if operand == flat:
                found.add(divisor)
            elif len(operand.terms) == 1 and not operand.const and operand.terms[0][1] == 1:
                inner = operand.terms[0][0]
                if isinstance(inner, Atom) and inner.op == "floordiv" and inner.args[0] == flat:
                    found.add(inner.args[1])
                    found.add(dim_mul(inner.args[1], divisor))
    return {d for d in found if d != 1}


def _chain(cuts: set[Dim], extent: Dim) -> list[Dim] | None:
    """The cuts in increasing order when each divides the next and the last divides `extent`."""
    def probe(d: Dim) -> tuple[int, ...]:
        return tuple(evaluate(d, _Symbols(p)) for p in _PROBES)

    try:
        ordered = sorted(cuts, key=probe)
    except (ShapeError, TypeError, ValueError):
        return None
    for small, large in zip(ordered, [*ordered[1:], extent]):
        if small == large:
            return None
        try:
            dim_div(large, small)
        except (ShapeError, ZeroDivisionError):
            return None
    return ordered


class _Symbols(dict):
    """Every symbol bound to one probe value."""

    def __init__(self, value: int) -> None:
        super().__init__()
        self.value = value

    def __missing__(self, key: str) -> int:
        return self.value

    def __contains__(self, key: object) -> bool:
        return True


class _Refused(Exception):
    """An index this pass cannot rewrite: the loop stays flat."""


class _Rewrite:
    """Expressions over the flat index rewritten over the loop's axes, divisions simplified."""

    def __init__(self, flat: Ix, extents: dict[str, Dim]) -> None:
        self.flat = flat
        self.extents = extents

    def expr(self, e: Expr) -> Expr:
        if isinstance(e, Load):
            return Load(e.buffer, self.ix(e.index))
        if isinstance(e, Apply):
            return Apply(e.op, tuple(self.expr(a) for a in e.args), e.dtype)
        if isinstance(e, Guarded):
            return Guarded(tuple((self.ix(g), n) for g, n in e.guards), self.expr(e.value), e.fill, e.dtype)
        if isinstance(e, IndexValue):
            return IndexValue(self.ix(e.index), e.dtype)
        if isinstance(e, Const):
            return e
        raise _Refused(type(e).__name__)

    def ix(self, ix: Ix) -> Ix:
        out = Ix.of(ix.const)
        for var, coef in ix.terms:
            if var == FLAT:
                out = out + self.flat.scale(coef)
            elif isinstance(var, Atom):
                out = out + self.atom(var).scale(coef)
            else:
                raise _Refused(f"loop variable {var}")
        return out

    def atom(self, atom: Atom) -> Ix:
        if atom.op == "floordiv":
            return ix_floordiv(self.ix(atom.args[0]), atom.args[1], self.extents)
        if atom.op == "mod":
            return ix_mod(self.ix(atom.args[0]), atom.args[1], self.extents)
        if atom.op == "min":
            return Ix.var(Atom("min", (self.ix(atom.args[0]), self.ix(atom.args[1]))))
        if atom.op == "flag":
            return Ix.var(Atom("flag", (self.expr(atom.args[0]),)))
        if atom.op == "value":
            return Ix.var(Atom("value", (self.expr(atom.args[0]), *atom.args[1:])))
        raise _Refused(atom.op)


def _divides_loop_index(value: Expr) -> bool:
    """Whether a division or remainder of a loop variable is left (the rewrite did not help)."""
    return any(
        isinstance(e, Atom) and e.op in ("floordiv", "mod") and any(isinstance(v, str) for v in _variables(e.args[0]))
        for e in walk(value)
    )


def _variables(ix: Ix) -> list[str | Atom]:
    found: list[str | Atom] = []
    for var, _ in ix.terms:
        found.append(var)
        if isinstance(var, Atom) and var.op in ("floordiv", "mod", "min"):
            for arg in var.args:
                if isinstance(arg, Ix):
                    found.extend(_variables(arg))
    return found


__all__ = ["delinearize"]
