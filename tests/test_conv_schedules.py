"""Convolutions in each generated product kind against onnxruntime, at shapes whose last register
tile is narrower than a whole one (a vector or two of columns), with a fused bias and relu."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import compile_onnx, executable

# (output channels, input channels, kernel, stride, pad, input height, width): odd channel counts,
# and outputs whose columns per image (or per row block) end in a partial tile
CONVOLUTIONS = [
    (13, 7, 3, 1, 1, 7, 7),  # 49 positions: a tile of 48 and one column (panels)
    (11, 5, 3, 2, 1, 27, 27),  # stride 2: 14x14 = 196 positions, 4 past the last whole tile
    (9, 7, 3, 1, 1, 9, 22),  # rows of 22 read in place: blocks of 24-column rows end in part of a tile
    (21, 13, 1, 1, 0, 7, 7),  # a 1x1 convolution: a plain product of 49 columns
    (8, 3, 7, 2, 3, 31, 45),  # a stem: 4 phase planes, 23 columns a row
]
# for the "direct" kind besides: channels copied innermost 8 by 8 with some left over (21 = 2 x 8 +
# 5 columns, 17 = 2 x 8 + 1 channels), C^T's tiles stored 8 by 8 (64 = 48 + 16 channels, 8 + 3), a
# dilated window, and 7 rows that two threads share by channels
DIRECT_CONVOLUTIONS = [
    (64, 17, 3, 1, 1, 10, 21, 1),
    (11, 16, 3, 2, 1, 16, 16, 1),
    (24, 8, 3, 1, 2, 12, 12, 2),
    (96, 32, 3, 1, 1, 7, 7, 1),
    (40, 24, 1, 1, 0, 28, 28, 1),  # a 1x1 convolution's 784 columns as 14 rows of 56
    (160, 64, 3, 1, 1, 30, 30, 1),  # a weight larger than the image: channels shared, 2 blocks of rows made 1
]


def _conv_bias_relu(
    out_channels: int, in_channels: int, kernel: int, stride: int, pad: int, height: int, width: int, dilation: int = 1
) -> bytes:
    rng = np.random.default_rng(out_channels * 100 + in_channels)
    weight = rng.standard_normal((out_channels, in_channels, kernel, kernel)).astype(np.float32)
    bias = rng.standard_normal(out_channels).astype(np.float32)
    out_h, out_w = ((size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for size in (height, width))
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride, stride], dilations=[dilation] * 2),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        "conv_bias_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", in_channels, height, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", out_channels, out_h, out_w])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("candidate", ["native-mixed", "native-panels", "native-tiled"])
@pytest.mark.parametrize("case", range(len(CONVOLUTIONS)))
def test_partial_register_tiles_equal_onnxruntime(case: int, candidate: str) -> None:
    data = _conv_bias_relu(*CONVOLUTIONS[case])
    artifact = compile_onnx(data, candidates=(candidate,))
    assert artifact.report["chosen"] == candidate, artifact.report["rejected"]
    _equals_onnxruntime(executable(artifact), data, CONVOLUTIONS[case], candidate)


def _equals_onnxruntime(program, data: bytes, shape: tuple, label: str) -> None:
    """The program's output against onnxruntime's at batch 1 and 3, several runs each: worker
    threads wake after the first run and share the later ones."""
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(sum(shape))
    in_channels, height, width = shape[1], shape[5], shape[6]
    for batch in (1, 3):
        x = rng.standard_normal((batch, in_channels, height, width)).astype(np.float32)
        want = session.run(None, {"x": x})[0]
        for run in range(4):
            got = program.run({"x": x})["y"]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{label} batch {batch} run {run}")


def _transposed_program(data: bytes, kind: str = "transposed"):
    """The model's program with every product whose A is a weight computed transposed (its weight
    packed as A^T's panels: lc_sgemm_t, or lc_conv_direct for the "direct" kind), the others as
    generated panels."""
    from compiler.backends import native_cpu
    from compiler.frontends.onnx import load_graph
    from compiler.kernels.fusion import fuse
    from compiler.kernels.ir import GemmCall
    from compiler.kernels.lower import lower
    from compiler.render.c import prepack_weights, render, transposed_packable

    graph = load_graph(data)
    lowered = fuse(lower(graph))
    chosen = [n for n, kernel in enumerate(lowered.kernels) if transposed_packable(lowered, kernel)]
    assert chosen, "no product whose A is a weight"
    program = prepack_weights(lowered, transposed=chosen)
    assert all(program.kernels[n].packed_a for n in chosen)
    kinds = {n: kind if n in chosen else "panels" for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)}
    source = render(program, gemm=kinds)
    assert ("lc_sgemm_t(k, " if kind == "transposed" else "lc_conv_direct(g, ") in source
    return native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, native_cpu.build(source))


@pytest.mark.parametrize("case", range(len(CONVOLUTIONS)))
def test_convolutions_computed_transposed_equal_onnxruntime(case: int) -> None:
    """C^T = B^T A^T with the weight packed: positions along the tile's rows in tiles as even as
    whole tiles allow (49 = 7 x 7), channels in partial tiles of a vector or two, the result
    transposed back into C in squares, then the fused bias and relu."""
    data = _conv_bias_relu(*CONVOLUTIONS[case])
    _equals_onnxruntime(_transposed_program(data), data, CONVOLUTIONS[case], "transposed")


@pytest.mark.parametrize("shape", CONVOLUTIONS + DIRECT_CONVOLUTIONS, ids=str)
def test_convolutions_computed_direct_equal_onnxruntime(shape: tuple) -> None:
    """The "direct" kind: the input rows a task reads copied channels innermost (zero-padded), a
    register tile of positions (each broadcast from its window through k's offsets) by output
    channels (the weight packed as A^T's panels), stored transposed into C, then bias and relu;
    offered by the e-graph for every convolution whose A is its weight (a 1x1 one's plain product
    reads its 49 columns as a row of 49, windows of one)."""
    from compiler.frontends.onnx import load_graph
    from compiler.kernels.fusion import fuse
    from compiler.kernels.lower import lower
    from compiler.kernels.schedule import KernelSchedule
    from compiler.search.cpu_schedules import kernel_terms
    from compiler.search.schedule import schedule_space

    data = _conv_bias_relu(*shape)
    program = fuse(lower(load_graph(data)))
    terms = [term for term in kernel_terms(program) if term.direct]
    assert len(terms) == 1
    space = schedule_space(terms, None, target="cpu")
    assert KernelSchedule("direct-windows") in space.alternatives[terms[0].number]
    _equals_onnxruntime(_transposed_program(data, "direct"), data, shape, "direct")


@pytest.mark.parametrize(("rows", "trans_a"), [(100, 0), (100, 1), (7, 0), (300, 1)])
def test_a_weight_times_activations_computed_transposed_equals_numpy(rows: int, trans_a: int) -> None:
    """y = W x (W [rows, 300] or stored transposed): k crosses a 256-deep block, the 130 columns
    more than one chunk of C^T, and C's rows split between the threads in whole register tiles."""
    rng = np.random.default_rng(rows + trans_a)
    weight = rng.standard_normal((300, rows) if trans_a else (rows, 300)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["w", "x"], ["y"], transA=trans_a)], "left_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [300, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, "n"])],
        [numpy_helper.from_array(weight, "w")],
    )
    program = _transposed_program(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    w = weight.T if trans_a else weight
    for n in (1, 49, 130):
        x = rng.standard_normal((300, n)).astype(np.float32)
        want = w.astype(np.float64) @ x.astype(np.float64)
        for run in range(2):
            np.testing.assert_allclose(program.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4, err_msg=f"n={n} run {run}")
