"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from api.deps import ServicesDep
from api.services import Services
from cloud.errors import Forbidden, Unauthorized, Unavailable
from cloud.metrics import REGISTRY

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def check_ready(services: Services) -> None:
    """Raises Unavailable unless the database, the object store and the engine all answer."""

    def check() -> None:
        with services.db.session() as session:
            session.execute(text("SELECT 1"))
        services.store.exists("readyz-probe")

    try:
        await run_in_threadpool(check)
    except Exception as exc:
        raise Unavailable(f"not ready: {type(exc).__name__}: {exc}") from None
    if services.engine is None:
        raise Unavailable("not ready: the inference engine has not started")


@router.get("/readyz")
async def readyz(services: ServicesDep) -> dict[str, str]:
    await check_ready(services)
    return {"status": "ready"}


# clients that share the server's machine; without a token only they may read /metrics
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def require_operator(
    request: Request, services: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    token = services.settings.metrics_token
    if token:
        sent = (authorization or "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(sent.encode(), token.encode()):
            raise Unauthorized("/metrics needs 'Authorization: Bearer <LUMINAL_METRICS_TOKEN>'")
    elif request.client is None or request.client.host not in _LOOPBACK:
        raise Forbidden("/metrics is served to this machine only; set LUMINAL_METRICS_TOKEN to scrape it remotely")


@router.get("/metrics", dependencies=[Depends(require_operator)])
async def prometheus_metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
