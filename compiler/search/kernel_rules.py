"""Rules that find fused kernels in a lowered program: attention with an online softmax, and a
product with its elementwise epilogue, reached from the primitive kernels that lowering writes.

A lowered program (compiler.kernels.ir) is written into an e-graph as a small kernel-level term
language, one term per kernel, each reading the terms of the kernels that last wrote what it
reads (so a buffer updated in place is two values):

    (Input b)                         buffer b as the program received it (no kernel wrote it yet)
    (Gemm step A B)                   the product at `step` of the values A and B
    (RowMap dtype rows n body)        an elementwise loop over rows x n, its last axis the key
    (RowReduce kind dtype rows n body)  a "max" or "sum" over the key (n) of each row's body
    (Kernel step)                     any other kernel: the rules see nothing inside it

and a loop's body is a value term over (Ld value access), (Cst dtype value), (Ap1 op dtype x),
(Ap2 op dtype x y) and (Opaque id) for what the rules need not look into; an access is
(Elem rows n), the loop's own element, (Row rows), its row, or (Other id), anything else. Shapes,
dims and other index expressions are interned into ids by the writer, so equal ids are equal
values: the max loop's body and the exponentials' shifted value are the same term exactly when
they are the same expression.

Beside the terms, the writer seeds facts about buffers and kernels that a rule cannot compute
(egglog has no negation, and counting readers is one): how many kernels read and write each
buffer, who reads it first, its role and dtype, which products are plain (float32, no epilogue,
unpacked), which read A packed, which loops read a buffer only at their own element, and how many
rows each frame's rows id counts (`flat-rows`: where heads are (kv heads, group) to the products
and heads to the softmax's loops, the two frames read the same rows at their own element or row).

The rules compose: a row max and a loop of exp2(c * (x - max)) over the same x are a shifted
exponential; its row sum and the product of it with V, divided by the sums, is a softmax times
V; that over a product's scores (directly or through one elementwise loop applying the mask) is
an attention candidate. A candidate whose span no other kernel disturbs (what it reads written
in between, its output touched in between: an interval fact the caller computes for the
candidates only) becomes `OnlineAttention`, unioned with the division's term, and the relation
`AttentionFound` names its kernels for the caller to build the `AttentionCall`. Likewise a
product whose only reader is an elementwise loop is an epilogue candidate, and one whose loop the
caller can re-index over (t, i, j) becomes `ProductWithEpilogue`. Every rule is guarded by rank
(rows and key ids), dtype and readers: an under-constrained rule gives wrong programs.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from egglog import bindings

from compiler.kernels.ir import (
    Apply,
    Atom,
    Const,
    Expr,
    GemmCall,
    Guarded,
    Ix,
    Load,
    LoopKernel,
    Program,
)
from compiler.kernels.ir_walk import kernel_reads, kernel_stores, linear, renamed, strides_of, walk
from compiler.search.rules import RuleSet, egglog_rewrite, egglog_rule
from compiler.shape import numel

DECLARATIONS = """
(datatype Acc
  (Elem i64 i64)
  (Row i64)
  (Other i64))
(datatype Ex
  (Input i64)
  (Gemm i64 Ex Ex)
  (RowMap String i64 i64 Ex)
  (RowReduce String String i64 i64 Ex)
  (Kernel i64)
  (Ld Ex Acc)
  (Cst String f64)
  (Ap1 String String Ex)
  (Ap2 String String Ex Ex)
  (Opaque i64)
  (SoftmaxTimes Ex f64 Ex)
  (OnlineAttention Ex Ex f64 Ex)
  (ProductWithEpilogue Ex Ex))

(relation KernelAt (i64 Ex))
(relation Out (i64 i64))
(relation ReadBy (i64 i64))
(relation Role (i64 String))
(function reader-count (i64) i64 :no-merge)
(function writer-count (i64) i64 :no-merge)
(function first-reader (i64) i64 :no-merge)
(function buffer-dtype (i64) String :no-merge)
(function elements (i64) i64 :no-merge)

(function gemm-rows (i64) i64 :no-merge)
(function flat-rows (i64) i64 :no-merge)
(function gemm-n (i64) i64 :no-merge)
(function gemm-k (i64) i64 :no-merge)
(function gemm-a (i64) i64 :no-merge)
(function gemm-b (i64) i64 :no-merge)
(function gemm-dtype (i64) String :no-merge)
(function head-size (i64) i64 :no-merge)
(function head-width (i64) i64 :no-merge)
(relation PlainProduct (i64))
(relation NoEpilogue (i64))
(relation PackedA (i64))

