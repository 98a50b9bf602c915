"""Vertical fusion of elementwise loops: a chain of loops over the same elements, each reading
the ones before at its own element (GELU's tanh or erf spelled as several values, each read more
than once and so given a buffer by lowering), becomes one loop whose earlier values are locals
(`Let`), stored only where another kernel still reads them. One pass over memory and one fork
and join instead of one per value. Device-neutral: a renderer declares the locals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from compiler.kernels.delinearize import delinearize
from compiler.kernels.epilogue import fuse_epilogues
from compiler.kernels.ir import (
    Atom,
    Expr,
    Guarded,
    IndexValue,
    Ix,
    Let,
    Load,
    LoopKernel,
    Program,
)
from compiler.kernels.ir_walk import (
    drop_unit_axes,
    identity_index,
    kernel_reads,
    kernel_stores,
    linear,
    map_loads,
    plan_slots,
    walk,
)
from compiler.shape import Dim, numel


@dataclass
class _Group:
    steps: list[int] = field(default_factory=list)
    # the shape of its members that are not flat, None while every member is flat
    shape: tuple[Dim, ...] | None = None
    written: set[int] = field(default_factory=set)
    # what its members read
    reads: set[int] = field(default_factory=set)


def fuse(program: Program) -> Program:
    """Chains of elementwise loops as one loop, flat loops that divide their index given back
    their axes, then a product's elementwise consumer (bias, activation, residual) run on its
    blocks of C as they are written: what native programs get."""
    return fuse_epilogues(delinearize(fuse_elementwise(program)))


def fuse_elementwise(program: Program) -> Program:
    """The program with chains of elementwise loops over the same elements fused (see the module's
    docstring); the program itself when there are none."""
    kernels = program.kernels
    readers: dict[int, list[int]] = {}
    for step, kernel in enumerate(kernels):
        for b in kernel_reads(kernel):
            readers.setdefault(b, []).append(step)
    writes = Counter(b for kernel in kernels for b in kernel_stores(kernel))
    group_of: dict[int, _Group] = {}  # buffer written by a group member -> its group
    groups: list[_Group] = []
    for step, kernel in enumerate(kernels):
        # a loop that updates a buffer in place (lowering scales a product's rows so) stays as it is
        if not _elementwise(kernel) or writes[kernel.out] != 1 or kernel.out in kernel_reads(kernel):
            continue
        sources = {id(group_of[b]): group_of[b] for b in kernel_reads(kernel) if b in group_of}
        if not sources and groups and groups[-1].steps[-1] == step - 1 and groups[-1].reads & kernel_reads(kernel):
            sources = {id(groups[-1]): groups[-1]}  # the loop just before reads the same operands
        group = next(iter(sources.values())) if len(sources) == 1 else None
        if group is None or not _joins(program, group, kernel, step, readers):
            group = _Group()
            groups.append(group)
        group.steps.append(step)
        group.written.add(kernel.out)
        group.reads |= kernel_reads(kernel)
        if len(kernel.shape) != 1 or not _flat_identity(kernel):
            group.shape = tuple(kernel.shape)
        group_of[kernel.out] = group
    fused: dict[int, LoopKernel | None] = {}
    for group in groups:
        if len(group.steps) < 2:
            continue
        members = [kernels[s] for s in group.steps]
        outside = {s for b in group.written for s in readers.get(b, []) if s not in group.steps}
        shape = group.shape if group.shape is not None else tuple(members[-1].shape)
        lets = tuple(
            Let(m.out, _on_shape(m, shape), program.buffers[m.out].role != "temp" or any(
                s in outside for s in readers.get(m.out, [])))
            for m in members[:-1]
        )
        last = members[-1]
        fused[group.steps[-1]] = LoopKernel(last.out, shape, _on_shape(last, shape), None, last.node, lets)
        for s in group.steps[:-1]:
            fused[s] = None
    if not fused:
        return program
    kept = [fused.get(s, k) for s, k in enumerate(kernels)]  # None: computed in a later member's loop
    result = Program(program.buffers, [k for k in kept if k is not None], program.symbols, {}, program.weights)
    result.slots = plan_slots(result)
    return result


def _elementwise(kernel) -> bool:
    return isinstance(kernel, LoopKernel) and kernel.reduce is None and not kernel.lets and len(kernel.shape) >= 1


def _joins(program: Program, group: _Group, kernel: LoopKernel, step: int, readers: dict[int, list[int]]) -> bool:
    """Whether `kernel` can be computed in `group`'s loop, which then runs at `step`."""
    first = program.kernels[group.steps[0]]
    if numel(first.shape) != numel(kernel.shape):
        return False
    flat = len(kernel.shape) == 1 and _flat_identity(kernel)
    if not flat and group.shape is not None and tuple(kernel.shape) != group.shape:
        return False
    # every read of the group's values is at the reading element
    if any(
        isinstance(e, Load) and e.buffer in group.written and not _is_identity(e.index, kernel.shape)
        for e in walk(kernel.value)
    ):
        return False
    # nothing outside the group reads its values before the fused loop runs (at `step`), and
    # nothing there updates in place what its members read (they now read it at `step`)
    if any(s not in group.steps and s < step for b in group.written for s in readers.get(b, [])):
        return False
    return not any(
        group.reads & kernel_stores(program.kernels[s]) for s in range(group.steps[0] + 1, step) if s not in group.steps
    )


def _is_identity(ix: Ix, shape) -> bool:
    return drop_unit_axes(ix, shape) == identity_index(shape)


def _flat_identity(kernel: LoopKernel) -> bool:
    """A flat loop whose every load reads at its own element (and that reads its index nowhere
    else): it computes the same on any shape of as many elements."""
    o0 = Ix.var("o0")
    for e in walk(kernel.value):
        if isinstance(e, Load) and e.index != o0 or isinstance(e, IndexValue):
            return False
        if isinstance(e, Guarded) and any(v == "o0" for g, _ in e.guards for v, _ in g.terms):
            return False
        if isinstance(e, Atom) and e.op not in ("flag", "value"):
            return False
    return True


def _on_shape(kernel: LoopKernel, shape) -> Expr:
    """The kernel's value over a loop of `shape` (a flat loop's loads, all at o0, re-indexed)."""
    if tuple(kernel.shape) == tuple(shape):
        return kernel.value
    index = linear([Ix.var(f"o{j}") for j in range(len(shape))], shape)
    return map_loads(kernel.value, lambda load: Load(load.buffer, index))


__all__ = ["fuse", "fuse_elementwise"]
