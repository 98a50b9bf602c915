"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from api.deps import ServicesDep
from cloud.errors import Unavailable
from cloud.metrics import REGISTRY

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(services: ServicesDep) -> dict[str, str]:
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
    return {"status": "ready"}


@router.get("/metrics")
async def prometheus_metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
