"""From the primitive-op graph to the kernel IR: which values get a buffer, and the loop nests.

A value gets its own buffer (it is a *root*) when it is an output, a reduction, a contraction,
or an elementwise value read more than once or through a view that reads it repeatedly
(broadcast, sliding window) or conditionally (padding). Everything else is inlined into the
kernel that reads it: chains of elementwise ops, casts, gathers and every view become one loop
nest whose loads go through index expressions. Contractions become GEMM calls when
`use_gemm`, with operands repacked into the layout the call wants only when their layout is not
already right (weights are repacked once, here, not at run time); otherwise they stay loop nests
with a sum, which is the alternative the search measures against the library call.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from compiler.contraction import Contraction, find_contraction, users_of
from compiler.dtypes import is_float
from compiler.ir import BINARY_OPS, UNARY_OPS, Graph, Op
from compiler.kernels.ir import (
    Apply,
    Atom,
    Buffer,
    Const,
    Expr,
    GemmCall,
    Guarded,
    IndexValue,
    Ix,
    Kernel,
    Load,
    LoopKernel,
    Panels,
    Program,
    ix_floordiv,
    ix_max,
    ix_mod,
)
from compiler.kernels.ir_walk import expr_variables, linear, plan_slots, renamed, strides_of, walk
from compiler.reference import eval_node
from compiler.shape import (
    Dim,
    Shape,
    dim_add,
    dim_min,
    dim_mul,
    dim_sub,
    evaluate,
    is_static,
    numel,
    provably_le,
    symbols_of,
)

# element types the native renderers handle; a graph with others stays on the NumPy backend
NATIVE_DTYPES = frozenset(
    {"float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}
)
GEMM_DTYPES = frozenset({"float32", "float64"})
# views that read a source element more than once: an elementwise value read through one is
# computed once into a buffer instead of recomputed per read (padding reads each at most once)
_REPEATING_VIEWS = frozenset({"expand", "window"})
_COMPUTE = UNARY_OPS | BINARY_OPS | {Op.CAST, Op.GATHER}
# a reduction over at most this many elements (static) is unrolled into the expression that reads
# it (a clamp is a max over a concatenation of 2): a loop of 2 is not worth a kernel and a buffer
UNROLL_REDUCE_MAX = 4
# a value read more than once is recomputed by each reader while its inlined expression costs at
# most this (loads and arithmetic 1, transcendental functions 8); the C compiler shares what one
# kernel recomputes, and a buffer round trip costs more than a few multiply-adds
INLINE_COST_LIMIT = 8
OP_COST = {Op.EXP2: 8, Op.LOG2: 8, Op.SIN: 8, Op.SQRT: 4, Op.RECIP: 2, Op.MOD: 4, Op.GATHER: 2}
# probe sizes for symbols when grouping reshape axes: each symbol its own prime, so products of
# different symbols (batch vs seq) rarely coincide; a group is kept only when its sizes are equal
# as symbolic expressions, the probes only steer which axes are tried together
_PROBES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061, 1063, 1069, 1087, 1091, 1093, 1097)


class NotNative(Exception):
    """The graph uses something the native backends do not handle (an element type)."""


def lower(graph: Graph, use_gemm: bool = True) -> Program:
    return _Lowering(graph, use_gemm).run()


@dataclass
class _Use:
    count: int = 0
    repeated: bool = False


class _Lowering:
    def __init__(self, graph: Graph, use_gemm: bool) -> None:
        self.graph = graph
        self.nodes = graph.nodes
        users = users_of(graph)
        self.contractions: dict[int, Contraction] = {}
        for i, node in enumerate(self.nodes):
            if use_gemm and node.op is Op.SUM_REDUCE and node.dtype in GEMM_DTYPES:
                found = find_contraction(graph, i, users)
                if found is not None and len(found.operands) == 2:
                    self.contractions[i] = found
        self.buffers: list[Buffer] = []
        self.kernels: list[Kernel] = []
        self.buffer_of: dict[int, int] = {}
        # (dtype, shape, value) -> the temp a product's operand was computed into
        self.packed: dict[tuple, int] = {}
        self.weights: dict[str, np.ndarray] = dict(graph.weights)
        self.symbols: set[str] = set()
        self.scalars = self.scalar_constants()
        # the product being lowered: batch letters split into (outer, inner, group) (grouped_batch)
        self.letter_split: dict[str, tuple[str, str, int]] = {}

    def scalar_constants(self) -> dict[int, np.ndarray]:
        """Values every element of which is one constant, computed here: a scale of 1/sqrt(d)
        broadcast over the attention scores is a literal in the loop, not a buffer of copies."""
        found: dict[int, np.ndarray] = {}
        for i, node in enumerate(self.nodes):
            if node.op is Op.CONSTANT and self.weights[node.arg].size == 1:
                found[i] = np.asarray(self.weights[node.arg]).reshape(())
            elif node.op is Op.VIEW and node.arg[0] != "pad" and node.srcs[0] in found:
                found[i] = found[node.srcs[0]]
            elif (node.op in UNARY_OPS or node.op in BINARY_OPS or node.op is Op.CAST) and all(
                s in found for s in node.srcs
            ):
                found[i] = np.asarray(eval_node(node, [found[s] for s in node.srcs], self.graph, {})).reshape(())
        return found

    def unrolled_reduce(self, i: int) -> bool:
        """A reduction small enough to be computed inside the expression that reads it."""
        node = self.nodes[i]
        if node.op not in (Op.SUM_REDUCE, Op.MAX_REDUCE) or i in self.contractions:
            return False
        extents = [self.nodes[node.srcs[0]].shape[a] for a in node.arg]
        return all(isinstance(d, int) for d in extents) and int(np.prod(extents, dtype=np.int64)) <= UNROLL_REDUCE_MAX

    # -- which values get buffers ----------------------------------------------------------------

    def reads(self, i: int) -> tuple[int, ...]:
        if i in self.contractions:
            return self.contractions[i].operands
        return self.nodes[i].srcs

    def plan_roots(self) -> tuple[set[int], set[int]]:
        outputs = {i for _, i in self.graph.outputs}
        needed: set[int] = set()
        stack = list(outputs)
        while stack:
            i = stack.pop()
            if i in needed:
                continue
            needed.add(i)
            stack.extend(self.reads(i))
        for i in needed:
            if self.nodes[i].dtype not in NATIVE_DTYPES:
                raise NotNative(f"{self.nodes[i].dtype} values")
        uses: dict[int, _Use] = {}
        consumers = [i for i in needed if self.nodes[i].op is not Op.VIEW] + list(outputs)
        for consumer in consumers:
            sources = self.reads(consumer) if consumer not in outputs or self.nodes[consumer].op is not Op.VIEW else ()
            for position, src in enumerate(sources):
                # a gather's computed indices get a buffer: inlined, the index expression would be
                # copied into every index expression derived from it (exponential through reshapes)
                # (an affine index, like a select's 2*i + cond, simplifies away instead)
                repeated = self.nodes[consumer].op is Op.GATHER and position == 1 and not self.affine_index(src)
                while self.nodes[src].op is Op.VIEW:
                    repeated |= self.nodes[src].arg[0] in _REPEATING_VIEWS
                    src = self.nodes[src].srcs[0]
                use = uses.setdefault(src, _Use())
                use.count += 1
                use.repeated |= repeated
        roots = set(outputs) | set(self.contractions)
        cost: dict[int, int] = {}
        for i in sorted(needed):
            node = self.nodes[i]
            inline = node.op in _COMPUTE or self.unrolled_reduce(i)
            if i in self.scalars:
                cost[i] = 1
                continue
            if node.op in (Op.SUM_REDUCE, Op.MAX_REDUCE) and not inline:
                roots.add(i)
            if not inline:
                cost[i] = 1
                continue
            if i in roots:
                cost[i] = 1
                continue
            cost[i] = OP_COST.get(node.op, 1) + sum(cost.get(self.source(s), 1) for s in self.reads(i))
            if node.op in (Op.SUM_REDUCE, Op.MAX_REDUCE):
                cost[i] *= max(1, int(np.prod([self.nodes[node.srcs[0]].shape[a] for a in node.arg])))
            use = uses.get(i)
            if use is not None and (use.repeated or use.count > 1 and cost[i] > INLINE_COST_LIMIT):
                roots.add(i)
                cost[i] = 1
        return needed, roots

    def affine_index(self, i: int) -> bool:
        """Whether integer value i is an affine form of loop indices, integer constants and
        bool-to-integer casts (see as_index), so that a gather through it needs no index buffer."""
        node = self.nodes[i]
        if i in self.scalars:
            return node.dtype.startswith(("int", "uint"))
        if node.op is Op.IOTA:
            return True
        if node.op is Op.CAST:
            return self.nodes[node.srcs[0]].dtype == "bool" and node.dtype.startswith(("int", "uint"))
        if node.op is Op.ADD:
            return all(self.affine_index(s) for s in node.srcs)
        if node.op is Op.MUL:
            a, b = node.srcs
            return (a in self.scalars and self.affine_index(b)) or (b in self.scalars and self.affine_index(a))
        if node.op is Op.VIEW and node.arg[0] != "pad":
            return self.affine_index(node.srcs[0])
        return False

    def source(self, i: int) -> int:
        """The value a chain of views reads."""
        while self.nodes[i].op is Op.VIEW:
            i = self.nodes[i].srcs[0]
        return i

    # -- buffers -----------------------------------------------------------------------------------

    def new_buffer(self, dtype: str, shape: Shape, role: str, name: str = "") -> int:
        for d in shape:
            if not isinstance(d, int):
                self.symbols |= d.symbols
        self.buffers.append(Buffer(len(self.buffers), dtype, tuple(shape), role, name))
        return len(self.buffers) - 1

    def weight_buffer(self, key: str) -> int:
        array = self.weights[key]
        for buffer in self.buffers:
            if buffer.role == "weight" and buffer.name == key:
                return buffer.id
        return self.new_buffer(array.dtype.name, array.shape, "weight", key)

    # -- expressions -------------------------------------------------------------------------------

    def expr(self, i: int, idx: list[Ix], extents: dict[str, Dim]) -> Expr:
        node = self.nodes[i]
        if i in self.buffer_of:
            return Load(self.buffer_of[i], linear(idx, node.shape))
        if i in self.scalars:
            return Const(self.scalars[i].item(), node.dtype)
        op = node.op
        if op is Op.CONSTANT:
            array = self.weights[node.arg]
            if array.size == 1:
                return Const(array.reshape(()).item(), node.dtype)
            return Load(self.weight_buffer(node.arg), linear(idx, node.shape))
        if op is Op.INPUT:
            raise AssertionError("inputs have buffers")
        if op is Op.IOTA:
            return IndexValue(idx[0], node.dtype)
        if op is Op.VIEW:
            src = node.srcs[0]
            src_idx, guards = view_index(node.arg, idx, self.nodes[src].shape, node.shape, extents)
            known = [(g, n) for g, n in guards if g.is_const() and isinstance(g.const, int) and isinstance(n, int)]
            if any(not 0 <= g.const < n for g, n in known):
                return Const(node.arg[2], node.dtype)  # statically in the padding (an unrolled index)
            guards = [guard for guard in guards if guard not in known]
            inner = self.expr(src, src_idx, extents)
            if guards:
                return Guarded(tuple(guards), inner, node.arg[2], node.dtype)
            return inner
        if op is Op.GATHER:
            data, indices = node.srcs
            axis = node.arg
            rank = len(self.nodes[indices].shape)
            chosen = self.expr(indices, idx[axis : axis + rank], extents)
            size = self.nodes[data].shape[axis]
            affine = as_index(chosen, self.buffers)
            top = ix_max(affine, extents) if affine is not None else None
            if top is not None and isinstance(affine.const, int) and affine.const >= 0 and provably_le(dim_add(top, 1), size):
                picked = affine  # provably inside the axis: no wrapping or clamping to render
            else:
                picked = Ix.var(Atom("value", (chosen, size)))
            data_idx = idx[:axis] + [picked] + idx[axis + rank :]
            return self.expr(data, data_idx, extents)
        if op in UNARY_OPS or op in BINARY_OPS:
            args = tuple(self.expr(s, idx, extents) for s in node.srcs)
            joined = joined_parts(*args, extents) if op is Op.ADD else None
            return joined if joined is not None else Apply(op.value, args, node.dtype)
        if op is Op.CAST:
            return Apply("cast", (self.expr(node.srcs[0], idx, extents),), node.dtype)
        if op in (Op.SUM_REDUCE, Op.MAX_REDUCE):
            return self.unrolled(i, idx, extents)
        raise AssertionError(f"{op} is always a root")

    def unrolled(self, i: int, idx: list[Ix], extents: dict[str, Dim]) -> Expr:
        """A small reduction as one expression: every reduced index a constant."""
        node = self.nodes[i]
        src_shape = self.nodes[node.srcs[0]].shape
        axes = node.arg
        terms: list[Expr] = []
        for flat in range(int(np.prod([src_shape[a] for a in axes], dtype=np.int64))):
            picked = iter(np.unravel_index(flat, [src_shape[a] for a in axes]) if axes else ())
            kept = iter(idx)
            src_idx = [Ix.of(int(next(picked))) if axis in axes else next(kept) for axis in range(len(src_shape))]
            terms.append(self.expr(node.srcs[0], src_idx, extents))
        if not terms:
            return Const(0 if node.op is Op.SUM_REDUCE else float("-inf"), node.dtype)
        total = terms[0]
        for term in terms[1:]:
            total = Apply("add" if node.op is Op.SUM_REDUCE else "max", (total, term), node.dtype)
        return total

    # -- kernels -------------------------------------------------------------------------------

    def run(self) -> Program:
        _, roots = self.plan_roots()
        for i in self.graph.inputs:
            node = self.nodes[i]
            self.buffer_of[i] = self.new_buffer(node.dtype, node.shape, "input", node.arg)
        output_names: dict[int, list[str]] = {}
        for name, i in self.graph.outputs:
            output_names.setdefault(i, []).append(name)
        for i in sorted(roots):
            node = self.nodes[i]
            if node.op in (Op.INPUT, Op.CONSTANT, Op.VIEW, Op.IOTA) or i in self.scalars:
                continue  # an output that computes nothing: copied into its buffer below
            names = output_names.get(i)
            role, name = ("output", names.pop(0)) if names else ("temp", "")
            out = self.new_buffer(node.dtype, node.shape, role, name)
            if i in self.contractions:
                self.lower_contraction(i, out)
            else:
                self.kernels.append(self.loop_kernel(i, out))
            self.buffer_of[i] = out
        for i, names in output_names.items():
            for name in names:
                node = self.nodes[i]
                out = self.new_buffer(node.dtype, node.shape, "output", name)
                extents = {f"o{j}": d for j, d in enumerate(node.shape)}
                value = self.expr(i, [Ix.var(f"o{j}") for j in range(len(node.shape))], extents)
                self.kernels.append(LoopKernel(out, node.shape, value, None, i))
        program = Program(self.buffers, self.kernels, sorted(self.symbols))
        program.slots = plan_slots(program)
        program.weights = {b.name: self.weights[b.name] for b in self.buffers if b.role == "weight"}
        return program

    def loop_kernel(self, i: int, out: int) -> LoopKernel:
        node = self.nodes[i]
        out_vars = [Ix.var(f"o{j}") for j in range(len(node.shape))]
        extents = {f"o{j}": d for j, d in enumerate(node.shape)}
        if node.op in (Op.SUM_REDUCE, Op.MAX_REDUCE) and not self.unrolled_reduce(i):
            src = node.srcs[0]
            src_shape = self.nodes[src].shape
            axes = node.arg
            src_idx, kept, reduced = [], iter(out_vars), []
            for axis, d in enumerate(src_shape):
                if axis in axes:
                    name = f"r{len(reduced)}"
                    extents[name] = d
                    reduced.append(d)
                    src_idx.append(Ix.var(name))
                else:
                    src_idx.append(next(kept))
            value = self.expr(src, src_idx, extents)
            kind = "sum" if node.op is Op.SUM_REDUCE else "max"
            return LoopKernel(out, node.shape, value, (kind, tuple(reduced)), i)
        return LoopKernel(out, node.shape, self.expr(i, out_vars, extents), None, i)

    def lower_contraction(self, i: int, out: int) -> None:
        found = self.contractions[i]
        inputs, out_axes = found.subscripts.split("->")
        a_letters, b_letters = inputs.split(",")
        node = self.nodes[i]
        sizes: dict[str, Dim] = {}
        for operand, letters, squeezed in zip(found.operands, (a_letters, b_letters), found.squeezes):
            kept = [d for axis, d in enumerate(self.nodes[operand].shape) if axis not in squeezed]
            sizes.update(zip(letters, kept))
        # axes of extent 1 index nothing: where keeping them would split the product into dot
        # products (an output pixel of a 1x1 image makes every channel a batch index of its own)
        # they are left out of the call's batch, rows, columns and sum; elsewhere they stay (the
        # attention rules read a product's batch axis by axis)
        ones = {c for c, d in sizes.items() if isinstance(d, int) and d == 1}
        if ones and not (
            _splits_into_dot_products(out_axes, a_letters, b_letters, sizes)
            or _ones_widen_the_batch(out_axes, a_letters, b_letters, ones)
        ):
            ones = set()
        out_letters = "".join(c for c in out_axes if c not in ones)
        only_a = set(a_letters) - set(b_letters) - set(out_letters) - ones
        only_b = set(b_letters) - set(a_letters) - set(out_letters) - ones
        if only_a or only_b:
            # a factor summed on its own first: not a matrix product
            self.kernels.append(self.loop_kernel(i, out))
            return
        batch = [c for c in out_letters if c in a_letters and c in b_letters]
        m_letters = [c for c in out_letters if c in a_letters and c not in b_letters]
        n_letters = [c for c in out_letters if c in b_letters and c not in a_letters]
        k_letters = [c for c in a_letters if c in b_letters and c not in out_letters and c not in ones]
        a = (found.operands[0], a_letters, found.squeezes[0], ones)
        b = (found.operands[1], b_letters, found.squeezes[1], ones)
        if all(sizes[c] == 1 for c in m_letters + n_letters):
            # dot products (a variance's sum of squares): a library call each costs more than the sum
            self.kernels.append(self.loop_kernel(i, out))
            return
        in_place = _in_place_split(out_letters, batch, m_letters, n_letters)
        if in_place is not None:
            batch, m_letters, n_letters, swap = in_place
            if swap:
                a, b, m_letters, n_letters = b, a, n_letters, m_letters  # C^T = B^T A^T: write C in place
        canonical = batch + m_letters + n_letters
        target = out
        if "".join(canonical) != out_letters:
            target = self.new_buffer(node.dtype, tuple(sizes[c] for c in canonical), "temp")
        else:
            self.letter_split = self.grouped_batch((a, b), batch, sizes)
            for c, (outer, inner, group) in self.letter_split.items():
                sizes[outer], sizes[inner] = sizes[c] // group, group
            batch = [part for c in batch for part in (self.letter_split[c][:2] if c in self.letter_split else (c,))]
            canonical = batch + m_letters + n_letters
        fresh_buffers = len(self.buffers)  # from here on: operands packed for this call
        scaled = self.row_scaled_operand(a, batch, m_letters, k_letters, n_letters, sizes)
        if scaled is not None:
            a_buf, trans_a, a_strides, row_scale = scaled
            lda = None
        else:
            a_buf, trans_a, a_strides, _, lda = self.gemm_operand(a, batch, m_letters, k_letters, sizes, node.dtype)
            row_scale = None
        b_buf, trans_b, b_strides, panels, ldb = self.gemm_operand(b, batch, k_letters, n_letters, sizes, node.dtype, True)

        def size(letters: Sequence[str]) -> Dim:
            return numel(sizes[c] for c in letters)

        self.kernels.append(
            GemmCall(
                a_buf, b_buf, target, tuple(sizes[c] for c in batch), size(m_letters), size(n_letters),
                size(k_letters), trans_a, trans_b, a_strides, b_strides, node.dtype, i, panels, lda, ldb,
            )
        )
        # a loop reads an int8 weight in place, widening it as it multiplies: a real alternative at
        # the few rows a decoding step has, whatever the rows' symbol
        if target == out and row_scale is None and (self.matrix_vector(m_letters, n_letters, sizes) or self.dequantizes(b[0])):
            packed = None
            if a_buf >= fresh_buffers and self.buffers[a_buf].role == "temp" and size(n_letters) != 1 and len(set(found.operands)) == 2:
                # A computed on the way (a query's rotary embedding) is read from the call's copy, not
                # recomputed by the loop for every column (every key) it does not depend on
                read = self.packed_read(i, a_buf, trans_a, a_strides, batch, m_letters, k_letters, sizes)
                packed = (found.operands.index(a[0]), read)
            self.offer_loop_form(i, out, packed)
        if row_scale is not None:  # C[m, n] *= f[m], in place
            shape = tuple(sizes[c] for c in canonical)
            names = {c: f"o{j}" for j, c in enumerate(canonical)}
            own = Load(target, linear([Ix.var(names[c]) for c in canonical], shape))
            self.kernels.append(LoopKernel(target, shape, Apply("mul", (own, renamed(row_scale, names)), node.dtype), None, i))
        self.letter_split = {}
        if target != out:
            var_of = {c: Ix.var(f"o{j}") for j, c in enumerate(out_axes)}
            index = linear([var_of[c] for c in canonical], tuple(sizes[c] for c in canonical))
            self.kernels.append(LoopKernel(out, node.shape, Load(target, index), None, i))

    def grouped_batch(self, operands, batch: list[str], sizes: dict[str, Dim]) -> dict[str, tuple[str, str, int]]:
        """Batch letters an operand reads through a division by a constant group (grouped-query
        attention's query head h reads key head h // 2), each split into (outer, inner, group):
        h = outer * group + inner is two batch axes, and the operand that reads h // group is read
        in place with stride 0 along inner instead of being copied once per query head."""
        used = {c for _, letters, _, _ in operands for c in letters}
        fresh = (c for c in string.ascii_letters if c not in used)
        split: dict[str, tuple[str, str, int]] = {}
        for base, letters, squeezed, ones in operands:
            axis_letter = _axis_letters(letters, squeezed, ones, len(self.nodes[base].shape))
            value = self.expr(base, [Ix() if c is None else Ix.var(c) for c in axis_letter], dict(sizes))
            for e in walk(value):
                if not (isinstance(e, Atom) and e.op == "floordiv" and isinstance(e.args[1], int)):
                    continue
                numerator, group = e.args
                if len(numerator.terms) != 1 or numerator.const != 0:
                    continue
                ((c, coef),) = numerator.terms
                size = sizes.get(c) if isinstance(c, str) and c in batch and coef == 1 else None
                if c not in split and group > 1 and isinstance(size, int) and size % group == 0:
                    split[c] = (next(fresh), next(fresh), group)
        if split and any(self.constant_value(base) is not None for base, *_ in operands):
            return {}  # a folded weight is transposed by its letters: no split of them
        return split

    def axis_indices(self, axis_letter: list[str | None], var_of: dict[str, Ix]) -> list[Ix]:
        """Each axis' index from its letter's variable: a split letter's as outer * group + inner,
        where an operand that does not read inner has no variable for it."""
        idx = []
        for c in axis_letter:
            if c is None:
                idx.append(Ix())
            elif c in self.letter_split:
                outer, inner, group = self.letter_split[c]
                idx.append(var_of[outer].scale(group) + var_of.get(inner, Ix()))
            else:
                idx.append(var_of[c])
        return idx

    def own_batch(self, batch: list[str], letters: str, value: Expr) -> list[str]:
        """The batch letters an operand has, in the call's order: a split letter's outer part, and its
        inner part only where the operand's value reads it (else its stride is 0)."""
        own = set(letters)
        for c, (outer, inner, _) in self.letter_split.items():
            if c in own:
                own |= {outer} | ({inner} if inner in expr_variables(value) else set())
        return [c for c in batch if c in own]

    @staticmethod
    def matrix_vector(m_letters: list[str], n_letters: list[str], sizes: dict[str, Dim]) -> bool:
        """Whether C has one row or one column per batch index (statically): a product whose
        operands a GEMM's blocking reuses nothing of, so a loop nest is a real alternative."""
        return any(isinstance(extent, int) and extent == 1 for extent in (numel(sizes[c] for c in m_letters), numel(sizes[c] for c in n_letters)))

    def offer_loop_form(self, i: int, out: int, packed: tuple[int, Load] | None = None) -> None:
        """The product just lowered also as the reduction loop over its operands where the graph
        has them (GemmCall.loops), when that form reads no weight the call does not (a weight
        stored twice would cost memory whichever form runs); `packed`: (which factor, its read from
        the call's packed copy) for a factor read there instead of recomputed."""
        known = len(self.buffers)
        loops = self.loop_kernel(i, out)
        if len(self.buffers) > known or loops.reduce is None:
            del self.buffers[known:]  # (only weights are made while an expression is built)
            return
        if packed is not None and isinstance(loops.value, Apply) and loops.value.op == "mul":
            position, read = packed
            factors = list(loops.value.args)
            factors[position] = read
            loops = replace(loops, value=replace(loops.value, args=tuple(factors)))
        self.kernels[-1] = replace(self.kernels[-1], loops=loops)

    def packed_read(
        self, i: int, buffer: int, trans: bool, strides: tuple[Dim, ...], batch: list[str], rows: list[str],
        cols: list[str], sizes: dict[str, Dim],
    ) -> Load:
        """The element of an operand packed for product i's call that the product's reduction loop
        (loop_kernel: its kept axes o0.., its reduced axes r0..) multiplies."""
        node = self.nodes[i]
        product_shape = self.nodes[node.srcs[0]].shape
        var_of: dict[str, Ix] = {}
        extents: dict[str, Dim] = {}
        for axis, letter in enumerate(string.ascii_letters[: len(product_shape)]):
            reduced = axis in node.arg
            name = f"r{sum(a in node.arg for a in range(axis))}" if reduced else f"o{sum(a not in node.arg for a in range(axis))}"
            var_of[letter], extents[name] = Ix.var(name), product_shape[axis]
        for c, (outer, inner, group) in self.letter_split.items():
            var_of[outer], var_of[inner] = ix_floordiv(var_of[c], group, extents), ix_mod(var_of[c], group, extents)
        order = cols + rows if trans else rows + cols
        index = linear([var_of[c] for c in order], tuple(sizes[c] for c in order))
        for c, stride in zip(batch, strides):
            index = index + var_of[c].scale(stride)
        return Load(buffer, index)

    def row_scaled_operand(
        self, operand: tuple[int, str, tuple[int, ...]], batch: list[str], rows: list[str], cols: list[str],
        n_letters: list[str], sizes: dict[str, Dim],
    ) -> tuple[int, bool, tuple[Dim, ...], Expr] | None:
        """A's buffer, transposition and batch strides, and f (over the batch and row letters), when A
        is X * f[batch, row] with X stored as the call reads it: sum_k X[m, k] f[m] B[k, n] is
        f[m] * (X B)[m, n], so X is multiplied where it lies and C is scaled after, instead of X * f
        being stored first (a softmax's division by its row sums, ahead of attention's second
        product: C has head-size columns, the probabilities sequence-length ones). None otherwise,
        or where C has more columns than A (the scaling would cost more than the copy)."""
        base, letters, squeezed, ones = operand
        if self.nodes[base].dtype not in ("float32", "float64"):
            return None
        probe = _probe_sizes([tuple(sizes[c] for c in rows + cols + n_letters)])
        if _probe(numel(sizes[c] for c in n_letters), probe) > _probe(numel(sizes[c] for c in cols), probe):
            return None
        axis_letter = _axis_letters(letters, squeezed, ones, len(self.nodes[base].shape))
        value = self.expr(base, self.axis_indices(axis_letter, _letter_vars(sizes)), dict(sizes))
        if not isinstance(value, Apply) or value.op != "mul":
            return None
        own_batch = self.own_batch(batch, letters, value)
        allowed = set(own_batch) | set(rows)
        for x, f in (value.args, value.args[::-1]):
            if not isinstance(x, Load) or not expr_variables(f) <= allowed:
                continue
            for trans, order in ((False, own_batch + rows + cols), (True, own_batch + cols + rows)):
                if x.index == linear([Ix.var(c) for c in order], tuple(sizes[c] for c in order)):
                    return x.buffer, trans, self.batch_strides(batch, order, sizes), f
        return None

    def gemm_operand(
        self, operand: tuple[int, str, tuple[int, ...]], batch: list[str], rows: list[str], cols: list[str],
        sizes: dict[str, Dim], dtype: str, right: bool = False,
    ) -> tuple[int, bool, tuple[Dim, ...], Panels | None, Dim | None]:
        """A buffer holding the operand as [its batch letters, rows, cols] (or cols, rows when
        transposed), whether it is transposed, its stride per batch letter, for the `right`
        operand read through windows (a convolution's) the loop nest that computes it in panels
        instead of a kernel that stores it whole, and its row stride where that is not the
        packed one (a head's slice of a [tokens, heads * size] projection, read in place)."""
        base, letters, squeezed, ones = operand
        shape = self.nodes[base].shape
        axis_letter = _axis_letters(letters, squeezed, ones, len(shape))
        value = self.expr(base, self.axis_indices(axis_letter, _letter_vars(sizes)), dict(sizes))
        own_batch = self.own_batch(batch, letters, value)
        for trans, order in ((False, own_batch + rows + cols), (True, own_batch + cols + rows)):
            if isinstance(value, Load) and value.index == linear([Ix.var(c) for c in order], tuple(sizes[c] for c in order)):
                return value.buffer, trans, self.batch_strides(batch, order, sizes), None, None
            inner, outer = (cols, rows) if not trans else (rows, cols)
            strided = _strided(value, own_batch, outer, inner, sizes) if len(outer) == 1 else None
            if strided is not None:
                strides, ld = strided
                return value.buffer, trans, tuple(strides.get(c, 0) for c in batch), None, ld
        trans, order = False, own_batch + rows + cols
        packed_shape = tuple(sizes[c] for c in order)
        dequantized = self.dequantizes(base)
        folded = None if dequantized else self.constant_value(base)
        if folded is not None:
            array = np.squeeze(folded, axis=squeezed) if squeezed else folded
            array = array[tuple(0 if c in ones else slice(None) for c in letters)]
            kept = [c for c in letters if c not in ones]
            array = np.ascontiguousarray(np.transpose(array, [kept.index(c) for c in order]))
            key = f"{self.nodes[base].arg if self.nodes[base].op is Op.CONSTANT else 'folded'}:gemm:{base}:{''.join(order)}"
            self.weights[key] = array
            buffer = self.new_buffer(array.dtype.name, array.shape, "weight", key)
        else:
            # blocks split the leading n axis: windows are read in place, int8 weights widened in cache
            panels = right and bool(cols) and (self.reads_windows(base) or dequantized)
            if not panels and self.reads_along_rows(base, axis_letter, rows, cols, sizes):
                trans, order = True, own_batch + cols + rows
                packed_shape = tuple(sizes[c] for c in order)
            extents = {f"o{j}": d for j, d in enumerate(packed_shape)}
            var_of = {c: Ix.var(f"o{j}") for j, c in enumerate(order)}
            value = self.expr(base, self.axis_indices(axis_letter, var_of), extents)
            key = (dtype, packed_shape, value)
            if not panels and key in self.packed:
                # the same operand of another product (a layer norm's output feeding the query, key
                # and value projections): computed and stored once
                return self.packed[key], trans, self.batch_strides(batch, order, sizes), None, None
            buffer = self.new_buffer(dtype, packed_shape, "panel" if panels else "temp")
            kernel = LoopKernel(buffer, packed_shape, value, None, base)
            if panels:
                axes = tuple(batch.index(c) for c in own_batch)
                return buffer, False, self.batch_strides(batch, order, sizes), Panels(kernel, axes, len(rows)), None
            self.kernels.append(kernel)
            self.packed[key] = buffer
        return buffer, trans, self.batch_strides(batch, order, sizes), None, None

    def reads_along_rows(
        self, base: int, axis_letter: list[str | None], rows: list[str], cols: list[str], sizes: dict[str, Dim]
    ) -> bool:
        """Whether an operand's loads step by one along its last row letter rather than its last
        column letter (attention's K^T over keys stored [key, head size]): packed as [cols, rows]
        for a transposed call, its copy then reads and writes contiguously, not a transpose."""
        if not rows or not cols:
            return False
        value = self.expr(base, self.axis_indices(axis_letter, _letter_vars(sizes)), dict(sizes))
        along_rows = along_cols = 0
        for e in walk(value):
            if isinstance(e, Load):
                steps = dict(e.index.terms)
                along_rows += steps.get(rows[-1]) == 1
                along_cols += steps.get(cols[-1]) == 1
        return along_rows > along_cols

    def dequantizes(self, i: int) -> bool:
        """Whether a value widens an integer weight into floats (compiler.quantize's int8 weights):
        folded into a float weight it would be stored four times larger, and the bytes a product
        moves are what weight-only quantization saves."""
        stack, seen = [i], set()
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            node = self.nodes[j]
            if node.op is Op.CAST and is_float(node.dtype):
                source = self.nodes[node.srcs[0]]
                if source.op is Op.CONSTANT and not is_float(source.dtype) and source.dtype != "bool":
                    return True
            if node.op in (Op.VIEW, Op.MUL, Op.CAST):  # the spelling of cast(q) * scale, nothing wider
                stack.extend(node.srcs)
        return False

    def reads_windows(self, i: int) -> bool:
        """Whether a value is read through a sliding window (each element several times)."""
        while self.nodes[i].op is Op.VIEW:
            if self.nodes[i].arg[0] == "window":
                return True
            i = self.nodes[i].srcs[0]
        return False

    @staticmethod
    def batch_strides(batch: list[str], order: list[str], sizes: dict[str, Dim]) -> tuple[Dim, ...]:
        strides = []
        for c in batch:
            if c in order:
                strides.append(numel(sizes[x] for x in order[order.index(c) + 1 :]))
            else:
                strides.append(0)
        return tuple(strides)

    def constant_value(self, i: int) -> np.ndarray | None:
        """The value of a node that depends on constants only (static shapes), else None."""
        memo: dict[int, np.ndarray] = {}
        order: list[int] = []
        stack, seen = [i], set()
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            node = self.nodes[j]
            if node.op in (Op.INPUT, Op.IOTA) or not is_static(node.shape):
                return None
            order.append(j)
            stack.extend(node.srcs)
        for j in sorted(order):
            node = self.nodes[j]
            memo[j] = eval_node(node, [memo[s] for s in node.srcs], self.graph, {})
        return np.asarray(memo[i])


def _splits_into_dot_products(out_letters: str, a_letters: str, b_letters: str, sizes: dict[str, Dim]) -> bool:
    """Whether the product, its letters split as lower_contraction splits them, writing its output
    in place, has one row and one column per batch index though its output has more."""
    batch = [c for c in out_letters if c in a_letters and c in b_letters]
    m_letters = [c for c in out_letters if c in a_letters and c not in b_letters]
    n_letters = [c for c in out_letters if c in b_letters and c not in a_letters]
    in_place = _in_place_split(out_letters, batch, m_letters, n_letters)
    if in_place is not None:
        batch, m_letters, n_letters, _ = in_place
    return numel(sizes[c] for c in m_letters + n_letters) == 1 and numel(sizes[c] for c in batch) != 1


def _batch_of_split(out_letters: str, a_letters: str, b_letters: str) -> list[str]:
    """The batch letters of the product as lower_contraction splits it to write in place."""
    batch = [c for c in out_letters if c in a_letters and c in b_letters]
    m_letters = [c for c in out_letters if c in a_letters and c not in b_letters]
    n_letters = [c for c in out_letters if c in b_letters and c not in a_letters]
    in_place = _in_place_split(out_letters, batch, m_letters, n_letters)
    return in_place[0] if in_place is not None else batch


def _ones_widen_the_batch(out_letters: str, a_letters: str, b_letters: str, ones: set[str]) -> bool:
    """Whether letters of extent 1 push rows into the batch: a decoding step's [batch, 1, k]
    times a weight read as [1, k, n] is one matrix-vector product per sequence, each streaming the
    whole weight, where without the 1 it is one product of `batch` rows."""
    kept = [c for c in _batch_of_split(out_letters, a_letters, b_letters) if c not in ones]
    dropped = _batch_of_split(*("".join(c for c in w if c not in ones) for w in (out_letters, a_letters, b_letters)))
    return len(dropped) < len(kept)


def _axis_letters(letters: str, squeezed: Sequence[int], ones: set[str], rank: int) -> list[str | None]:
    """Each axis of an operand's base: its letter, or None where it is broadcast (squeezed) or of
    extent 1 (indexed at 0)."""
    letter_iter = iter(letters)
    named = [None if axis in squeezed else next(letter_iter) for axis in range(rank)]
    return [None if c in ones else c for c in named]


def _in_place_split(
    out_letters: str, batch: list[str], m_letters: list[str], n_letters: list[str]
) -> tuple[list[str], list[str], list[str], bool] | None:
    """(batch, m, n, swap) such that the product's output is [batch..., m..., n...] (or
    [batch..., n..., m...] with the operands swapped) in the output's own layout, so the call
    writes it in place. Output letters ahead of the last shared batch letter become batch letters
    too (the operand without one is read with stride 0 along it): a convolution's output
    [image, group, channel, y, x] is then one product per image and group, [channel] x [y, x],
    with no transpose after it. None when no split fits (the result is then transposed)."""
    for cut in range(len(out_letters) + 1):
        prefix, rest = out_letters[:cut], out_letters[cut:]
        if not set(batch) <= set(prefix):
            continue
        m_rest = [c for c in rest if c in m_letters]
        n_rest = [c for c in rest if c in n_letters]
        if "".join(m_rest + n_rest) == rest:
            return list(prefix), m_rest, n_rest, False
        if "".join(n_rest + m_rest) == rest:
            return list(prefix), m_rest, n_rest, True
    return None


# ---- index arithmetic ----------------------------------------------------------------------------


def as_index(e: Expr, buffers: Sequence[Buffer]) -> Ix | None:
    """An integer value expression as an index expression when it is affine in loop indices, with
    bool-to-integer casts as 0/1 flags; None otherwise."""
    if isinstance(e, IndexValue):
        return e.index
    if isinstance(e, Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return Ix.of(e.value)
    if not isinstance(e, Apply) or not e.dtype.startswith(("int", "uint")):
        return None
    if e.op == "cast":
        inner = e.args[0]
        dtype = buffers[inner.buffer].dtype if isinstance(inner, Load) else inner.dtype
        return Ix.var(Atom("flag", (inner,))) if dtype == "bool" else None
    if e.op == "add":
        parts = [as_index(a, buffers) for a in e.args]
        return None if None in parts else parts[0] + parts[1]
    if e.op == "mul":
        a, b = e.args
        if isinstance(b, Const):
            a, b = b, a
        rest = as_index(b, buffers)
        if isinstance(a, Const) and isinstance(a.value, int) and rest is not None:
            return rest.scale(a.value)
    return None


def joined_parts(a: Expr, b: Expr, extents: dict[str, Dim]) -> Expr | None:
    """a + b as one read where both are the same value, each zero outside one range of the same
    index and the two ranges adjacent (a concatenation of a tensor with itself: the repeat of key
    and value heads for grouped-query attention): the value guarded to the union of the ranges,
    or not guarded where the union holds every value the index takes. None otherwise."""
    if not (isinstance(a, Guarded) and isinstance(b, Guarded)) or a.value != b.value or a.dtype != b.dtype:
        return None
    if len(a.guards) != 1 or len(b.guards) != 1 or a.fill != 0 or b.fill != 0:
        return None
    (ga, na), (gb, nb) = a.guards[0], b.guards[0]
    if ga.terms != gb.terms:
        return None
    # guard (g, n) with g = t + c holds for t in [-c, n - c)
    if dim_sub(dim_sub(nb, gb.const), dim_sub(0, ga.const)) == 0:
        (ga, na), (gb, nb) = (gb, nb), (ga, na)  # b's range ends where a's begins: b first
    if dim_sub(dim_sub(na, ga.const), dim_sub(0, gb.const)) != 0:
        return None
    low, high = dim_sub(0, ga.const), dim_sub(nb, gb.const)
    top = _index_top(Ix(ga.terms), extents)
    if top is not None and provably_le(low, 0) and provably_le(dim_add(top, 1), high):
        return a.value
    return Guarded(((ga, dim_add(na, nb)),), a.value, a.fill, a.dtype)


def _index_top(ix: Ix, extents: dict[str, Dim]) -> Dim | None:
    """The largest value of an index of nonnegative terms (loop variables, remainders), or None."""
    top: Dim = ix.const
    for var, coef in ix.terms:
        if not isinstance(coef, int) or coef < 0:
            return None
        if isinstance(var, str):
            top = dim_add(top, dim_mul(coef, dim_sub(extents[var], 1)))
        elif var.op == "mod":
            top = dim_add(top, dim_mul(coef, dim_sub(var.args[1], 1)))
        else:
            return None
    return top


def _strided(value: Expr, batch: list[str], outer: list[str], inner: list[str], sizes: dict[str, Dim]):
    """({batch letter: stride}, row stride) when `value` loads a matrix whose inner letters are
    contiguous and whose one outer letter steps by a stride of at least the inner extent (rows of a
    wider buffer), batch letters anywhere; None otherwise."""
    if not isinstance(value, Load) or value.index.const != 0:
        return None
    coefs: dict[str, Dim] = {}
    for var, coef in value.index.terms:
        if not isinstance(var, str) or var not in set(batch) | set(outer) | set(inner):
            return None
        coefs[var] = coef
    inner_sizes = tuple(sizes[c] for c in inner)
    if any(coefs.get(c, 0) != stride for c, stride in zip(inner, strides_of(inner_sizes))):
        return None
    ld = coefs.get(outer[0], 0)
    if sizes[outer[0]] != 1 and (ld == 0 or not provably_le(numel(inner_sizes), ld)):
        return None
    return {c: coefs[c] for c in batch if c in coefs}, ld if sizes[outer[0]] != 1 else numel(inner_sizes)


def _letter_vars(sizes: dict[str, Dim]) -> dict[str, Ix]:
    """Each letter of a product as a loop variable of its own name."""
    return {c: Ix.var(c) for c in sizes}


def _probe(d: Dim, sizes: dict[str, int]) -> int:
    return d if isinstance(d, int) else evaluate(d, sizes)


def _probe_sizes(shapes: Sequence[Shape]) -> dict[str, int]:
    """A distinct probe size per symbol (beyond the table, distinct odd numbers past it)."""
    names = sorted(symbols_of([d for shape in shapes for d in shape]))
    return {name: _PROBES[k] if k < len(_PROBES) else _PROBES[-1] + 2 * (k + 1) for k, name in enumerate(names)}


def view_index(
    transform: tuple, idx: list[Ix], src_shape: Shape, out_shape: Shape, extents: dict[str, Dim]
) -> tuple[list[Ix], list[tuple[Ix, Dim]]]:
    """The source index a view reads for output index `idx`, and the bounds it must satisfy."""
    kind = transform[0]
    if kind == "permute":
        src = [Ix()] * len(src_shape)
        for j, p in enumerate(transform[1]):
            src[p] = idx[j]
        return src, []
    if kind == "expand":
        return [Ix() if s == 1 else ix for ix, s in zip(idx, src_shape)], []
    if kind == "slice":
        src = []
        for ix, d, (start, stop, step) in zip(idx, src_shape, transform[1]):
            if isinstance(d, int) and isinstance(start, int) and (stop is None or isinstance(stop, int)):
                start = range(*slice(start, stop, step).indices(d)).start
            elif step < 0:
                start = dim_min(start, dim_sub(d, 1))
            src.append(ix.scale(step) + Ix.of(start))
        return src, []
    if kind == "pad":
        src, guards = [], []
        for ix, d, (before, _after) in zip(idx, src_shape, transform[1]):
            if before == 0 and _after == 0:
                src.append(ix)
                continue
            shifted = ix + Ix.of(dim_sub(0, before))
            src.append(shifted)
            guards.append((shifted, d))
        return src, guards
    if kind == "window":
        _, axes, _kernel, strides, dilations = transform
        src = list(idx[: len(src_shape)])
        for j, (axis, stride, dilation) in enumerate(zip(axes, strides, dilations)):
            src[axis] = idx[axis].scale(stride) + idx[len(src_shape) + j].scale(dilation)
        return src, []
    if kind == "reshape":
        return reshape_index(idx, src_shape, out_shape, extents), []
    raise NotNative(f"view {kind}")


def reshape_index(idx: list[Ix], src_shape: Shape, out_shape: Shape, extents: dict[str, Dim]) -> list[Ix]:
    """Axes are grouped where running products agree, so a split or merge of adjacent axes costs
    one multiply-add or one division, not a round trip through the flat offset."""
    src = [Ix()] * len(src_shape)
    for gs, go in _reshape_groups(src_shape, out_shape):
        out_dims = tuple(out_shape[j] for j in go)
        flat = linear([idx[j] for j in go], out_dims)
        inner: Dim = 1
        for pos in range(len(gs) - 1, -1, -1):
            axis = gs[pos]
            part = ix_floordiv(flat, inner, extents)
            src[axis] = part if pos == 0 else ix_mod(part, src_shape[axis], extents)
            inner = dim_mul(inner, src_shape[axis])
    return src


def _reshape_groups(src_shape: Shape, out_shape: Shape) -> list[tuple[list[int], list[int]]]:
    """Runs of source and output axes (size-1 axes left out) that hold the same elements, in order.
    Probe sizes, one per symbol, suggest where runs end; a run stands only when its sizes are equal
    as symbolic expressions (a probe cannot tell batch from seq when they happen to coincide), else
    it is merged with the runs after it until they are. A last run that never is, or a reshape with
    no runs at all, goes through the flat offset; it holds the same number of elements because
    the whole reshape does and every run before it does."""
    src_axes = [j for j, d in enumerate(src_shape) if d != 1]
    out_axes = [j for j, d in enumerate(out_shape) if d != 1]
    sizes = _probe_sizes([src_shape, out_shape])
    suggested: list[tuple[list[int], list[int]]] = []
    s = o = 0
    while s < len(src_axes) and o < len(out_axes):
        gs, go = [src_axes[s]], [out_axes[o]]
        ps, po = _probe(src_shape[gs[0]], sizes), _probe(out_shape[go[0]], sizes)
        s, o = s + 1, o + 1
        while ps != po:
            if ps < po and s < len(src_axes):
                gs.append(src_axes[s])
                ps *= _probe(src_shape[src_axes[s]], sizes)
                s += 1
            elif po < ps and o < len(out_axes):
                go.append(out_axes[o])
                po *= _probe(out_shape[out_axes[o]], sizes)
                o += 1
            else:
                break
        suggested.append((gs, go))
    suggested.append((src_axes[s:], out_axes[o:]))  # what the probes could not pair, if anything
    groups: list[tuple[list[int], list[int]]] = []
    gs, go = [], []
    for more_s, more_o in suggested:
        gs, go = gs + more_s, go + more_o
        if gs and go and dim_sub(numel(src_shape[j] for j in gs), numel(out_shape[j] for j in go)) == 0:
            groups.append((gs, go))
            gs, go = [], []
    if gs or go:
        if groups and not (gs and go):  # axes whose sizes multiply to 1: part of the run before
            last_s, last_o = groups.pop()
            gs, go = last_s + gs, last_o + go
        groups.append((gs, go))
    return groups


__all__ = [
    "GEMM_DTYPES",
    "NATIVE_DTYPES",
    "NotNative",
    "as_index",
    "joined_parts",
    "lower",
    "reshape_index",
    "view_index",
]
