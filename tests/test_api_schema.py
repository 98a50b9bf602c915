"""Schemathesis generates requests from the OpenAPI document (a bounded number per operation)
and sends them to a real server with a valid key: none may get a 5xx or break the error shape."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings

from api.server import BackgroundServer
from luminal_cloud import Client
from tests.onnx_models import mlp

EXAMPLES_PER_OPERATION = 25


def test_generated_requests_never_get_a_5xx(settings, keys, tmp_path) -> None:
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp().SerializeToString())
    headers = {"Authorization": f"Bearer {keys['alice']}"}
    with BackgroundServer(settings) as server, Client(server.url, keys["alice"]) as client:
        client.deploy(model, name="mlp")  # something real for the generated requests to reach
        schema = schemathesis.openapi.from_dict(httpx.get(f"{server.url}/openapi.json").json())
        tried = 0
        for result in schema.get_all_operations():
            operation = result.ok()

            @given(case=operation.as_strategy())
            @hypothesis_settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
            def check(case) -> None:
                nonlocal tried
                tried += 1
                response = case.call(base_url=server.url, headers=headers)
                assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
                if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
                    error = response.json()["error"]
                    # the KServe v2 protocol's errors are {"error": "<message>"}
                    assert error if case.formatted_path.startswith("/v2") else error["message"], response.text

            check()
        assert tried >= 5 * EXAMPLES_PER_OPERATION // 2