(relation ElementwiseLoop (i64))
(relation FlatLoop (i64))
(relation ReadsOnlyAtElem (i64 i64))
(function ready-after (i64 i64) i64 :no-merge)
(relation HeadLimit (i64))

(relation ShiftedExp (i64 i64 f64))
(relation ExpSum (i64 i64))
(relation Softmaxed (i64 i64 i64 i64 i64 f64))
(relation ScoreSource (i64 i64 i64 i64))
(relation AttentionCandidate (i64 i64 i64 i64 i64 i64 i64 f64))
(relation Undisturbed (i64 i64))
(relation AttentionFound (i64 i64 i64 i64 i64 i64 i64 f64))
(relation EpilogueCandidate (i64 i64))
(relation Regroupable (i64 i64))
(relation EpilogueFound (i64 i64))
"""


# the one dtype the fused attention kernel is written for (narrow formats are chosen later)
_F32 = '"float32"'

ALGEBRA = RuleSet(
    "kernel_algebra",
    "operand order of add and mul inside loop bodies, so each pattern needs one order only",
    (
        egglog_rewrite("add_commutes", "(Ap2 \"add\" d a b)", "(Ap2 \"add\" d b a)"),
        egglog_rewrite("mul_commutes", "(Ap2 \"mul\" d a b)", "(Ap2 \"mul\" d b a)"),
    ),
)

SOFTMAX = RuleSet(
    "softmax",
    "a softmax spelled by primitives: row max, exp2 of the shifted scaled value, row sum, and the "
    "product of the exponentials with V divided by the sums",
    (
        egglog_rule(
            "shifted_exponential",
            # exp2(c * (x + -1 * max_row(x))) with c > 0, over the same rows and keys as the max
            f"(KernelAt top M) (= M (RowReduce \"max\" dm rows n x)) "
            f"(KernelAt ex E) (= E (RowMap {_F32} rows n (Ap1 \"exp2\" {_F32} (Ap2 \"mul\" dc (Cst dk c) "
            f"(Ap2 \"add\" da x (Ap2 \"mul\" dn (Cst dm1 -1.0) (Ld M (Row rows)))))))) "
            "(> c 0.0) (< top ex) (Out top mo) (Role mo \"temp\") "
            "(= (reader-count mo) 1) (ReadBy mo ex) (= (writer-count mo) 1)",
            "(ShiftedExp ex top c)",
        ),
        egglog_rule(
            "row_sum_of_exponentials",
            "(ShiftedExp ex top c) (KernelAt ex E) (= E (RowMap d rows n body)) "
            "(KernelAt sm S) (= S (RowReduce \"sum\" ds rows n (Ld E (Elem rows n)))) (< ex sm) "
            "(Out sm so) (Role so \"temp\") (= (reader-count so) 1) (= (writer-count so) 1)",
            "(ExpSum sm ex)",
        ),
        egglog_rule(
            "softmax_times_values",
            # (P V)[row, :] * recip(sum_row): the normalization after the product, in place
            "(ShiftedExp ex top c) (ExpSum sm ex) (KernelAt ex E) (= E (RowMap d rows n body)) "
            "(Out ex eo) (Role eo \"temp\") (= (reader-count eo) 2) (= (writer-count eo) 1) "
            "(ReadBy eo sm) (ReadBy eo pv) "
            "(KernelAt pv PV) (= PV (Gemm pv E V)) (PlainProduct pv) (PackedA pv) "
            "(= prows (gemm-rows pv)) (= (flat-rows prows) (flat-rows rows)) (= (gemm-k pv) n) (= vn (gemm-n pv)) (< sm pv) "
            "(KernelAt sm S) (KernelAt dv D) "
            f"(= D (RowMap {_F32} prows vn (Ap2 \"mul\" dp (Ld PV (Elem prows vn)) "
            f"(Ap1 \"recip\" {_F32} (Ld S (Row prows)))))) "
            "(< pv dv) (Out pv vc) (Out dv vc) (= (first-reader vc) dv) "
            "(Out sm so) (= (reader-count so) 1) (ReadBy so dv) "
            "(KernelAt top M) (= M (RowReduce \"max\" dm rows n x))",
            "(union D (SoftmaxTimes x c V)) (Softmaxed dv pv sm ex top c)",
        ),
        *(
            egglog_rule(
                f"softmax_normalized{kind}_before_values",
                # (E * recip(sum_row)) V: the normalization (torch's safe form turns a NaN row into
                # zeros) a loop of its own before the product; Softmaxed names that loop as the division
                "(ShiftedExp ex top c) (ExpSum sm ex) (KernelAt ex E) (= E (RowMap d rows n body)) "
                "(Out ex eo) (Role eo \"temp\") (= (reader-count eo) 2) (= (writer-count eo) 1) "
                "(ReadBy eo sm) (ReadBy eo nm) (KernelAt sm S) (Out sm so) (ReadBy so nm) "
                f"(KernelAt nm N) (= N (RowMap {_F32} prows n {body})) (= (flat-rows prows) (flat-rows rows)) "
                "(Out nm no) (Role no \"temp\") (= (reader-count no) 1) (= (writer-count no) 1) (ReadBy no pv) "
                "(KernelAt pv PV) (= PV (Gemm pv N V)) (PlainProduct pv) (PackedA pv) "
                "(= (gemm-rows pv) prows) (= (gemm-k pv) n) (< sm nm) (< nm pv) "
                "(KernelAt top M) (= M (RowReduce \"max\" dm rows n x))",
                "(union PV (SoftmaxTimes x c V)) (Softmaxed nm pv sm ex top c)",
            )
            for kind, body in (
                ("", f"(Ap2 \"mul\" dp (Ld E (Elem prows n)) (Ap1 \"recip\" {_F32} (Ld S (Row prows))))"),
                (
                    "_nan_to_zero",
                    f"(Ap1 \"zero_nan\" {_F32} (Ap2 \"mul\" dp (Ld E (Elem prows n)) (Ap1 \"recip\" {_F32} (Ld S (Row prows)))))",
                ),
            )
        ),
    ),
)

ATTENTION = RuleSet(
    "attention",
    "softmax(scores) V over a product's scores, read directly or through one masking loop",
    (
        egglog_rule(
            "scores_read_directly",
            # the max and the exponentials read the product's sums, at their own element only
            "(KernelAt sc G) (= G (Gemm sc Q K)) (PlainProduct sc) (Out sc c) (Role c \"temp\") "
            "(= (writer-count c) 1) (= (reader-count c) 2) "
            "(KernelAt top M) (= M (RowReduce \"max\" dm rows n x)) (ReadsOnlyAtElem top c) "
            "(= (flat-rows (gemm-rows sc)) (flat-rows rows)) (= (gemm-n sc) n) (< sc top)",
            "(ScoreSource top sc -1 c)",
        ),
        *(
            egglog_rule(
                f"scores_read_through_a_{kind}_masking_loop",
                # one elementwise loop (scale, mask) over the scores' elements is their only reader
                "(KernelAt sc G) (= G (Gemm sc Q K)) (PlainProduct sc) (Out sc c) (Role c \"temp\") "
                "(= (writer-count c) 1) (= (reader-count c) 1) (ReadBy c mk) "
                f"(KernelAt mk P) (= P (RowMap dp {frame} pbody)) {flat}(ReadsOnlyAtElem mk c) "
                "(Out mk b) (Role b \"temp\") (= (writer-count b) 1) "
                "(KernelAt top M) (= M (RowReduce \"max\" dm rows n x)) (ReadsOnlyAtElem top b) "
                "(= (elements mk) (elements top)) "
                "(= (flat-rows (gemm-rows sc)) (flat-rows rows)) (= (gemm-n sc) n) (< sc mk) (< mk top)",
                "(ScoreSource top sc mk b)",
            )
            # a flat loop over as many elements, or one over the scores' own rows and keys
            for kind, frame, flat in (("flat", "prows pn", "(FlatLoop mk) "), ("shaped", "rows n", ""))
        ),
        egglog_rule(
            "attention_candidate",
            "(Softmaxed dv pv sm ex top c) (ScoreSource top sc mk b) "
            "(= (reader-count b) 2) (ReadBy b top) (ReadBy b ex) "
            "(HeadLimit limit) (<= (head-size sc) limit) (<= (head-width pv) limit)",
            "(AttentionCandidate sc mk top ex sm pv dv c)",
        ),
    ),
)

ATTENTION_FOUND = RuleSet(
    "attention_found",
    "a candidate whose span nothing else disturbs is one online-softmax kernel",
    (
        egglog_rule(
            "online_attention",
            "(AttentionCandidate sc mk top ex sm pv dv c) (Undisturbed sc dv) (< pv dv) "
            "(KernelAt sc G) (= G (Gemm sc Q K)) (KernelAt pv PV) (= PV (Gemm pv E V)) "
            "(KernelAt top M) (= M (RowReduce \"max\" dm rows n x)) (KernelAt dv D)",
            "(union D (OnlineAttention G x c V)) (AttentionFound sc mk top ex sm pv dv c)",
        ),
        egglog_rule(
            "online_attention_normalized_first",
            # the product with V is the attention's output: the normalization ran before it
            "(AttentionCandidate sc mk top ex sm pv dv c) (Undisturbed sc dv) (< dv pv) "
            "(KernelAt sc G) (= G (Gemm sc Q K)) (KernelAt pv PV) (= PV (Gemm pv P V)) "
            "(KernelAt top M) (= M (RowReduce \"max\" dm rows n x))",
            "(union PV (OnlineAttention G x c V)) (AttentionFound sc mk top ex sm pv dv c)",
        ),
    ),
)

EPILOGUE = RuleSet(
    "epilogue",
    "a product whose only reader is an elementwise loop over it",
    (
        egglog_rule(
            "product_read_by_one_loop",
            "(KernelAt sc G) (= G (Gemm sc A B)) (NoEpilogue sc) (Out sc c) (Role c \"temp\") "
            "(= (reader-count c) 1) (= (writer-count c) 1) (ReadBy c lp) (< sc lp) "
            "(ElementwiseLoop lp) (Out lp o) (= (writer-count o) 1) "
            "(= (buffer-dtype o) (gemm-dtype sc)) (!= o (gemm-a sc)) (!= o (gemm-b sc)) "
            # the loop's other operands exist when the product runs: the loop moves up to it
            "(<= (ready-after lp c) sc)",
            "(EpilogueCandidate sc lp)",
        ),
    ),
)

EPILOGUE_FOUND = RuleSet(
    "epilogue_found",
    "a candidate whose loop reads only linear functions of C's (t, i, j) runs inside the product",
    (
        egglog_rule(
            "product_with_epilogue",
            "(EpilogueCandidate sc lp) (Regroupable sc lp) (KernelAt sc G) (KernelAt lp L) "
            "(Out lp o) (Role o r) (!= r \"weight\") (!= r \"input\") (!= r \"panel\")",
            "(union L (ProductWithEpilogue G L)) (EpilogueFound sc lp)",
        ),
    ),
)

# the stages of each search, in order; a caller computes its interval facts between the two
ATTENTION_RULES: tuple[RuleSet, ...] = (ALGEBRA, SOFTMAX, ATTENTION)
ATTENTION_FOUND_RULES: tuple[RuleSet, ...] = (ATTENTION_FOUND,)
EPILOGUE_RULES: tuple[RuleSet, ...] = (EPILOGUE,)
EPILOGUE_FOUND_RULES: tuple[RuleSet, ...] = (EPILOGUE_FOUND,)

_SPAN = bindings.RustSpan(__file__, 0, 0)


# ---- the program as terms and facts ------------------------------------------------------------


@dataclass
class KernelGraph:
    """One program's kernels in an e-graph (see the module's docstring), and how long it took."""

    program: Program
    egraph: bindings.EGraph
    seconds: Counter = field(default_factory=Counter)

    def run(self, rulesets: Iterable[RuleSet]) -> None:
        """Declares the rule sets and saturates them one after the other."""
        started = time.perf_counter()
        lines = []
        names = []
        for rs in rulesets:
            lines.append(f"(ruleset {rs.name})")
            lines += [f'{rule.text[:-1]} :ruleset {rs.name} :name "{rule.name}")' for rule in rs.rules]
            names.append(rs.name)
        if names:
            lines.append("(run-schedule " + " ".join(f"(saturate (run {name}))" for name in names) + ")")
            self.egraph.parse_and_run_program("\n".join(lines))
        self.seconds["rules"] += time.perf_counter() - started

    def add_facts(self, facts: Iterable[str]) -> None:
        text = "\n".join(facts)
        if text:
            self.egraph.parse_and_run_program(text)

    def rows(self, relation: str) -> list[tuple]:
        """The rows of a relation, its i64 columns as ints and f64 ones as floats, sorted."""
        frozen = self.egraph.freeze().functions.get(relation)
        if frozen is None:
            return []
        rows = []
        for row in frozen.rows:
            values = []
            for sort, value in zip(frozen.input_sorts, row.inputs, strict=True):
                values.append(self.egraph.value_to_f64(value) if sort == "f64" else self.egraph.value_to_i64(value))
            rows.append(tuple(values))
        return sorted(rows)


def kernel_graph(program: Program, head_limit: int | None = None, bodies: bool = True) -> KernelGraph:
    """The program's kernels written into a fresh e-graph as terms and facts; without `bodies`
    every loop is an opaque (Kernel step), for rules that need only the facts (half the time)."""
    started = time.perf_counter()
    egraph = bindings.EGraph()
    egraph.parse_and_run_program(DECLARATIONS)
    writer = _Writer(program, bodies)
    text = writer.program_text()
    if head_limit is not None:
        text += f"\n(HeadLimit {head_limit})"
    egraph.parse_and_run_program(text)
    graph = KernelGraph(program, egraph)
    graph.seconds["build"] += time.perf_counter() - started
    return graph


class _Writer:
    """Writes a program's kernels as egglog text: one `let` per kernel, then the facts."""

    def __init__(self, program: Program, bodies: bool = True) -> None:
        self.program = program
        self.bodies = bodies
        self.ids: dict[object, int] = {}
        self.lines: list[str] = []

    def intern(self, key: object) -> int:
        return self.ids.setdefault(key, len(self.ids))

    def rows_id(self, rows: tuple) -> int:
        """The id of a frame's rows, and the fact of how many there are: rows split otherwise
        (heads as (kv heads, group) where the keys and values are shared) are the same rows in the
        same order wherever a loop reads them at its own element or row."""
        key = ("shape", tuple(rows))
        known = key in self.ids
        rows_id = self.intern(key)
        if not known:
            self.lines.append(f"(set (flat-rows {rows_id}) {self.intern(('elements', numel(rows)))})")
        return rows_id

    def program_text(self) -> str:
        program, kernels = self.program, self.program.kernels
        readers: dict[int, list[int]] = defaultdict(list)
        writers: dict[int, list[int]] = defaultdict(list)
        for step, kernel in enumerate(kernels):
            for b in kernel_reads(kernel):
                readers[b].append(step)
            for b in kernel_stores(kernel):
                writers[b].append(step)
        last_writer = {b: steps[-1] for b, steps in writers.items()}
        # the value each buffer holds before the current step: the term of its latest writer
        current: dict[int, str] = {}
        for step, kernel in enumerate(kernels):
            term = self.kernel_term(step, kernel, current)
            self.lines.append(f"(let $k{step} {term})")
            self.lines.append(f"(KernelAt {step} $k{step})")
            for b in sorted(kernel_stores(kernel)):
                self.lines.append(f"(Out {step} {b})")
            self.kernel_facts(step, kernel, last_writer)
            for b in kernel_stores(kernel):
                current[b] = f"$k{step}"
        # every rule asks its facts of a kernel's output: weights and inputs need none (each
        # command costs egglog about 0.2 ms, the bulk of the time)
        for b in sorted(writers):
            buffer = program.buffers[b]
            self.lines.append(f'(Role {b} "{buffer.role}")')
            self.lines.append(f'(set (buffer-dtype {b}) "{buffer.dtype}")')
            self.lines.append(f"(set (reader-count {b}) {len(readers[b])})")
            self.lines.append(f"(set (writer-count {b}) {len(writers[b])})")
            if readers[b]:
                self.lines.append(f"(set (first-reader {b}) {readers[b][0]})")
            self.lines += [f"(ReadBy {b} {s})" for s in readers[b]]
        return "\n".join(self.lines)

    # -- kernels

    def kernel_term(self, step: int, kernel, current: dict[int, str]) -> str:

        def value_of(b: int) -> str:
            return current.get(b, f"(Input {b})")

        if isinstance(kernel, GemmCall):
            operand_b = value_of(kernel.b) if kernel.b_panels is None else f"(Opaque {self.intern(('panels', step))})"
            return f"(Gemm {step} {value_of(kernel.a)} {operand_b})"
        frame = _frame(kernel) if self.bodies else None
        if frame is None:
            return f"(Kernel {step})"
        rows, n, key = frame
        rows_id, n_id = self.rows_id(rows), self.intern(("dim", n))
        loop = _Loop(rows, n, key, rows_id, n_id, _element_index(rows, n, key), _row_index(rows))
        body = self.expr(kernel.value, loop, value_of)
        # the dtype the loop computes in (a narrow program stores it narrower)
        value = kernel.value
        dtype = self.program.buffers[value.buffer].dtype if isinstance(value, Load) else value.dtype
        if kernel.reduce is None:
            return f'(RowMap "{dtype}" {rows_id} {n_id} {body})'
        return f'(RowReduce "{kernel.reduce[0]}" "{dtype}" {rows_id} {n_id} {body})'

    def kernel_facts(self, step: int, kernel, last_writer: dict[int, int]) -> None:
        program = self.program
        if isinstance(kernel, GemmCall):
            nb = len(kernel.batch)
            facts = [
                f"(set (gemm-rows {step}) {self.rows_id((*kernel.batch, kernel.m))})",
                f"(set (gemm-n {step}) {self.intern(('dim', kernel.n))})",
                f"(set (gemm-k {step}) {self.intern(('dim', kernel.k))})",
                f"(set (gemm-a {step}) {kernel.a})",
                f"(set (gemm-b {step}) {kernel.b})",
                f'(set (gemm-dtype {step}) "{kernel.dtype}")',
            ]
            # the heads a fused kernel must hold: the scores' k, the values' n, when known
            if isinstance(kernel.k, int):
                facts.append(f"(set (head-size {step}) {kernel.k})")
            if isinstance(kernel.n, int):
                facts.append(f"(set (head-width {step}) {kernel.n})")
            if kernel.epilogue is None:
                facts.append(f"(NoEpilogue {step})")
            if plain_product(program, kernel):
                facts.append(f"(PlainProduct {step})")
            packed = tuple(strides_of((*kernel.batch, kernel.m, kernel.k))[:nb])
            if not kernel.trans_a and kernel.lda is None and tuple(kernel.a_batch_strides) == packed:
                facts.append(f"(PackedA {step})")
            self.lines += facts
            return
        if not isinstance(kernel, LoopKernel):
            return
        reads = kernel_reads(kernel)
        for b in sorted(reads):
            ready = max((last_writer.get(x, -1) for x in reads - {b}), default=-1)
            self.lines.append(f"(set (ready-after {step} {b}) {ready})")
        if kernel.reduce is None:
            self.lines.append(f"(ElementwiseLoop {step})")
            if len(kernel.shape) == 1:
                self.lines.append(f"(FlatLoop {step})")
        frame = _frame(kernel) if self.bodies else None
        if frame is None:
            return
        rows, n, key = frame
        self.lines.append(f"(set (elements {step}) {self.intern(('elements', numel((*rows, n))))})")
        own = _element_index(rows, n, key)
        loads = [e for e in walk(kernel.value) if isinstance(e, Load)]
        for b in sorted({load.buffer for load in loads}):
            if all(load.index == own for load in loads if load.buffer == b):
                self.lines.append(f"(ReadsOnlyAtElem {step} {b})")

    # -- values

    def expr(self, e: Expr, loop: _Loop, value_of) -> str:
        kept = zero_where_nan(e)
        if kept is not None:
            return f'(Ap1 "zero_nan" "{e.dtype}" {self.expr(kept, loop, value_of)})'
        if isinstance(e, Load):
            return f"(Ld {value_of(e.buffer)} {self.access(e.index, loop)})"
        if isinstance(e, Const) and _finite(e.value):
            return f'(Cst "{e.dtype}" {float(e.value)!r})'
        if isinstance(e, Apply) and len(e.args) == 1:
            return f'(Ap1 "{e.op}" "{e.dtype}" {self.expr(e.args[0], loop, value_of)})'
        if isinstance(e, Apply) and len(e.args) == 2:
            x, y = (self.expr(a, loop, value_of) for a in e.args)
            return f'(Ap2 "{e.op}" "{e.dtype}" {x} {y})'
        # padding, iotas, other constants: equal only when equal in the loop's own variables
        return f"(Opaque {self.intern(('expr', loop.rows, loop.n, _normal(e, loop.key)))})"

    def access(self, index: Ix, loop: _Loop) -> str:
        if index == loop.element:
            return f"(Elem {loop.rows_id} {loop.n_id})"
        if index == loop.row:
            return f"(Row {loop.rows_id})"
        return f"(Other {self.intern(('index', loop.rows, loop.n, _normal(index, loop.key)))})"


