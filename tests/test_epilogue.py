"""Fusion in the kernel IR: chains of elementwise loops as one loop with locals
(compiler/kernels/fusion.py), and fused epilogues (compiler/kernels/epilogue.py), where an
elementwise loop over a product's output runs inside the product, on each block of C as it is
written. Which loops fuse, which must not, and that fused programs match the reference
interpreter for every kind of product."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

from compiler.backends import native_cpu
from compiler.frontends.onnx import load_graph
from compiler.kernels.epilogue import fuse_epilogues
from compiler.kernels.fusion import fuse, fuse_elementwise
from compiler.kernels.ir import GemmCall, LoopKernel
from compiler.kernels.ir_walk import kernel_reads
from compiler.kernels.lower import lower
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.c import prepack_weights, render
from tests.onnx_models import init, make_model, mlp, tensor


def run_native(graph, program, gemm: str, inputs) -> dict[str, np.ndarray]:
    if gemm != "blas":
        program = prepack_weights(program)
    library = native_cpu.build(render(program, gemm=gemm))
    return native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, library).run(inputs)


def assert_matches_reference(graph, program, gemm: str, seeds=(0, 1), sizes=(1, 5)) -> None:
    for seed, size in zip(seeds, sizes):
        inputs = sample_inputs(graph, seed=seed, symbol_size=size)
        want = run_graph(graph, inputs)
        got = run_native(graph, program, gemm, inputs)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{name} {gemm} size={size}")


def fused(program) -> list[GemmCall]:
    return [k for k in program.kernels if isinstance(k, GemmCall) and k.epilogue is not None]


def test_a_dense_layers_bias_and_relu_run_inside_its_product() -> None:
    graph = load_graph(mlp(hidden=64).SerializeToString())  # Gemm, Relu, Gemm, Softmax
    program = lower(graph)
    call, relu = program.kernels[:2]
    assert isinstance(call, GemmCall) and isinstance(relu, LoopKernel) and call.c in kernel_reads(relu)
    after = fuse_epilogues(program)
    assert len(after.kernels) == len(program.kernels) - 1
    first = after.kernels[0]
    # the product writes the relu's buffer and rewrites it in place; its own C is left unused
    assert first.epilogue is not None and first.c == relu.out
    assert call.c not in after.slots and all(call.c not in kernel_reads(k) for k in after.kernels)
    kernel = render(after).split("static void k0(")[1].split("static void k1(")[0]
    assert "scipy_cblas_sgemm(101" in kernel and f"b{relu.out}[t * m * n + i * n + j] = " in kernel
    assert "LC_MAX(" in kernel  # the relu, inside the product's kernel
    for gemm in ("blas", "mixed", "panels", "tiled"):
        assert_matches_reference(graph, after, gemm)


def _product_then(nodes, extra_inputs=(), x_shape=("n", 24), n: int = 40, y_shape=None, seed: int = 0) -> onnx.ModelProto:
    """y = f(x @ w, ...) for the nodes given, which read "c" (the product) and write "y"."""
    rng = np.random.default_rng(seed)
    w = init("w", rng.standard_normal((x_shape[-1], n)).astype(np.float32))
    inits = [w, init("bias", rng.standard_normal(n).astype(np.float32))]
    product = helper.make_node("MatMul", ["x", "w"], ["c"])
    outputs = [tensor("y", list(y_shape or (x_shape[0], n)))]
    return make_model([product, *nodes], [tensor("x", list(x_shape)), *extra_inputs], outputs, inits)


def test_a_loop_reading_the_product_transposed_or_twice_is_left_alone() -> None:
    transposed = _product_then([helper.make_node("Transpose", ["c"], ["y"], perm=[1, 0])], y_shape=(40, "n"))
    twice = _product_then(
        [helper.make_node("Relu", ["c"], ["r"]), helper.make_node("ReduceSum", ["c"], ["s"], keepdims=1),
         helper.make_node("Add", ["r", "s"], ["y"])]
    )
    for model in (transposed, twice):
        graph = load_graph(model.SerializeToString())
        program = fuse_epilogues(lower(graph))
        assert fused(program) == []
        assert_matches_reference(graph, program, "blas")


def test_a_sum_of_two_products_fuses_into_the_later_one() -> None:
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["x", "w2"], ["d"]),
        helper.make_node("Add", ["c", "d"], ["s"]),
        helper.make_node("Add", ["s", "bias"], ["y"]),
    ]
    model = _product_then(nodes)
    model.graph.initializer.append(init("w2", rng.standard_normal((24, 40)).astype(np.float32)))
    graph = load_graph(model.SerializeToString())
    program = fuse_epilogues(lower(graph))
    calls = [k for k in program.kernels if isinstance(k, GemmCall)]
    # the add reads both products: only the second one has the first's sum ready
    assert len(program.kernels) == 2 and calls[0].epilogue is None and calls[1].epilogue is not None
    for gemm in ("blas", "tiled"):
        assert_matches_reference(graph, program, gemm)


def test_a_convolutions_batch_norm_and_relu_run_inside_it() -> None:
    rng = np.random.default_rng(2)
    channels, out = 8, 16
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["b"]),
        helper.make_node("Add", ["b", "x2"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    inits = [
        init("w", rng.standard_normal((out, channels, 3, 3)).astype(np.float32)),
        *(init(name, rng.uniform(0.5, 1.5, out).astype(np.float32)) for name in ("scale", "shift", "mean", "var")),
    ]
    model = make_model(
        nodes, [tensor("x", ["n", channels, 24, 24]), tensor("x2", ["n", out, 24, 24])],
        [tensor("y", ["n", out, 24, 24])], inits,
    )
    graph = load_graph(model.SerializeToString())
    program = fuse_epilogues(lower(graph))
    (call,) = fused(program)
    assert call.b_panels is not None  # the windows' product: panels, or read in place by "mixed"
    source = render(program, gemm="mixed")
    assert "lc_conv_rows(g" in source and "const int64_t lc_i0 = m_lo, lc_i1 = m_lo + rows_m, lc_j0 = r0 * 24, lc_j1 = r1 * 24;" in source
    for gemm in ("blas", "mixed", "panels", "tiled"):
        assert_matches_reference(graph, program, gemm, sizes=(1, 3))


# erf and tanh lower to several values, each read more than once (lets), and to selects (flags)
EPILOGUES = ("bias", "relu", "sigmoid", "erf", "tanh", "residual", "row_scale", "transpose")


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=st.lists(st.sampled_from(EPILOGUES), min_size=1, max_size=3),
    k=st.integers(1, 40),
    n=st.integers(1, 50),
    gemm=st.sampled_from(["blas", "mixed", "panels", "tiled"]),
)
def test_fused_programs_match_the_reference(chain, k, n, gemm) -> None:
    # x @ w then a chain of elementwise ops; each operand has the shape its place in the chain has
    nodes, extra, value, shape = [], [], "c", ("n", n)
    for number, step in enumerate(chain):
        out = f"e{number}"
        if step == "transpose":
            nodes.append(helper.make_node("Transpose", [value], [out], perm=[1, 0]))
            shape = shape[::-1]
        elif step in ("relu", "sigmoid", "erf", "tanh"):
            nodes.append(helper.make_node(step.capitalize(), [value], [out]))
        else:
            operand = {"bias": [shape[1]], "residual": list(shape), "row_scale": [shape[0], 1]}[step]
            extra.append(tensor(f"v{number}", operand))
            nodes.append(helper.make_node("Mul" if step == "row_scale" else "Add", [value, f"v{number}"], [out]))
        value = out
    nodes.append(helper.make_node("Identity", [value], ["y"]))
    graph = load_graph(_product_then(nodes, extra, x_shape=("n", k), n=n, y_shape=shape).SerializeToString())
    program = fuse(lower(graph))
    # with the product read in its own layout, its first reader is an elementwise loop: it fuses
    # (k = n = 1 may fold to a product of scalars, and no call is left to fuse into). Not where an
    # erf or tanh runs in the transposed layout: its several values, each read more than once, are
    # computed by a loop of their own, which a loop reading them transposed does not take in
    # (hypothesis found ['transpose', 'tanh', 'transpose'], which never fused)
    transposed_lets = any(
        step in ("erf", "tanh") and chain[:number].count("transpose") % 2 for number, step in enumerate(chain)
    )
    if (
        chain.count("transpose") % 2 == 0
        and not transposed_lets
        and any(isinstance(kernel, GemmCall) for kernel in program.kernels)
    ):
        assert fused(program), chain
    assert_matches_reference(graph, program, gemm, sizes=(1, 7))


def _unary_model(nodes, outputs=("y",)) -> onnx.ModelProto:
    return make_model(nodes, [tensor("x", ["n", 40])], [tensor(name, ["n", 40]) for name in outputs])


def test_a_chain_of_elementwise_values_is_one_loop_with_locals() -> None:
    # erf lowers to several values, each read more than once: each had a buffer and a loop
    graph = load_graph(_unary_model([helper.make_node("Erf", ["x"], ["y"])]).SerializeToString())
    program = lower(graph)
    loops = [k for k in program.kernels if isinstance(k, LoopKernel)]
    assert len(loops) >= 2
    fused_program = fuse_elementwise(program)
    (loop,) = fused_program.kernels
    assert len(loop.lets) == len(loops) - 1 and not any(let.store for let in loop.lets)
    # the values are locals now: no arena slot, and the loop computes them a chunk at a time
    assert not fused_program.slots
    assert all(f"lc_v{let.buffer}[" in render(fused_program) for let in loop.lets)
    assert_matches_reference(graph, fused_program, "blas", sizes=(1, 700))


def test_a_value_another_kernel_reads_is_stored_as_well() -> None:
    nodes = [
        helper.make_node("Tanh", ["x"], ["e"]),
        helper.make_node("Add", ["e", "e"], ["y"]),
        helper.make_node("ReduceSum", ["e"], ["s"], keepdims=1),
    ]
    outputs = [tensor("y", ["n", 40]), tensor("s", ["n", 1])]
    graph = load_graph(make_model(nodes, [tensor("x", ["n", 40])], outputs).SerializeToString())
    program = fuse_elementwise(lower(graph))
    stored = [let.buffer for k in program.kernels if isinstance(k, LoopKernel) for let in k.lets if let.store]
    reductions = [k for k in program.kernels if isinstance(k, LoopKernel) and k.reduce is not None]
    # tanh's value is computed in y's loop and kept for the sum, which reads a whole row of it
    assert stored and any(set(stored) & kernel_reads(r) for r in reductions)
    assert_matches_reference(graph, program, "blas", sizes=(1, 9))


def test_a_product_scaled_in_place_keeps_its_scaling_loop_and_matches() -> None:
    # (g * x) @ w with g one number per row (and fewer columns in C than in x): lowering scales
    # C's rows in place after the call
    nodes = [
        helper.make_node("Mul", ["g", "x"], ["gx"]),
        helper.make_node("MatMul", ["gx", "w"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Sigmoid", ["r"], ["y"]),
    ]
    rng = np.random.default_rng(3)
    model = make_model(
        nodes, [tensor("x", ["n", 64]), tensor("g", ["n", 1])], [tensor("y", ["n", 16])],
        [init("w", rng.standard_normal((64, 16)).astype(np.float32))],
    )
    graph = load_graph(model.SerializeToString())
    program = lower(graph)
    in_place = [k for k in program.kernels if isinstance(k, LoopKernel) and k.out in kernel_reads(k)]
    assert in_place, "lowering no longer scales the product's rows in place: this test tests nothing"
    after = fuse(program)
    # the product is written twice (the call, then the scaling): neither fusion may take it
    assert in_place[0] in after.kernels and fused(after) == []
    for gemm in ("blas", "tiled"):
        assert_matches_reference(graph, after, gemm)
