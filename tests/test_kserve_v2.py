"""The KServe v2 / Open Inference Protocol: metadata, readiness, JSON and binary inference checked
against onnxruntime, bad input, errors in the v2 shape, metering, and NVIDIA's own tritonclient."""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnxruntime
import pytest
import tritonclient.http as triton
from fastapi.testclient import TestClient
from onnx import helper
from tritonclient.utils import InferenceServerException

from api.main import create_app
from api.server import BackgroundServer
from api.services import open_database
from cloud.auth import create_key
from cloud.errors import DeadlineExceeded, Overloaded, Unavailable
from cloud.metrics import REGISTRY
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import int_input_model, make_model, mlp, tensor, unsupported_model

MLP = mlp().SerializeToString()


def two_outputs_model() -> bytes:
    """x[batch, 4] -> relu(x) and sigmoid(x): outputs to choose between."""
    nodes = [helper.make_node("Relu", ["x"], ["relu"]), helper.make_node("Sigmoid", ["x"], ["sigmoid"])]
    outputs = [tensor("relu", ["batch", 4]), tensor("sigmoid", ["batch", 4])]
    return make_model(nodes, [tensor("x", ["batch", 4])], outputs).SerializeToString()


def ort(data: bytes, inputs: dict) -> dict[str, np.ndarray]:
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))


def deploy(client, key: str, name: str, data: bytes) -> None:
    upload(client, key, name, data)
    assert wait_for(client, key, name, 1)["status"] == "ready"


@pytest.fixture
def deployed(client, keys) -> str:
    deploy(client, keys["alice"], "mlp", MLP)
    return "mlp"


def json_input(name: str, array: np.ndarray, datatype: str = "FP32") -> dict:
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.ravel().tolist()}


def binary_body(header: dict, *parts: bytes) -> tuple[bytes, dict[str, str]]:
    """A body in the binary tensor data extension's framing, and the header giving its split."""
    encoded = json.dumps(header).encode()
    return encoded + b"".join(parts), {"Inference-Header-Content-Length": str(len(encoded))}


def split_binary(response) -> tuple[dict, bytes]:
    length = int(response.headers["Inference-Header-Content-Length"])
    return json.loads(response.content[:length]), response.content[length:]


def test_server_metadata_and_health_need_no_key(client) -> None:
    metadata = client.get("/v2").json()
    assert metadata["name"] == "luminal-cloud" and "binary_tensor_data" in metadata["extensions"]
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200


def test_model_metadata_in_v2_datatypes_with_minus_one_for_symbolic_dims(client, keys, deployed) -> None:
    key = keys["alice"]
    expected = {
        "name": "mlp",
        "versions": ["1"],
        "platform": "onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
    }
    assert client.get("/v2/models/mlp", headers=auth(key)).json() == expected
    assert client.get("/v2/models/mlp/versions/1", headers=auth(key)).json() == expected
    deploy(client, key, "ids", int_input_model().SerializeToString())
    assert client.get("/v2/models/ids", headers=auth(key)).json()["inputs"][0]["datatype"] == "INT64"


def test_readiness_and_missing_models_answer_in_the_v2_error_shape(client, keys, deployed) -> None:
    key = keys["alice"]
    assert client.get("/v2/models/mlp/ready", headers=auth(key)).status_code == 200
    assert client.get("/v2/models/mlp/versions/1/ready", headers=auth(key)).status_code == 200
    for path in ("/v2/models/mlp/versions/2/ready", "/v2/models/mlp/versions/two", "/v2/models/ghost/ready"):
        response = client.get(path, headers=auth(key))
        assert response.status_code == 404, path
        assert isinstance(response.json()["error"], str), response.text
    # another tenant's model is as missing as one that never existed
    assert client.get("/v2/models/mlp", headers=auth(keys["bob"])).json() == {"error": "model 'mlp' not found"}
    denied = client.get("/v2/models/mlp")
    assert denied.status_code == 401 and "Authorization" in denied.json()["error"]


def test_a_version_not_ready_is_400_once_failed_and_503_while_compiling(client, keys, deployed, monkeypatch) -> None:
    key = keys["alice"]
    upload(client, key, "mlp", unsupported_model().SerializeToString())
    assert wait_for(client, key, "mlp", 2)["status"] == "failed"
    monkeypatch.setattr(client.app.state.services.compiler, "submit", lambda *_: None)
    upload(client, key, "mlp", MLP)  # version 3 stays queued
    body = {"inputs": [json_input("x", np.zeros((1, 8), np.float32))]}
    for version, status in (("2", 400), ("3", 503)):
        ready = client.get(f"/v2/models/mlp/versions/{version}/ready", headers=auth(key))
        assert ready.status_code == 400 and f"version {version} is" in ready.json()["error"]
        response = client.post(f"/v2/models/mlp/versions/{version}/infer", headers=auth(key), json=body)
        assert response.status_code == status and f"version {version} is" in response.json()["error"]
    # the model itself still serves its ready version
    assert client.get("/v2/models/mlp", headers=auth(key)).json()["versions"] == ["1"]
    assert client.post("/v2/models/mlp/infer", headers=auth(key), json=body).status_code == 200


