"""Clients that go away (issue 29, finding 9), on raw sockets against a real uvicorn server: a body
that stalls gets 408 within LUMINAL_BODY_READ_TIMEOUT_S and its connection is closed; a client that
leaves mid-body is a client event (one log line, a count apart from server errors), never an
"unhandled error"; a slow but steady upload is never cut off; and the server serves on."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from api.server import BackgroundServer
from cloud import metrics
from cloud.metrics import REGISTRY
from tests.conftest import make_settings

# short, so that a stall shows within a test; far below the socket's own timeout below
BODY_TIMEOUT_S = 1.0
# longer than any answer can take: reaching it means the server hung
HUNG_S = 15.0
BOUNDARY = "luminal-test-boundary"


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    content_type: str
    body: bytes
    # what the whole body gets (no model "m" exists; the upload is not ONNX): proof it still serves
    whole_status: int
    # the metrics' route label
    kind: str


def _json_body() -> bytes:
    return json.dumps({"inputs": {"x": [[0.25] * 100]}}).encode()


def _multipart() -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\nm\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="model.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode() + b"not an onnx model " * 100 + f"\r\n--{BOUNDARY}--\r\n".encode()


ROUTES = [
    Route("infer", "/v1/models/m/infer", "application/json", _json_body(), 404, "infer"),
    Route("v2-infer", "/v2/models/m/infer", "application/json", _json_body(), 404, "infer"),
    Route("upload", "/v1/models", f"multipart/form-data; boundary={BOUNDARY}", _multipart(), 400, "upload"),
]


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[BackgroundServer, str]]:
    from api.services import open_database
    from cloud.auth import create_key

    settings = make_settings(tmp_path / "data", body_read_timeout_s=BODY_TIMEOUT_S)
    db = open_database(settings)
    try:
        key = create_key(db, "alice")
    finally:
        db.dispose()
    with BackgroundServer(settings) as running:
        yield running, key


def _connect(server: BackgroundServer, route: Route, key: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=HUNG_S)
    head = (
        f"POST {route.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: {route.content_type}\r\nContent-Length: {len(route.body)}\r\n\r\n"
    )
    sock.sendall(head.encode())
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (TimeoutError if it never does)."""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def _status_and_body(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response, its body as long as its Content-Length says, on a connection left open."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    status, headers, body = _status_and_body(reply)
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return status, headers, body


def _whole_request(server: BackgroundServer, route: Route, key: str) -> int:
    """The status a complete request on `route` gets, on a connection of its own."""
    with _connect(server, route, key) as sock:
        sock.sendall(route.body)
        return _read_response(sock)[0]


def _client_events(route: Route, event: str) -> float:
    labels = {"tenant": "alice", "route": route.kind, "event": event}
    return REGISTRY.get_sample_value("luminal_client_events_total", labels) or 0.0


def _requests(outcome: str) -> float:
    labels = {"tenant": "alice", "model": metrics.UNKNOWN_MODEL, "status": outcome}
    return REGISTRY.get_sample_value("luminal_inference_requests_total", labels) or 0.0


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_a_stalled_body_gets_408_its_connection_closes_and_the_server_serves_on(server, route) -> None:
    running, key = server
    timeouts = _client_events(route, "body_timeout")
    with _connect(running, route, key) as sock:
        sock.sendall(route.body[:10])  # of the Content-Length announced, then silence
        status, headers, body = _status_and_body(_read_until_closed(sock))
    assert status == 408
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    message = error if route.path.startswith("/v2/") else error["message"]
    if not route.path.startswith("/v2/"):
        assert error["code"] == "request_timeout"
    assert f"no bytes arrived for {BODY_TIMEOUT_S:g} s" in message and "10 of" in message
    assert _client_events(route, "body_timeout") == timeouts + 1
    assert _whole_request(running, route, key) == route.whole_status


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_a_client_leaving_mid_body_is_a_client_event_not_a_server_error(server, route, caplog) -> None:
    running, key = server
    caplog.set_level(logging.INFO)
    uvicorn_log = logging.getLogger("uvicorn")  # it does not propagate to the root, where caplog listens
    uvicorn_log.addHandler(caplog.handler)
    try:
        left, errors = _client_events(route, "client_disconnected"), _requests("error")
        disconnected = _requests("client_disconnected")
        with _connect(running, route, key) as sock:
            sock.sendall(route.body[: len(route.body) // 2])
            time.sleep(0.2)  # the half has arrived and is being read when the client goes
        deadline = time.monotonic() + HUNG_S
        while _client_events(route, "client_disconnected") == left:
            assert time.monotonic() < deadline, "the disconnect was never counted"
            time.sleep(0.02)
        assert _whole_request(running, route, key) == route.whole_status
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert _client_events(route, "client_disconnected") == left + 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert not any("unhandled error" in r.getMessage() or r.exc_info for r in caplog.records)
    lines = [r.getMessage() for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(lines) == 1 and route.path in lines[0] and "alice" in lines[0], lines
    if route.kind == "infer":  # the request metrics count it apart from the server's errors
        assert (_requests("client_disconnected"), _requests("error")) == (disconnected + 1, errors)


def test_a_slow_steady_upload_is_never_cut_off(server) -> None:
    # each pause below the timeout, all of them together well past it: the limit is per chunk
    running, key = server
    route = next(r for r in ROUTES if r.name == "upload")
    pieces = 6
    size = -(-len(route.body) // pieces)
    with _connect(running, route, key) as sock:
        for start in range(0, len(route.body), size):
            sock.sendall(route.body[start : start + size])
            time.sleep(BODY_TIMEOUT_S * 0.4)
        status, _, body = _read_response(sock)
    assert status == 400 and b"onnx" in body.lower(), body  # the upload's own verdict, not 408
