"""A program's arena layout, prepared once per loaded program (compiler.backends.layout.ArenaPlan),
gives what evaluating every buffer's symbolic shape gives, at any sizes: a decoder lays out a
call every step, its past one token longer each time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compiler import compile_onnx
from compiler.backends.layout import ArenaPlan
from compiler.dtypes import numpy_dtype
from compiler.shape import evaluate

DECODER = Path(__file__).parent / "fixtures" / "generation" / "gpt2" / "model_torchscript.onnx"


def naive(program, slots: dict[int, int], bindings: dict[str, int], alignment: int):
    outputs = [b for b in program.buffers if b.role == "output"]
    temps = [b for b in program.buffers if b.role == "temp" and b.id in slots]
    shapes = [tuple(evaluate(d, bindings) for d in b.shape) for b in outputs]
    slot_bytes: dict[int, int] = {}
    for b in temps:
        size = (
            int(np.prod([evaluate(d, bindings) for d in b.shape], dtype=np.int64))
            * numpy_dtype(b.dtype).itemsize
        )
        slot_bytes[slots[b.id]] = max(slot_bytes.get(slots[b.id], 0), size)
    offsets, total = {}, 0
    for slot in sorted(slot_bytes):
        offsets[slot] = total
        total += -(-slot_bytes[slot] // alignment) * alignment
    return shapes, [offsets[slots[b.id]] for b in temps], total


def test_the_prepared_layout_equals_the_buffers_evaluated_one_by_one() -> None:
    from compiler.backends import native_cpu
    from compiler.runnable import executable

    program = executable(compile_onnx(DECODER.read_bytes(), "cpu"))
    assert isinstance(program, native_cpu.NativeProgram)
    plan = ArenaPlan(program._outputs, program._temps, program.slots, native_cpu.ALIGNMENT)
    assert len(plan._dims) < len(program._temps)  # few distinct dims among many buffers
    for batch, seq, past in [(1, 1, 0), (3, 5, 7), (16, 1, 100), (2, 64, 1)]:
        bindings = {"batch_size": batch, "sequence_length": seq, "past_sequence_length": past}
        bindings = {k: v for k, v in bindings.items() if k in program.symbols}
        buffers = type("P", (), {"buffers": program.buffers})
        assert plan(bindings) == naive(buffers, program.slots, bindings, native_cpu.ALIGNMENT)
