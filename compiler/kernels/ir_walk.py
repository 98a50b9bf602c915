"""Reading and rewriting kernel-IR terms (compiler/kernels/ir.py): the utilities every pass over
the kernel IR shares (lowering, fusion, the epilogue and attention passes, the renderers).

    walk(expr)                    every value, index and index atom under an expression
    map_loads, substituted, renamed  an expression with its loads or loop variables replaced
    expr_reads, kernel_reads, kernel_stores, kernel_writes, lets_reads  which buffers a term touches
    strides_of, linear, identity_index, drop_unit_axes  row-major offsets as index expressions
    plan_slots(program)           arena slots for temps whose lifetimes do not overlap
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from compiler.kernels.ir import (
    Apply,
    Atom,
    AttentionCall,
    Const,
    Epilogue,
    Expr,
    GemmCall,
    Guarded,
    IndexValue,
    Ix,
    Kernel,
    Load,
    LoopKernel,
    Program,
)
from compiler.shape import Dim, Shape, dim_mul, dim_sub

# ---- walking ---------------------------------------------------------------------------------


def walk(expr: Expr | Ix | Atom) -> Iterator[object]:
    """Every value expression, index expression and index atom under `expr` (itself included),
    gathered indices and padding guards too."""
    stack: list[object] = [expr]
    while stack:
        e = stack.pop()
        yield e
        if isinstance(e, Load):
            stack.append(e.index)
        elif isinstance(e, Guarded):
            stack.append(e.value)
            stack.extend(ix for ix, _ in e.guards)
        elif isinstance(e, Apply):
            stack.extend(e.args)
        elif isinstance(e, IndexValue):
            stack.append(e.index)
        elif isinstance(e, Ix):
            stack.extend(v for v, _ in e.terms if isinstance(v, Atom))
        elif isinstance(e, Atom):
            stack.extend(a for a in e.args if isinstance(a, (Ix, Load, Guarded, Apply, IndexValue, Const)))



# ---- rewriting -------------------------------------------------------------------------------


def map_loads(e, fn):
    """e with every load replaced by fn(load), innermost first: loads in gathered indices,
    padding guards and selects' flags included."""
    if isinstance(e, Load):
        return fn(Load(e.buffer, _map_index(e.index, fn)))
    if isinstance(e, Apply):
        return Apply(e.op, tuple(map_loads(a, fn) for a in e.args), e.dtype)
    if isinstance(e, Guarded):
        return Guarded(tuple((_map_index(g, fn), n) for g, n in e.guards), map_loads(e.value, fn), e.fill, e.dtype)
    if isinstance(e, IndexValue):
        return IndexValue(_map_index(e.index, fn), e.dtype)
    return e


def _map_index(ix: Ix, fn) -> Ix:
    if all(isinstance(v, str) for v, _ in ix.terms):
        return ix
    terms = []
    for var, coef in ix.terms:
        if isinstance(var, Atom):
            var = Atom(var.op, tuple(
                _map_index(a, fn) if isinstance(a, Ix) else map_loads(a, fn) if isinstance(a, Load | Apply | Guarded | IndexValue) else a
                for a in var.args
            ))
        terms.append((var, coef))
    return Ix(tuple(terms), ix.const)


def renamed(e, names: dict[str, str]):
    """An expression (or index, or index atom) with its loop variables renamed."""
    return substituted(e, {old: Ix.var(new) for old, new in names.items()})


def substituted(e, values: dict[str, Ix]):
    """An expression (or index, or index atom) with loop variables replaced by index expressions."""
    if isinstance(e, Ix):
        total = Ix.of(e.const)
        for var, coef in e.terms:
            if isinstance(var, str):
                total = total + (values[var].scale(coef) if var in values else Ix(((var, coef),), 0))
            else:
                total = total + Ix(((substituted(var, values), coef),), 0)
        return total
    if isinstance(e, Atom):
        return Atom(e.op, tuple(substituted(a, values) if isinstance(a, (Ix, Atom, Load, Guarded, Apply, IndexValue, Const)) else a for a in e.args))
    if isinstance(e, Load):
        return Load(e.buffer, substituted(e.index, values))
    if isinstance(e, Guarded):
        return Guarded(tuple((substituted(g, values), n) for g, n in e.guards), substituted(e.value, values), e.fill, e.dtype)
    if isinstance(e, Apply):
        return Apply(e.op, tuple(substituted(a, values) for a in e.args), e.dtype)
    if isinstance(e, IndexValue):
        return IndexValue(substituted(e.index, values), e.dtype)
    return e