def test_json_inference_matches_onnxruntime_and_echoes_the_id(client, keys, deployed) -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    body = {"id": "req-7", "inputs": [json_input("x", x)]}
    for path in ("/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer"):
        response = client.post(path, headers=auth(keys["alice"]), json=body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json"
        reply = response.json()
        assert (reply["model_name"], reply["model_version"], reply["id"]) == ("mlp", "1", "req-7")
        [y] = reply["outputs"]
        assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [3, 3])
        got = np.array(y["data"], np.float32).reshape(y["shape"])
        np.testing.assert_allclose(got, ort(MLP, {"x": x})["y"], rtol=1e-5, atol=1e-6)
        assert reply["parameters"]["request_id"] == response.headers["X-Request-ID"]
    # nested data is row-major too
    nested = {"inputs": [{**json_input("x", x), "data": x.tolist()}]}
    again = client.post("/v2/models/mlp/infer", headers=auth(keys["alice"]), json=nested).json()
    assert again["outputs"][0]["data"] == reply["outputs"][0]["data"]


def test_integer_inputs_by_json_and_binary(client, keys) -> None:
    data = int_input_model().SerializeToString()
    deploy(client, keys["alice"], "ids", data)
    ids = np.array([[1, -2, 3], [2**40, 5, 6]], np.int64)
    reply = client.post(
        "/v2/models/ids/infer", headers=auth(keys["alice"]), json={"inputs": [json_input("ids", ids, "INT64")]}
    ).json()
    assert reply["outputs"][0]["datatype"] == "INT64" and reply["outputs"][0]["data"] == ids.ravel().tolist()
    header = {
        "inputs": [{"name": "ids", "shape": [2, 3], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}}],
        "parameters": {"binary_data_output": True},
    }
    body, headers = binary_body(header, ids.astype("<i8").tobytes())
    response = client.post("/v2/models/ids/infer", headers={**auth(keys["alice"]), **headers}, content=body)
    reply, raw = split_binary(response)
    assert reply["outputs"][0]["parameters"] == {"binary_data_size": ids.nbytes}
    np.testing.assert_array_equal(np.frombuffer(raw, "<i8").reshape(2, 3), ort(data, {"ids": ids})["y"])


def test_binary_inference_returns_the_outputs_asked_for_in_their_order(client, keys) -> None:
    data = two_outputs_model()
    deploy(client, keys["alice"], "two", data)
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    expected = ort(data, {"x": x})
    header = {
        "id": "b1",
        "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "sigmoid", "parameters": {"binary_data": True}}, {"name": "relu"}],
    }
    body, headers = binary_body(header, x.astype("<f4").tobytes())
    response = client.post("/v2/models/two/infer", headers={**auth(keys["alice"]), **headers}, content=body)
    assert response.status_code == 200, response.content[:300]
    assert response.headers["content-type"] == "application/octet-stream"
    reply, raw = split_binary(response)
    assert reply["id"] == "b1" and [o["name"] for o in reply["outputs"]] == ["sigmoid", "relu"]
    sigmoid, relu = reply["outputs"]
    assert sigmoid["parameters"] == {"binary_data_size": len(raw)} and "data" not in sigmoid
    np.testing.assert_allclose(np.frombuffer(raw, "<f4").reshape(2, 4), expected["sigmoid"], rtol=1e-5)
    np.testing.assert_allclose(np.array(relu["data"]).reshape(2, 4), expected["relu"], rtol=1e-6)
    # one output alone, and JSON only: no framing header in the response
    only = client.post(
        "/v2/models/two/infer",
        headers=auth(keys["alice"]),
        json={"inputs": [json_input("x", x)], "outputs": [{"name": "relu"}]},
    )
    assert "Inference-Header-Content-Length" not in only.headers
    assert [o["name"] for o in only.json()["outputs"]] == ["relu"]


