"""The KServe v2 / Open Inference Protocol beside /v1, on the same engine, keys and metering:
health, server and model metadata, model readiness, and inference with JSON or binary tensors.

Each model route comes twice, as the protocol has it: for the version the service picks (the
newest ready one) and for /versions/{version}. Errors are {"error": "<message>"} (api.errors).
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from api import kserve_v2
from api.codec import rendered_size
from api.deps import CurrentTenant, ServicesDep
from api.inference import serve
from api.routes.health import check_ready
from api.schemas import V2InferRequest, V2InferResponse, V2ModelMetadata, V2ServerMetadata
from api.services import Services
from cloud.db import Tenant
from cloud.errors import InvalidRequest, NotFound, NotReady
from compiler import Signature
from registry import version_ref

router = APIRouter(prefix="/v2", tags=["kserve v2"])

SERVER_NAME = "luminal-cloud"
EXTENSIONS = ["binary_tensor_data"]

# the body is read by the handler (see api.routes.infer); the schema is declared for OpenAPI
_BODY_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": V2InferRequest.model_json_schema()},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.get("", response_model=V2ServerMetadata)
async def server_metadata(request: Request) -> V2ServerMetadata:
    return V2ServerMetadata(name=SERVER_NAME, version=request.app.version, extensions=EXTENSIONS)


@router.get("/health/live")
async def server_live() -> Response:
    return Response()


@router.get("/health/ready")
async def server_ready(services: ServicesDep) -> Response:
    await check_ready(services)
    return Response()


def _number(name: str, version: str | None) -> int | str | None:
    """The version a path names, by number or alias (prod); the protocol's versions are strings."""
    if version is None:
        return None
    try:
        return version_ref(version)
    except InvalidRequest:
        raise NotFound(f"model {name!r} has no version {version!r}") from None


async def _model_metadata(services: Services, tenant: Tenant, name: str, version: str | None) -> V2ModelMetadata:
    found = await run_in_threadpool(services.registry.resolve, tenant.id, name, _number(name, version))
    model = await run_in_threadpool(services.registry.get_model, tenant.id, name)
    signature = Signature.from_json(found.signature)
    return V2ModelMetadata(
        name=name,
        versions=[str(v.number) for v in model.versions if v.status == "ready"],
        platform="onnx",
        inputs=[kserve_v2.tensor_metadata(spec) for spec in signature.inputs],
        outputs=[kserve_v2.tensor_metadata(spec) for spec in signature.outputs],
    )


@router.get("/models/{name}", response_model=V2ModelMetadata)
async def model_metadata(name: str, tenant: CurrentTenant, services: ServicesDep) -> V2ModelMetadata:
    return await _model_metadata(services, tenant, name, None)


@router.get("/models/{name}/versions/{version}", response_model=V2ModelMetadata)
async def version_metadata(name: str, version: str, tenant: CurrentTenant, services: ServicesDep) -> V2ModelMetadata:
    return await _model_metadata(services, tenant, name, version)


async def _model_ready(services: Services, tenant: Tenant, name: str, version: str | None) -> Response:
    try:
        await run_in_threadpool(services.registry.resolve, tenant.id, name, _number(name, version))
    except NotReady as exc:
        # the protocol answers "not ready" with a 4xx; a missing model or version stays 404
        raise InvalidRequest(exc.message) from None
    return Response()


@router.get("/models/{name}/ready")
async def model_ready(name: str, tenant: CurrentTenant, services: ServicesDep) -> Response:
    return await _model_ready(services, tenant, name, None)


@router.get("/models/{name}/versions/{version}/ready")
async def version_ready(name: str, version: str, tenant: CurrentTenant, services: ServicesDep) -> Response:
    return await _model_ready(services, tenant, name, version)


async def _infer(services: Services, tenant: Tenant, request: Request, name: str, version: str | None) -> Response:
    decode = partial(kserve_v2.decode_request, header_length=request.headers.get(kserve_v2.HEADER_LENGTH))
    served = await serve(services, tenant, request, name, _number(name, version), decode)
    requested = served.decoded.outputs
    outputs = {output: served.result.outputs[output] for output, _ in requested}
    as_json = {output: outputs[output] for output, binary in requested if not binary}
    # JSON for large outputs is written off the event loop (api.codec); raw bytes cost a copy
    body, header_length = await services.codec.run(
        rendered_size(as_json),
        kserve_v2.render_response,
        name,
        served.version.number,
        served.decoded.id,
        outputs,
        requested,
        served.usage().model_dump(),
    )
    headers = {"X-Request-ID": served.request_id}
    if header_length is None:
        return Response(body, media_type="application/json", headers=headers)
    headers[kserve_v2.HEADER_LENGTH] = str(header_length)
    return Response(body, media_type="application/octet-stream", headers=headers)


@router.post("/models/{name}/infer", response_model=V2InferResponse, openapi_extra=_BODY_SCHEMA)
async def model_infer(name: str, request: Request, tenant: CurrentTenant, services: ServicesDep) -> Response:
    return await _infer(services, tenant, request, name, None)


@router.post("/models/{name}/versions/{version}/infer", response_model=V2InferResponse, openapi_extra=_BODY_SCHEMA)
async def version_infer(
    name: str, version: str, request: Request, tenant: CurrentTenant, services: ServicesDep
) -> Response:
    return await _infer(services, tenant, request, name, version)
