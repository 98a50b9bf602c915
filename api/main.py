"""Builds the FastAPI app: services from settings, routers, error handlers, the body guard."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from api.errors import error_response, install_error_handlers
from api.routes import admin, health, infer, kserve_v2, models, openai, usage, versions
from api.services import build_engine, build_services
from api.uploads import UploadSlots
from cloud import metrics
from cloud.errors import BodyReadTimeout, ClientDisconnected, LuminalError, PayloadTooLarge
from cloud.settings import Settings, get_settings

log = logging.getLogger(__name__)

# the paths whose bodies only a tenant may send: the /v1 API and KServe v2 inference, but for
# the operators' routes, which take an operator's key (api.deps.get_operator)
_AUTHENTICATED_BODIES = ("/v1/", "/v2/models/")
_OPERATOR_PATHS = "/v1/admin/"


class GuardedBody:
    """Before a request body is read: the API key is checked (a request without a valid key
    costs the server no body), and the body is held to its route's limit, by Content-Length
    and by counting what actually arrives. While it is read, a body that stalls gets 408 and a
    client that leaves is a client event (a log line and a count), never a server error."""

    def __init__(self, app, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    def _limit(self, path: str) -> int:
        if path.endswith("/infer"):
            return self.settings.max_infer_body_bytes
        return self.settings.max_upload_bytes + 64 * 1024  # multipart framing around the file

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if path.startswith(_AUTHENTICATED_BODIES) and not path.startswith(_OPERATOR_PATHS):
            services = scope["app"].state.services
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            try:
                tenant = services.auth.cached(authorization) or await run_in_threadpool(services.auth, authorization)
            except LuminalError as exc:
                # a wrong key, or the database holding the keys unreachable (503): answered here,
                # outside the app's error handlers
                challenge = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
                await error_response(path, exc.status, exc.code, exc.message, challenge)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        limit = self._limit(path)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(path, limit)(scope, receive, send)
            return
        body = _WatchedBody(receive, send, limit, self.settings.body_read_timeout_s)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if body.event is None:
                raise
            # else the app only failed because the body never came: the event says it all
        if body.event is not None:
            await _client_event(scope, receive, send, body, length)


def _too_large(path: str, limit: int):
    return error_response(path, 413, "payload_too_large", f"the request body is larger than {limit} bytes")


class _WatchedBody:
    """The request's `receive` and `send`, watched while the body arrives: it is refused past
    `limit` bytes (chunked, or a lying Content-Length), each chunk must come within `idle_s`,
    and a client that leaves before the end is noted. After such an event the app's own answer
    is dropped: the guard answers 408 itself, or no one is left to answer."""

    def __init__(self, receive, send, limit: int, idle_s: float) -> None:
        self._receive = receive
        self._send = send
        self.limit = limit
        self.idle_s = idle_s
        self.received = 0
        self.complete = False
        self.response_started = False
        # "client_disconnected" or "body_timeout", once it happens, and what it raised
        self.event: str | None = None
        self._error: Exception | None = None
        self._drop_sends = False

    def _happened(self, event: str, error: Exception) -> Exception:
        self.event, self._error = event, error
        self._drop_sends = not self.response_started
        return error

    async def receive(self):
        if self._error is not None:  # an app that reads on after the event waits no longer
            raise self._error
        if self.complete:  # past the body, a receive waits for a disconnect: no deadline
            return await self._receive()
        try:
            async with asyncio.timeout(self.idle_s):
                message = await self._receive()
        except TimeoutError:
            raise self._happened(
                "body_timeout", BodyReadTimeout(f"no request body bytes for {self.idle_s:g} s")
            ) from None
        if message["type"] == "http.disconnect":
            raise self._happened(
                "client_disconnected", ClientDisconnected("the client closed the connection before the end of the body")
            )
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise PayloadTooLarge(f"the request body is larger than {self.limit} bytes")
            self.complete = not message.get("more_body", False)
        return message

    async def send(self, message) -> None:
        if self._drop_sends:
            return
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)


def _route_kind(path: str) -> str:
    # a fixed set of labels, whatever the path
    if path.endswith("/infer"):
        return "infer"
    return "upload" if path.rstrip("/") == "/v1/models" else "other"


async def _client_event(scope, receive, send, body: _WatchedBody, length: bytes | None) -> None:
    """One log line and one count for a body the client abandoned; a 408 if one can be sent."""
    tenant = scope.get("state", {}).get("tenant")
    path = scope["path"]
    metrics.CLIENT_EVENTS.labels(
        tenant.name if tenant is not None else metrics.NO_TENANT, _route_kind(path), body.event
    ).inc()
    of = f"{body.received} of {length.decode('latin-1')}" if length is not None else str(body.received)
    where = f"{scope['method']} {path}" + (f" (tenant {tenant.name})" if tenant is not None else "")
    if body.event == "client_disconnected":
        log.info("%s: the client closed the connection after %s body bytes", where, of)
        return
    log.info("%s: no body bytes for %g s after %s; answering 408 and closing", where, body.idle_s, of)
    if body.response_started:
        return  # the app answered before the body stalled: its response stands
    message = (
        f"the request body stalled: no bytes arrived for {body.idle_s:g} s ({of} bytes received); "
        "send the body without pauses"
    )
    await error_response(path, 408, "request_timeout", message, {"Connection": "close"})(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = build_services(settings)
        services.engine = build_engine(services)
        app.state.services = services
        services.compiler.resume_unfinished()
        try:
            yield
        finally:
            await services.engine.close()
            services.close()

    app = FastAPI(title="Luminal Cloud", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    # inference first: a request is matched against routes in this order
    routers = (infer, kserve_v2, openai, models, versions, usage, admin, health)
    for router in (module.router for module in routers):
        app.include_router(router)
    # the last added runs first: the key is checked before an upload takes one of its tenant's slots
    app.add_middleware(UploadSlots, settings=settings)
    app.add_middleware(GuardedBody, settings=settings)
    return app