@dataclass(frozen=True)
class _Loop:
    """A loop seen as rows x keys: its row variables are o0.., its key variable `key`."""

    rows: tuple
    n: object
    key: str
    rows_id: int
    n_id: int
    # the index of the loop's own element, and of its row, in row-major buffers of those shapes
    element: Ix
    row: Ix


def _frame(kernel) -> tuple[tuple, object, str] | None:
    """(rows, keys, the key's variable) of a loop the rules can read: an elementwise loop of rank
    at least one (its last axis the key) or a reduction over one axis; None for any other."""
    if not isinstance(kernel, LoopKernel) or kernel.lets:
        return None
    shape = tuple(kernel.shape)
    if kernel.reduce is None:
        return (shape[:-1], shape[-1], f"o{len(shape) - 1}") if shape else None
    kind, extents = kernel.reduce
    if kind not in ("max", "sum") or len(extents) != 1:
        return None
    return shape, extents[0], "r0"


def _element_index(rows: tuple, n, key: str) -> Ix:
    return linear([Ix.var(f"o{j}") for j in range(len(rows))] + [Ix.var(key)], (*rows, n))


def _row_index(rows: tuple) -> Ix:
    return linear([Ix.var(f"o{j}") for j in range(len(rows))], rows)


def _normal(e, key: str):
    """An expression or index with the key's variable renamed, so a reduction's r0 and an
    elementwise loop's last variable read alike."""
    return renamed(e, {key: "key"})


