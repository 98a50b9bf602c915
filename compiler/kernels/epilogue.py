"""Fused epilogues: an elementwise loop over a product's output (bias, activation, residual add,
a convolution's folded batch norm) applied by the product itself to each block of C it has just
written, while the block is still in cache, instead of as a separate pass over the whole of C.

The loop's element space must be C's, read back at its own element, and every other load must be
a linear function of C's flat batch index `t`, row `i` and column `j` (a bias reads a row's or a
column's value, a residual the same element of another buffer), or of the axes `t` and `i` are
flattened from (a channel's bias where t runs over images and channels). The loop's output then takes C's
place: the product writes its sums there and the epilogue rewrites them in place; C's buffer is
left unused. Device-neutral: renderers decide where in their tiling the epilogue runs.

Which loop fuses into which product is found by egglog rules (compiler.search.kernel_rules);
this module re-indexes a candidate's loop over (t, i, j) and builds the `Epilogue`.
"""

from __future__ import annotations

from dataclasses import replace

from compiler.kernels.ir import (
    Apply,
    Atom,
    Const,
    Epilogue,
    Expr,
    GemmCall,
    Guarded,
    Ix,
    Let,
    Load,
    LoopKernel,
    Program,
)
from compiler.kernels.ir_walk import (
    drop_unit_axes,
    identity_index,
    map_loads,
    plan_slots,
    strides_of,
)
from compiler.search import kernel_rules
from compiler.shape import Dim, dim_mul, numel

# the epilogue's index variables: flat batch index, row of C, column of C
T, I, J = "t", "i", "j"


def fuse_epilogues(program: Program) -> Program:
    """The program with each product's elementwise consumer fused into it where that is exact
    (see the module's docstring); the program itself when none is."""
    found = find_epilogues(program)
    if not found:
        return program
    kernels: list = list(program.kernels)
    for (step, consumer), epilogue in found.items():
        call, c = program.kernels[step], program.kernels[consumer].out
        loops = replace(call.loops, out=c) if call.loops is not None else None  # (C's elements in the same order)
        kernels[step] = replace(call, c=c, epilogue=epilogue, loops=loops)
        kernels[consumer] = None
    result = Program(program.buffers, [k for k in kernels if k is not None], program.symbols, {}, program.weights)
    result.slots = plan_slots(result)
    return result


def find_epilogues(program: Program) -> dict[tuple[int, int], Epilogue]:
    """(product step, loop step) -> the loop as the product's epilogue, for each pair the rules
    (compiler.search.kernel_rules) find: a product whose only reader is an elementwise loop of its
    dtype, both written once, the loop's other operands ready when the product runs. Re-indexing
    the loop over (t, i, j) is the fact computed here, for the rules' candidates only."""
    if not any(isinstance(k, GemmCall) and k.epilogue is None for k in program.kernels):
        return {}  # no product to fuse into: no e-graph
    graph = kernel_rules.kernel_graph(program, bodies=False)
    graph.run(kernel_rules.EPILOGUE_RULES)
    built = {}
    for step, consumer in graph.rows("EpilogueCandidate"):
        epilogue = _epilogue(program, program.kernels[step], program.kernels[consumer])
        if epilogue is not None:
            built[step, consumer] = epilogue
    graph.add_facts(f"(Regroupable {step} {consumer})" for step, consumer in built)
    graph.run(kernel_rules.EPILOGUE_FOUND_RULES)
    found, taken = {}, set()
    for step, consumer in graph.rows("EpilogueFound"):
        if consumer not in taken:
            taken.add(consumer)
            found[step, consumer] = built[step, consumer]
    return found


def _epilogue(program: Program, call: GemmCall, loop: LoopKernel) -> Epilogue | None:
    """The loop's value (and lets) over (t, i, j), C's own element read from the loop's output;
    None when the loop is not an exact elementwise epilogue of the product."""
    if loop.reduce is not None or program.buffers[loop.out].dtype != call.dtype:
        return None
    if loop.out in (call.a, call.b) or program.buffers[loop.out].role not in ("temp", "output"):
        return None
    shape = loop.shape
    identity = identity_index(shape)
    mn = dim_mul(call.m, call.n)
    for p, q in _cuts(shape, (numel(call.batch), call.m, call.n)):
        groups = ((0, p, T), (p, q, I), (q, len(shape), J))
        values = [_rewrite(v, shape, groups, call.c, identity) for v in loop.values]
        if all(v is not None for v in values):
            c_index = _canonical(Ix(((T, mn), (I, call.n), (J, 1))))
            *lets, value = (_swap_accumulator(v, call.c, loop.out, c_index) for v in values)
            return Epilogue(
                value, loop.node, tuple(Let(old.buffer, new, old.store) for old, new in zip(loop.lets, lets, strict=True))
            )
    return None


