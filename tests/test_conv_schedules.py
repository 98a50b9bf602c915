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


def _conv_bias_relu(
    out_channels: int, in_channels: int, kernel: int, stride: int, pad: int, height: int, width: int
) -> bytes:
    rng = np.random.default_rng(out_channels * 100 + in_channels)
    weight = rng.standard_normal((out_channels, in_channels, kernel, kernel)).astype(np.float32)
    bias = rng.standard_normal(out_channels).astype(np.float32)
    out_h, out_w = ((size + 2 * pad - kernel) // stride + 1 for size in (height, width))
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride, stride]),
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
    program = executable(artifact)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(case)
    in_channels, height, width = CONVOLUTIONS[case][1], *CONVOLUTIONS[case][5:]
    for batch in (1, 3):
        x = rng.standard_normal((batch, in_channels, height, width)).astype(np.float32)
        want = session.run(None, {"x": x})[0]
        for run in range(4):  # worker threads wake after the first run and share the later ones
            got = program.run({"x": x})["y"]
            np.testing.assert_allclose(
                got, want, rtol=1e-4, atol=1e-4, err_msg=f"{candidate} batch {batch} run {run}"
            )
