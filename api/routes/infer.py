"""Inference: validate against the signature, queue for batching, answer with outputs and usage."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.codec import render_infer_response, rendered_size
from api.deps import CurrentTenant, ServicesDep
from api.schemas import InferRequest, InferResponse, InferUsage
from cloud import metrics
from cloud.errors import LuminalError
from cloud.validation import decode_body, symbol_limits
from compiler import Signature
from scheduler.engine import Route

router = APIRouter(prefix="/v1/models", tags=["inference"])


# the body is read by the handler, after authentication, and decoded off the event loop; the
# schema is declared here so the OpenAPI document still shows it
_BODY_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": InferRequest.model_json_schema()}},
    }
}


@router.post("/{name}/infer", response_model=InferResponse, openapi_extra=_BODY_SCHEMA)
async def infer(
    name: str,
    request: Request,
    tenant: CurrentTenant,
    services: ServicesDep,
    version: Annotated[int | None, Query(ge=1)] = None,
) -> Response:
    started = time.perf_counter()
    outcome = "error"
    model_label = metrics.UNKNOWN_MODEL  # until the name resolves to a model of this tenant
    try:
        raw = await request.body()
        found = await run_in_threadpool(services.registry.resolve, tenant.id, name, version)
        model_label = name
        signature = Signature.from_json(found.signature)
        settings = services.settings
        arrays, rows = await services.codec.run(
            len(raw),
            decode_body,
            raw,
            signature,
            settings.max_request_elements,
            symbol_limits(signature, settings),
            settings.max_request_memory_bytes,
        )
        route = Route(
            version_id=found.id,
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            model_name=name,
            version=found.number,
            target=found.target,
            artifact_key=found.artifact_key,
            batchable=signature.batch_symbol is not None,
        )
        request_id = uuid.uuid4().hex
        result = await services.engine.infer(route, arrays, rows, request_id)
        outcome = "ok"
    except LuminalError as exc:
        outcome = str(exc.status)
        raise
    finally:
        metrics.REQUESTS.labels(tenant.name, model_label, outcome).inc()
        metrics.REQUEST_LATENCY.labels(tenant.name, model_label).observe(time.perf_counter() - started)
    usage = InferUsage(
        request_id=request_id,
        exec_ms=result.exec_seconds * 1000,
        batch_size=result.batch_size,
        batch_rows=result.batch_rows,
        queue_ms=result.queue_seconds * 1000,
    )

    # large outputs take a while to write as JSON: not on the event loop, which answers /healthz
    body = await services.codec.run(
        rendered_size(result.outputs),
        render_infer_response,
        name,
        found.number,
        result.outputs,
        usage.model_dump(),
    )
    return Response(body, media_type="application/json", headers={"X-Request-ID": request_id})
