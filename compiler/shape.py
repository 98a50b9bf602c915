"""Shapes whose dimensions may be symbolic (a batch or sequence size known only at run time).

A dimension is an ``int`` or a :class:`SymDim`: a product of named symbols times an integer
coefficient (``784*batch``). Products and exact quotients are closed under that form, which is
what reshapes and flattens of a batched tensor need. Sums of symbols are not representable yet:
the frontend refuses graphs that need them, with an error naming the node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod


class ShapeError(ValueError):
    """A shape computation that cannot be expressed or does not hold."""


@dataclass(frozen=True, slots=True)
class SymDim:
    coef: int
    # sorted symbol names, repeated for powers: ("batch", "seq")
    symbols: tuple[str, ...]

    @staticmethod
    def named(name: str) -> SymDim:
        return SymDim(1, (name,))

    def __mul__(self, other: Dim) -> Dim:
        if isinstance(other, int):
            return _normalize(self.coef * other, self.symbols)
        return _normalize(self.coef * other.coef, tuple(sorted(self.symbols + other.symbols)))

    __rmul__ = __mul__

    def __str__(self) -> str:
        parts = ([str(self.coef)] if self.coef != 1 else []) + list(self.symbols)
        return "*".join(parts)

    def __repr__(self) -> str:
        return f"SymDim({self})"


Dim = int | SymDim
Shape = tuple[Dim, ...]


def _normalize(coef: int, symbols: tuple[str, ...]) -> Dim:
    if not symbols or coef == 0:
        return coef
    return SymDim(coef, symbols)


def dim_mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return a * b if isinstance(a, SymDim) else b * a  # type: ignore[operator]


def dim_div(a: Dim, b: Dim) -> Dim:
    """Exact division of monomials; raises ShapeError when it does not divide."""
    a_coef, a_syms = (a, ()) if isinstance(a, int) else (a.coef, a.symbols)
    b_coef, b_syms = (b, ()) if isinstance(b, int) else (b.coef, b.symbols)
    remaining = Counter(a_syms)
    remaining.subtract(Counter(b_syms))
    if b_coef == 0 or a_coef % b_coef or any(n < 0 for n in remaining.values()):
        raise ShapeError(f"{a} is not divisible by {b}")
    return _normalize(a_coef // b_coef, tuple(sorted(remaining.elements())))


def numel(shape: Iterable[Dim]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = dim_mul(total, d)
    return total


def is_static(shape: Iterable[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def symbols_of(shape: Iterable[Dim]) -> set[str]:
    return {s for d in shape if isinstance(d, SymDim) for s in d.symbols}


def evaluate(dim: Dim, bindings: Mapping[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    try:
        return dim.coef * prod(bindings[s] for s in dim.symbols)
    except KeyError as missing:
        raise ShapeError(f"no value bound for symbolic dimension {missing}") from None


def evaluate_shape(shape: Iterable[Dim], bindings: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(d, bindings) for d in shape)


def dim_to_json(dim: Dim) -> int | str:
    return dim if isinstance(dim, int) else str(dim)


def dim_from_json(value: int | str) -> Dim:
    if isinstance(value, int):
        return value
    coef, symbols = 1, []
    for part in value.split("*"):
        if part.lstrip("-").isdigit():
            coef *= int(part)
        else:
            symbols.append(part)
    return _normalize(coef, tuple(sorted(symbols)))


def shape_to_json(shape: Iterable[Dim]) -> list[int | str]:
    return [dim_to_json(d) for d in shape]


def shape_from_json(values: Iterable[int | str]) -> Shape:
    return tuple(dim_from_json(v) for v in values)


def broadcast_shapes(a: Shape, b: Shape) -> Shape:
    """Numpy broadcasting over possibly symbolic dims (a symbol broadcasts only against 1)."""
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + a
    b = (1,) * (rank - len(b)) + b
    out: list[Dim] = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeError(f"shapes {list(a)} and {list(b)} do not broadcast")
    return tuple(out)
