"""Where a loaded program's buffers go for a call: the symbols' values the inputs imply (checked
against the graph's limits), the outputs' shapes, and each temp's offset in one arena, its slots
planned at compile time (`Program.slots`: temps whose lifetimes do not overlap share one). Every
backend lays out its calls this way: the native CPU program in host memory, a CUDA program in
device memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from compiler.dtypes import numpy_dtype
from compiler.kernels.ir import Buffer, Program
from compiler.shape import ShapeError, evaluate, shape_to_json


def describe(program: Program, size_limits: Mapping[str, int]) -> dict[str, Any]:
    """What a runtime needs of a program besides its code: buffers, arena slots, symbols, and the
    largest size each symbol may take (the graph's own limits)."""
    return {
        "size_limits": dict(sorted(size_limits.items())),
        "buffers": [
            {"dtype": b.dtype, "shape": shape_to_json(b.shape), "role": b.role, "name": b.name}
            for b in program.buffers
        ],
        "slots": {str(k): v for k, v in program.slots.items()},
        "symbols": program.symbols,
    }


def bind_inputs(inputs: Sequence[Buffer], values: Mapping[str, np.ndarray], size_limits: Mapping[str, int]) -> dict[str, int]:
    """The symbols' values the inputs' shapes give; ShapeError past a symbol's limit (the
    generated code reads without bounds checks: a slice past its buffer is refused here)."""
    bindings: dict[str, int] = {}
    for b in inputs:
        actual = np.shape(values[b.name])
        for declared, size in zip(b.shape, actual, strict=True):
            if not isinstance(declared, int):
                symbol = declared.as_symbol()
                if symbol is not None:
                    bindings.setdefault(symbol, int(size))
    for symbol, limit in size_limits.items():
        if bindings.get(symbol, 0) > limit:
            raise ShapeError(f"{symbol}={bindings[symbol]} takes a slice past the end of a buffer (at most {limit})")
    return bindings


class ArenaPlan:
    """arena_layout for one program, prepared once: its buffers' sizes hold few distinct
    symbolic dims, each evaluated once per call (a decoder's past length changes every step, so
    a layout is worked out every step; evaluating every buffer's dims took a millisecond)."""

    def __init__(self, outputs: Sequence[Buffer], temps: Sequence[Buffer], slots: Mapping[int, int], alignment: int) -> None:
        distinct: dict[object, int] = {}

        def refs(shape) -> tuple[int, ...]:
            # an int stays itself (>= 0); a symbolic dim becomes -(1 + its index in `distinct`)
            return tuple(d if isinstance(d, int) else -1 - distinct.setdefault(d, len(distinct)) for d in shape)

        self._outputs = [refs(b.shape) for b in outputs]
        self._temps = [(slots[b.id], numpy_dtype(b.dtype).itemsize, refs(b.shape)) for b in temps]
        self._dims = list(distinct)
        self._alignment = alignment

    def __call__(self, bindings: Mapping[str, int]) -> tuple[list[tuple[int, ...]], list[int], int]:
        values = [evaluate(d, bindings) for d in self._dims]

        def size(ref: int) -> int:
            return ref if ref >= 0 else values[-1 - ref]

        output_shapes = [tuple(size(r) for r in shape) for shape in self._outputs]
        slot_bytes: dict[int, int] = {}
        for slot, itemsize, shape in self._temps:
            count = 1
            for ref in shape:
                count *= size(ref)
            slot_bytes[slot] = max(slot_bytes.get(slot, 0), count * itemsize)
        slot_offsets, total = {}, 0
        alignment = self._alignment
        for slot in sorted(slot_bytes):
            slot_offsets[slot] = total
            total += -(-slot_bytes[slot] // alignment) * alignment
        return output_shapes, [slot_offsets[slot] for slot, _, _ in self._temps], total


def arena_layout(
    outputs: Sequence[Buffer], temps: Sequence[Buffer], slots: Mapping[int, int], bindings: Mapping[str, int], alignment: int
) -> tuple[list[tuple[int, ...]], list[int], int]:
    """The outputs' shapes, each temp's offset (in `temps` order) and the arena's size in bytes,
    every slot starting at a multiple of `alignment` (ArenaPlan, prepared for one call)."""
    return ArenaPlan(outputs, temps, slots, alignment)(bindings)


__all__ = ["ArenaPlan", "arena_layout", "bind_inputs", "describe"]
