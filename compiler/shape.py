"""Shapes whose dimensions may be symbolic (a batch or sequence size known only at run time).

A dimension is an ``int`` or a :class:`SymDim`: an integer polynomial over *atoms*, where an atom
is a named symbol (``batch``, ``seq``) or a floor division, maximum or minimum of smaller
expressions. ``784*batch``, ``seq+1``, ``seq-1``, ``(seq+1)//2`` and ``max(seq,4)`` are all
SymDims. The form is canonical (terms sorted, zero terms dropped, constants folded to ``int``),
so two expressions that are equal as written compare equal, and simplification uses the one fact
known about every symbol: it is at least 1.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# An atom is a symbol name or (op, *operands) with op in "floordiv", "mod", "max", "min".
Atom = str | tuple
# One term: the atoms multiplied (sorted, repeated for powers) and the integer coefficient.
Term = tuple[tuple[Atom, ...], int]


class ShapeError(ValueError):
    """A shape computation that cannot be expressed or does not hold."""


@dataclass(frozen=True, slots=True)
class SymDim:
    # canonical terms sorted by atoms; the constant term, if any, has no atoms and comes last
    terms: tuple[Term, ...]

    @staticmethod
    def named(name: str) -> SymDim:
        return SymDim(((((name,)), 1),))

    def as_symbol(self) -> str | None:
        """The symbol's name when this dim is exactly one symbol, else None."""
        if len(self.terms) == 1:
            (atoms, coef), = self.terms
            if coef == 1 and len(atoms) == 1 and isinstance(atoms[0], str):
                return atoms[0]
        return None

    @property
    def symbols(self) -> frozenset[str]:
        """Every symbol name this dim depends on."""
        return frozenset(s for atoms, _ in self.terms for atom in atoms for s in _atom_symbols(atom))

    def __add__(self, other: Dim) -> Dim:
        return dim_add(self, other)

    __radd__ = __add__

    def __sub__(self, other: Dim) -> Dim:
        return dim_add(self, dim_neg(other))

    def __rsub__(self, other: Dim) -> Dim:
        return dim_add(other, dim_neg(self))

    def __neg__(self) -> Dim:
        return dim_neg(self)

    def __mul__(self, other: Dim) -> Dim:
        return dim_mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other: int) -> Dim:
        return dim_floordiv(self, other)

    def __str__(self) -> str:
        return _render(self.terms)

    def __repr__(self) -> str:
        return f"SymDim({self})"


Dim = int | SymDim
Shape = tuple[Dim, ...]


# ---- arithmetic ------------------------------------------------------------------------------


def _terms(d: Dim) -> dict[tuple[Atom, ...], int]:
    if isinstance(d, SymDim):
        return dict(d.terms)
    return {(): int(d)} if d else {}


def _atom_key(atom: Atom) -> str:
    return atom if isinstance(atom, str) else _render_atom(atom)


def _make(terms: Mapping[tuple[Atom, ...], int]) -> Dim:
    live = [(atoms, coef) for atoms, coef in terms.items() if coef]
    if all(not atoms for atoms, _ in live):
        return sum(coef for _, coef in live)
    # constant last; otherwise by the rendered atoms, so the order is total and stable
    live.sort(key=lambda t: (not t[0], [_atom_key(a) for a in t[0]]))
    return SymDim(tuple(live))


def as_dim(value: object) -> Dim:
    """An element of a (possibly symbolic) shape array as a Dim: numpy integers become int."""
    return value if isinstance(value, SymDim) else int(value)  # type: ignore[call-overload]


def dim_add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    out = _terms(a)
    for atoms, coef in _terms(b).items():
        out[atoms] = out.get(atoms, 0) + coef
    return _make(out)


def dim_neg(a: Dim) -> Dim:
    if isinstance(a, int):
        return -a
    return _make({atoms: -coef for atoms, coef in a.terms})


def dim_sub(a: Dim, b: Dim) -> Dim:
    return dim_add(a, dim_neg(b))


