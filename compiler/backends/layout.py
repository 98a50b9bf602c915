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


def arena_layout(
    outputs: Sequence[Buffer], temps: Sequence[Buffer], slots: Mapping[int, int], bindings: Mapping[str, int], alignment: int
) -> tuple[list[tuple[int, ...]], list[int], int]:
    """The outputs' shapes, each temp's offset (in `temps` order) and the arena's size in bytes,
    every slot starting at a multiple of `alignment`."""
    output_shapes = [tuple(evaluate(d, bindings) for d in b.shape) for b in outputs]
    slot_bytes: dict[int, int] = {}
    for b in temps:
        size = int(np.prod([evaluate(d, bindings) for d in b.shape], dtype=np.int64)) * numpy_dtype(b.dtype).itemsize
        slot = slots[b.id]
        slot_bytes[slot] = max(slot_bytes.get(slot, 0), size)
    slot_offsets, total = {}, 0
    for slot in sorted(slot_bytes):
        slot_offsets[slot] = total
        total += -(-slot_bytes[slot] // alignment) * alignment
    return output_shapes, [slot_offsets[slots[b.id]] for b in temps], total


__all__ = ["arena_layout", "bind_inputs", "describe"]
