"""Uploading, listing and deleting models."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, UploadFile, status
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, ServicesDep
from api.schemas import (
    CompileProgress,
    ModelDeleted,
    ModelList,
    ModelPublic,
    ModelSummary,
    SignaturePublic,
    VersionCreated,
    VersionPublic,
)
from api.validation import symbol_limits
from cloud.db import Model, ModelVersion
from cloud.settings import Settings
from compiler import Signature
from compiler.targets import EXPORTED
from registry import report_and_progress

router = APIRouter(prefix="/v1/models", tags=["models"])

@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=VersionCreated)
async def upload_model(
    tenant: CurrentTenant,
    services: ServicesDep,
    file: Annotated[UploadFile, File(description="an ONNX model")],
    name: Annotated[str, Form()],
    target: Annotated[str, Form()] = "cpu",
    precision: Annotated[str, Form(description="exported, or tf32, float16 or bfloat16 on a GPU target")] = EXPORTED,
) -> VersionCreated:
    # the part is already a file (Starlette spools parts over 1 MiB to disk): streamed on from there
    version = await run_in_threadpool(
        services.registry.create_version,
        tenant.id,
        name,
        file.file,
        target,
        services.settings.max_upload_bytes,
        precision=precision,
    )
    # answered once the compile is queued (on Celery: the broker holds it), so a gateway that
    # dies after answering loses no compile
    await run_in_threadpool(services.compiler.submit, version.id, tenant.id)
    return VersionCreated(
        name=name, version=version.number, status=version.status, target=target, precision=version.precision
    )


def _summary(model: Model) -> ModelSummary:
    latest = model.versions[-1]
    return ModelSummary(
        name=model.name,
        latest_version=latest.number,
        latest_status=latest.status,
        versions=len(model.versions),
        created_at=model.created_at,
    )


@router.get("", response_model=ModelList)
async def list_models(tenant: CurrentTenant, services: ServicesDep) -> ModelList:
    models = await run_in_threadpool(services.registry.list_models, tenant.id)
    return ModelList(models=[_summary(m) for m in models if m.versions])


def _signature(stored: dict[str, Any] | None, settings: Settings) -> SignaturePublic | None:
    if stored is None:
        return None
    return SignaturePublic(**stored, dim_limits=symbol_limits(Signature.from_json(stored), settings))


@router.get("/{name}", response_model=ModelPublic)
async def get_model(name: str, tenant: CurrentTenant, services: ServicesDep) -> ModelPublic:
    model = await run_in_threadpool(services.registry.get_model, tenant.id, name)
    versions = [_version(v, services.settings) for v in model.versions]
    return ModelPublic(name=model.name, created_at=model.created_at, versions=versions)


def _version(version: ModelVersion, settings: Settings) -> VersionPublic:
    report, progress = report_and_progress(version)
    return VersionPublic(
        version=version.number,
        status=version.status,
        target=version.target,
        precision=version.precision,
        created_at=version.created_at,
        signature=_signature(version.signature, settings),
        report=report,
        error=version.error,
        progress=None if progress is None else CompileProgress(**progress),
    )


@router.delete("/{name}", response_model=ModelDeleted)
async def delete_model(name: str, tenant: CurrentTenant, services: ServicesDep) -> ModelDeleted:
    version_ids = await run_in_threadpool(services.registry.delete_model, tenant.id, name)
    services.compiler.cancel(version_ids)
    for version_id in version_ids:
        services.engine.forget(version_id)
    return ModelDeleted(name=name, deleted=True, versions=len(version_ids))