# ---- what a term reads and writes ------------------------------------------------------------


def expr_variables(expr: Expr) -> set[str]:
    """The loop variables an expression's indices use (gathered and guarded ones included)."""
    return {v for e in walk(expr) if isinstance(e, Ix) for v, _ in e.terms if isinstance(v, str)}


def expr_reads(expr: Expr) -> set[int]:
    """The buffers an expression loads from, indices (gathered ones) included."""
    return {e.buffer for e in walk(expr) if isinstance(e, Load)}


def kernel_writes(kernel: Kernel) -> int:
    return kernel.c if isinstance(kernel, GemmCall) else kernel.out  # (an AttentionCall's too)


def kernel_stores(kernel: Kernel) -> set[int]:
    """Every buffer a kernel writes: its output and the lets it stores."""
    if isinstance(kernel, GemmCall):
        lets = kernel.epilogue.lets if kernel.epilogue is not None else ()
    elif isinstance(kernel, AttentionCall):
        lets = ()
    else:
        lets = kernel.lets
    return {kernel_writes(kernel)} | {let.buffer for let in lets if let.store}


def lets_reads(fused: LoopKernel | Epilogue) -> set[int]:
    """The buffers a loop with lets (or an epilogue) loads from (a let's buffer is a local there)."""
    return set().union(*(expr_reads(v) for v in fused.values)) - {let.buffer for let in fused.lets}


def kernel_reads(kernel: Kernel) -> set[int]:
    if isinstance(kernel, AttentionCall):
        return {kernel.scores.a, kernel.scores.b, kernel.values.b} | (expr_reads(kernel.score) - {kernel.scores.c})
    if isinstance(kernel, GemmCall):
        reads = {kernel.a} | (expr_reads(kernel.b_panels.kernel.value) if kernel.b_panels is not None else {kernel.b})
        if kernel.epilogue is not None:
            reads |= lets_reads(kernel.epilogue) - {kernel.c}
        if kernel.loops is not None:  # (either form may run: both keep what they read alive)
            reads |= lets_reads(kernel.loops)
        return reads
    return lets_reads(kernel)


def exclusive_feeders(program: Program, number: int) -> tuple[int, ...]:
    """The kernels that compute product `number`'s operands for it alone (a convolution's windows
    stored as a matrix, an operand copied into the call's layout): loops storing a temp that no
    other kernel reads. A product run as its loop form (GemmCall.loops) makes them dead."""
    call = program.kernels[number]
    if not isinstance(call, GemmCall):
        return ()
    operands = {call.a, call.b} - {call.c}
    if call.loops is not None:
        # an operand the loop form reads itself (a norm's output) is computed whichever form runs
        operands -= {b for value in call.loops.values for b in expr_reads(value)}
    readers: dict[int, int] = {}
    for step, kernel in enumerate(program.kernels):
        for buffer in kernel_reads(kernel):
            readers[buffer] = readers.get(buffer, 0) + 1
    feeders = []
    for step, kernel in enumerate(program.kernels[:number]):
        if (
            isinstance(kernel, LoopKernel) and kernel.out in operands and not any(let.store for let in kernel.lets)
            and program.buffers[kernel.out].role == "temp" and readers.get(kernel.out) == 1
            and sum(kernel_writes(k) == kernel.out for k in program.kernels) == 1
        ):
            feeders.append(step)
    return tuple(feeders)



# ---- row-major offsets -----------------------------------------------------------------------


def strides_of(shape: Shape) -> list[Dim]:
    strides: list[Dim] = [1] * len(shape)
    for j in range(len(shape) - 2, -1, -1):
        strides[j] = dim_mul(strides[j + 1], shape[j + 1])
    return strides


def linear(idx: Sequence[Ix], shape: Shape) -> Ix:
    """The offset of idx in a row-major buffer of this shape. Axes that are the digits of one flat
    index x (x // P % d ... x % d', as a reshape from a flat value spells them) are recombined
    into x, so a flat-to-shaped-to-flat round trip costs no division."""
    strides = strides_of(shape)
    axes = [j for j, d in enumerate(shape) if d != 1]
    total = Ix()
    end = len(axes)
    while end > 0:
        start, whole = _digit_run(idx, shape, axes[:end])
        if start is None:
            j = axes[end - 1]
            total = total + idx[j].scale(strides[j])
            end -= 1
            continue
        total = total + whole.scale(strides[axes[end - 1]])
        end = start
    return total


