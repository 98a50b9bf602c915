"""The HTTP API end to end (in-process ASGI client): upload, compile, infer, bill, and bad input."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime
import pytest
from fastapi.testclient import TestClient
from onnx import helper
from sqlalchemy import func, select

from api.main import create_app
from api.services import open_database
from cloud.auth import create_key
from cloud.db import Model, ModelVersion, UsageRecord
from cloud.metrics import REGISTRY
from tests.conftest import FIXTURES, auth, make_settings, upload, wait_for
from tests.onnx_models import (
    embedding_model,
    fixed_shape_model,
    init,
    int_input_model,
    make_model,
    mlp,
    tensor,
    unsupported_model,
)

MLP = mlp().SerializeToString()


def with_opset(model, version: int):
    model.opset_import[0].version = version
    return model


def ort(data: bytes, inputs: dict) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, inputs)


@pytest.fixture
def deployed(client, keys):
    created = upload(client, keys["alice"], "mlp", MLP)
    assert created == {
        "name": "mlp",
        "version": 1,
        "status": "queued",
        "target": "cpu",
        "precision": "exported",
        "task": "inference",
    }
    assert wait_for(client, keys["alice"], "mlp", 1)["status"] == "ready"
    return "mlp"


def infer(client, key, name, inputs, **params):
    return client.post(f"/v1/models/{name}/infer", headers=auth(key), json={"inputs": inputs}, params=params)


def test_upload_compile_and_infer_match_onnxruntime(client, keys, deployed) -> None:
    model = client.get("/v1/models/mlp", headers=auth(keys["alice"])).json()
    [version] = model["versions"]
    assert version["signature"]["inputs"] == [{"name": "x", "shape": ["batch", 8], "dtype": "float32"}]
    assert version["report"]["kernels"] > 0 and version["error"] is None
    assert version["precision"] == "exported"
    listed = client.get("/v1/models/mlp/versions", headers=auth(keys["alice"])).json()["versions"]
    assert [(v["target"], v["precision"]) for v in listed] == [("cpu", "exported")]
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    response = infer(client, keys["alice"], "mlp", {"x": x.tolist()})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "mlp" and body["version"] == 1
    np.testing.assert_allclose(
        np.array(body["outputs"]["y"], np.float32), ort(MLP, {"x": x})[0], rtol=1e-5, atol=1e-6
    )
    assert body["usage"]["batch_size"] == 1 and body["usage"]["exec_ms"] > 0
    assert response.headers["X-Request-ID"] == body["usage"]["request_id"]


def test_reupload_creates_next_version_and_both_serve(client, keys, deployed) -> None:
    other = mlp(seed=5).SerializeToString()
    assert upload(client, keys["alice"], "mlp", other)["version"] == 2
    wait_for(client, keys["alice"], "mlp", 2)
    x = np.ones((1, 8), np.float32)
    latest = infer(client, keys["alice"], "mlp", {"x": x.tolist()}).json()
    first = infer(client, keys["alice"], "mlp", {"x": x.tolist()}, version=1).json()
    assert latest["version"] == 2 and first["version"] == 1
    np.testing.assert_allclose(np.array(latest["outputs"]["y"]), ort(other, {"x": x})[0], rtol=1e-5)
    np.testing.assert_allclose(np.array(first["outputs"]["y"]), ort(MLP, {"x": x})[0], rtol=1e-5)
    listed = client.get("/v1/models", headers=auth(keys["alice"])).json()["models"]
    assert [(m["name"], m["latest_version"], m["versions"]) for m in listed] == [("mlp", 2, 2)]


def test_unbatchable_model_serves_its_fixed_shape(client, keys) -> None:
    data = fixed_shape_model().SerializeToString()
    upload(client, keys["alice"], "fixed", data)
    wait_for(client, keys["alice"], "fixed", 1)
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 3
    body = infer(client, keys["alice"], "fixed", {"x": x.tolist()}).json()
    np.testing.assert_allclose(np.array(body["outputs"]["y"]), ort(data, {"x": x})[0], rtol=1e-6)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (MLP[: len(MLP) // 2], "not a usable ONNX model"),
        (b"\x00\x01garbage bytes that are not protobuf", "not a usable ONNX model"),
        (b"name,value\n1,2\n", "not a usable ONNX model"),
        (with_opset(mlp(), 999).SerializeToString(), "opset 999 (the newest this service knows is"),
    ],
)
def test_bad_uploads_get_400(client, keys, data: bytes, message: str) -> None:
    response = client.post(
        "/v1/models", headers=auth(keys["alice"]), files={"file": ("m.onnx", data)}, data={"name": "bad"}
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert client.get("/v1/models/bad", headers=auth(keys["alice"])).status_code == 404


def test_upload_over_the_limit_gets_413(client, keys, settings) -> None:
    data = b"\x08" * (settings.max_upload_bytes + 200 * 1024)
    response = client.post(
        "/v1/models", headers=auth(keys["alice"]), files={"file": ("big.onnx", data)}, data={"name": "big"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize(
    ("form", "message"),
    [({"name": "bad name!"}, "model name"), ({"name": "ok", "target": "tpu"}, "unknown target 'tpu'")],
)
def test_bad_upload_fields_get_400(client, keys, form, message) -> None:
    response = client.post(
        "/v1/models", headers=auth(keys["alice"]), files={"file": ("m.onnx", MLP)}, data=form
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ("float16", "precision 'float16' runs on GPU targets"),  # a narrow float on the cpu
        ("float8", "unknown precision 'float8'; known: exported, tf32, float16, bfloat16, int8"),
    ],
)
def test_a_precision_the_target_cannot_run_gets_400_naming_it(client, keys, precision, message) -> None:
    form = {"name": "half", "target": "cpu", "precision": precision}
    response = client.post(
        "/v1/models", headers=auth(keys["alice"]), files={"file": ("m.onnx", MLP)}, data=form
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and message in error["message"]
    assert client.get("/v1/models/half", headers=auth(keys["alice"])).status_code == 404


def test_a_gpu_upload_keeps_the_precision_it_asked_for(tmp_path) -> None:
    settings = make_settings(tmp_path / "gpu", targets=("cpu", "h100"), allow_unmeasured_compile=True)
    db = open_database(settings)
    try:
        key = create_key(db, "alice")
    finally:
        db.dispose()
    with TestClient(create_app(settings)) as client:
        created = upload(client, key, "mlp", MLP, target="h100", precision="bfloat16")
        assert (created["target"], created["precision"]) == ("h100", "bfloat16")
        wait_for(client, key, "mlp", 1)  # however the compile ends, the version keeps its precision
        [version] = client.get("/v1/models/mlp", headers=auth(key)).json()["versions"]
        [summary] = client.get("/v1/models/mlp/versions", headers=auth(key)).json()["versions"]
        assert version["precision"] == summary["precision"] == "bfloat16"


def test_unsupported_ops_fail_the_version_with_the_missing_ops(client, keys) -> None:
    upload(client, keys["alice"], "exotic", unsupported_model().SerializeToString())
    version = wait_for(client, keys["alice"], "exotic", 1)
    assert version["status"] == "failed"
    assert "NonZero, Unique" in version["error"]
    response = infer(client, keys["alice"], "exotic", {"x": [[1, 2, 3, 4]]})
    assert response.status_code == 409
    assert "failed" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "inputs"),
        ({"z": [[0.0] * 8]}, "unknown input 'z'"),
        ({"x": [[0.0] * 8], "z": [1]}, "unknown input 'z'"),
        ({"x": [0.0] * 8}, "input 'x' has rank 1"),
        ({"x": [[0.0] * 7]}, "dimension 1 is 7, expected 8"),
        ({"x": [["a"] * 8]}, 'element [0, 0] is a string ("a") where float32 numbers are expected'),
        ({"x": [[True] * 8]}, "element [0, 0] is true: booleans are accepted only for bool inputs"),
        ({"x": [[0.0] * 8, [0.0] * 7]}, "not a rectangular"),
        ({"x": [[None] * 8]}, "element [0, 0] is null"),
        ({"x": [[1e39] * 8]}, "element [0, 0] (1e+39) is out of range for float32"),
        ({"x": [[0.0] * 8] * 300}, "allowed 1 to 256"),
    ],
)
def test_bad_inputs_get_400_naming_input_and_signature(client, keys, deployed, inputs, message) -> None:
    response = infer(client, keys["alice"], "mlp", inputs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if "unknown" in message or "rank" in message or "expected 8" in message:
        assert "x: float32[batch, 8]" in error["message"]


def test_float_given_for_integer_input_gets_400(client, keys) -> None:
    upload(client, keys["alice"], "ids", int_input_model().SerializeToString())
    wait_for(client, keys["alice"], "ids", 1)
    assert infer(client, keys["alice"], "ids", {"ids": [[1, 2, 3]]}).json()["outputs"]["y"] == [[1, 2, 3]]
    response = infer(client, keys["alice"], "ids", {"ids": [[1.5, 2, 3]]})
    assert response.status_code == 400
    assert "element [0, 0] is 1.5 where int64 integers are expected" in response.json()["error"]["message"]


def test_out_of_range_token_id_gets_400_and_spares_the_rest_of_its_batch(client, keys) -> None:
    upload(client, keys["alice"], "embed", embedding_model().SerializeToString())
    wait_for(client, keys["alice"], "embed", 1)
    bodies = [{"ids": [[1, 2, 3]]}, {"ids": [[1, 99, 3]]}, {"ids": [[9, 0, 4]]}]
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda body: infer(client, keys["alice"], "embed", body), bodies))
    assert [r.status_code for r in responses] == [200, 400, 200]
    assert "out of range" in responses[1].json()["error"]["message"]
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    assert responses[2].json()["outputs"]["y"] == table[[[9, 0, 4]]].tolist()


def test_a_models_own_length_limit_is_published_and_enforced_with_400(client, keys) -> None:
    # a GPT-2-style decoder slices its 64-position causal-mask buffer to the sequence length
    upload(client, keys["alice"], "gpt", (FIXTURES / "gpt2_torchscript.onnx").read_bytes())
    version = wait_for(client, keys["alice"], "gpt", 1)
    assert version["status"] == "ready", version
    assert version["signature"]["dim_limits"]["seq"] == 64
    assert infer(client, keys["alice"], "gpt", {"input_ids": [[1] * 64]}).status_code == 200
    response = infer(client, keys["alice"], "gpt", {"input_ids": [[1] * 65]})
    assert response.status_code == 400
    assert "(seq) is 65; allowed 1 to 64" in response.json()["error"]["message"]


def test_a_transformers_sentence_encoder_serves_any_batch_and_length(client, keys) -> None:
    # BertModel + mean pooling, exported by torch.onnx.export(dynamo=True), as a user brings it
    data = (FIXTURES / "hf" / "bert_mean_pooling_dynamo.onnx").read_bytes()
    upload(client, keys["alice"], "minilm", data)
    version = wait_for(client, keys["alice"], "minilm", 1)
    assert version["status"] == "ready", version
    assert [spec["shape"] for spec in version["signature"]["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 3), (2, 9)):
        ids = rng.integers(0, 100, (batch, seq)).astype(np.int64)
        mask = np.ones((batch, seq), np.int64)
        mask[-1, seq // 2 :] = 0
        response = infer(
            client, keys["alice"], "minilm", {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
        )
        assert response.status_code == 200, response.text
        (want,) = ort(data, {"input_ids": ids, "attention_mask": mask})
        np.testing.assert_allclose(
            response.json()["outputs"]["sentence_embedding"], want, rtol=1e-4, atol=1e-5
        )


def test_unknown_model_and_version_get_404(client, keys, deployed) -> None:
    assert infer(client, keys["alice"], "nope", {"x": [[0.0] * 8]}).status_code == 404
    response = infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]}, version=9)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "model 'mlp' has no version 9"
    assert infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]}, version=0).status_code == 400


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_key_gets_401(client, headers) -> None:
    for response in (client.get("/v1/models", headers=headers), client.get("/v1/usage", headers=headers)):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthorized"


def test_tenants_see_only_their_own_models(client, keys, deployed) -> None:
    bob = auth(keys["bob"])
    assert client.get("/v1/models", headers=bob).json() == {"models": [], "object": "list", "data": []}
    assert client.get("/v1/models/mlp", headers=bob).status_code == 404
    assert infer(client, keys["bob"], "mlp", {"x": [[0.0] * 8]}).status_code == 404
    assert client.delete("/v1/models/mlp", headers=bob).status_code == 404
    # bob's model of the same name is his own
    upload(client, keys["bob"], "mlp", mlp(seed=9).SerializeToString())
    assert client.get("/v1/models/mlp", headers=auth(keys["alice"])).json()["versions"][0]["version"] == 1
    infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]})
    assert client.get("/v1/usage", headers=bob).json()["items"] == []


def test_usage_sums_billed_execution_time(client, keys, deployed, settings) -> None:
    rows_sent, billed = 0, 0.0
    for rows in (1, 2, 5):
        body = infer(client, keys["alice"], "mlp", {"x": [[0.5] * 8] * rows}).json()
        rows_sent += rows
        billed += body["usage"]["exec_ms"] / 1000
    report = client.get("/v1/usage", headers=auth(keys["alice"])).json()
    assert report["tenant"] == "alice"
    [item] = report["items"]
    assert (item["model"], item["version"], item["requests"], item["rows"]) == ("mlp", 1, 3, rows_sent)
    assert item["billed_seconds"] == pytest.approx(billed, rel=1e-6)
    assert item["price_per_second"] == settings.price_per_second["cpu"]
    assert item["cost"] == pytest.approx(billed * settings.price_per_second["cpu"], rel=1e-6)
    db = client.app.state.services.db
    with db.session() as session:
        assert session.scalar(select(func.count(UsageRecord.id))) == 3


def test_a_tenant_cannot_tell_that_another_uploaded_the_same_bytes(client, keys, deployed) -> None:
    upload(client, keys["bob"], "mine", MLP)
    bobs = wait_for(client, keys["bob"], "mine", 1)
    alices = client.get("/v1/models/mlp", headers=auth(keys["alice"])).json()["versions"][0]
    assert bobs["status"] == "ready"
    # bob's compile is his own: its own measurements, in a report that names nothing of alice's
    assert bobs["report"] != alices["report"]
    assert "cached" not in str(bobs) and "artifacts/" not in str(bobs)
    with client.app.state.services.db.session() as session:
        stored = dict(
            session.execute(select(Model.name, ModelVersion.artifact_key).join(ModelVersion.model)).all()
        )
    assert stored["mine"] != stored["mlp"] and stored["mine"].split("/")[1] != stored["mlp"].split("/")[1]


def test_deleting_frees_the_stored_files_no_other_version_uses(client, keys, deployed, settings) -> None:
    def stored() -> list[str]:
        return sorted(
            str(p.relative_to(settings.objects_dir)) for p in settings.objects_dir.rglob("*") if p.is_file()
        )

    upload(client, keys["alice"], "same-bytes", MLP)
    assert wait_for(client, keys["alice"], "same-bytes", 1)["status"] == "ready"
    upload(client, keys["bob"], "same-bytes", MLP)
    assert wait_for(client, keys["bob"], "same-bytes", 1)["status"] == "ready"
    before = stored()
    assert any(p.startswith("graphs/") for p in before) and any(p.startswith("artifacts/") for p in before)
    assert client.delete("/v1/models/mlp", headers=auth(keys["alice"])).status_code == 200
    assert stored() == before  # alice's other version still uses them
    assert client.delete("/v1/models/same-bytes", headers=auth(keys["alice"])).status_code == 200
    bobs = stored()
    assert bobs and len(bobs) < len(before)  # alice's copies are gone, bob's (his own) stay
    assert infer(client, keys["bob"], "same-bytes", {"x": [[0.0] * 8]}).status_code == 200
    assert client.delete("/v1/models/same-bytes", headers=auth(keys["bob"])).status_code == 200
    assert not [p for p in stored() if p.startswith(("graphs/", "artifacts/"))]


def test_delete_removes_the_model(client, keys, deployed) -> None:
    response = client.delete("/v1/models/mlp", headers=auth(keys["alice"]))
    assert response.status_code == 200 and response.json() == {"name": "mlp", "deleted": True, "versions": 1}
    assert client.get("/v1/models/mlp", headers=auth(keys["alice"])).status_code == 404
    assert infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]}).status_code == 404


def test_health_and_metrics(client, keys, deployed, settings) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]})
    infer(client, keys["alice"], "mlp", {"x": [[0.0] * 3]})
    settings.metrics_token = "operator-token"
    text = client.get("/metrics", headers=auth("operator-token")).text
    assert 'luminal_inference_requests_total{model="mlp",status="ok",tenant="alice"}' in text
    assert 'luminal_inference_requests_total{model="mlp",status="400",tenant="alice"}' in text
    assert 'luminal_batch_size_requests_bucket{le="1.0",model="mlp",tenant="alice"}' in text
    assert 'luminal_billed_seconds_total{tenant="alice"}' in text


def test_metrics_are_for_operators_only(client, keys, settings) -> None:
    # the test client is not on loopback: without a token configured, it is refused
    response = client.get("/metrics")
    assert response.status_code == 403 and "LUMINAL_METRICS_TOKEN" in response.json()["error"]["message"]
    settings.metrics_token = "operator-token"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=auth(keys["alice"])).status_code == 401  # a tenant key is no token
    assert client.get("/metrics", headers=auth("operator-token")).status_code == 200


def test_random_model_names_do_not_grow_the_metrics(client, keys, settings) -> None:
    settings.metrics_token = "operator-token"
    labels = {"tenant": "bob", "model": "(unknown)", "status": "404"}
    counted = REGISTRY.get_sample_value("luminal_inference_requests_total", labels) or 0.0
    before = client.get("/metrics", headers=auth("operator-token")).text.count("\n")
    for i in range(50):
        assert infer(client, keys["bob"], f"missing-{i}", {"x": [[0.0]]}).status_code == 404
    text = client.get("/metrics", headers=auth("operator-token")).text
    assert "missing-" not in text
    assert REGISTRY.get_sample_value("luminal_inference_requests_total", labels) == counted + 50
    assert text.count("\n") - before < 40  # one series family for all of them, not one per name


def test_malformed_json_body_gets_400(client, keys, deployed) -> None:
    response = client.post(
        "/v1/models/mlp/infer",
        headers={**auth(keys["alice"]), "Content-Type": "application/json"},
        content=b"{not json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


def test_concurrent_uploads_of_a_new_name_get_distinct_versions(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", max_uploads_per_tenant=4)  # all four at once
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    with TestClient(create_app(settings)) as client, ThreadPoolExecutor(max_workers=4) as pool:
        created = list(
            pool.map(lambda i: upload(client, key, "race", mlp(seed=i).SerializeToString()), range(4))
        )
        assert sorted(c["version"] for c in created) == [1, 2, 3, 4]
        for number in range(1, 5):
            assert wait_for(client, key, "race", number)["status"] == "ready"


def cube_model() -> bytes:
    """sum(sin(a x b x c)): three vectors of 4096 ask for a 4096^3 float tensor, 275 GB."""
    vector = {name: tensor(name, ["n" + name]) for name in "abc"}
    nodes = [
        helper.make_node("Unsqueeze", ["a", "axes12"], ["a3"]),
        helper.make_node("Unsqueeze", ["b", "axes02"], ["b3"]),
        helper.make_node("Unsqueeze", ["c", "axes01"], ["c3"]),
        helper.make_node("Mul", ["a3", "b3"], ["ab"]),
        helper.make_node("Mul", ["ab", "c3"], ["abc"]),
        helper.make_node("Sin", ["abc"], ["s"]),
        helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0),
    ]
    axes = [init(f"axes{i}{j}", np.array([i, j], np.int64)) for i, j in ((1, 2), (0, 2), (0, 1))]
    return make_model(nodes, list(vector.values()), [tensor("y", [])], axes).SerializeToString()


def test_dim_limits_are_lowered_until_the_largest_request_fits_memory(client, keys, settings) -> None:
    upload(client, keys["alice"], "cube", cube_model())
    version = wait_for(client, keys["alice"], "cube", 1)
    assert version["status"] == "ready"
    limits = version["signature"]["dim_limits"]
    assert set(limits) == {"na", "nb", "nc"} and max(limits.values()) < settings.max_sequence_dim
    # each limit was halved from 4096 until a float32 cube at all of them (and its sines) fits
    assert 2 * 4 * limits["na"] * limits["nb"] * limits["nc"] <= settings.max_request_memory_bytes
    assert infer(client, keys["alice"], "cube", {n: [0.5] * 4 for n in "abc"}).status_code == 200
    too_long = infer(client, keys["alice"], "cube", {n: [0.5] * 4096 for n in "abc"})
    assert too_long.status_code == 400
    assert f"allowed 1 to {limits['na']}" in too_long.json()["error"]["message"]


def test_a_request_estimated_over_the_memory_budget_gets_413_before_it_runs(client, keys, settings) -> None:
    settings.max_request_memory_bytes = 8  # not even the smallest cube fits
    upload(client, keys["alice"], "cube", cube_model())
    assert wait_for(client, keys["alice"], "cube", 1)["status"] == "ready"
    response = infer(client, keys["alice"], "cube", {n: [0.5] for n in "abc"})
    assert response.status_code == 413
    assert "would need about" in response.json()["error"]["message"]


def test_a_request_that_runs_out_of_memory_gets_413_not_500(client, keys, settings) -> None:
    settings.max_request_memory_bytes = 1 << 50  # no estimate stands in the way: the executor fails
    settings.max_sequence_dim = 4096
    upload(client, keys["alice"], "cube", cube_model())
    assert wait_for(client, keys["alice"], "cube", 1)["status"] == "ready"
    huge = infer(client, keys["alice"], "cube", {n: [0.5] * 4096 for n in "abc"})
    assert huge.status_code == 413, huge.text
    assert "more memory than the server can give" in huge.json()["error"]["message"]


def test_idle_models_leave_memory_and_load_again_on_the_next_request(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", idle_unload_s=0.2)
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    with TestClient(create_app(settings)) as client:
        upload(client, key, "mlp", MLP)
        wait_for(client, key, "mlp", 1)
        runtime = client.app.state.services.engine.runtimes["cpu"]
        assert infer(client, key, "mlp", {"x": [[0.0] * 8]}).status_code == 200
        assert len(runtime.loaded_keys) == 1
        deadline = time.monotonic() + 10
        while runtime.loaded_keys:  # the engine's janitor unloads it, with no request to prompt it
            assert time.monotonic() < deadline, "the idle model was never unloaded"
            time.sleep(0.05)
        assert infer(client, key, "mlp", {"x": [[0.0] * 8]}).status_code == 200
        assert len(runtime.loaded_keys) == 1


def test_large_bodies_are_decoded_and_rendered_in_a_child_process(client, keys, deployed) -> None:
    codec = client.app.state.services.codec
    codec.process_above_bytes = 0  # every body and response goes through the codec's children
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    response = infer(client, keys["alice"], "mlp", {"x": x.tolist()})
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json()["outputs"]["y"], ort(MLP, {"x": x})[0], rtol=1e-5, atol=1e-6)
    [child] = codec._pool._processes.values()
    assert child.pid != os.getpid()
    # an error raised in the child reaches the tenant whole: status, code and message
    bad = infer(client, keys["alice"], "mlp", {"x": [[0.0] * 7]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_input"
    assert "x: float32[batch, 8]" in bad.json()["error"]["message"]


def test_a_decoder_child_that_dies_costs_one_request_a_503(client, keys, deployed) -> None:
    codec = client.app.state.services.codec
    codec.process_above_bytes = 0
    assert infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]}).status_code == 200
    [child] = codec._pool._processes.values()
    with codec._lock:  # the next submitted request finds its child gone
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    response = infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]})
    assert response.status_code == 503 and "retry" in response.json()["error"]["message"]
    assert infer(client, keys["alice"], "mlp", {"x": [[0.0] * 8]}).status_code == 200
