"""Models with symbolic input dims through the HTTP API: any sizes up to each symbol's limit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from onnx import helper

from cloud.settings import Settings
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import init, make_model, tensor

MAX_ELEMENTS = 5000
WIDTH = 700


@pytest.fixture
def settings(tmp_path) -> Settings:
    return make_settings(tmp_path / "data", max_request_elements=MAX_ELEMENTS, dim_limits={"steps": 8})


def pair_model() -> bytes:
    """y = relu(a + b) * a with a, b: [batch, seq]."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("Mul", ["r", "a"], ["y"]),
    ]
    inputs = [tensor("a", ["batch", "seq"]), tensor("b", ["batch", "seq"])]
    return make_model(nodes, inputs, [tensor("y", ["batch", "seq"])]).SerializeToString()


def widen_model() -> bytes:
    """y = x @ w with x: [batch, steps, 1] and w: [1, WIDTH], so the output outgrows the input."""
    weights = np.linspace(-1, 1, WIDTH, dtype=np.float32).reshape(1, WIDTH)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    return make_model(
        nodes, [tensor("x", ["batch", "steps", 1])], [tensor("y", ["batch", "steps", WIDTH])], [init("w", weights)]
    ).SerializeToString()


def unnamed_model() -> bytes:
    nodes = [helper.make_node("Neg", ["x"], ["y"])]
    return make_model(nodes, [tensor("x", [None, None])], [tensor("y", [None, None])]).SerializeToString()


def deploy(client, key: str, name: str, data: bytes) -> dict:
    upload(client, key, name, data)
    version = wait_for(client, key, name, 1)
    assert version["status"] == "ready", version["error"]
    return version


def infer(client, key: str, name: str, inputs: dict):
    return client.post(f"/v1/models/{name}/infer", headers=auth(key), json={"inputs": inputs})


def error_of(response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


@pytest.fixture
def pair(client, keys) -> str:
    deploy(client, keys["alice"], "pair", pair_model())
    return "pair"


def test_signature_shows_dims_by_name_with_their_limits(client, keys, pair) -> None:
    version = client.get("/v1/models/pair", headers=auth(keys["alice"])).json()["versions"][0]
    signature = version["signature"]
    assert signature["inputs"] == [
        {"name": "a", "shape": ["batch", "seq"], "dtype": "float32"},
        {"name": "b", "shape": ["batch", "seq"], "dtype": "float32"},
    ]
    assert signature["outputs"] == [{"name": "y", "shape": ["batch", "seq"], "dtype": "float32"}]
    assert signature["batch_symbol"] == "batch"
    assert signature["dim_limits"] == {"batch": 256, "seq": 4096}


def test_unnamed_dims_are_named_after_input_and_axis(client, keys) -> None:
    signature = deploy(client, keys["alice"], "unnamed", unnamed_model())["signature"]
    assert signature["inputs"] == [{"name": "x", "shape": ["x_0", "x_1"], "dtype": "float32"}]
    assert signature["dim_limits"] == {"x_0": 256, "x_1": 4096}
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    response = infer(client, keys["alice"], "unnamed", {"x": x.tolist()})
    assert response.status_code == 200, response.text
    np.testing.assert_array_equal(np.array(response.json()["outputs"]["y"], np.float32), -x)


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (2, 7), (3, 33), (1, 4096)])
def test_any_sizes_within_the_limits_match_numpy(client, keys, pair, batch, seq) -> None:
    rng = np.random.default_rng(batch * 1000 + seq)
    a, b = (rng.standard_normal((batch, seq)).astype(np.float32) for _ in range(2))
    response = infer(client, keys["alice"], "pair", {"a": a.tolist(), "b": b.tolist()})
    assert response.status_code == 200, response.text
    y = np.array(response.json()["outputs"]["y"], np.float32)
    np.testing.assert_allclose(y, np.maximum(a + b, 0) * a, rtol=1e-6, atol=1e-7)


def test_concurrent_requests_of_different_lengths_each_get_their_own_answer(client, keys, pair) -> None:
    sizes = [(1, 3), (2, 5), (1, 3), (3, 9), (1, 5), (2, 3)]
    rng = np.random.default_rng(7)
    requests = [tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(2)) for shape in sizes]

    def call(pair_of_arrays):
        a, b = pair_of_arrays
        return infer(client, keys["alice"], "pair", {"a": a.tolist(), "b": b.tolist()})

    with ThreadPoolExecutor(max_workers=len(sizes)) as pool:
        responses = list(pool.map(call, requests))
    for (a, b), response in zip(requests, responses):
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()["outputs"]["y"]), np.maximum(a + b, 0) * a, rtol=1e-6)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 4097), "input 'a' dimension 1 (seq) is 4097; allowed 1 to 4096"),
        ((257, 1), "input 'a' dimension 0 (batch) is 257; allowed 1 to 256"),
        ((1, 0), "input 'a' dimension 1 (seq) is 0; allowed 1 to 4096"),
    ],
)
def test_dims_over_their_limit_get_400_naming_input_dim_and_limit(client, keys, pair, shape, message) -> None:
    zeros = np.zeros(shape, np.float32).tolist()
    assert error_of(infer(client, keys["alice"], "pair", {"a": zeros, "b": zeros})) == message


def test_one_symbol_with_two_sizes_gets_400_naming_the_symbol(client, keys, pair) -> None:
    a, b = np.zeros((2, 7)).tolist(), np.zeros((2, 9)).tolist()
    assert error_of(infer(client, keys["alice"], "pair", {"a": a, "b": b})) == (
        "symbol 'seq' is 9 in input 'b' dimension 1 but 7 in input 'a' dimension 1; "
        "one request gives each symbol one size"
    )


def test_too_many_elements_are_refused_before_the_lists_are_read(client, keys, pair) -> None:
    # ragged after the first row: only the claimed shape was looked at when the limit refused it
    claimed = [[0.0] * 2500] + [[0.0]] * 2
    message = error_of(infer(client, keys["alice"], "pair", {"a": claimed, "b": claimed}))
    assert message == f"input 'a' would have 7500 elements, more than the limit of {MAX_ELEMENTS}"
    ragged = [[0.0] * 5] + [[0.0]] * 2
    assert "not a rectangular nested list" in error_of(infer(client, keys["alice"], "pair", {"a": ragged, "b": ragged}))


def test_per_symbol_override_and_output_size_limit(client, keys) -> None:
    signature = deploy(client, keys["alice"], "widen", widen_model())["signature"]
    assert signature["dim_limits"] == {"batch": 256, "steps": 8}
    x = np.linspace(0, 1, 7, dtype=np.float32).reshape(1, 7, 1)
    response = infer(client, keys["alice"], "widen", {"x": x.tolist()})
    assert response.status_code == 200, response.text
    weights = np.linspace(-1, 1, WIDTH, dtype=np.float32).reshape(1, WIDTH)
    np.testing.assert_allclose(np.array(response.json()["outputs"]["y"]), x @ weights, rtol=1e-6, atol=1e-7)
    over = np.zeros((1, 9, 1)).tolist()
    assert error_of(infer(client, keys["alice"], "widen", {"x": over})) == (
        "input 'x' dimension 1 (steps) is 9; allowed 1 to 8"
    )
    # 8 steps fit the symbol's limit, but 8 * WIDTH output elements do not fit the request's
    eight = np.zeros((1, 8, 1)).tolist()
    assert error_of(infer(client, keys["alice"], "widen", {"x": eight})) == (
        f"output 'y' would have {8 * WIDTH} elements, more than the limit of {MAX_ELEMENTS}"
    )
