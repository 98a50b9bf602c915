"""The SDK (sdk/luminal_cloud): both clients against a live server (deploy with its progress,
binary v2 predictions, deploy_torch with a stand-in for torch, typed errors), and the retry and
fallback paths against httpx.MockTransport."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import threading
import time
import types

import httpx
import numpy as np
import onnx
import onnxruntime
import pytest

from api.server import BackgroundServer, free_port
from api.services import open_database
from cloud.auth import create_key
from luminal_cloud import (
    APIError,
    AsyncClient,
    Client,
    DeadlineExceeded,
    DeployFailed,
    Forbidden,
    InvalidInput,
    InvalidModel,
    InvalidRequest,
    LuminalCloudError,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServerUnreachable,
    Unauthorized,
    Unavailable,
)
from luminal_cloud import client as client_module
from tests.conftest import make_settings
from tests.onnx_models import int_input_model, mlp, unsupported_model


class Terminal(io.StringIO):
    """A stream that says it is a terminal, so deploy draws its progress there."""

    def isatty(self) -> bool:
        return True


class Recording(httpx.HTTPTransport):
    """The real transport, noting each request's method, path and content type."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.headers.get("content-type", "")))
        return super().handle_request(request)


@pytest.fixture
def server(settings, keys):
    with BackgroundServer(settings) as running:
        yield running


@pytest.fixture
def model_path(tmp_path):
    # 256 x 1024 weights: a 1 MB upload, sent in several chunks
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp(n_in=256, hidden=1024).SerializeToString())
    return path


def ort(path, inputs: dict) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)


def lines(stream: io.StringIO) -> list[str]:
    """What a terminal would have shown at each redraw."""
    return [line.strip() for line in stream.getvalue().replace("\n", "\r").split("\r") if line.strip()]


# -- deploy and its progress


def test_deploy_shows_upload_then_compile_then_candidates_on_a_terminal(server, keys, model_path) -> None:
    terminal = Terminal()
    with Client(server.url, keys["alice"], progress_stream=terminal) as client:
        version = client.deploy(model_path, name="mlp")
    assert version["status"] == "ready"
    shown = lines(terminal)
    assert shown[0].startswith("Uploading mlp.onnx  [")
    size = f"{model_path.stat().st_size / 1e6:.1f} MB"
    assert any(line.endswith(f"[{'#' * 24}]  {size} / {size}") for line in shown), shown
    compiling = [line for line in shown if line.startswith("Compiling mlp v1")]
    assert compiling and all(("queued" in line) or ("compiling" in line) for line in compiling)
    assert compiling[-1].endswith(("0:00", "0:01", "0:02", "0:03", "0:04", "0:05"))
    assert shown[-1].startswith("mlp v1 ready in ") and "native-blas chosen" in shown[-1]
    assert terminal.getvalue().endswith("\n")


