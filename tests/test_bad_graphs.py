"""Malformed ONNX graphs are refused at parse time with a message naming the problem.

Each graph is built with onnx.helper and never shown to onnx.checker, which rejects (or chokes
on) some of them before our checks would run.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler.errors import InvalidModel, UnsupportedModel
from compiler.frontends.onnx import parse_model
from tests.conftest import auth
from tests.onnx_models import IR_VERSION, OPSET, init, tensor

X = tensor("x", ["batch", 4])
Y = tensor("y", ["batch", 4])


def model(nodes, inputs=(X,), outputs=(Y,), initializers=(), **graph_fields) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "bad", list(inputs), list(outputs), list(initializers), **graph_fields)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def refused(proto: onnx.ModelProto, error: type[Exception] = InvalidModel) -> str:
    with pytest.raises(error) as caught:
        parse_model(proto.SerializeToString())
    return str(caught.value)


def raw_tensor(name: str, data_type: int, dims: list[int], **data) -> TensorProto:
    """A TensorProto as written, without the consistency checks of helper.make_tensor."""
    return TensorProto(name=name, data_type=data_type, dims=dims, **data)


def external(name: str, location: str = "weights.bin") -> TensorProto:
    tensor_proto = raw_tensor(name, TensorProto.FLOAT, [4], data_location=TensorProto.EXTERNAL)
    tensor_proto.external_data.add(key="location", value=location)
    return tensor_proto


def relu(src: str, dst: str, name: str = "") -> onnx.NodeProto:
    return helper.make_node("Relu", [src], [dst], name=name)


# -- order, cycles and dangling reads --


def test_cycle_is_reported_with_its_nodes_and_values() -> None:
    nodes = [
        helper.make_node("Add", ["x", "c"], ["a"], name="first"),
        relu("a", "b", "second"),
        relu("b", "c", "third"),
        relu("a", "y", "last"),
    ]
    assert refused(model(nodes)) == (
        "the graph has a cycle: node 'first' (Add), which writes 'a' read by node 'second' (Relu), "
        "which writes 'b' read by node 'third' (Relu), which writes 'c' read by node 'first' (Add)"
    )


def test_node_reading_its_own_output_is_a_cycle() -> None:
    message = refused(model([helper.make_node("Add", ["x", "y"], ["y"], name="loop")]))
    assert message == "the graph has a cycle: node 'loop' (Add), which writes 'y' read by node 'loop' (Add)"


def test_read_before_definition_names_both_nodes() -> None:
    nodes = [relu("a", "y", "late"), relu("x", "a", "early")]
    message = refused(model(nodes))
    assert message == (
        "node 'late' (Relu) reads 'a' before it is defined (by node 'early' (Relu)); "
        "ONNX requires nodes in topological order"
    )


def test_dangling_input_is_named() -> None:
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"])]
    assert refused(model(nodes)) == (
        "node #0 (Add) reads 'ghost', which no initializer, graph input or node defines"
    )


def test_graph_output_naming_nothing() -> None:
    outputs = [Y, tensor("nowhere", ["batch", 4])]
    message = refused(model([relu("x", "y")], outputs=outputs))
    assert message == "graph output 'nowhere' is produced by no node, input or initializer"


def test_initializers_need_not_be_graph_inputs() -> None:
    weights = init("w", np.ones(4, np.float32))
    parse_model(model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[weights]).SerializeToString())


def test_omitted_optional_inputs_and_outputs_are_fine() -> None:
    nodes = [helper.make_node("Dropout", ["x", "", ""], ["y", ""])]
    parse_model(model(nodes).SerializeToString())


# -- names defined twice --


@pytest.mark.parametrize(
    ("nodes", "graph", "message"),
    [
        (
            [relu("x", "y", "one"), helper.make_node("Sigmoid", ["x"], ["y"], name="two")],
            {},
            "value 'y' is written twice: by node 'one' (Relu) and by node 'two' (Sigmoid)",
        ),
        (
            [relu("x", "w"), relu("w", "y")],
            {"initializers": [init("w", np.ones(4, np.float32))]},
            "node #0 (Relu) writes 'w', which is also an initializer",
        ),
        ([relu("x", "x"), relu("x", "y")], {}, "node #0 (Relu) writes 'x', which is also a graph input"),
        ([relu("x", "y")], {"inputs": [X, X]}, "graph input 'x' is declared twice"),
        ([relu("x", "y")], {"outputs": [Y, Y]}, "graph output 'y' is declared twice"),
        (
            [relu("x", "y")],
            {"initializers": [init("w", np.ones(4, np.float32)), init("w", np.zeros(4, np.float32))]},
            "initializer 'w' is declared twice",
        ),
        ([relu("x", "y")], {"inputs": [X, tensor("", [1])]}, "a graph input has an empty name"),
    ],
)
def test_duplicate_and_empty_names(nodes, graph, message) -> None:
    assert refused(model(nodes, **graph)) == message


# -- external data, anywhere --


def test_external_initializer_is_refused() -> None:
    message = refused(model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[external("w")]))
    assert "'w' refers to external data" in message and "self-contained" in message


def test_external_constant_value_with_escaping_path_is_refused() -> None:
    constant = helper.make_node("Constant", [], ["w"], name="weights", value=external("w", "../../etc/passwd"))
    message = refused(model([constant, helper.make_node("Add", ["x", "w"], ["y"])]))
    assert message == (
        "attribute 'value' of node 'weights' (Constant) refers to external data; "
        "external data is not supported: upload the model as one self-contained .onnx file"
    )


def test_external_sparse_initializer_is_refused() -> None:
    indices = helper.make_tensor("idx", TensorProto.INT64, [1], [0])
    sparse = helper.make_sparse_tensor(external("w"), indices, [4])
    message = refused(model([helper.make_node("Add", ["x", "w"], ["y"])], sparse_initializer=[sparse]))
    assert message.startswith("sparse initializer 'w' (values) refers to external data")


def test_external_data_inside_a_subgraph_is_refused() -> None:
    def branch(value: TensorProto) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node("Constant", [], ["out"], value=value)], "b", [], [tensor("out", [4])])

    inline = helper.make_tensor("inline", TensorProto.FLOAT, [4], [0.0] * 4)
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch(external("inner")), else_branch=branch(inline))
    message = refused(model([node], inputs=[tensor("cond", [], TensorProto.BOOL)]))
    assert message.startswith(
        "attribute 'then_branch' of node #0 (If), subgraph: attribute 'value' of node #0 (Constant) "
        "refers to external data"
    )


# -- absurd or inconsistent tensors and declared dims --


def test_initializer_claiming_too_many_elements() -> None:
    huge = raw_tensor("w", TensorProto.FLOAT, [1 << 20, 1 << 20], raw_data=b"")
    message = refused(model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[huge]))
    assert message == (
        "initializer 'w' claims 1099511627776 elements (dims [1048576, 1048576]), more than the limit of 2**31"
    )


def test_raw_data_shorter_than_dims() -> None:
    short = raw_tensor("w", TensorProto.FLOAT, [4], raw_data=np.ones(3, np.float32).tobytes())
    message = refused(model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[short]))
    assert message == "initializer 'w' has 12 bytes of data but its dims [4] of float32 need 16"


def test_typed_values_disagreeing_with_dims() -> None:
    constant = helper.make_node("Constant", [], ["w"], value=raw_tensor("v", TensorProto.INT64, [2, 3], int64_data=[1, 2]))
    message = refused(model([constant, helper.make_node("Add", ["x", "w"], ["y"])]))
    assert message == "attribute 'value' of node #0 (Constant) has 2 values but its dims [2, 3] need 6"


def test_negative_tensor_dim() -> None:
    bad = raw_tensor("w", TensorProto.FLOAT, [-4])
    message = refused(model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[bad]))
    assert message == "initializer 'w' has a negative dimension in [-4]"


def test_sparse_tensor_with_absurd_dense_shape() -> None:
    values = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    indices = helper.make_tensor("idx", TensorProto.INT64, [1], [0])
    sparse = helper.make_sparse_tensor(values, indices, [1 << 40])
    constant = helper.make_node("Constant", [], ["w"], sparse_value=sparse)
    message = refused(model([constant, helper.make_node("Add", ["x", "w"], ["y"])]))
    assert message.startswith("attribute 'sparse_value' of node #0 (Constant) claims 1099511627776 elements")


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([-1, 4], "graph input 'x' declares dimension 0 as -1"),
        ([1 << 20, "n", 1 << 20], "graph input 'x' declares 1099511627776 elements in its fixed dimensions"),
    ],
)
def test_absurd_declared_input_dims(shape, message) -> None:
    assert message in refused(model([relu("x", "y")], inputs=[tensor("x", shape)]))


# -- well-formed but unsupported --


def test_foreign_domain_is_unsupported_and_named() -> None:
    proto = model([helper.make_node("FusedGelu", ["x"], ["y"], domain="com.microsoft")])
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assert refused(proto, UnsupportedModel) == "unsupported: com.microsoft.FusedGelu (domain 'com.microsoft')"


def test_model_local_function_is_unsupported() -> None:
    function = helper.make_function("local", "Twice", ["a"], ["b"], [relu("a", "b")], [helper.make_opsetid("", OPSET)])
    proto = model([helper.make_node("Twice", ["x"], ["y"], domain="local")])
    proto.functions.append(function)
    proto.opset_import.append(helper.make_opsetid("local", 1))
    assert refused(proto, UnsupportedModel) == "unsupported: model-local functions (local.Twice)"


def test_sparse_initializer_is_unsupported() -> None:
    values = helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])
    sparse = helper.make_sparse_tensor(values, helper.make_tensor("idx", TensorProto.INT64, [1], [3]), [4])
    proto = model([helper.make_node("Add", ["x", "w"], ["y"])], sparse_initializer=[sparse])
    assert refused(proto, UnsupportedModel) == "unsupported: sparse initializer 'w'"


# -- through the API: refused at upload, nothing stored --


def test_upload_of_a_cyclic_graph_gets_400_naming_the_cycle(client, keys) -> None:
    nodes = [relu("y", "a", "left"), relu("a", "y", "right")]
    response = client.post(
        "/v1/models",
        headers=auth(keys["alice"]),
        files={"file": ("cycle.onnx", model(nodes).SerializeToString())},
        data={"name": "cycle"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_model"
    assert "the graph has a cycle" in error["message"] and "node 'left' (Relu)" in error["message"]
    assert client.get("/v1/models/cycle", headers=auth(keys["alice"])).status_code == 404
