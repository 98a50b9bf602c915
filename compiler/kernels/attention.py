"""Attention recognized in a lowered program and made one kernel (`AttentionCall`).

Lowering spells softmax(score(Q K^T)) V as six kernels: the scores' product, a max over each row
of the scores (with the scale and mask applied), their exponentials exp2(c * (score - max)), the
rows' sums, the product of the exponentials with V, and a division of that by the sums. The scores
and their exponentials are batch x heads x sequence^2 values each written and read several times;
one kernel computing them a block of keys at a time with a running max and sum (online softmax)
keeps them in registers. Where the mask or scale is applied by its own elementwise loop (a causal
mask's select), that loop is folded into the score too. A renderer decides whether to use it: a
CUDA schedule does, and measurement picks (compiler.pipeline).

Every kernel replaced must have no reader outside the pattern, and nothing between the scores'
product and the fused kernel may write what the fused kernel reads: then computing it all at the
place of the product with V is the same program.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from compiler.kernels.ir import (
    Apply,
    AttentionCall,
    Const,
    GemmCall,
    Ix,
    Load,
    LoopKernel,
    Program,
)
from compiler.kernels.lower import (
    kernel_reads,
    kernel_stores,
    linear,
    map_loads,
    plan_slots,
    renamed,
    strides_of,
    substituted,
    walk,
)
from compiler.shape import Dim


def fuse_attention(program: Program, head_limit: int) -> Program:
    """The program with each attention it spells as one AttentionCall (see the module's docstring)
    whose heads (the scores' k, the values' n) are known and at most `head_limit` (what the
    renderer's kernel holds); the program itself when there is none."""
    kernels: list = list(program.kernels)
    found = False
    readers = _readers(kernels)
    for step, call in enumerate(program.kernels):
        match = _match(program, kernels, readers, step) if isinstance(call, GemmCall) else None
        if match is None:
            continue
        fused, replaced, at = match
        if all(isinstance(h, int) and h <= head_limit for h in (fused.scores.k, fused.values.n)):
            kernels[at] = fused
            for other in replaced:
                kernels[other] = None
            readers = _readers(kernels)
            found = True
    if not found:
        return program
    result = replace(program, kernels=[k for k in kernels if k is not None])
    result.slots = plan_slots(result)
    return result


def attention_count(program: Program) -> int:
    return sum(isinstance(k, AttentionCall) for k in program.kernels)


def _match(
    program: Program, kernels: list, readers: dict[int, list[int]], step: int
) -> tuple[AttentionCall, list[int], int] | None:
    """(the fused kernel, the steps it replaces, the step it takes) when the product at `step`
    computes the scores of an attention; None otherwise. `readers`: the steps reading each buffer."""
    scores = kernels[step]
    if not _plain_product(program, scores):
        return None
    batch, m, n = scores.batch, scores.m, scores.n
    rows = (*batch, m)
    nb = len(batch)
    row_vars = [Ix.var(f"o{j}") for j in range(nb + 1)]
    key = Ix.var("r0")
    # the scores' readers: the max and the exponentials, or one loop applying the mask that they read
    score_buffer, score_producer = scores.c, None
    first = _only(readers[scores.c])
    if first is not None and _elementwise(kernels[first]):
        score_buffer, score_producer = kernels[first].out, first
    users = readers[score_buffer]
    if len(users) != 2:
        return None
    top_step, exp_step = sorted(users, key=lambda s: not _is_reduce(kernels[s], "max"))
    top, exponentials = kernels[top_step], kernels[exp_step]
    if not _is_reduce(top, "max") or tuple(top.shape) != rows or tuple(top.reduce[1]) != (n,) or not _elementwise(exponentials):
        return None
    if tuple(exponentials.shape) != (*rows, n) or program.buffers[top.out].role != "temp":
        return None
    at_key = linear(row_vars + [key], (*rows, n))
    if not _reads_at(top.value, score_buffer, at_key):
        return None
    score = top.value
    if score_producer is not None:
        producer = kernels[score_producer]
        if producer.lets or program.buffers[score_buffer].role != "temp":
            return None
        score = _inline(score, score_buffer, producer, (*rows, n), at_key)
        if score is None or not _reads_at(score, scores.c, at_key):
            return None
    # the exponentials: exp2(c * (score - max)), the score read at the loop's own element
    log2_scale = _exponent_scale(exponentials.value, top.value, top.out, rows)
    if log2_scale is None or readers[top.out] != [exp_step]:
        return None
    e_users = readers[exponentials.out]
    if len(e_users) != 2 or program.buffers[exponentials.out].role != "temp":
        return None
    sum_step, values_step = sorted(e_users, key=lambda s: isinstance(kernels[s], GemmCall))
    sums, values = kernels[sum_step], kernels[values_step]
    if not _is_reduce(sums, "sum") or tuple(sums.shape) != rows or tuple(sums.reduce[1]) != (n,):
        return None
    if sums.value != Load(exponentials.out, at_key) or program.buffers[sums.out].role != "temp":
        return None
    if not _plain_product(program, values) or values.a != exponentials.out or values.trans_a or values.lda is not None:
        return None
    if values.batch != batch or values.m != m or values.k != n:
        return None
    if values.a_batch_strides != tuple(strides_of((*batch, m, n))[:nb]):
        return None
    # the division of P V by the sums, in place, the only reader of the unscaled product
    division_step = _only(readers[sums.out])
    if division_step is None or readers[values.c] and readers[values.c][0] != division_step:
        return None
    division = kernels[division_step]
    if not _divides(division, values, sums.out, rows):
        return None
    steps = [step, top_step, exp_step, sum_step, values_step, division_step]
    if score_producer is not None:
        steps.append(score_producer)
    if not step < top_step < exp_step < sum_step < values_step < division_step:
        return None
    if score_producer is not None and not step < score_producer < top_step:
        return None
    if program.buffers[scores.c].role != "temp":
        return None
    fused = AttentionCall(scores, values, score, log2_scale, values.node)
    # what the fused kernel reads holds at the division what it held where the pattern first read
    # it (a mask may be computed after the scores' product, V after the max), and nothing else
    # touches the output on the way
    first_read = {b: min(s for s in steps if b in kernel_reads(kernels[s])) for b in kernel_reads(fused)}
    for other in range(step, division_step + 1):
        if other in steps or kernels[other] is None:
            continue
        stores = kernel_stores(kernels[other])
        if any(other > first_read[b] for b in stores & first_read.keys()):
            return None
        if values.c in stores | kernel_reads(kernels[other]):
            return None
    # what the replaced kernels wrote on the way is written and read by them only
    for buffer in {scores.c, score_buffer, top.out, exponentials.out, sums.out}:
        writers = [s for s, k in enumerate(kernels) if k is not None and buffer in kernel_stores(k)]
        if any(s not in steps for s in readers[buffer] + writers):
            return None
    return fused, [s for s in steps if s != division_step], division_step


def _plain_product(program: Program, call) -> bool:
    """A float32 product of two stored operands with nothing fused into it."""
    return (
        isinstance(call, GemmCall)
        and call.epilogue is None
        and call.b_panels is None
        and not call.packed_b
        and call.dtype == "float32"
        and program.buffers[call.c].role in ("temp", "output")
    )


def _readers(kernels: list) -> dict[int, list[int]]:
    """The steps reading each buffer (none for a buffer no kernel reads)."""
    readers: dict[int, list[int]] = defaultdict(list)
    for step, kernel in enumerate(kernels):
        for b in kernel_reads(kernel) if kernel is not None else ():
            readers[b].append(step)
    return readers


def _only(steps: list[int]) -> int | None:
    return steps[0] if len(steps) == 1 else None


def _elementwise(kernel) -> bool:
    return isinstance(kernel, LoopKernel) and kernel.reduce is None and not kernel.lets


def _is_reduce(kernel, kind: str) -> bool:
    return isinstance(kernel, LoopKernel) and kernel.reduce is not None and kernel.reduce[0] == kind and not kernel.lets and len(kernel.reduce[1]) == 1


def _reads_at(value, buffer: int, at_key: Ix) -> bool:
    """Whether `value` reads `buffer`, and only at the row's key (the max loop's scores; a flat
    producer's index rewritten into the row's variables must come out so)."""
    loads = [e for e in walk(value) if isinstance(e, Load) and e.buffer == buffer]
    return bool(loads) and all(load.index == at_key for load in loads)


def _inline(score, buffer: int, producer: LoopKernel, shape: tuple[Dim, ...], at_key: Ix):
    """`score` with its loads of the producer's output replaced by the producer's value there: a
    flat loop's variable o0 is the element's offset; a loop over the scores' own shape has the
    max loop's variables, the key's named r0."""
    if len(producer.shape) == 1:
        value = substituted(producer.value, {"o0": at_key})
    elif tuple(producer.shape) == shape:
        value = renamed(producer.value, {f"o{len(shape) - 1}": "r0"})
    else:
        return None
    return map_loads(score, lambda load: value if load.buffer == buffer else load)


def _exponent_scale(value, top_value, top: int, rows: tuple[Dim, ...]) -> float | None:
    """c where value is exp2(c * (score + -1 * max)), c > 0, the score being the max loop's value
    at the loop's own key (its last variable) and max its result at the row; None otherwise."""
    nb = len(rows) - 1
    row = linear([Ix.var(f"o{j}") for j in range(nb + 1)], rows)
    if not (isinstance(value, Apply) and value.op == "exp2" and value.dtype == "float32"):
        return None
    product = value.args[0]
    if not (isinstance(product, Apply) and product.op == "mul"):
        return None
    constants = [a for a in product.args if isinstance(a, Const)]
    others = [a for a in product.args if not isinstance(a, Const)]
    if len(constants) != 1 or len(others) != 1 or not float(constants[0].value) > 0:
        return None
    difference = others[0]
    if not (isinstance(difference, Apply) and difference.op == "add"):
        return None
    at_element = renamed(top_value, {"r0": f"o{nb + 1}"})
    for x, negated in (difference.args, difference.args[::-1]):
        if x != at_element or not (isinstance(negated, Apply) and negated.op == "mul"):
            continue
        minus = [a for a in negated.args if isinstance(a, Const)]
        maxima = [a for a in negated.args if isinstance(a, Load)]
        if len(minus) == 1 and len(maxima) == 1 and float(minus[0].value) == -1.0 and maxima[0] == Load(top, row):
            return float(constants[0].value)
    return None


def _divides(division, values: GemmCall, sums: int, rows: tuple[Dim, ...]) -> bool:
    """division is values.c[t, i, c] = values.c[t, i, c] * recip(sums[t, i]), in place."""
    if not _elementwise(division) or division.out != values.c or tuple(division.shape) != (*rows, values.n):
        return False
    nb = len(rows) - 1
    own = linear([Ix.var(f"o{j}") for j in range(nb + 2)], (*rows, values.n))
    row = linear([Ix.var(f"o{j}") for j in range(nb + 1)], rows)
    value = division.value
    if not (isinstance(value, Apply) and value.op == "mul"):
        return False
    for x, scale in (value.args, value.args[::-1]):
        if x == Load(values.c, own) and scale == Apply("recip", (Load(sums, row),), "float32"):
            return True
    return False
