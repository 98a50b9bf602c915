"""The rewrite rules of the search compiler's first stage, kept together as data.

Two kinds of rules live here, both named for what they rewrite:

* egglog rules (``RULESETS``), grouped in named rule sets and run in the order of ``STAGES``.
  The e-graph sees each primitive node as one term whose first argument is its result dtype,
  so every guard can name the dtype it needs. ``facts`` is an analysis set (value facts such as
  "all ones", "non-negative", magnitude bounds), saturated a bounded number of times before each
  rewrite iteration; the others rewrite.
* Python layout rules (``LAYOUT_RULES``): view chains are canonicalized in Python, before and
  after the e-graph, because composing permutations and shapes (possibly symbolic) is a
  computation egglog would need a Python-side table for anyway. Inside the e-graph a view is an
  opaque ``(View dtype src kind key)`` whose key names (transform, source shape) in a Python table,
  so two views with the same key are the same index map over sources of the same shape. A sum
  or max over axes of size 1 is rewritten to a reshape there too.

Constant folding of weights-only subgraphs is a Python pass too (compiler/search/passes.py); the
rules below only create the compile-time products ``CMul`` / ``CAdd`` of constants that it folds.

Soundness notes (every rewrite keeps the shape and dtype of its e-class: operands of a binary op
have the shape and dtype of its result in this IR, so ``x*1 -> x`` needs no broadcast check):

* ``x+0 -> x`` on floats turns ``-0.0 + 0.0`` (``+0.0``) back into ``-0.0``: equal as numbers,
  different only through ``1/x``. Every compiler's algebraic simplifier makes the same choice.
* ``1/(1/x) -> x`` (floats only) is exact except where ``1/x`` over- or underflows (|x| beyond
  about 2**126 in float32): the rewrite returns x where the original returned 0 or inf.
* ``log2(exp2 x) -> x`` only where |x| is provably at most 2**6 (float32, bfloat16), 2**9
  (float64) or 2**3 (float16), so exp2 neither overflows nor leaves the normal range; the bound
  comes from the ``mag-hi`` analysis (constants, sin, casts of bools, products and sums of those).
  Without a bound it is left alone: exp2(200.0) is inf in float32 and log2(inf) is not 200.
* ``exp2(log2 x) -> x`` only where x is known non-negative (or NaN): log2 of a negative number is
  NaN. The sign of a zero may change (exp2(log2(-0.0)) is +0.0), as with x+0.
* Chains of constants, ``c1*(c2*x) -> (c1*c2)*x`` and ``c1+(c2+x) -> (c1+c2)+x``, re-associate:
  exact for integers and bools (wrapping arithmetic is associative), a rounding-level change for
  floats, where they are guarded by the magnitude analysis so the folded constant can neither
  overflow nor leave the normal range (c1*c2 with c1 = c2 = 1e30 would be inf in float32 while
  c1*(c2*x) is finite for x = 1e-30); a multiplied constant with a zero element has no lower
  bound and is not folded. What no guard on constants can prevent: an intermediate overflow of
  the original (c2*x = inf for c2 = 1e30, x = 1e10, then c1 = 1e-30) disappears when folded.
  Only constants stored at their own size fold (bare, or under one shared view), so a folded
  constant is never bigger than the ones it replaces.
* ``x*0 -> 0`` is applied to integers and bools only: for floats inf*0 and NaN*0 are NaN.
* Casts: ``cast(cast(x, a), b) -> cast(x, b)`` only when ``a`` holds every value of x's dtype
  exactly (``WIDENS``); a cast to the value's own dtype is removed.
* Boolean masks computed through an integer type (``bool(uint8(a) * uint8(b))``) become ``a*b``
  (logical and) and ``a+b`` (logical or) on the bools, which is what the reference interpreter's
  multiply and add do on bools.

No rule is commutative or associative in general: operands of add and mul are written with the
constant first (egraph._term writes the input graph so, and the rules' results keep it),
so each rule needs one operand order only, except the identities, which match both orders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from compiler.dtypes import DTYPES, is_float, is_signed_int, is_unsigned_int, numpy_dtype
from compiler.ir import Node, Op
from compiler.shape import Shape, is_static

# ---- the e-graph's vocabulary --------------------------------------------------------------

DECLARATIONS = """
(datatype T
  (Leaf i64)
  (Recip String T)
  (Log2 String T)
  (Exp2 String T)
  (Sqrt String T)
  (Sin String T)
  (Add String T T)
  (Mul String T T)
  (Mod String T T)
  (Lt String T T)
  (Cast String String T)
  (SumR String T i64)
  (MaxR String T i64)
  (Gather String T T i64)
  (View String T String i64)
  (CMul String T T)
  (CAdd String T T))
