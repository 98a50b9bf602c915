"""Flat loops given back their axes (compiler/kernels/delinearize.py): a loop over a flattened
value whose loads divide the flat index runs over the axes the divisors cut it into, with affine
indices; results are unchanged."""

from __future__ import annotations

import numpy as np
import onnxruntime
from onnx import helper

from compiler.backends import native_cpu
from compiler.frontends.onnx import load_graph
from compiler.kernels.delinearize import delinearize
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import Atom, Buffer, Ix, Load, LoopKernel, Program
from compiler.kernels.ir_walk import walk
from compiler.kernels.lower import lower
from compiler.pipeline import sample_inputs
from compiler.render.c import render
from tests.onnx_models import make_model, tensor


def _divisions(kernel: LoopKernel) -> list[Atom]:
    return [e for v in kernel.values for e in walk(v) if isinstance(e, Atom) and e.op in ("floordiv", "mod")]


def _flattened_transpose() -> bytes:
    """[n, 4, 6] transposed to [n, 6, 4] and flattened: one flat loop whose load divides o0."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["t", "flat"], ["y"]),
    ]
    flat = helper.make_tensor("flat", 7, [1], [-1])
    return make_model(nodes, [tensor("x", ["n", 4, 6])], [tensor("y", ["m"])], [flat]).SerializeToString()


def test_a_flattened_transpose_runs_over_its_axes_with_affine_indices():
    data = _flattened_transpose()
    graph = load_graph(data)
    lowered = lower(graph)
    (flat,) = [k for k in lowered.kernels if isinstance(k, LoopKernel) and len(k.shape) == 1]
    assert _divisions(flat)  # the flat loop divides its index (the test's premise)
    program = fuse(lowered)
    (kernel,) = [k for k in program.kernels if k.out == flat.out]
    assert len(kernel.shape) == 3 and kernel.shape[1:] == (6, 4) and not _divisions(kernel)
    library = native_cpu.build(render(program))
    runner = native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, library)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for n in (1, 3):
        inputs = sample_inputs(graph, seed=n, symbol_size=n)
        np.testing.assert_array_equal(runner.run(inputs)["y"], session.run(None, inputs)[0])


def _flat_program(index: Ix) -> Program:
    buffers = [Buffer(0, "float32", (24,), "input", "x"), Buffer(1, "float32", (24,), "output", "y")]
    return Program(buffers, [LoopKernel(1, (24,), Load(0, index))], [])


def test_divisors_that_do_not_chain_leave_the_loop_flat():
    """o0 % 4 and o0 % 6: neither divides the other, so no shape makes both affine."""
    o0 = Ix.var("o0")
    index = Ix.var(Atom("mod", (o0, 4))).scale(6) + Ix.var(Atom("mod", (o0, 6)))
    program = _flat_program(index)
    assert delinearize(program) is program


def test_chained_divisors_cut_the_loop_outermost_first():
    """(o0 / 6) % 2 and o0 % 6 over 24 elements: the shape [2, 2, 6]."""
    o0 = Ix.var("o0")
    index = Ix.var(Atom("mod", (Ix.var(Atom("floordiv", (o0, 6))), 2))).scale(6) + Ix.var(Atom("mod", (o0, 6)))
    (kernel,) = delinearize(_flat_program(index)).kernels
    assert kernel.shape == (2, 2, 6) and not _divisions(kernel)
    assert kernel.value == Load(0, Ix.var("o1").scale(6) + Ix.var("o2"))
