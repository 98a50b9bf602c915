"""ONNX graphs the tests build with onnx.helper."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# what both onnxruntime and the onnx checker in the test environment accept
IR_VERSION = 10
OPSET = 17


def make_model(nodes, inputs, outputs, initializers=(), opset: int = OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def tensor(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def mlp(seed: int = 0, n_in: int = 8, hidden: int = 16, n_out: int = 3) -> onnx.ModelProto:
    """Gemm -> Relu -> Gemm -> Softmax with a symbolic batch dimension."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal((n_in, hidden)).astype(np.float32)
    b0 = rng.standard_normal(hidden).astype(np.float32)
    w1 = rng.standard_normal((hidden, n_out)).astype(np.float32)
    b1 = rng.standard_normal(n_out).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w1", "b1"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
    ]
    return make_model(
        nodes,
        [tensor("x", ["batch", n_in])],
        [tensor("y", ["batch", n_out])],
        [init("w0", w0), init("b0", b0), init("w1", w1), init("b1", b1)],
    )


def fixed_shape_model() -> onnx.ModelProto:
    """A model with no symbolic dimension: requests cannot be batched together."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["y"])]
    return make_model(nodes, [tensor("x", [2, 3])], [tensor("y", [2, 3])])


def unsupported_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Unique", ["a"], ["b"]),
        helper.make_node("NonZero", ["b"], ["y"]),
    ]
    return make_model(nodes, [tensor("x", ["batch", 4])], [tensor("y", ["batch", 4])])


def int_input_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", ["ids"], ["y"])]
    return make_model(nodes, [tensor("ids", ["batch", 3], TensorProto.INT64)], [tensor("y", ["batch", 3], TensorProto.INT64)])


def embedding_model(vocab: int = 10, width: int = 4) -> onnx.ModelProto:
    """Token ids [batch, seq] looked up in a [vocab, width] table."""
    table = numpy_helper.from_array(np.arange(vocab * width, dtype=np.float32).reshape(vocab, width), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"])]
    return make_model(
        nodes,
        [tensor("ids", ["batch", "seq"], TensorProto.INT64)],
        [tensor("y", ["batch", "seq", width])],
        initializers=[table],
    )


def heavy_compile_model(side: int = 20000, repeats: int = 8) -> onnx.ModelProto:
    """A few hundred bytes that cost the compiler's verification `repeats` passes over a
    side x side float32 tensor (1.6 GB at 20000): a stand-in for an upload that asks for
    unbounded compile time or memory."""
    nodes, terms = [], []
    for i in range(repeats):
        value = helper.make_tensor("value", TensorProto.FLOAT, [1], [float(i + 1)])
        nodes += [
            helper.make_node("ConstantOfShape", ["shape"], [f"filled{i}"], value=value),
            helper.make_node("Sin", [f"filled{i}"], [f"sines{i}"]),
            helper.make_node("ReduceSum", [f"sines{i}"], [f"total{i}"], keepdims=0),
        ]
        terms.append(f"total{i}")
    nodes += [helper.make_node("Sum", terms, ["total"]), helper.make_node("Add", ["x", "total"], ["y"])]
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [side, side])
    return make_model(nodes, [tensor("x", [1])], [tensor("y", [1])], [shape])