def identity_index(shape: Shape) -> Ix:
    """A loop over `shape` reading a row-major buffer of that shape at its own element (axes of
    extent one left out: their variable is always 0)."""
    return drop_unit_axes(linear([Ix.var(f"o{j}") for j in range(len(shape))], shape), shape)


def drop_unit_axes(ix: Ix, shape: Shape) -> Ix:
    """ix without the terms of the loop variables o<j> of axes of extent one."""
    units = {f"o{j}" for j, d in enumerate(shape) if d == 1}
    return Ix(tuple(t for t in ix.terms if t[0] not in units), ix.const)



def _digit_run(idx: Sequence[Ix], shape: Shape, axes: list[int]) -> tuple[int | None, Ix]:
    """The longest run of axes ending at axes[-1] that reads the digits of one index x, innermost
    first: (position in axes where it starts, the run's combined offset in units of the last
    axis), or (None, _) when there is no run of two or more."""
    last = _as_digit(idx[axes[-1]])
    if last is None or last[1] != 1 or last[2] is None or dim_sub(last[2], shape[axes[-1]]) != 0:
        return None, Ix()
    x = last[0]
    inner: Dim = shape[axes[-1]]  # the product of the run's sizes so far
    position = len(axes) - 1
    while position > 0:
        above = _as_digit(idx[axes[position - 1]])
        if above is None or above[0] != x or dim_sub(above[1], inner) != 0:
            break
        if above[2] is None:  # x // P with nothing cut off the top: the run is x itself
            return position - 1, x
        if dim_sub(above[2], shape[axes[position - 1]]) != 0:
            break
        position -= 1
        inner = dim_mul(inner, shape[axes[position]])
    if position == len(axes) - 1:
        return None, Ix()
    return position, Ix.var(Atom("mod", (x, inner)))


def _as_digit(ix: Ix) -> tuple[Ix, Dim, Dim | None] | None:
    """(x, P, d) when ix is x // P % d, (x, P, None) when it is x // P, (x, 1, d) for x % d."""
    if ix.const != 0 or len(ix.terms) != 1 or ix.terms[0][1] != 1 or not isinstance(ix.terms[0][0], Atom):
        return None
    atom = ix.terms[0][0]
    if atom.op == "floordiv":
        return atom.args[0], atom.args[1], None
    if atom.op != "mod":
        return None
    inner, size = atom.args
    below = _as_digit(inner)
    if below is not None and below[2] is None:
        return below[0], below[1], size
    return inner, 1, size



# ---- buffer planning -------------------------------------------------------------------------


def plan_slots(program: Program) -> dict[int, int]:
    """Arena slots for temps: a temp takes a free slot when first written and frees it after its
    last read, so temps whose lifetimes do not overlap share memory."""
    last_read: dict[int, int] = {}
    first_write: dict[int, int] = {}
    for step, kernel in enumerate(program.kernels):
        for buffer in kernel_reads(kernel):
            last_read[buffer] = step
        for written in kernel_stores(kernel):
            first_write.setdefault(written, step)
    slots: dict[int, int] = {}
    free: list[int] = []
    count = 0
    releases: dict[int, list[int]] = {}
    for buffer, step in last_read.items():
        releases.setdefault(step, []).append(buffer)
    for step, kernel in enumerate(program.kernels):
        for written in sorted(kernel_stores(kernel)):
            if program.buffers[written].role == "temp" and written not in slots:
                if free:
                    slots[written] = free.pop()
                else:
                    slots[written] = count
                    count += 1
        for buffer in releases.get(step, []):
            if buffer in slots and first_write.get(buffer, -1) <= step:
                free.append(slots[buffer])
        free.sort(reverse=True)
    return slots


__all__ = [
    "drop_unit_axes",
    "expr_reads",
    "identity_index",
    "kernel_reads",
    "kernel_stores",
    "kernel_writes",
    "lets_reads",
    "linear",
    "map_loads",
    "plan_slots",
    "renamed",
    "strides_of",
    "substituted",
    "walk",
]
