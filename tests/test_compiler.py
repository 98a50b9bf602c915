"""The compiler against onnxruntime: each supported op, the torch fixtures, artifacts, refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from compiler import Artifact, InvalidModel, UnsupportedModel, compile_onnx, executable
from compiler.frontends.onnx import load_graph
from compiler.reference import run_graph
from tests.conftest import FIXTURES
from tests.onnx_models import init, make_model, mlp, tensor, unsupported_model

RNG = np.random.default_rng(42)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def single(op: str, inputs: dict[str, np.ndarray], out_shape, consts=None, **attrs):
    """A one-node model: graph inputs from `inputs`, initializers from `consts`."""
    consts = consts or {}
    names = list(inputs) + list(consts)
    node = helper.make_node(op, names, ["y"], **attrs)
    model = make_model(
        [node],
        [tensor(n, list(v.shape)) for n, v in inputs.items()],
        [tensor("y", out_shape)],
        [init(n, v) for n, v in consts.items()],
    )
    return model, inputs


CASES = {
    "gemm": single("Gemm", {"a": f32(3, 4)}, [3, 5], {"b": f32(5, 4), "c": f32(5)}, transB=1, alpha=0.5, beta=2.0),
    "gemm_transA": single("Gemm", {"a": f32(4, 3)}, [3, 5], {"b": f32(4, 5)}, transA=1),
    "matmul_batched": single("MatMul", {"a": f32(2, 3, 4), "b": f32(4, 5)}, [2, 3, 5]),
    "matmul_vec": single("MatMul", {"a": f32(4), "b": f32(2, 4, 3)}, [2, 3]),
    "add_broadcast": single("Add", {"a": f32(2, 3, 4), "b": f32(4)}, [2, 3, 4]),
    "sub": single("Sub", {"a": f32(2, 3), "b": f32(2, 1)}, [2, 3]),
    "mul": single("Mul", {"a": f32(3, 1), "b": f32(1, 4)}, [3, 4]),
    "div": single("Div", {"a": f32(2, 3)}, [2, 3], {"b": np.abs(f32(2, 3)) + 0.5}),
    "relu": single("Relu", {"x": f32(3, 5)}, [3, 5]),
    "sigmoid": single("Sigmoid", {"x": f32(3, 5) * 8}, [3, 5]),
    "tanh": single("Tanh", {"x": f32(3, 5) * 4}, [3, 5]),
    "softmax": single("Softmax", {"x": f32(2, 3, 6) * 5}, [2, 3, 6], axis=1),
    "reshape": single("Reshape", {"x": f32(2, 3, 4)}, [4, 6], {"s": np.array([4, -1], np.int64)}),
    "flatten": single("Flatten", {"x": f32(2, 3, 4, 5)}, [6, 20], axis=2),
    "transpose": single("Transpose", {"x": f32(2, 3, 4)}, [4, 2, 3], perm=[2, 0, 1]),
    "conv": single("Conv", {"x": f32(2, 3, 7, 7)}, [2, 4, 4, 4], {"w": f32(4, 3, 3, 3), "b": f32(4)},
                   pads=[1, 1, 1, 1], strides=[2, 2]),
    "conv_grouped_dilated": single("Conv", {"x": f32(1, 4, 9, 9)}, [1, 6, 5, 5], {"w": f32(6, 2, 3, 3)},
                                   group=2, dilations=[2, 2]),
    "conv_same_upper": single("Conv", {"x": f32(1, 2, 6, 6)}, [1, 3, 3, 3], {"w": f32(3, 2, 3, 3)},
                              auto_pad="SAME_UPPER", strides=[2, 2]),
    "maxpool": single("MaxPool", {"x": f32(2, 3, 6, 6)}, [2, 3, 3, 3], kernel_shape=[2, 2], strides=[2, 2]),
    "maxpool_ceil_pad": single("MaxPool", {"x": f32(1, 2, 7, 7)}, [1, 2, 4, 4], kernel_shape=[3, 3],
                               strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
    "avgpool_pads": single("AveragePool", {"x": f32(1, 2, 5, 5)}, [1, 2, 5, 5], kernel_shape=[3, 3],
                           pads=[1, 1, 1, 1]),
    "avgpool_include_pad": single("AveragePool", {"x": f32(1, 2, 5, 5)}, [1, 2, 5, 5], kernel_shape=[3, 3],
                                  pads=[1, 1, 1, 1], count_include_pad=1),
    "global_avgpool": single("GlobalAveragePool", {"x": f32(2, 3, 4, 5)}, [2, 3, 1, 1]),
    "batchnorm": single("BatchNormalization", {"x": f32(2, 3, 4, 4)}, [2, 3, 4, 4],
                        {"s": f32(3), "b": f32(3), "m": f32(3), "v": np.abs(f32(3)) + 0.1}, epsilon=1e-3),
    "concat": single("Concat", {"a": f32(2, 3), "b": f32(2, 5)}, [2, 8], axis=1),
    "identity": single("Identity", {"x": f32(4)}, [4]),
}


def ort_run(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    model, inputs = CASES[case]
    artifact = compile_onnx(model.SerializeToString())
    got = executable(artifact).run(inputs)["y"]
    want = ort_run(model, inputs)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the reference interpreter is the oracle the generated program is checked against
    np.testing.assert_allclose(run_graph(artifact.graph, inputs)["y"], want, rtol=1e-5, atol=1e-5)


def test_constant_node_and_chain() -> None:
    nodes = [
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.FLOAT, [3], [1, 2, 3])),
        helper.make_node("Mul", ["x", "c"], ["m"]),
        helper.make_node("Relu", ["m"], ["y"]),
    ]
    model = make_model(nodes, [tensor("x", ["n", 3])], [tensor("y", ["n", 3])])
    x = f32(4, 3)
    got = executable(compile_onnx(model.SerializeToString())).run({"x": x})["y"]
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-6)


def test_relu_keeps_infinities_and_nan() -> None:
    model, _ = single("Relu", {"x": f32(4)}, [4])
    x = np.array([-np.inf, np.inf, np.nan, -1.0], np.float32)
    got = executable(compile_onnx(model.SerializeToString())).run({"x": x})["y"]
    np.testing.assert_array_equal(got, np.array([0, np.inf, np.nan, 0], np.float32))


@pytest.mark.parametrize(("fixture", "shape"), [("torch_mlp.onnx", (20,)), ("torch_cnn.onnx", (1, 12, 12))])
@pytest.mark.parametrize("batch", [1, 7])
def test_torch_exports_match_onnxruntime(fixture: str, shape: tuple, batch: int) -> None:
    data = (FIXTURES / fixture).read_bytes()
    artifact = compile_onnx(data)
    assert artifact.signature.batch_symbol == "batch"
    x = f32(batch, *shape)
    got = executable(artifact).run({"input": x})["output"]
    np.testing.assert_allclose(got, ort_run(onnx.load_from_string(data), {"input": x})[0], rtol=1e-4, atol=1e-5)


def test_batch_dimension_stays_symbolic() -> None:
    artifact = compile_onnx(mlp().SerializeToString())
    signature = artifact.signature.to_json()
    assert signature["inputs"] == [{"name": "x", "shape": ["batch", 8], "dtype": "float32"}]
    assert signature["outputs"] == [{"name": "y", "shape": ["batch", 3], "dtype": "float32"}]
    program = executable(artifact)
    for batch in (1, 3, 64):
        assert program.run({"x": f32(batch, 8)})["y"].shape == (batch, 3)


@pytest.mark.parametrize(("candidate", "built"), [("numpy", set()), ("native-blas", {"program.so"})])
def test_artifact_round_trips_through_files(candidate, built) -> None:
    artifact = compile_onnx(mlp().SerializeToString(), candidates=(candidate,))
    assert artifact.report["chosen"] == candidate
    files = artifact.to_files()
    assert set(files) == {"manifest.json", "program.json", "weights.npz"} | built
    loaded = Artifact.from_files(files.__getitem__)
    x = f32(5, 8)
    np.testing.assert_array_equal(executable(loaded).run({"x": x})["y"], executable(artifact).run({"x": x})["y"])
    assert loaded.signature == artifact.signature
    assert loaded.graph_hash == artifact.graph_hash == loaded.graph.content_hash()


def test_matmul_becomes_one_contraction_kernel() -> None:
    artifact = compile_onnx(mlp().SerializeToString())
    assert artifact.report["fused_contractions"] == 2
    assert artifact.report["verify_max_abs_error"] < 1e-5


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (mlp().SerializeToString()[:40], "protobuf"),
        (b"this is not an onnx file at all", "not a valid ONNX model"),
    ],
)
def test_malformed_files_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(InvalidModel, match=message):
        load_graph(data)


def test_unsupported_ops_are_listed_together() -> None:
    with pytest.raises(UnsupportedModel) as caught:
        load_graph(unsupported_model().SerializeToString())
    assert caught.value.missing == ["NonZero", "Unique"]


def test_dangling_input_is_invalid() -> None:
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"])]
    model = make_model(nodes, [tensor("x", [2])], [tensor("y", [2])])
    with pytest.raises(InvalidModel, match="ghost"):
        load_graph(model.SerializeToString())


def test_external_data_is_refused() -> None:
    model = mlp()
    weight = model.graph.initializer[0]
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../../etc/passwd"
    with pytest.raises(InvalidModel, match="external data"):
        load_graph(model.SerializeToString())
