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

The recognition is done by egglog rules (compiler.search.kernel_rules): the program's kernels go
into an e-graph as terms, the rules compose a softmax and then attention from the row max, the
exponentials, the row sums and the two products, and this module only computes the facts that
need the candidate's span (what lies between its first and last kernel) and builds the
`AttentionCall` of each attention the rules found.
"""

from __future__ import annotations

from dataclasses import replace

from compiler.kernels.ir import AttentionCall, GemmCall, Ix, LoopKernel, Program
from compiler.kernels.ir_walk import (
    kernel_reads,
    kernel_stores,
    linear,
    map_loads,
    plan_slots,
    renamed,
    strides_of,
    substituted,
)
from compiler.search import kernel_rules
from compiler.shape import Dim, dim_mul

# a row of AttentionCandidate / AttentionFound: the steps of the scores' product, the masking
# loop (-1: none), the max, the exponentials, the sums, the product with V and the division,
# then the exponent's scale
Match = tuple[int, int, int, int, int, int, int, float]


def fuse_attention(program: Program, head_limit: int) -> Program:
    """The program with each attention it spells as one AttentionCall (see the module's docstring)
    whose heads (the scores' k, the values' n) are known and at most `head_limit` (what the
    renderer's kernel holds); the program itself when there is none."""
    found = find_attention(program, head_limit)
    if not found:
        return program
    kernels: list = list(program.kernels)
    for match, fused in found:
        steps = _steps(match)
        kernels[steps[-1]] = fused
        for step in steps[:-1]:
            kernels[step] = None
    result = replace(program, kernels=[k for k in kernels if k is not None])
    result.slots = plan_slots(result)
    return result


def find_attention(program: Program, head_limit: int) -> list[tuple[Match, AttentionCall]]:
    """Each attention the rules find in the program, with the kernel that replaces it, spans
    disjoint, in program order."""
    if sum(isinstance(k, GemmCall) for k in program.kernels) < 2:
        return []  # no scores and values to find: no e-graph
    graph = kernel_rules.kernel_graph(program, head_limit)
    graph.run(kernel_rules.ATTENTION_RULES)
    built = {match: _build(program, match) for match in graph.rows("AttentionCandidate")}
    graph.add_facts(
        f"(Undisturbed {match[0]} {match[6]})"
        for match, fused in built.items() if fused is not None and _undisturbed(program, match, fused)
    )
    graph.run(kernel_rules.ATTENTION_FOUND_RULES)
    found, taken = [], set()
    for match in graph.rows("AttentionFound"):
        steps = set(_steps(match))
        if steps & taken:
            continue
        taken |= steps
        found.append((match, built[match]))
    return found


def attention_count(program: Program) -> int:
    return sum(isinstance(k, AttentionCall) for k in program.kernels)


def _steps(match: Match) -> list[int]:
    """The steps a match replaces, in program order: the last (the division, or the product with V
    where the normalization came first) is where the fused kernel goes."""
    return sorted(s for s in match[:7] if s >= 0)


def _build(program: Program, match: Match) -> AttentionCall | None:
    """The fused kernel of a match: the max loop's value (the masking loop's inlined) is the score.
    Where the max loop, the scores' product and the product with V split the heads differently
    (grouped KV heads: (kv heads, group), K or V read at stride 0 on the group), each is split the
    finest way, so that one batch index t names the same head in all three; None where they cannot
    be aligned."""
    scores_step, mask_step, top_step, _, _, values_step, _, log2_scale = match
    scores, values = program.kernels[scores_step], program.kernels[values_step]
    top = program.kernels[top_step]
    rows = tuple(top.shape)  # the score's variables: o0.. the batch axes, then the query row; r0 the key
    at_key = linear([Ix.var(f"o{j}") for j in range(len(rows))] + [Ix.var("r0")], (*rows, scores.n))
    score = top.value
    if mask_step >= 0:
        producer = program.kernels[mask_step]
        score = _inline(score, producer.out, producer, (*rows, scores.n), at_key)
    frame = rows[:-1]
    finest = max((frame, tuple(scores.batch), tuple(values.batch)), key=len)
    splits = [_splits(batch, finest) for batch in (frame, tuple(scores.batch), tuple(values.batch))]
    if score is None or None in splits or not rows[-1] == scores.m == values.m:
        return None
    if frame != finest:
        score = substituted(score, _split_variables(len(frame), finest, splits[0]))
    scores, values = (
        call if tuple(call.batch) == finest else _split_product(call, finest, groups)
        for call, groups in ((scores, splits[1]), (values, splits[2]))
    )
    # the normalization before the product in torch's safe form: a row with no finite score is zeros
    division = program.kernels[match[6]]
    empty_rows_zero = match[6] < values_step and kernel_rules.zero_where_nan(division.value) is not None
    return AttentionCall(scores, values, score, log2_scale, values.node, empty_rows_zero)


def _splits(batch: tuple, finer: tuple) -> list[list[int]] | None:
    """For each axis of `batch`, the run of `finer`'s axes it splits into (their extents' product
    its extent; a symbolic axis only into itself), or None where `finer` is no such split."""
    groups: list[list[int]] = []
    at = 0
    for extent in batch:
        if not isinstance(extent, int):
            if at >= len(finer) or finer[at] != extent:
                return None
            groups.append([at])
            at += 1
            continue
        group, product = [], 1
        while at < len(finer) and isinstance(finer[at], int) and (not group or product < extent):
            group.append(at)
            product *= finer[at]
            at += 1
        if not group or product != extent:
            return None
        groups.append(group)
    while groups and at < len(finer) and finer[at] == 1:  # trailing unit axes join the last run
        groups[-1].append(at)
        at += 1
    return groups if at == len(finer) else None


def _split_product(call: GemmCall, finer: tuple, groups: list[list[int]]) -> GemmCall:
    """The product over the batch axes `finer`, each of its axes split as `groups` say."""
    a_strides, b_strides = [], []
    for axis, group in enumerate(groups):
        steps = strides_of([finer[g] for g in group])
        a_strides += [dim_mul(call.a_batch_strides[axis], step) for step in steps]
        b_strides += [dim_mul(call.b_batch_strides[axis], step) for step in steps]
    return replace(call, batch=finer, a_batch_strides=tuple(a_strides), b_batch_strides=tuple(b_strides))


def _split_variables(rank: int, finer: tuple, groups: list[list[int]]) -> dict[str, Ix]:
    """The variables o0.. of `rank` batch axes and then a row, in those of the axes `finer`."""
    variables = {
        f"o{axis}": sum((Ix.var(f"o{g}").scale(step) for g, step in zip(group, strides_of([finer[g] for g in group]))), Ix())
        for axis, group in enumerate(groups)
    }
    variables[f"o{rank}"] = Ix.var(f"o{len(finer)}")  # the row
    return variables


def _undisturbed(program: Program, match: Match, fused: AttentionCall) -> bool:
    """Whether what the fused kernel reads holds at the division what it held where the pattern
    first read it (a mask may be computed after the scores' product, V after the max), and nothing
    else touches the output on the way: the fact the rules cannot compute, a candidate's span."""
    kernels = program.kernels
    steps = _steps(match)
    first_read = {b: min(s for s in steps if b in kernel_reads(kernels[s])) for b in kernel_reads(fused)}
    for other in range(steps[0], steps[-1] + 1):
        if other in steps:
            continue
        stores = kernel_stores(kernels[other])
        if any(other > first_read[b] for b in stores & first_read.keys()):
            return False
        if fused.out in stores | kernel_reads(kernels[other]):
            return False
    return True


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
