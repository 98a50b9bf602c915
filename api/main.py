"""Builds the FastAPI app: services from settings, routers, error handlers, the body guard."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from api.errors import error_response, install_error_handlers
from api.routes import admin, health, infer, kserve_v2, models, usage, versions
from api.services import build_engine, build_services
from api.uploads import UploadSlots
from cloud.errors import PayloadTooLarge, Unauthorized
from cloud.settings import Settings, get_settings

# the paths whose bodies only a tenant may send: the /v1 API and KServe v2 inference
_AUTHENTICATED_BODIES = ("/v1/", "/v2/models/")


class GuardedBody:
    """Before a request body is read: the API key is checked (a request without a valid key
    costs the server no body), and the body is held to its route's limit, by Content-Length
    and by counting what actually arrives."""

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
        if path.startswith(_AUTHENTICATED_BODIES):
            services = scope["app"].state.services
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            try:
                tenant = services.auth.cached(authorization) or await run_in_threadpool(services.auth, authorization)
            except Unauthorized as exc:
                response = error_response(path, 401, exc.code, exc.message, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        limit = self._limit(path)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(path, limit)(scope, receive, send)
            return
        await self.app(scope, _counting(receive, limit), send)


def _too_large(path: str, limit: int):
    return error_response(path, 413, "payload_too_large", f"the request body is larger than {limit} bytes")


def _counting(receive, limit: int):
    """`receive` that refuses a body growing past `limit` (chunked, or a lying Content-Length)."""
    received = 0

    async def counted():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
        return message

    return counted


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
    routers = (infer, kserve_v2, models, versions, usage, admin, health)
    for router in (module.router for module in routers):
        app.include_router(router)
    # the last added runs first: the key is checked before an upload takes one of its tenant's slots
    app.add_middleware(UploadSlots, settings=settings)
    app.add_middleware(GuardedBody, settings=settings)
    return app
