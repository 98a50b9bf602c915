"""One rule for input values on /v1 and /v2 (JSON and binary): numbers in the dtype's range,
booleans only for bool inputs, NaN and infinities only when the request asks; non-finite outputs
as strict JSON; not-ready versions answered alike on both routes; messages that name the problem
(a string input, a body that is not JSON, a file that is not .npy)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from api.errors import describe_validation_errors
from api.validation import decode_body
from cloud.errors import InvalidInput, InvalidRequest
from compiler import Signature
from tests.conftest import auth, upload, wait_for
from tests.onnx_models import int_input_model, make_model, mlp, tensor, unsupported_model


def doubling_model() -> bytes:
    """y = x + x over float32[batch, 2]: 3e38 (in range) doubles to infinity."""
    nodes = [helper.make_node("Add", ["x", "x"], ["y"])]
    return make_model(nodes, [tensor("x", ["batch", 2])], [tensor("y", ["batch", 2])]).SerializeToString()


def bool_model() -> bytes:
    nodes = [helper.make_node("Identity", ["m"], ["y"])]
    m, y = tensor("m", ["batch", 2], TensorProto.BOOL), tensor("y", ["batch", 2], TensorProto.BOOL)
    return make_model(nodes, [m], [y]).SerializeToString()


def deploy(client, key: str, name: str, data: bytes) -> None:
    upload(client, key, name, data)
    assert wait_for(client, key, name, 1)["status"] == "ready"


def strict_json(text: str):
    """The body as a strict JSON parser reads it: no NaN or Infinity tokens."""

    def refuse(token: str):
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def v1(client, key: str, name: str, body: str | dict):
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(f"/v1/models/{name}/infer", headers={**auth(key), "Content-Type": "application/json"}, content=content)


def v2(client, key: str, name: str, header: str | dict, binary: bytes = b""):
    content = (header if isinstance(header, str) else json.dumps(header)).encode()
    headers = auth(key)
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(content))
    return client.post(f"/v2/models/{name}/infer", headers=headers, content=content + binary)


def v2_json(name: str, shape: list[int], data_json: str, datatype: str = "FP32", parameters: str = "{}") -> str:
    """A v2 body written by hand, so that its data may hold the tokens NaN and Infinity."""
    return (
        f'{{"parameters": {parameters}, "inputs": [{{"name": "{name}", "shape": {json.dumps(shape)}, '
        f'"datatype": "{datatype}", "data": {data_json}}}]}}'
    )


def v2_binary(name: str, array: np.ndarray, datatype: str, parameters: dict | None = None) -> dict:
    return {
        "parameters": parameters or {},
        "inputs": [
            {"name": name, "shape": list(array.shape), "datatype": datatype, "parameters": {"binary_data_size": array.nbytes}}
        ],
    }


def message(response, v2_route: bool) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return error if v2_route else error["message"]


ALLOW = '{"allow_non_finite": true}'


def test_non_finite_inputs_are_refused_naming_the_element_unless_the_request_asks(client, keys) -> None:
    key = keys["alice"]
    deploy(client, key, "double", doubling_model())
    nan_bits = np.array([[1.0, np.nan]], np.float32).astype("<f4")
    refused = {
        "v1 token": v1(client, key, "double", '{"inputs": {"x": [[1.0, NaN]]}}'),
        "v1 string": v1(client, key, "double", '{"inputs": {"x": [[1.0, "NaN"]]}}'),
        "v2 token": v2(client, key, "double", v2_json("x", [1, 2], "[1.0, NaN]")),
        "v2 binary": v2(client, key, "double", v2_binary("x", nan_bits, "FP32"), nan_bits.tobytes()),
    }
    for case, response in refused.items():
        text = message(response, case.startswith("v2"))
        assert "input 'x' element [" in text and "is NaN" in text and "allow_non_finite" in text, (case, text)
    infinity = v1(client, key, "double", '{"inputs": {"x": [[-Infinity, 1.0]]}}')
    assert "input 'x' element [0, 0] is -Infinity" in message(infinity, False)

    # asked for: the same values go through, and come back as JSON strings on both routes
    answers = [
        v1(client, key, "double", f'{{"inputs": {{"x": [[1.0, NaN], ["Infinity", -Infinity]]}}, "parameters": {ALLOW}}}'),
        v2(client, key, "double", v2_json("x", [2, 2], '[1.0, NaN, "Infinity", -Infinity]', parameters=ALLOW)),
    ]
    for response in answers:
        assert response.status_code == 200, response.text
        body = strict_json(response.text)
        flat = [v for row in body["outputs"]["y"] for v in row] if "model" in body else body["outputs"][0]["data"]
        assert flat == [2.0, "NaN", "Infinity", "-Infinity"]
    asked = v2(client, key, "double", v2_binary("x", nan_bits, "FP32", {"allow_non_finite": True}), nan_bits.tobytes())
    assert asked.status_code == 200 and strict_json(asked.text)["outputs"][0]["data"] == [2.0, "NaN"]


def test_non_finite_outputs_are_strict_json_strings_on_both_routes(client, keys) -> None:
    key = keys["alice"]
    deploy(client, key, "double", doubling_model())
    x = [[3e38, -3e38]]  # each within float32; doubled, past it
    reply = v1(client, key, "double", {"inputs": {"x": x}})
    assert reply.status_code == 200 and strict_json(reply.text)["outputs"]["y"] == [["Infinity", "-Infinity"]]
    reply = v2(client, key, "double", {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": x[0]}]})
    assert reply.status_code == 200 and strict_json(reply.text)["outputs"][0]["data"] == ["Infinity", "-Infinity"]


def test_numbers_past_the_dtype_are_refused_alike_on_v1_and_v2(client, keys) -> None:
    key = keys["alice"]
    deploy(client, key, "double", doubling_model())
    deploy(client, key, "ids", int_input_model().SerializeToString())
    cases = [
        ("double", "[[1e39, 0]]", "[1e39, 0]", [1, 2], "FP32", "element [0, 0] (1e+39) is out of range for float32"),
        # json reads 1e999 as infinity: it is still a number too large, even when non-finite values are allowed
        ("double", "[[0, 1e999]]", "[0, 1e999]", [1, 2], "FP32", "element [0, 1] is a number too large for any float"),
        ("ids", "[[1, 2, 18446744073709551616]]", "[1, 2, 18446744073709551616]", [1, 3], "INT64",
         "element [0, 2] (18446744073709551616) is out of range for int64"),
        ("ids", "[[-9223372036854775809, 2, 3]]", "[-9223372036854775809, 2, 3]", [1, 3], "INT64",
         "element [0, 0] (-9223372036854775809) is out of range for int64"),
        ("ids", "[[1, 2.5, 3]]", "[1, 2.5, 3]", [1, 3], "INT64", "element [0, 1] is 2.5 where int64 integers are expected"),
    ]
    for model, nested, flat, shape, datatype, words in cases:
        name = "x" if model == "double" else "ids"
        body = f'{{"inputs": {{"{name}": {nested}}}, "parameters": {ALLOW}}}'
        assert words in message(v1(client, key, model, body), False), words
        flat_words = words.replace("[0, 0]", "[0]").replace("[0, 1]", "[1]").replace("[0, 2]", "[2]")
        response = v2(client, key, model, v2_json(name, shape, flat, datatype, ALLOW))
        assert flat_words in message(response, True), flat_words


def test_booleans_only_for_bool_inputs_and_only_true_or_false(client, keys) -> None:
    key = keys["alice"]
    deploy(client, key, "double", doubling_model())
    deploy(client, key, "mask", bool_model())
    # numpy made 1.0 of a true among floats: refused by name on both routes
    text = message(v1(client, key, "double", {"inputs": {"x": [[1.0, True]]}}), False)
    assert "input 'x' element [0, 1] is true: booleans are accepted only for bool inputs" in text
    text = message(v2(client, key, "double", v2_json("x", [1, 2], "[1.0, true]")), True)
    assert "input 'x' element [1] is true" in text

    ok = v1(client, key, "mask", {"inputs": {"m": [[True, False]]}})
    assert ok.status_code == 200 and ok.json()["outputs"]["y"] == [[True, False]]
    text = message(v1(client, key, "mask", {"inputs": {"m": [[True, 1]]}}), False)
    assert "input 'm' element [0, 1] is 1; a bool input takes true or false" in text
    text = message(v2(client, key, "mask", v2_json("m", [1, 2], "[0, 1]", "BOOL")), True)
    assert "input 'm' element [0] is 0; a bool input takes true or false" in text
    two = np.array([[1, 2]], np.uint8)
    text = message(v2(client, key, "mask", v2_binary("m", two, "BOOL"), two.tobytes()), True)
    assert "input 'm' element [0, 1] is the byte 2; a bool input takes 0 or 1" in text


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}, "outputs.0.parameters.binary_data"),
        ({"parameters": {"binary_data_output": "true"}}, "parameters.binary_data_output"),
        ({"parameters": {"binary_data_output": 1}}, "parameters.binary_data_output"),
        ({"parameters": {"allow_non_finite": "yes"}}, "parameters.allow_non_finite"),
        ({"inputs": [{"name": "x", "shape": ["1", 2], "datatype": "FP32", "data": [1, 2]}]}, "inputs.0.shape.0"),
        ({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": "8"}}]},
         "inputs.0.parameters.binary_data_size"),
        ({"id": 7}, "id"),
    ],
)
def test_v2_parameters_are_type_checked(client, keys, parameters, words) -> None:
    key = keys["alice"]
    deploy(client, key, "double", doubling_model())
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}], **parameters}
    text = message(v2(client, key, "double", body), True)
    assert words in text, text


SIGNATURE = Signature.from_json(
    {
        "inputs": [{"name": "x", "shape": ["batch", 2], "dtype": "float32"}],
        "outputs": [{"name": "y", "shape": ["batch", 2], "dtype": "float32"}],
        "batch_symbol": "batch",
    }
)


@pytest.mark.parametrize(
    ("body", "error", "words"),
    [
        ('{"inputs": {"x": "hello"}}', InvalidInput, "input 'x' is a string (\"hello\") where numbers are expected"),
        ('{"inputs": {"x": ["a", "b"]}}', InvalidInput, "input 'x' element [0] is a string (\"a\") where numbers"),
        ('{"inputs": {"x": [["a", 1]]}}', InvalidInput, "input 'x' element [0, 0] is a string (\"a\") where float32"),
        ('{"inputs": {"x": [[1, null]]}}', InvalidInput, "input 'x' element [0, 1] is null where float32 numbers"),
        ('{"inputs": {"x": {"a": 1}}}', InvalidInput, "input 'x' is an object where numbers are expected"),
        ('{"inputs": {"x": [[1, 2]]}, "parameters": {"allow_nan": true}}', InvalidRequest, "unknown parameter 'allow_nan'"),
        ('{"inputs": {"x": [[1, 2]]}, "parameters": {"allow_non_finite": 1}}', InvalidRequest, "must be true or false"),
        ('{"inputs": {"x": [[1, 2]]}, "parameters": true}', InvalidRequest, "parameters: must be an object"),
    ],
)
def test_v1_values_and_parameters_are_named(body, error, words) -> None:
    with pytest.raises(error) as raised:
        decode_body(body.encode(), SIGNATURE, 1000, {"batch": 8}, None)
    assert words in raised.value.message


def test_a_string_input_and_2_to_the_64_are_named_over_http(client, keys) -> None:
    key = keys["alice"]
    deploy(client, key, "mlp", mlp().SerializeToString())
    deploy(client, key, "ids", int_input_model().SerializeToString())
    text = message(v1(client, key, "mlp", {"inputs": {"x": "hello"}}), False)
    assert text.startswith("input 'x' is a string (\"hello\") where numbers are expected") and "rank" not in text
    text = message(v1(client, key, "ids", {"inputs": {"ids": [[1, 2, 2**64]]}}), False)
    assert "element [0, 2] (18446744073709551616) is out of range for int64" in text and "mixed" not in text


def test_a_body_that_is_not_json_is_named_so(client, keys) -> None:
    key = keys["alice"]
    path = "/v1/models/mlp/aliases/prod"
    sent_as_json = client.put(path, headers={**auth(key), "Content-Type": "application/json"}, content=b"not json")
    assert sent_as_json.status_code == 400
    assert sent_as_json.json()["error"]["message"] == "the body is not valid JSON (Expecting value at character 0)"
    cut = client.put(path, headers={**auth(key), "Content-Type": "application/json"}, content=b'{"version": 1,')
    assert "the body is not valid JSON" in cut.json()["error"]["message"] and "at character 14" in cut.json()["error"]["message"]
    untyped = client.put(path, headers=auth(key), content=b"not json")
    assert untyped.status_code == 400 and untyped.json()["error"]["message"] == "the body must be a JSON object"
    empty = client.put(path, headers=auth(key))
    assert empty.status_code == 400 and "the body is empty" in empty.json()["error"]["message"]


def test_describe_validation_errors_keeps_field_errors_and_pydantic_json_errors() -> None:
    assert describe_validation_errors([{"type": "int_type", "loc": ("body", "version"), "msg": "bad"}]) == "version: bad"
    pydantic_own = {"type": "json_invalid", "loc": (), "msg": "Invalid JSON: EOF while parsing at line 1 column 3"}
    assert describe_validation_errors([pydantic_own]) == "the body is not valid JSON (EOF while parsing at line 1 column 3)"


def test_a_version_not_ready_answers_alike_on_v1_and_v2(client, keys, monkeypatch) -> None:
    key = keys["alice"]
    upload(client, key, "m", unsupported_model().SerializeToString())
    assert wait_for(client, key, "m", 1)["status"] == "failed"
    monkeypatch.setattr(client.app.state.services.compiler, "submit", lambda *_: None)
    upload(client, key, "m", mlp().SerializeToString())  # version 2 stays queued
    x = [[0.0] * 4]
    for version, v1_status, v2_status in ((1, 409, 400), (2, 503, 503)):
        body = {"inputs": {"x": x}}
        on_v1 = client.post(f"/v1/models/m/infer?version={version}", headers=auth(key), json=body)
        v2_body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x[0]}]}
        on_v2 = client.post(f"/v2/models/m/versions/{version}/infer", headers=auth(key), json=v2_body)
        assert (on_v1.status_code, on_v2.status_code) == (v1_status, v2_status), (on_v1.text, on_v2.text)
        assert on_v1.json()["error"]["code"] == "not_ready" and f"version {version} is" in on_v2.json()["error"]
        # queued or compiling passes: come back in a second; failed never will
        expected = "1" if v1_status == 503 else None
        assert on_v1.headers.get("Retry-After") == on_v2.headers.get("Retry-After") == expected
        ready = client.get(f"/v2/models/m/versions/{version}/ready", headers=auth(key))
        assert ready.status_code == 400 and f"version {version} is" in ready.json()["error"]


def test_a_text_file_given_as_npy_is_named_not_npy(tmp_path) -> None:
    from luminal_cloud.cli import UsageError, _load_input

    text = tmp_path / "x.npy"
    text.write_text("1 2 3\n")
    with pytest.raises(UsageError) as raised:
        _load_input(f"x={text}")
    assert str(raised.value) == f"{text} (input 'x') is not a .npy array file; write one with numpy.save"
    assert "pickle" not in str(raised.value)
    objects = tmp_path / "o.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UsageError, match="holds Python objects") as raised:
        _load_input(f"x={objects}")
    assert "pickle" not in str(raised.value)