def _cuts(shape: tuple[Dim, ...], sizes: tuple[Dim, Dim, Dim]) -> list[tuple[int, int]]:
    """Every (p, q) with prod(shape[:p]), prod(shape[p:q]), prod(shape[q:]) equal to `sizes`."""
    rank = len(shape)
    return [
        (p, q)
        for p in range(rank + 1)
        for q in range(p, rank + 1)
        if numel(shape[:p]) == sizes[0] and numel(shape[p:q]) == sizes[1] and numel(shape[q:]) == sizes[2]
    ]


def _rewrite(e: Expr, shape, groups, c: int, identity: Ix) -> Expr | None:
    """e with every load's index over the loop's o-variables rewritten over (t, i, j)."""
    if isinstance(e, Const):
        return e
    if isinstance(e, Load):
        if e.buffer == c and drop_unit_axes(e.index, shape) != identity:
            return None  # C read anywhere but at its own element
        index = _regroup(e.index, shape, groups, c, identity)
        return None if index is None else Load(e.buffer, index)
    if isinstance(e, Apply):
        args = [_rewrite(a, shape, groups, c, identity) for a in e.args]
        return None if any(a is None for a in args) else Apply(e.op, tuple(args), e.dtype)
    if isinstance(e, Guarded):  # a select's choice (a flag), or padding linear in (t, i, j)
        guards = [(_regroup(g, shape, groups, c, identity), n) for g, n in e.guards]
        value = _rewrite(e.value, shape, groups, c, identity)
        if value is None or any(g is None for g, _ in guards):
            return None
        return Guarded(tuple(guards), value, e.fill, e.dtype)
    return None  # iotas: not an epilogue's


def _regroup(ix: Ix, shape, groups, c: int, identity: Ix) -> Ix | None:
    """ix = sum over groups of f_g * (the group's flat index), when each group's coefficients
    are one factor times the group's row-major strides; None otherwise. A flag (a select's
    choice) is kept with its value rewritten; any other index atom is refused."""
    coefs: dict[str, Dim] = {}
    terms: list[tuple[str | Atom, Dim]] = []
    for var, coef in ix.terms:
        if isinstance(var, Atom):
            flag = _rewrite(var.args[0], shape, groups, c, identity) if var.op == "flag" else None
            if flag is None:
                return None
            terms.append((Atom("flag", (flag,)), coef))
        elif var.startswith("o"):
            coefs[var] = coef
        else:
            return None
    for lo, hi, name in groups:
        strides = strides_of(shape[lo:hi])
        live = [d for d in range(lo, hi) if shape[d] != 1]
        if not live:
            continue
        factor = coefs.get(f"o{live[-1]}", 0)  # the innermost live axis's stride is 1
        if all(coefs.get(f"o{d}", 0) == (dim_mul(factor, strides[d - lo]) if factor != 0 else 0) for d in live):
            if factor != 0:
                terms.append((name, factor))
            continue
        if name == J:
            return None  # (the row's vector loop: its digits would cost a division per element)
        # part of the batch or row index (a channel's bias where t runs over image and channel):
        # each axis read as a digit of the group's flat index, computed once per row
        for d in live:
            if coefs.get(f"o{d}", 0) != 0:
                terms.append((_digit(name, strides[d - lo], shape[d], outermost=d == live[0]), coefs[f"o{d}"]))
    return _canonical(Ix(tuple(terms), ix.const))


def _digit(name: str, stride: Dim, extent: Dim, outermost: bool) -> str | Atom:
    """The axis of a row-major group whose flat index is `name`: (name / stride) % extent (the
    outermost axis needs no remainder)."""
    quotient: str | Atom = name if stride == 1 else Atom("floordiv", (Ix.var(name), stride))
    return quotient if outermost else Atom("mod", (Ix.var(quotient), extent))


def _canonical(ix: Ix) -> Ix:
    return Ix() + ix


def _swap_accumulator(e: Expr, c: int, out: int, index: Ix) -> Expr:
    """C's element becomes the output's own element, which holds the product's sum when the
    epilogue runs."""
    return map_loads(e, lambda load: Load(out, index) if load.buffer == c else load)


__all__ = ["find_epilogues", "fuse_epilogues"]