def test_large_bodies_are_decoded_and_rendered_in_a_child_process(tmp_path, keys) -> None:
    settings = make_settings(tmp_path / "data", codec_process_above_bytes=0)  # every body goes to the child
    key = create_key_for(settings, "erin")
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    with TestClient(create_app(settings)) as client:
        deploy(client, key, "mlp", MLP)
        header = {
            "inputs": [{"name": "x", "shape": [4, 8], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
        body, headers = binary_body(header, x.tobytes())
        reply, raw = split_binary(client.post("/v2/models/mlp/infer", headers={**auth(key), **headers}, content=body))
        assert reply["outputs"][0]["parameters"] == {"binary_data_size": 4 * 3 * 4}
        np.testing.assert_allclose(np.frombuffer(raw, "<f4").reshape(4, 3), ort(MLP, {"x": x})["y"], rtol=1e-5)
        as_json = client.post("/v2/models/mlp/infer", headers=auth(key), json={"inputs": [json_input("x", x)]}).json()
        np.testing.assert_allclose(np.array(as_json["outputs"][0]["data"]), np.frombuffer(raw, "<f4"), rtol=1e-6)
        refused = client.post("/v2/models/mlp/infer", headers=auth(key), json={"inputs": [json_input("x", x, "INT8")]})
        assert refused.status_code == 400 and "expects FP32" in refused.json()["error"]


def create_key_for(settings, tenant: str) -> str:
    db = open_database(settings)
    try:
        return create_key(db, tenant)
    finally:
        db.dispose()


def bad_requests(x: np.ndarray) -> list[tuple[str, bytes, dict[str, str], str]]:
    """(case, body, extra headers, words the 400's message must contain) for a model taking x: FP32[batch, 8]."""
    binary_x = {"name": "x", "shape": [2, 8], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
    raw = x.astype("<f4").tobytes()
    cases = [
        ("shape disagrees with data", {"inputs": [{**json_input("x", x), "shape": [3, 8]}]}, (), "24"),
        ("datatype is not the model's", {"inputs": [json_input("x", x, "FP64")]}, (), "expects FP32"),
        ("unknown datatype", {"inputs": [json_input("x", x, "FLOAT32")]}, (), "FLOAT32"),
        ("binary section too short", {"inputs": [binary_x]}, (raw[:-4],), "only 60 left"),
        ("binary section too long", {"inputs": [binary_x]}, (raw + b"\0\0",), "2 bytes left over"),
        ("binary size disagrees with shape", {"inputs": [{**binary_x, "shape": [1, 8]}]}, (raw,), "needs 32"),
        ("unknown output", {"inputs": [json_input("x", x)], "outputs": [{"name": "z"}]}, (), "unknown output 'z'"),
        ("unknown input", {"inputs": [json_input("x", x), json_input("w", x)]}, (), "unknown input 'w'"),
        ("missing input", {"inputs": [json_input("w", x)]}, (), "unknown input 'w'"),
        ("no inputs", {"inputs": []}, (), "inputs"),
        ("input twice", {"inputs": [json_input("x", x), json_input("x", x)]}, (), "given twice"),
        ("neither data nor binary", {"inputs": [{**json_input("x", x), "data": None}]}, (), "neither data"),
        ("booleans for floats", {"inputs": [{**json_input("x", x), "data": [True] * 16}]}, (), "booleans"),
        ("wrong rank", {"inputs": [{**json_input("x", x), "shape": [16]}]}, (), "rank 1"),
        ("negative dim", {"inputs": [{**json_input("x", x), "shape": [-2, -8]}]}, (), "greater than or equal to 0"),
    ]
    built = []
    for case, header, parts, words in cases:
        body, headers = binary_body(header, *parts) if parts else (json.dumps(header).encode(), {})
        built.append((case, body, headers, words))
    encoded = json.dumps({"inputs": [binary_x]}).encode()
    built += [
        ("header length past the body", encoded + raw, {"Inference-Header-Content-Length": "999999"}, "999999"),
        ("header length not a number", encoded + raw, {"Inference-Header-Content-Length": "12a"}, "'12a'"),
        ("malformed JSON header", b'{"inputs": [', {}, "JSON"),
        ("header length cuts the JSON", encoded + raw, {"Inference-Header-Content-Length": "10"}, "JSON"),
    ]
    return built


def test_bad_requests_get_400_naming_the_problem(client, keys, deployed) -> None:
    x = np.ones((2, 8), np.float32)
    for case, body, headers, words in bad_requests(x):
        response = client.post("/v2/models/mlp/infer", headers={**auth(keys["alice"]), **headers}, content=body)
        assert response.status_code == 400, (case, response.text)
        message = response.json()["error"]
        assert isinstance(message, str) and words in message, (case, message)


def test_a_missing_input_is_named(client, keys) -> None:
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    model = make_model(nodes, [tensor("a", ["batch", 2]), tensor("b", ["batch", 2])], [tensor("y", ["batch", 2])])
    deploy(client, keys["alice"], "add", model.SerializeToString())
    body = {"inputs": [json_input("a", np.ones((1, 2), np.float32))]}
    response = client.post("/v2/models/add/infer", headers=auth(keys["alice"]), json=body)
    assert response.status_code == 400 and "missing input 'b'" in response.json()["error"]


def test_infer_refuses_a_missing_key_and_a_large_body_in_the_v2_shape(client, keys, settings) -> None:
    denied = client.post("/v2/models/mlp/infer", content=b"{}")
    assert denied.status_code == 401 and "Authorization" in denied.json()["error"]
    assert denied.headers["WWW-Authenticate"] == "Bearer"
    wrong = client.post("/v2/models/mlp/infer", headers=auth("lc_wrong"), content=b"{}")
    assert wrong.status_code == 401 and isinstance(wrong.json()["error"], str)
    large = client.post(
        "/v2/models/mlp/infer", headers=auth(keys["alice"]), content=b"0" * (settings.max_infer_body_bytes + 1)
    )
    assert large.status_code == 413 and str(settings.max_infer_body_bytes) in large.json()["error"]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (Overloaded("the queue is full", retry_after=3), 429),
        (Unavailable("no runtime serves device type 'cpu'"), 503),
        (DeadlineExceeded("the request did not finish in 30 s"), 504),
    ],
)
def test_engine_errors_keep_their_status_in_the_v2_shape(client, keys, deployed, monkeypatch, error, status) -> None:
    async def failing(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(client.app.state.services.engine, "infer", failing)
    body = {"inputs": [json_input("x", np.zeros((1, 8), np.float32))]}
    response = client.post("/v2/models/mlp/infer", headers=auth(keys["alice"]), json=body)
    assert response.status_code == status and response.json() == {"error": error.message}
    if status == 429:
        assert response.headers["Retry-After"] == "3"


def test_v2_requests_are_metered_and_counted_like_v1(client, keys, deployed) -> None:
    labels = {"tenant": "alice", "model": "mlp", "status": "ok"}
    counted = REGISTRY.get_sample_value("luminal_inference_requests_total", labels) or 0.0
    x = np.ones((2, 8), np.float32)
    client.post("/v1/models/mlp/infer", headers=auth(keys["alice"]), json={"inputs": {"x": x.tolist()}})
    header = {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32", "parameters": {"binary_data_size": 64}}]}
    body, headers = binary_body(header, x.tobytes())
    for _ in range(2):
        assert client.post("/v2/models/mlp/infer", headers={**auth(keys["alice"]), **headers}, content=body).is_success
    client.post("/v2/models/mlp/infer", headers=auth(keys["alice"]), json={"inputs": [json_input("x", x)]})
    [item] = client.get("/v1/usage", headers=auth(keys["alice"])).json()["items"]
    assert (item["model"], item["requests"], item["rows"]) == ("mlp", 4, 8) and item["billed_seconds"] > 0
    assert REGISTRY.get_sample_value("luminal_inference_requests_total", labels) == counted + 4


def test_nvidia_tritonclient_drives_a_model_deployed_through_v1(settings, keys) -> None:
    key = keys["alice"]
    data = two_outputs_model()
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    expected = ort(data, {"x": x})
    with BackgroundServer(settings) as server:
        # the model is deployed through /v1, as a user would
        with httpx.Client(base_url=server.url, headers=auth(key), timeout=60) as http:
            upload(http, key, "two", data)
            assert wait_for(http, key, "two", 1)["status"] == "ready"
        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        # each call gets its own headers: tritonclient writes the binary framing header into them
        try:
            assert client.is_server_live() and client.is_server_ready()
            assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
            assert client.is_model_ready("two", headers=auth(key))
            assert client.is_model_ready("two", "1", headers=auth(key))
            assert not client.is_model_ready("two", "2", headers=auth(key))
            metadata = client.get_model_metadata("two", headers=auth(key))
            assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
            for binary in (True, False):
                given = triton.InferInput("x", list(x.shape), "FP32")
                given.set_data_from_numpy(x, binary_data=binary)
                asked = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("sigmoid", "relu")]
                result = client.infer("two", [given], outputs=asked, request_id="t1", headers=auth(key))
                assert result.get_response()["id"] == "t1"
                for name in ("sigmoid", "relu"):
                    np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=1e-5, atol=1e-6)
            # no outputs named: tritonclient asks for all of them in binary
            given = triton.InferInput("x", list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            result = client.infer("two", [given], model_version="1", headers=auth(key))
            np.testing.assert_allclose(result.as_numpy("relu"), expected["relu"], rtol=1e-6)
            with pytest.raises(InferenceServerException) as refused:
                client.infer("two", [given])
            assert refused.value.status() == "401"
            with pytest.raises(InferenceServerException) as missing:
                client.infer("ghost", [given], headers=auth(key))
            assert missing.value.status() == "404" and "ghost" in missing.value.message()
        finally:
            client.close()
        with httpx.Client(base_url=server.url, headers=auth(key)) as http:
            [item] = http.get("/v1/usage").json()["items"]
    assert (item["model"], item["requests"], item["rows"]) == ("two", 3, 9)
