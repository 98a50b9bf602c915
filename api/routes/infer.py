"""Inference: validate against the signature, queue for batching, answer with outputs and usage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from api.codec import render_infer_response, rendered_size
from api.deps import CurrentTenant, ServicesDep
from api.inference import serve
from api.schemas import InferRequest, InferResponse
from api.validation import decode_body
from registry import version_ref

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
    version: Annotated[
        str | None, Query(description="a version number, or an alias (prod); default: the newest ready version")
    ] = None,
) -> Response:
    ref = None if version is None else version_ref(version)
    served = await serve(services, tenant, request, name, ref, decode_body)
    outputs = served.result.outputs
    # large outputs take a while to write as JSON: not on the event loop, which answers /healthz
    body = await services.codec.run(
        rendered_size(outputs), render_infer_response, name, served.version.number, outputs, served.usage().model_dump()
    )
    return Response(body, media_type="application/json", headers={"X-Request-ID": served.request_id})