def zero_where_nan(e: Expr) -> Expr | None:
    """x, where `e` is where(isnan(x), 0, x) as lowering spells it (a sum of two guarded branches
    on the flag of not(x < inf or -inf < x)); None for anything else."""
    if not (isinstance(e, Apply) and e.op == "add" and len(e.args) == 2 and all(isinstance(a, Guarded) for a in e.args)):
        return None
    branches = {}
    for branch in e.args:
        if len(branch.guards) != 1 or branch.guards[0][1] != 1 or branch.fill != 0:
            return None
        index = branch.guards[0][0]
        if len(index.terms) != 1 or index.terms[0][1] != 1 or not isinstance(index.terms[0][0], Atom):
            return None
        flag = index.terms[0][0]
        if flag.op != "flag" or index.const not in (0, -1) or index.const in branches:
            return None
        branches[index.const] = (flag.args[0], branch.value)  # const -1: the flag is 1 (x is NaN)
    if set(branches) != {0, -1} or branches[0][0] != branches[-1][0]:
        return None
    condition, zero, kept = branches[0][0], branches[-1][1], branches[0][1]
    if not (isinstance(zero, Const) and zero.value == 0):
        return None
    # not(x < inf or -inf < x), through whatever casts the bools took on the way (before the graph
    # search simplified them: to uint8 for the or, back to bool for the not)
    test = _uncast(condition)
    if not (_is_apply(test, "less_than") and _uncast(test.args[1]) == Const(True, "bool") and _is_apply(_uncast(test.args[0]), "add")):
        return None
    below, above = (_uncast(a) for a in _uncast(test.args[0]).args)
    inf = lambda sign, x: isinstance(x, Const) and x.value == sign * math.inf
    if not (_is_apply(below, "less_than") and _is_apply(above, "less_than")):
        return None
    if below.args[0] == kept and inf(1, below.args[1]) and above.args[1] == kept and inf(-1, above.args[0]):
        return kept
    return None


def _uncast(e: Expr) -> Expr:
    while isinstance(e, Apply) and e.op == "cast":
        e = e.args[0]
    return e


def _is_apply(e: Expr, op: str) -> bool:
    return isinstance(e, Apply) and e.op == op and len(e.args) == 2


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def plain_product(program: Program, call) -> bool:
    """A float32 product of two stored operands with nothing fused into it."""
    return (
        isinstance(call, GemmCall)
        and call.epilogue is None
        and call.b_panels is None
        and not call.packed_b
        and not call.packed_a
        and call.dtype == "float32"
        and program.buffers[call.c].role in ("temp", "output")
    )


__all__ = [
    "ATTENTION_FOUND_RULES",
    "ATTENTION_RULES",
    "EPILOGUE_FOUND_RULES",
    "EPILOGUE_RULES",
    "KernelGraph",
    "kernel_graph",
    "plain_product",
    "zero_where_nan",
]