def dim_mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    out: dict[tuple[Atom, ...], int] = {}
    for atoms_a, coef_a in _terms(a).items():
        for atoms_b, coef_b in _terms(b).items():
            atoms = tuple(sorted(atoms_a + atoms_b, key=_atom_key))
            out[atoms] = out.get(atoms, 0) + coef_a * coef_b
    return _make(out)


def dim_floordiv(a: Dim, divisor: int) -> Dim:
    """floor(a / divisor) for a positive integer divisor."""
    divisor = int(divisor)
    if divisor <= 0:
        raise ShapeError(f"floor division of {a} by {divisor}")
    if isinstance(a, int):
        return a // divisor
    # floor((divisor*q + r) / divisor) = q + floor(r / divisor) for integer polynomials q, r
    whole = {atoms: coef // divisor for atoms, coef in a.terms}
    rest = _make({atoms: coef % divisor for atoms, coef in a.terms})
    if isinstance(rest, int):
        return dim_add(_make(whole), rest // divisor)
    low, high = bounds(rest)
    if 0 <= low and high < divisor:
        return _make(whole)
    return dim_add(_make(whole), _make({(("floordiv", rest, divisor),): 1}))


def dim_mod(a: Dim, divisor: int) -> Dim:
    """a mod divisor (in [0, divisor)) for a positive integer divisor."""
    divisor = int(divisor)
    if divisor <= 0:
        raise ShapeError(f"{a} modulo {divisor}")
    if isinstance(a, int):
        return a % divisor
    rest = _make({atoms: coef % divisor for atoms, coef in a.terms})
    if isinstance(rest, int):
        return rest % divisor
    low, high = bounds(rest)
    if 0 <= low and high < divisor:
        return rest
    return _make({(("mod", rest, divisor),): 1})


def dim_ceildiv(a: Dim, divisor: int) -> Dim:
    return dim_floordiv(dim_add(a, divisor - 1), divisor)


def dim_max(a: Dim, b: Dim) -> Dim:
    return _extreme("max", a, b)


def dim_min(a: Dim, b: Dim) -> Dim:
    return _extreme("min", a, b)


def _extreme(op: str, a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b) if op == "max" else min(a, b)
    low, high = bounds(dim_sub(a, b))
    if low >= 0:
        return a if op == "max" else b
    if high <= 0:
        return b if op == "max" else a
    pair = tuple(sorted((a, b), key=lambda d: str(d)))
    return _make({((op, *pair),): 1})


def dim_div(a: Dim, b: Dim) -> Dim:
    """Exact division (a reshape's inferred dim); raises ShapeError when it does not divide."""
    if b == 0:
        raise ShapeError(f"{a} is not divisible by {b}")
    if isinstance(a, int) and isinstance(b, int):
        if a % b:
            raise ShapeError(f"{a} is not divisible by {b}")
        return a // b
    if a == b:
        return 1
    if a == 0:
        return 0
    divisor = _terms(b)
    if len(divisor) == 1:
        (d_atoms, d_coef), = divisor.items()
        out: dict[tuple[Atom, ...], int] = {}
        for atoms, coef in _terms(a).items():
            remaining = list(atoms)
            for atom in d_atoms:
                if atom not in remaining:
                    raise ShapeError(f"{a} is not divisible by {b}")
                remaining.remove(atom)
            if coef % d_coef:
                raise ShapeError(f"{a} is not divisible by {b}")
            out[tuple(remaining)] = coef // d_coef
        return _make(out)
    # a polynomial divisor: try the quotient of the leading terms and check it
    (a_atoms, a_coef), (b_atoms, b_coef) = next(iter(_terms(a).items())), next(iter(divisor.items()))
    try:
        guess = dim_div(_make({a_atoms: a_coef}), _make({b_atoms: b_coef}))
    except ShapeError:
        guess = None
    if guess is not None and dim_mul(guess, b) == a:
        return guess
    raise ShapeError(f"{a} is not divisible by {b}")


# ---- bounds ------------------------------------------------------------------------------------

_INF = math.inf


def bounds(d: Dim, limits: Mapping[str, int] | None = None) -> tuple[float, float]:
    """An interval holding every value `d` takes when each symbol is at least 1 (and at most its
    limit, where `limits` gives one)."""
    if isinstance(d, int):
        return (d, d)
    low, high = 0.0, 0.0
    for atoms, coef in d.terms:
        t_low, t_high = float(coef), float(coef)
        for atom in atoms:
            t_low, t_high = _interval_mul((t_low, t_high), _atom_bounds(atom, limits))
        low, high = low + t_low, high + t_high
    return (low, high)


def _atom_bounds(atom: Atom, limits: Mapping[str, int] | None) -> tuple[float, float]:
    if isinstance(atom, str):
        return (1.0, float(limits[atom]) if limits is not None and atom in limits else _INF)
    op, *operands = atom
    if op == "floordiv":
        low, high = bounds(operands[0], limits)
        return (math.floor(low / operands[1]), math.floor(high / operands[1]) if high != _INF else _INF)
    if op == "mod":
        return (0, operands[1] - 1)
    (a_low, a_high), (b_low, b_high) = (bounds(x, limits) for x in operands)
    if op == "max":
        return (max(a_low, b_low), max(a_high, b_high))
    return (min(a_low, b_low), min(a_high, b_high))


def _interval_mul(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
    products = [_times(p, q) for p in x for q in y]
    return (min(products), max(products))


def _times(p: float, q: float) -> float:
    return 0.0 if p == 0 or q == 0 else p * q  # 0 * inf is 0 here: the factor is exactly zero


def symbol_limit(dim: Dim, bound: int) -> tuple[str, int] | None:
    """dim <= bound as (symbol, its largest size), for dims linear in one symbol (c*s + k, c > 0);
    None for any other form."""
    if not isinstance(dim, SymDim):
        return None
    constant = dict(dim.terms).get((), 0)
    linear = [(atoms, coef) for atoms, coef in dim.terms if atoms]
    if len(linear) != 1:
        return None
    (atoms, coef), = linear
    if len(atoms) != 1 or not isinstance(atoms[0], str) or coef <= 0:
        return None
    return atoms[0], (bound - constant) // coef


def provably_le(a: Dim, b: Dim) -> bool:
    return bounds(dim_sub(b, a))[0] >= 0


# ---- evaluation and inspection -------------------------------------------------------------


def evaluate(dim: Dim, bindings: Mapping[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    total = 0
    for atoms, coef in dim.terms:
        value = coef
        for atom in atoms:
            value *= _evaluate_atom(atom, bindings)
        total += value
    return total


def _evaluate_atom(atom: Atom, bindings: Mapping[str, int]) -> int:
    if isinstance(atom, str):
        try:
            return int(bindings[atom])
        except KeyError:
            raise ShapeError(f"no value bound for symbolic dimension {atom!r}") from None
    op, *operands = atom
    if op == "floordiv":
        return evaluate(operands[0], bindings) // operands[1]
    if op == "mod":
        return evaluate(operands[0], bindings) % operands[1]
    values = [evaluate(x, bindings) for x in operands]
    return max(values) if op == "max" else min(values)


def _atom_symbols(atom: Atom) -> Iterable[str]:
    if isinstance(atom, str):
        return (atom,)
    return [s for x in atom[1:] if isinstance(x, SymDim) for s in x.symbols]


# symbol values at which two dims are compared when their forms differ (see probably_equal)
_PROBES = (1, 2, 3, 5, 8, 13, 64, 97, 1000)


def probably_equal(a: Dim, b: Dim) -> bool:
    """Equal as written, or equal at many sizes of every symbol. Floors and mods have no single
    canonical form (seq + seq mod 2 is 2*((seq+1)//2)), so a reshape that relies on such an
    identity is accepted when it holds at these sizes, and checked again when run."""
    if a == b:
        return True
    names = sorted(symbols_of([a, b]))
    for i, probe in enumerate(_PROBES):
        bindings = {name: _PROBES[(i + k) % len(_PROBES)] for k, name in enumerate(names)}
        if evaluate(a, bindings) != evaluate(b, bindings):
            return False
    return True


def numel(shape: Iterable[Dim]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = dim_mul(total, d)
    return total


def is_static(shape: Iterable[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def symbols_of(shape: Iterable[Dim]) -> set[str]:
    return {s for d in shape if isinstance(d, SymDim) for s in d.symbols}


def evaluate_shape(shape: Iterable[Dim], bindings: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(d, bindings) for d in shape)


# ---- text form: what manifests and error messages show, parsed back by dim_from_json -------------


def _render(terms: tuple[Term, ...]) -> str:
    out = ""
    for atoms, coef in terms:
        factors = [_render_atom(a) for a in atoms]
        magnitude = abs(coef)
        body = "*".join(([str(magnitude)] if magnitude != 1 or not factors else []) + factors)
        if not out:
            out = ("-" if coef < 0 else "") + body
        else:
            out += ("-" if coef < 0 else "+") + body
    return out


def _render_atom(atom: Atom) -> str:
    if isinstance(atom, str):
        return atom
    op, *operands = atom
    # function style, so a coefficient in front can never be read as part of the numerator
    return f"{op}({operands[0]},{operands[1]})"


_TOKEN = re.compile(r"\s*(\d+|[A-Za-z_][A-Za-z0-9_]*|//|[-+*(),])")


@functools.lru_cache(maxsize=4096)  # signatures parse the same few texts on every request
def parse_dim(text: str) -> Dim:
    """The inverse of str() on a Dim: integers, symbols, + - * //, parentheses, max(), min(),
    floordiv() and mod()."""
    tokens = _tokenize(text)
    parser = _Parser(tokens, text)
    value = parser.sum()
    if parser.pos != len(tokens):
        raise ShapeError(f"cannot parse dimension {text!r}")
    return value


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise ShapeError(f"cannot parse dimension {text!r}")
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.text, self.pos = tokens, text, 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            raise ShapeError(f"cannot parse dimension {self.text!r}")
        self.pos += 1
        return token

    def sum(self) -> Dim:
        sign = -1 if self._peek() == "-" else 1
        if self._peek() in ("-", "+"):
            self._take()
        value = dim_mul(sign, self.product())
        while self._peek() in ("+", "-"):
            op = self._take()
            term = self.product()
            value = dim_add(value, term) if op == "+" else dim_sub(value, term)
        return value

    def product(self) -> Dim:
        value = self.factor()
        while self._peek() in ("*", "//"):
            op = self._take()
            other = self.factor()
            if op == "*":
                value = dim_mul(value, other)
            elif isinstance(other, int):
                value = dim_floordiv(value, other)
            else:
                raise ShapeError(f"cannot parse dimension {self.text!r}")
        return value

    def factor(self) -> Dim:
        token = self._take()
        if token == "(":
            value = self.sum()
            self._take(")")
            return value
        if token.isdigit():
            return int(token)
        if token in ("max", "min", "floordiv", "mod") and self._peek() == "(":
            self._take("(")
            a = self.sum()
            self._take(",")
            b = self.sum()
            self._take(")")
            if token in ("floordiv", "mod"):
                if not isinstance(b, int):
                    raise ShapeError(f"cannot parse dimension {self.text!r}")
                return dim_floordiv(a, b) if token == "floordiv" else dim_mod(a, b)
            return dim_max(a, b) if token == "max" else dim_min(a, b)
        if token[0].isalpha() or token[0] == "_":
            return SymDim.named(token)
        raise ShapeError(f"cannot parse dimension {self.text!r}")


def dim_to_json(dim: Dim) -> int | str:
    return dim if isinstance(dim, int) else str(dim)


def dim_from_json(value: int | str) -> Dim:
    return value if isinstance(value, int) else parse_dim(value)


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
            raise ShapeError(f"shapes {list(map(str, a))} and {list(map(str, b))} do not broadcast")
    return tuple(out)
