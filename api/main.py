"""Builds the FastAPI app: services from settings, routers, error handlers, body-size limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.errors import error_response, install_error_handlers
from api.routes import health, infer, models, usage
from api.services import build_engine, build_services
from cloud.settings import Settings, get_settings


class BodySizeLimit:
    """Refuses a request whose declared Content-Length exceeds the limit, before reading it."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                response = error_response(
                    413, "payload_too_large", f"the request body is larger than {self.limit} bytes"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    for router in (models.router, infer.router, usage.router, health.router):
        app.include_router(router)
    # multipart framing adds a little on top of the file itself
    app.add_middleware(BodySizeLimit, limit=settings.max_upload_bytes + 64 * 1024)
    return app