(datatype Outs
  (Nil)
  (Cons T Outs))

(relation Materialized (T))
(relation IsOne (T))
(relation IsZero (T))
(relation NonNeg (T))
(function mag-hi (T) i64 :merge (min old new))
(function mag-lo (T) i64 :merge (max old new))

(relation FloatType (String))
(relation ExactArith (String))
(relation Unsigned (String))
(relation HasZero (String))
(relation CountsBools (String))
(relation Widens (String String))
(function exp-max (String) i64 :merge (min old new))
(function exp-min (String) i64 :merge (max old new))
(function exp2-safe (String) i64 :merge (min old new))
"""
# the constructors of tensor terms (their tables' sizes are the e-graph's e-node count)
TERM_CONSTRUCTORS = frozenset(
    {"Leaf", "Recip", "Log2", "Exp2", "Sqrt", "Sin", "Add", "Mul", "Mod", "Lt", "Cast"}
    | {"SumR", "MaxR", "Gather", "View", "CMul", "CAdd"}
)
# Extraction cost per e-node, DAG-aware (a node shared by many readers is paid once): compute
# 10, a view 1 (an index map), a leaf 1, a compile-time op on constants 1 (folded away).
TERM_COSTS = {"Leaf": 1, "View": 1, "CMul": 1, "CAdd": 1, "Cons": 0, "Nil": 0}
COMPUTE_COST = 10
# The terms (String and i64 arguments carry what a rule may need to guard on):
#   (Leaf id)                    an INPUT, CONSTANT or IOTA node, or a value from an earlier chunk
#   (Op dtype src...)            a primitive op; dtype is its result's dtype
#   (Cast to from src)           a cast from dtype `from` to dtype `to`
#   (SumR dtype src axes)        (and MaxR) the reduced axes as a bit mask
#   (Gather dtype data idx axis)
#   (View dtype src kind key)    kind is the transform's name; key indexes (transform, source
#                                shape) in a Python-side table
#   (CMul dtype a b)             (and CAdd) a product or sum of two constants, folded after
#                                extraction
# The analyses:
#   Materialized x               x is a constant stored at its own size: an elementwise op of two
#                                folds with no growth
#   IsOne x, IsZero x            every element is 1 (True), 0 (False)
#   NonNeg x                     every element is >= 0 or NaN
#   mag-hi x = h, mag-lo x = l   every element has |x| <= 2**h; every element has |x| >= 2**l
# The dtype tables: FloatType, ExactArith (integers and bool: wrapping arithmetic is exact),
# Unsigned, HasZero, CountsBools (a bool survives a round trip and 1+1 != 0), Widens a b (every
# value of a is one of b), exp-max / exp-min (largest / smallest normal binary exponent),
# exp2-safe (the largest log2|x| for which exp2(x) is finite and normal).


@dataclass(frozen=True)
class Rule:
    name: str
    # egglog source of a rule or rewrite, without its :ruleset and :name
    text: str


@dataclass(frozen=True)
class RuleSet:
    name: str
    # what the set does, for the report and for a reader
    doc: str
    rules: tuple[Rule, ...]


def egglog_rewrite(name: str, lhs: str, rhs: str, *when: str) -> Rule:
    """A named egglog rewrite, applied only where every `when` condition holds."""
    guard = f" :when ({' '.join(when)})" if when else ""
    return Rule(name, f"(rewrite {lhs} {rhs}{guard})")


def egglog_rule(name: str, query: str, actions: str) -> Rule:
    """A named egglog rule: where `query` matches, do `actions`."""
    return Rule(name, f"(rule ({query}) ({actions}))")


_NOT_PAD = '(!= kind "pad")'

FACTS = RuleSet(
    "facts",
    "value facts propagated through views, casts and constant arithmetic",
    (
        egglog_rule("folded_product_is_materialized", "(= e (CMul d a b))", "(Materialized e)"),
        egglog_rule("folded_sum_is_materialized", "(= e (CAdd d a b))", "(Materialized e)"),
        egglog_rule("one_through_view", f"(IsOne x) (= e (View d x kind key)) {_NOT_PAD}", "(IsOne e)"),
        egglog_rule("zero_through_view", f"(IsZero x) (= e (View d x kind key)) {_NOT_PAD}", "(IsZero e)"),
        # 1 is representable in every dtype; 0 in every dtype but float8_e8m0fnu
        egglog_rule("one_through_cast", "(IsOne x) (= e (Cast to from x))", "(IsOne e)"),
        egglog_rule("zero_through_cast", "(IsZero x) (= e (Cast to from x)) (HasZero to)", "(IsZero e)"),
        egglog_rule("nonneg_exp2", "(= e (Exp2 d x))", "(NonNeg e)"),
        egglog_rule("nonneg_sqrt", "(= e (Sqrt d x))", "(NonNeg e)"),
        # arithmetic only on floats: integers wrap to negative values
        egglog_rule("nonneg_square", "(= e (Mul d x x)) (FloatType d)", "(NonNeg e)"),
        egglog_rule("nonneg_product", "(= e (Mul d a b)) (NonNeg a) (NonNeg b) (FloatType d)", "(NonNeg e)"),
        egglog_rule("nonneg_sum", "(= e (Add d a b)) (NonNeg a) (NonNeg b) (FloatType d)", "(NonNeg e)"),
        egglog_rule("nonneg_view", f"(NonNeg x) (= e (View d x kind key)) {_NOT_PAD}", "(NonNeg e)"),
        egglog_rule("nonneg_sum_reduce", "(NonNeg x) (= e (SumR d x axes)) (FloatType d)", "(NonNeg e)"),
        egglog_rule("nonneg_max_reduce", "(NonNeg x) (= e (MaxR d x axes))", "(NonNeg e)"),
        egglog_rule("nonneg_gather", "(NonNeg x) (= e (Gather d x i axis))", "(NonNeg e)"),
        egglog_rule("nonneg_cast_to_float", "(NonNeg x) (= e (Cast to from x)) (FloatType to)", "(NonNeg e)"),
        egglog_rule("nonneg_cast_unsigned", "(= e (Cast to from x)) (Unsigned from) (FloatType to)", "(NonNeg e)"),
        egglog_rule("mag_view", f"(= e (View d x kind key)) {_NOT_PAD} (= h (mag-hi x))", "(set (mag-hi e) h)"),
        egglog_rule("mag_lo_view", f"(= e (View d x kind key)) {_NOT_PAD} (= l (mag-lo x))", "(set (mag-lo e) l)"),
        egglog_rule("mag_sin", "(= e (Sin d x))", "(set (mag-hi e) 0)"),
        egglog_rule("mag_cast_bool", '(= e (Cast to "bool" x))', "(set (mag-hi e) 0)"),
        egglog_rule(
            "mag_product",
            "(= e (Mul d a b)) (= ha (mag-hi a)) (= hb (mag-hi b))",
            "(set (mag-hi e) (+ ha hb))",
        ),
        egglog_rule(
            "mag_sum",
            "(= e (Add d a b)) (= ha (mag-hi a)) (= hb (mag-hi b))",
            "(set (mag-hi e) (+ (max ha hb) 1))",
        ),
        egglog_rule(
            "mag_folded_product",
            "(= e (CMul d a b)) (= ha (mag-hi a)) (= hb (mag-hi b)) (= la (mag-lo a)) (= lb (mag-lo b))",
            "(set (mag-hi e) (+ ha hb)) (set (mag-lo e) (+ la lb))",
        ),
        egglog_rule(
            "mag_folded_sum",
            "(= e (CAdd d a b)) (= ha (mag-hi a)) (= hb (mag-hi b))",
            "(set (mag-hi e) (+ (max ha hb) 1))",
        ),
    ),
)

IDENTITIES = RuleSet(
    "identities",
    "algebraic identities that remove an op",
    (
        egglog_rewrite("mul_by_one_left", "(Mul d o x)", "x", "(IsOne o)"),
        egglog_rewrite("mul_by_one_right", "(Mul d x o)", "x", "(IsOne o)"),
        egglog_rewrite("add_zero_left", "(Add d z x)", "x", "(IsZero z)"),
        egglog_rewrite("add_zero_right", "(Add d x z)", "x", "(IsZero z)"),
        egglog_rewrite("mul_by_zero_exact_left", "(Mul d z x)", "z", "(IsZero z)", "(ExactArith d)"),
        egglog_rewrite("mul_by_zero_exact_right", "(Mul d x z)", "z", "(IsZero z)", "(ExactArith d)"),
        egglog_rewrite("recip_of_recip", "(Recip d (Recip d x))", "x", "(FloatType d)"),
        egglog_rule(
            "log2_of_bounded_exp2",
            "(= e (Log2 d (Exp2 d x))) (= h (mag-hi x)) (= limit (exp2-safe d)) (<= h limit)",
            "(union e x)",
        ),
        egglog_rewrite("exp2_of_nonneg_log2", "(Exp2 d (Log2 d x))", "x", "(NonNeg x)", "(FloatType d)"),
    ),
)

CASTS = RuleSet(
    "casts",
    "casts that change no value",
    (
        egglog_rewrite("cast_to_own_dtype", "(Cast d d x)", "x"),
        egglog_rewrite("cast_through_wider", "(Cast b a (Cast a s x))", "(Cast b s x)", "(Widens s a)"),
    ),
)

MASKS = RuleSet(
    "masks",
    "boolean logic computed through a numeric type, done on the bools",
    (
        egglog_rewrite(
            "bool_and_through_numbers",
            '(Cast "bool" w (Mul w (Cast w "bool" a) (Cast w "bool" b)))',
            '(Mul "bool" a b)',
            "(CountsBools w)",
        ),
        egglog_rewrite(
            "bool_or_through_numbers",
            '(Cast "bool" w (Add w (Cast w "bool" a) (Cast w "bool" b)))',
            '(Add "bool" a b)',
            "(CountsBools w)",
        ),
    ),
)


def _chain_rules() -> tuple[Rule, ...]:
    """c1 op (c2 op x) -> (c1 op c2) op x, for constants stored at their own size, bare or under
    the same view (same key: same transform of same-shaped sources), floats guarded by magnitude."""
    rules = []
    for op, folded in (("Mul", "CMul"), ("Add", "CAdd")):
        if op == "Mul":
            bound = (
                "(= ha (mag-hi a)) (= hb (mag-hi b)) (= la (mag-lo a)) (= lb (mag-lo b)) "
                "(<= (+ ha hb) (exp-max d)) (>= (+ la lb) (exp-min d))"
            )
        else:
            bound = "(= ha (mag-hi a)) (= hb (mag-hi b)) (< (max ha hb) (exp-max d))"
        for guard_name, guard in (("exact", "(ExactArith d)"), ("float", f"(FloatType d) {bound}")):
            # inner != x: an identity (x+0 = x) puts the inner op in x's own e-class, and
            # folding through it again and again would grow the e-graph without end
            consts = f"(Materialized a) (Materialized b) (!= inner x) {guard}"
            rules.append(
                egglog_rule(
                    f"fold_{op.lower()}_chain_{guard_name}",
                    f"(= outer ({op} d a inner)) (= inner ({op} d b x)) {consts}",
                    f"(union outer ({op} d ({folded} d a b) x))",
                )
            )
            rules.append(
                egglog_rule(
                    f"fold_{op.lower()}_chain_under_view_{guard_name}",
                    f"(= outer ({op} d (View d a kind key) inner)) (= inner ({op} d (View d b kind key) x)) "
                    f"{_NOT_PAD} {consts}",
                    f"(union outer ({op} d (View d ({folded} d a b) kind key) x))",
                )
            )
    return tuple(rules)


CONSTANT_CHAINS = RuleSet(
    "constant_chains", "chains of constant multiplies and adds folded into one constant", _chain_rules()
)

RULESETS: dict[str, RuleSet] = {rs.name: rs for rs in (FACTS, IDENTITIES, CASTS, MASKS, CONSTANT_CHAINS)}
# the analysis set saturated (boundedly) before every rewrite iteration
ANALYSIS = FACTS.name


@dataclass(frozen=True)
class Stage:
    name: str
    # rule sets run once per iteration, in this order, until none changes the e-graph
    rulesets: tuple[str, ...]


STAGES: tuple[Stage, ...] = (
    Stage("simplify", ("identities", "casts", "masks")),
    Stage("constant_chains", ("constant_chains",)),
    Stage("cleanup", ("identities", "casts", "masks")),
)


def ruleset_program() -> str:
    """The declarations and every rule set, as egglog source."""
    lines = [DECLARATIONS]
    for rs in RULESETS.values():
        lines.append(f"(ruleset {rs.name})")
        for rule in rs.rules:
            lines.append(f'{rule.text[:-1]} :ruleset {rs.name} :name "{rule.name}")')
    return "\n".join(lines)


# ---- dtype tables seeded into the e-graph ---------------------------------------------------

_COMPUTED_FLOATS = ("float16", "bfloat16", "float32", "float64")
# the largest log2|x| with exp2(x) finite and normal, as a power of two (|x| <= 2**limit)
_EXP2_SAFE = {"float16": 3, "bfloat16": 6, "float32": 6, "float64": 9}
# bools through these types keep 0 and 1 apart and 1+1 nonzero
_COUNTS_BOOLS = tuple(
    sorted(d for d in DTYPES if d in _COMPUTED_FLOATS or (d.startswith(("int", "uint")) and d[-1] in "2468"))
)


def _exact_set(dtype: str) -> tuple[float, float, int] | None:
    """(lowest, highest, integer bits) of the integers a dtype holds exactly, for WIDENS."""
    if dtype == "bool":
        return (0, 1, 1)
    if is_signed_int(dtype) or is_unsigned_int(dtype):
        info = np.iinfo(numpy_dtype(dtype)) if dtype not in ("int4", "int2", "uint4", "uint2") else None
        if info is None:
            return None
        return (int(info.min), int(info.max), info.bits)
    return None


def _widens(a: str, b: str) -> bool:
    """Every value of dtype a is a value of dtype b."""
    if a == b:
        return False
    if is_float(a):
        if not (a in _COMPUTED_FLOATS and b in _COMPUTED_FLOATS):
            return False
        fa, fb = ml_dtypes.finfo(numpy_dtype(a)), ml_dtypes.finfo(numpy_dtype(b))
        return fb.nmant >= fa.nmant and fb.maxexp >= fa.maxexp and fb.minexp <= fa.minexp
    span = _exact_set(a)
    if span is None:
        return False
    low, high, _ = span
    if b in _COMPUTED_FLOATS:
        digits = ml_dtypes.finfo(numpy_dtype(b)).nmant + 1
        return max(abs(low), high) <= 2**digits
    target = _exact_set(b)
    return target is not None and b != "bool" and target[0] <= low and high <= target[1]


WIDENS: tuple[tuple[str, str], ...] = tuple(
    (a, b) for a in sorted(DTYPES) for b in sorted(DTYPES) if _widens(a, b)
)


def dtype_facts() -> str:
    """The dtype tables as egglog facts."""
    facts = []
    for d in sorted(DTYPES):
        if d in _COMPUTED_FLOATS:
            info = ml_dtypes.finfo(numpy_dtype(d))
            facts.append(f'(FloatType "{d}")')
            # |x| <= 2**(maxexp-1) keeps a product finite; 2**minexp is the smallest normal
            facts.append(f'(set (exp-max "{d}") {info.maxexp - 1})')
            facts.append(f'(set (exp-min "{d}") {info.minexp})')
            facts.append(f'(set (exp2-safe "{d}") {_EXP2_SAFE[d]})')
        elif not is_float(d):
            facts.append(f'(ExactArith "{d}")')
        if d == "bool" or is_unsigned_int(d):
            facts.append(f'(Unsigned "{d}")')
        if d != "float8_e8m0fnu":
            facts.append(f'(HasZero "{d}")')
    facts += [f'(CountsBools "{d}")' for d in _COUNTS_BOOLS]
    facts += [f'(Widens "{a}" "{b}")' for a, b in WIDENS]
    return "\n".join(facts)


# ---- layout rules, applied in Python ------------------------------------------------------
# Each takes a node (its sources already canonical) and the nodes built so far, and returns
# None or (source id, transform): the node's value is that view of that source, or the source
# itself when the transform is None.

Replacement = tuple[int, tuple | None]
LayoutRule = Callable[[Node, list[Node]], Replacement | None]


def _full_slice(spec: tuple, shape: Shape) -> bool:
    return all(
        start == 0 and step == 1 and (stop is None or stop == d)
        for (start, stop, step), d in zip(spec, shape)
    )


def drop_identity_view(node: Node, nodes: list[Node]) -> Replacement | None:
    """A view that maps every element to itself: same-shape reshape or expand, the identity
    permutation, a full slice, a zero-width pad."""
    if node.op is not Op.VIEW:
        return None
    src = nodes[node.srcs[0]]
    kind = node.arg[0]
    if kind in ("reshape", "expand") and node.arg[1] == src.shape:
        return node.srcs[0], None
    if kind == "permute" and tuple(node.arg[1]) == tuple(range(len(src.shape))):
        return node.srcs[0], None
    if kind == "slice" and _full_slice(node.arg[1], src.shape):
        return node.srcs[0], None
    if kind == "pad" and all(before == 0 and after == 0 for before, after in node.arg[1]):
        return node.srcs[0], None
    return None


def _view_of_view(node: Node, nodes: list[Node], kind: str) -> Node | None:
    if node.op is not Op.VIEW or node.arg[0] != kind:
        return None
    src = nodes[node.srcs[0]]
    return src if src.op is Op.VIEW and src.arg[0] == kind else None


def compose_permutes(node: Node, nodes: list[Node]) -> Replacement | None:
    inner = _view_of_view(node, nodes, "permute")
    if inner is None:
        return None
    first, second = inner.arg[1], node.arg[1]
    return inner.srcs[0], ("permute", tuple(first[p] for p in second))


def compose_reshapes(node: Node, nodes: list[Node]) -> Replacement | None:
    inner = _view_of_view(node, nodes, "reshape")
    return None if inner is None else (inner.srcs[0], node.arg)


def compose_expands(node: Node, nodes: list[Node]) -> Replacement | None:
    inner = _view_of_view(node, nodes, "expand")
    return None if inner is None else (inner.srcs[0], node.arg)


def reduce_over_unit_axes(node: Node, nodes: list[Node]) -> Replacement | None:
    """A sum or max over axes of size 1 moves no value: it is a reshape."""
    if node.op not in (Op.SUM_REDUCE, Op.MAX_REDUCE):
        return None
    src = nodes[node.srcs[0]]
    if src.dtype != node.dtype or not all(src.shape[a] == 1 for a in node.arg):
        return None
    return node.srcs[0], ("reshape", node.shape)


LAYOUT_RULES: tuple[tuple[str, LayoutRule], ...] = (
    ("drop_identity_view", drop_identity_view),
    ("compose_permutes", compose_permutes),
    ("compose_reshapes", compose_reshapes),
    ("compose_expands", compose_expands),
    ("reduce_over_unit_axes", reduce_over_unit_axes),
)

# A weights-only node is folded into a new weight when its result is at most this many bytes
# larger than the constant inputs it frees (an expand of a scalar to a big tensor stays a view).
FOLD_SLACK_BYTES = 256


def static_bytes(shape: Shape, dtype: str) -> int | None:
    if not is_static(shape):
        return None
    count = 1
    for d in shape:
        count *= int(d)
    return count * numpy_dtype(dtype).itemsize


__all__ = [
    "ANALYSIS",
    "COMPUTE_COST",
    "FOLD_SLACK_BYTES",
    "LAYOUT_RULES",
    "RULESETS",
    "STAGES",
    "TERM_CONSTRUCTORS",
    "TERM_COSTS",
    "WIDENS",
    "Rule",
    "RuleSet",
    "Stage",
    "dtype_facts",
    "egglog_rewrite",
    "egglog_rule",
    "ruleset_program",
]