def test_async_deploy_shows_progress_and_predicts_like_onnxruntime(server, keys, model_path) -> None:
    terminal = Terminal()
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)

    async def run():
        async with AsyncClient(server.url, keys["alice"], progress_stream=terminal) as client:
            version = await client.deploy(model_path, name="mlp")
            outputs = await client.predict("mlp", {"x": x})
            models = await client.models()
            return version, outputs, models

    version, outputs, models = asyncio.run(run())
    assert version["status"] == "ready" and [m["name"] for m in models] == ["mlp"]
    shown = lines(terminal)
    assert shown[0].startswith("Uploading mlp.onnx") and shown[-1].startswith("mlp v1 ready in ")
    assert outputs["y"].dtype == np.float32
    np.testing.assert_allclose(outputs["y"], ort(model_path, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_progress_is_silent_off_a_terminal_or_when_turned_off(server, keys, model_path, capsys) -> None:
    piped, terminal = io.StringIO(), Terminal()
    with Client(server.url, keys["alice"], progress_stream=piped) as client:
        client.deploy(model_path, name="piped")
    with Client(server.url, keys["alice"], progress_stream=terminal) as client:
        client.deploy(model_path, name="quiet", progress=False)
    with Client(server.url, keys["alice"]) as client:  # stdout, which pytest captures: no TTY
        client.deploy(model_path, name="stdout")
    assert piped.getvalue() == "" and terminal.getvalue() == ""
    assert capsys.readouterr().out == ""


def test_deploy_raises_deploy_failed_with_the_compile_error(server, keys, tmp_path) -> None:
    bad = tmp_path / "exotic.onnx"
    bad.write_bytes(unsupported_model().SerializeToString())
    terminal = Terminal()
    with (
        Client(server.url, keys["alice"], progress_stream=terminal) as client,
        pytest.raises(DeployFailed, match="NonZero, Unique") as failed,
    ):
        client.deploy(bad, name="exotic")
    assert failed.value.name == "exotic" and failed.value.version == 1
    assert "operations the compiler does not support" in failed.value.reason
    assert lines(terminal)[-1].startswith("exotic v1 failed to compile after ")

    async def deploy_async():
        async with AsyncClient(server.url, keys["alice"]) as client:
            await client.deploy(bad, name="exotic")

    with pytest.raises(DeployFailed, match="NonZero, Unique"):
        asyncio.run(deploy_async())


def test_deploy_sends_the_precision_and_the_server_names_one_it_refuses(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", targets=("cpu", "h100"), allow_unmeasured_compile=True)
    db = open_database(settings)
    key = create_key(db, "carol")
    db.dispose()
    data = mlp().SerializeToString()
    with BackgroundServer(settings) as live, Client(live.url, key, progress_stream=io.StringIO()) as client:
        with pytest.raises(InvalidRequest, match="precision 'float16' runs on GPU targets"):
            client.deploy(data, name="half", precision="float16")  # the target is cpu
        created = client.deploy(data, name="half", target="h100", precision="bfloat16", wait=False)
        [listed] = client.versions("half")["versions"]
    assert created["precision"] == listed["precision"] == "bfloat16"


def compiling_server() -> httpx.MockTransport:
    """A server on which an upload is queued, compiles through two progress reports, then is
    ready."""
    polls = [
        {"status": "queued", "progress": None},
        {
            "status": "compiling",
            "progress": {"phase": "build", "candidate": "native-blas", "candidates_total": 3, "candidates_measured": 0},
        },
        {
            "status": "compiling",
            "progress": {"phase": "measure", "candidate": "numpy", "candidates_total": 3, "candidates_measured": 2},
        },
        {"status": "ready", "progress": None, "report": {"chosen": "native-blas", "candidates": []}},
    ]

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json={"name": "mlp", "version": 1, "status": "queued", "target": "cpu"})
        version = polls.pop(0) if len(polls) > 1 else polls[0]
        return httpx.Response(200, json={"name": "mlp", "versions": [{"version": 1, **version}]})

    return httpx.MockTransport(handle)


def test_deploy_shows_the_compile_phase_and_candidates_measured_while_compiling() -> None:
    async def deploy_async(terminal: Terminal) -> dict:
        async with AsyncClient(
            "http://luminal.test", "lc_x", transport=compiling_server(), progress_stream=terminal
        ) as client:
            return await client.deploy(b"onnx", name="mlp")

    sync_terminal, async_terminal = Terminal(), Terminal()
    with Client("http://luminal.test", "lc_x", transport=compiling_server(), progress_stream=sync_terminal) as client:
        assert client.deploy(b"onnx", name="mlp")["status"] == "ready"
    assert asyncio.run(deploy_async(async_terminal))["status"] == "ready"
    for terminal in (sync_terminal, async_terminal):
        compiling = [line for line in lines(terminal) if line.startswith("Compiling mlp v1")]
        assert [line.split("  ")[1][2:] for line in compiling] == [
            "queued",
            "compiling: build native-blas, 0/3 candidates measured",
            "compiling: measure numpy, 2/3 candidates measured",
        ], compiling
        assert lines(terminal)[-1].startswith("mlp v1 ready in ")


# -- predict


def test_predict_sends_binary_tensors_over_v2_in_the_models_dtypes(server, keys, tmp_path) -> None:
    path, ids_path = tmp_path / "mlp.onnx", tmp_path / "ids.onnx"
    path.write_bytes(mlp().SerializeToString())
    ids_path.write_bytes(int_input_model().SerializeToString())
    transport = Recording()
    x = np.random.default_rng(1).standard_normal((4, 8))  # float64: the model takes float32
    ids = np.array([[1, 2, 3], [-4, 5, 2**40]])
    with Client(server.url, keys["alice"], transport=transport, progress_stream=io.StringIO()) as client:
        client.deploy(path, name="mlp")
        client.deploy(ids_path, name="ids")
        first = client.predict("mlp", {"x": x})
        again = client.predict("mlp", {"x": x[:1]}, version=1)
        echoed = client.predict("ids", {"ids": ids})
    expected = ort(path, {"x": x.astype(np.float32)})[0]
    assert first["y"].dtype == np.float32 and first["y"].flags.writeable
    np.testing.assert_allclose(first["y"], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(again["y"], expected[:1], rtol=1e-4, atol=1e-5)
    assert echoed["y"].dtype == np.int64
    np.testing.assert_array_equal(echoed["y"], ids)
    infers = [(method, path, kind) for method, path, kind in transport.seen if path.endswith("/infer")]
    assert infers == [
        ("POST", "/v2/models/mlp/infer", "application/octet-stream"),
        ("POST", "/v2/models/mlp/versions/1/infer", "application/octet-stream"),
        ("POST", "/v2/models/ids/infer", "application/octet-stream"),
    ]
    # the server's protocol is asked once per client, each model's metadata once
    assert [p for _, p, _ in transport.seen].count("/v2") == 1
    assert [p for _, p, _ in transport.seen].count("/v2/models/mlp") == 1


def forwarding(upstream: httpx.Client, seen: list[str]) -> httpx.MockTransport:
    """A transport that passes requests on to the live server, but answers 404 for /v2 like a
    server that predates it."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path.startswith("/v2"):
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "Not Found"}})
        answer = upstream.send(
            httpx.Request(request.method, request.url, headers=request.headers, content=request.read())
        )
        return httpx.Response(
            answer.status_code,
            headers={"content-type": answer.headers["content-type"]},
            content=answer.content,
        )

    return httpx.MockTransport(handle)


def test_predict_falls_back_to_v1_json_where_the_server_has_no_v2(server, keys, tmp_path) -> None:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp().SerializeToString())
    x = np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)
    seen: list[str] = []
    with (
        httpx.Client() as upstream,
        Client(
            server.url, keys["alice"], transport=forwarding(upstream, seen), progress_stream=io.StringIO()
        ) as client,
    ):
        client.deploy(path, name="mlp")
        outputs = [client.predict("mlp", {"x": x}) for _ in range(2)]
    for output in outputs:
        assert output["y"].dtype == np.float32
        np.testing.assert_allclose(output["y"], ort(path, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert seen.count("/v2") == 1 and seen.count("/v1/models/mlp/infer") == 2
    assert not [p for p in seen if p.startswith("/v2/models")]


# -- deploy_torch


class TinyNet:
    """What deploy_torch is given in place of a torch.nn.Module."""


def fake_torch(calls: list[dict]) -> types.ModuleType:
    """A stand-in for torch whose onnx.export records its call and writes a real ONNX model
    (the MLP of tests.onnx_models, with the input and output names it was asked for)."""

    def export(module, args, f, **options):
        calls.append({"module": module, "args": args, "f": f, **options})
        model = mlp()
        graph = model.graph
        graph.input[0].name = graph.node[0].input[0] = options["input_names"][0]
        graph.output[0].name = graph.node[-1].output[0] = options["output_names"][0]
        onnx.save(model, f)

    torch = types.ModuleType("torch")
    torch.onnx = types.SimpleNamespace(export=export)
    return torch


def test_deploy_torch_exports_on_the_client_and_uploads(server, keys, monkeypatch) -> None:
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "torch", fake_torch(calls))
    net, example = TinyNet(), np.zeros((1, 8), np.float32)
    terminal = Terminal()
    with Client(server.url, keys["alice"], progress_stream=terminal) as client:
        version = client.deploy_torch(
            net, example, name="tiny", output_names=["probs"], dynamic_axes={"input": {0: "batch"}}
        )
        x = np.ones((2, 8), np.float32)
        probs = client.predict("tiny", {"input": x})["probs"]
    assert version["status"] == "ready"
    [call] = calls
    assert call["module"] is net and call["args"] == (example,)
    assert call["input_names"] == ["input"] and call["output_names"] == ["probs"]
    assert call["dynamic_axes"] == {"input": {0: "batch"}}
    assert lines(terminal)[0].startswith("Uploading tiny.onnx")
    assert probs.shape == (2, 3)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


def test_deploy_torch_without_torch_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` meets when it is not installed
    with (
        Client("http://127.0.0.1:9", "lc_x") as client,
        pytest.raises(ImportError, match=r"pip install 'luminal-cloud-sdk\[torch\]'"),
    ):
        client.deploy_torch(TinyNet(), np.zeros((1, 8)), name="tiny")


# -- retries


def answering(*responses: httpx.Response, times: list[float]) -> httpx.MockTransport:
    """A transport that gives these responses in turn (the last one from then on)."""

    def handle(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        given = responses[min(len(times), len(responses)) - 1]
        # a fresh copy each time: a response once read cannot be sent again
        return httpx.Response(given.status_code, headers=given.headers, content=given.content)

    return httpx.MockTransport(handle)


def busy(status: int = 429, retry_after: str | None = "1") -> httpx.Response:
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return httpx.Response(
        status, headers=headers, json={"error": {"code": "overloaded", "message": "queue full"}}
    )


OK = httpx.Response(200, json={"models": [{"name": "mlp"}]})


def test_429_is_retried_after_its_retry_after() -> None:
    times: list[float] = []
    transport = answering(busy(), busy(), OK, times=times)
    started = time.monotonic()
    with Client("http://luminal.test", "lc_x", transport=transport) as client:
        assert client.models() == [{"name": "mlp"}]
    assert len(times) == 3
    assert times[1] - times[0] >= 1.0 and times[2] - times[1] >= 1.0
    assert time.monotonic() - started < 3.5


def test_the_async_client_retries_the_same_way() -> None:
    times: list[float] = []
    transport = answering(busy(503, "0.2"), busy(429, "0.2"), OK, times=times)

    async def run():
        async with AsyncClient("http://luminal.test", "lc_x", transport=transport) as client:
            return await client.models()

    assert asyncio.run(run()) == [{"name": "mlp"}]
    assert len(times) == 3 and times[2] - times[0] >= 0.4


def test_retries_give_up_after_max_attempts_with_the_typed_error() -> None:
    times: list[float] = []
    transport = answering(busy(429, "0"), times=times)
    with (
        Client("http://luminal.test", "lc_x", transport=transport, max_attempts=3) as client,
        pytest.raises(Overloaded) as overloaded,
    ):
        client.models()
    assert len(times) == 3
    assert overloaded.value.retry_after == 0 and overloaded.value.status == 429
    assert isinstance(overloaded.value, APIError)


def test_retries_stop_at_the_wait_budget() -> None:
    times: list[float] = []
    transport = answering(busy(429, "30"), times=times)
    with (
        Client("http://luminal.test", "lc_x", transport=transport, max_retry_wait=5) as client,
        pytest.raises(Overloaded) as overloaded,
    ):
        client.models()
    # waiting 30 s would pass the budget of 5: the caller hears at once, with the server's hint
    assert len(times) == 1 and overloaded.value.retry_after == 30


def test_503_without_retry_after_backs_off_exponentially(monkeypatch) -> None:
    monkeypatch.setattr(client_module, "BACKOFF_FIRST", 0.1)
    times: list[float] = []
    unavailable = httpx.Response(503, json={"error": {"code": "unavailable", "message": "database down"}})
    transport = answering(unavailable, times=times)
    with (
        Client("http://luminal.test", "lc_x", transport=transport, max_attempts=4) as client,
        pytest.raises(Unavailable, match="database down"),
    ):
        client.usage()
    gaps = np.diff(times)
    assert len(times) == 4
    # each wait is drawn from [half, all] of 0.1, 0.2, 0.4 s
    for gap, ceiling in zip(gaps, (0.1, 0.2, 0.4)):
        assert ceiling / 2 <= gap < ceiling + 0.2


def test_client_errors_are_not_retried() -> None:
    times: list[float] = []
    transport = answering(
        httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}}), times=times
    )
    with Client("http://luminal.test", "lc_x", transport=transport) as client, pytest.raises(NotFound):
        client.model("ghost")
    assert len(times) == 1


# -- errors


def test_a_server_that_is_down_is_one_clear_exception() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, "lc_x") as client, pytest.raises(ServerUnreachable) as down:
        client.models()
    assert down.value.url == url and url in str(down.value)
    assert down.value.__cause__ is None and down.value.__suppress_context__

    async def run():
        async with AsyncClient(url, "lc_x") as client:
            await client.predict("mlp", {"x": np.zeros((1, 8))})

    with pytest.raises(ServerUnreachable, match="cannot reach the Luminal Cloud server at"):
        asyncio.run(run())


V1_ERRORS = [
    (400, "invalid_request", InvalidRequest),
    (400, "invalid_model", InvalidModel),
    (400, "invalid_input", InvalidInput),
    (401, "unauthorized", Unauthorized),
    (403, "forbidden", Forbidden),
    (404, "not_found", NotFound),
    (409, "not_ready", NotReady),
    (413, "payload_too_large", PayloadTooLarge),
    (429, "overloaded", Overloaded),
    (503, "unavailable", Unavailable),
    (503, "backend_unreachable", Unavailable),
    (504, "deadline_exceeded", DeadlineExceeded),
    (500, "internal_error", APIError),
]


@pytest.mark.parametrize(("status", "code", "expected"), V1_ERRORS)
def test_each_v1_error_code_raises_its_type(status, code, expected) -> None:
    body = {"error": {"code": code, "message": "what went wrong"}}
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
    with (
        Client("http://luminal.test", "lc_x", transport=transport, max_attempts=1) as client,
        pytest.raises(expected) as raised,
    ):
        client.usage()
    assert type(raised.value) is expected
    assert (raised.value.status, raised.value.code, raised.value.message) == (status, code, "what went wrong")


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, InvalidRequest),
        (401, Unauthorized),
        (404, NotFound),
        (413, PayloadTooLarge),
        (503, Unavailable),
        (504, DeadlineExceeded),
        (502, APIError),
    ],
)
def test_v2_errors_without_a_code_are_typed_by_status(status, expected) -> None:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(status, content=json.dumps({"error": "no"}))
    )
    with (
        Client("http://luminal.test", "lc_x", transport=transport, max_attempts=1) as client,
        pytest.raises(expected) as raised,
    ):
        client.usage()
    assert type(raised.value) is expected and raised.value.message == "no"


def test_typed_errors_from_the_live_server(server, keys, tmp_path) -> None:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(mlp().SerializeToString())
    with (
        Client(server.url, keys["alice"], progress_stream=io.StringIO()) as client,
        pytest.raises(NotFound, match="model 'ghost' not found"),
    ):
        client.predict("ghost", {"x": np.zeros((1, 8), np.float32)})
        with pytest.raises(InvalidModel):
            client.deploy(b"not onnx", name="junk")
        client.deploy(path, name="mlp")
        with pytest.raises(InvalidInput):
            client.infer("mlp", {"x": np.zeros((1, 5), np.float32)})
        with pytest.raises(InvalidRequest, match="x"):  # over v2: 400, no code
            client.predict("mlp", {"x": np.zeros((1, 5), np.float32)})
    with Client(server.url, "lc_not_a_key") as stranger, pytest.raises(Unauthorized):
        stranger.models()
    assert issubclass(Unauthorized, APIError) and issubclass(ServerUnreachable, LuminalCloudError)


def test_predict_on_a_failed_version_raises_not_ready_at_once_and_retries_a_queued_one(
    server, keys, tmp_path, monkeypatch
) -> None:
    bad, good = tmp_path / "exotic.onnx", tmp_path / "mlp.onnx"
    bad.write_bytes(unsupported_model().SerializeToString())
    good.write_bytes(mlp().SerializeToString())
    x = {"x": np.zeros((1, 8), np.float32)}
    with Client(server.url, keys["alice"], progress_stream=io.StringIO(), max_attempts=2) as client:
        with pytest.raises(DeployFailed):
            client.deploy(bad, name="exotic")
        started = time.monotonic()
        with pytest.raises(NotReady, match="version 1 is") as failed:
            client.predict("exotic", {"x": np.zeros((1, 4), np.float32)}, version=1)
        # failed never serves: a 409, not retried
        assert failed.value.status == 409 and time.monotonic() - started < 1
        services = server._server.config.app.state.services
        monkeypatch.setattr(services.compiler, "submit", lambda *_: None)  # it stays queued
        assert client.deploy(good, name="later", wait=False)["status"] == "queued"
        started = time.monotonic()
        with pytest.raises(NotReady, match="is queued") as queued:
            client.predict("later", x)
        # queued may pass: a 503 with Retry-After 1, retried like any 503 until max_attempts
        assert queued.value.status == 503 and 1 <= time.monotonic() - started < 5


class CountingTransport(httpx.HTTPTransport):
    """A real transport that remembers each answer's status."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[tuple[str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.statuses.append((request.url.path, response.status_code))
        return response


def test_the_client_retries_a_live_servers_429_after_its_retry_after(tmp_path) -> None:
    # a queue of one request, and a fixed window that holds the first one for 1.5 s
    settings = make_settings(
        tmp_path / "data", max_queue_requests=1, max_queue_delay_ms=1500, max_batch_rows=64, adaptive_batching=False
    )
    db = open_database(settings)
    key = create_key(db, "carol")
    db.dispose()
    x = np.ones((1, 8), np.float32)
    with BackgroundServer(settings) as live, Client(live.url, key) as client:
        client.deploy(mlp().SerializeToString(), name="mlp", progress=False)
        holder = threading.Thread(target=client.infer, args=("mlp", {"x": x}))
        holder.start()
        time.sleep(0.3)  # the first request waits in the queue, which is now full
        counting = CountingTransport()
        with Client(live.url, key, transport=counting) as retrying:
            started = time.monotonic()
            reply = retrying.infer("mlp", {"x": x})
            waited = time.monotonic() - started
        holder.join()
    infers = [status for path, status in counting.statuses if path.endswith("/infer")]
    assert infers[0] == 429 and infers[-1] == 200, counting.statuses
    assert waited >= settings.retry_after_s  # it honoured Retry-After
    expected = onnxruntime.InferenceSession(mlp().SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.asarray(reply["outputs"]["y"], np.float32), expected, rtol=1e-5, atol=1e-6)
