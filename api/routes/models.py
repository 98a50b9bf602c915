"""Uploading, listing and deleting models."""

from __future__ import annotations

import tempfile
from pathlib import Path
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
    OpenAIModel,
    SignaturePublic,
    VersionCreated,
    VersionPublic,
)
from api.validation import symbol_limits
from cloud.db import Model, ModelVersion
from cloud.errors import InvalidRequest
from cloud.settings import Settings
from compiler import Signature
from compiler.targets import EXPORTED
from registry import report_and_progress
from registry.bundle import GENERATION, bundle_from_parts, check_task, is_zip, read_zip

router = APIRouter(prefix="/v1/models", tags=["models"])

@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=VersionCreated)
async def upload_model(
    tenant: CurrentTenant,
    services: ServicesDep,
    file: Annotated[UploadFile, File(description="an ONNX model")],
    name: Annotated[str, Form()],
    target: Annotated[str, Form()] = "cpu",
    precision: Annotated[str, Form(description="exported, int8 (weight-only), or tf32, float16 or bfloat16 on a GPU target")] = EXPORTED,
    task: Annotated[str, Form(description="inference, or text-generation for a decoder with its KV cache")] = "inference",
    tokenizer: Annotated[UploadFile | None, File(description="text-generation: tokenizer.json")] = None,
    tokenizer_config: Annotated[UploadFile | None, File(description="text-generation: tokenizer_config.json")] = None,
    generation_config: Annotated[UploadFile | None, File(description="text-generation: generation_config.json")] = None,
    config: Annotated[UploadFile | None, File(description="text-generation: config.json (its context length)")] = None,
    chat_template: Annotated[UploadFile | None, File(description="text-generation: chat_template.jinja")] = None,
) -> VersionCreated:
    parts = {
        field: await part.read()
        for field, part in (
            ("tokenizer", tokenizer),
            ("tokenizer_config", tokenizer_config),
            ("generation_config", generation_config),
            ("config", config),
            ("chat_template", chat_template),
        )
        if part is not None
    }
    # the part is already a file (Starlette spools parts over 1 MiB to disk): streamed on from there
    version = await run_in_threadpool(
        _create_version, services, tenant.id, name, file, target, precision, check_task(task), parts
    )
    # answered once the compile is queued (on Celery: the broker holds it), so a gateway that
    # dies after answering loses no compile
    await run_in_threadpool(services.compiler.submit, version.id, tenant.id)
    return VersionCreated(
        name=name,
        version=version.number,
        status=version.status,
        target=target,
        precision=version.precision,
        task=version.task,
    )


def _create_version(
    services, tenant_id: int, name: str, file: UploadFile, target: str, precision: str, task: str, parts: dict
) -> ModelVersion:
    """A version from the upload: an ONNX file (with the tokenizer as parts), or a zip bundle."""
    limit = services.settings.max_upload_bytes
    head = file.file.read(4)
    file.file.seek(0)
    if not is_zip(head, file.filename):
        bundle = bundle_from_parts(parts) if parts or task == GENERATION else None
        return services.registry.create_version(
            tenant_id, name, file.file, target, limit, precision=precision, task=task, bundle=bundle
        )
    if parts:
        raise InvalidRequest("send the tokenizer files inside the zip bundle or as parts, not both")
    with tempfile.TemporaryDirectory(prefix="luminal-bundle-") as folder:
        graph, bundle = read_zip(file.file, limit, Path(folder))
        with graph.open("rb") as source:
            return services.registry.create_version(
                tenant_id, name, source, target, limit, precision=precision, task=task, bundle=bundle
            )


def _summary(model: Model) -> ModelSummary:
    latest = model.versions[-1]
    return ModelSummary(
        name=model.name,
        latest_version=latest.number,
        latest_status=latest.status,
        versions=len(model.versions),
        created_at=model.created_at,
        task=latest.task,
    )


@router.get("", response_model=ModelList)
async def list_models(tenant: CurrentTenant, services: ServicesDep) -> ModelList:
    models = [m for m in await run_in_threadpool(services.registry.list_models, tenant.id) if m.versions]
    generative = [
        OpenAIModel(id=m.name, created=int(m.created_at.timestamp()), owned_by=tenant.name)
        for m in models
        if any(v.task == GENERATION and v.status == "ready" for v in m.versions)
    ]
    return ModelList(models=[_summary(m) for m in models], data=generative)


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
        task=version.task,
        context_length=version.bundle.get("context_length") if version.bundle else None,
    )


@router.delete("/{name}", response_model=ModelDeleted)
async def delete_model(name: str, tenant: CurrentTenant, services: ServicesDep) -> ModelDeleted:
    version_ids = await run_in_threadpool(services.registry.delete_model, tenant.id, name)
    services.compiler.cancel(version_ids)
    for version_id in version_ids:
        services.engine.forget(version_id)
    return ModelDeleted(name=name, deleted=True, versions=len(version_ids))
