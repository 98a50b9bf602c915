"""Inference: validate against the signature, queue for batching, answer with outputs and usage."""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, ServicesDep
from api.schemas import InferRequest, InferResponse, InferUsage
from cloud import metrics
from cloud.errors import LuminalError
from cloud.validation import decode_body, symbol_limits
from compiler import Signature
from compiler.dtypes import is_float
from scheduler.engine import Route

router = APIRouter(prefix="/v1/models", tags=["inference"])


def encode_output(array: np.ndarray) -> Any:
    """Nested lists; non-finite floats as the strings "NaN", "Infinity", "-Infinity"."""
    if is_float(array.dtype.name) and array.dtype.itemsize < 4:
        array = array.astype(np.float32)  # bfloat16 and float8 scalars are not JSON numbers
    if is_float(array.dtype.name) and not np.all(np.isfinite(array)):
        as_object = array.astype(object)
        as_object[np.isnan(array)] = "NaN"
        as_object[np.isposinf(array)] = "Infinity"
        as_object[np.isneginf(array)] = "-Infinity"
        return as_object.tolist()
    return array.tolist()


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
        decode = partial(
            decode_body,
            raw,
            signature,
            settings.max_request_elements,
            symbol_limits(signature, settings),
            settings.max_request_memory_bytes,
        )
        arrays, rows = await run_in_threadpool(decode)
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

    def render() -> bytes:
        outputs = {k: encode_output(v) for k, v in result.outputs.items()}
        return InferResponse(model=name, version=found.number, outputs=outputs, usage=usage).model_dump_json().encode()

    # large outputs take a while to write as JSON: not on the event loop, which answers /healthz
    body = await run_in_threadpool(render)
    return Response(body, media_type="application/json", headers={"X-Request-ID": request_id})
