"""A model's versions and aliases: list them, point an alias (prod, canary) at a ready version,
roll it back, delete one version. Inference resolves an alias wherever it takes a version."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, ServicesDep
from api.schemas import (
    AliasDeleted,
    AliasEventPublic,
    AliasPublic,
    AliasUpdate,
    VersionDeleted,
    VersionList,
    VersionSummary,
)
from cloud.db import ModelAlias
from registry import alias_stack

router = APIRouter(prefix="/v1/models", tags=["versions"])


def _alias(model_name: str, alias: ModelAlias) -> AliasPublic:
    stack = alias_stack(alias.history)
    return AliasPublic(
        model=model_name,
        alias=alias.name,
        version=alias.version.number,
        previous=stack[-2].version if len(stack) > 1 else None,
        history=[AliasEventPublic(action=e.action, version=e.version, at=e.created_at) for e in alias.history],
    )


@router.get("/{name}/versions", response_model=VersionList)
async def list_versions(name: str, tenant: CurrentTenant, services: ServicesDep) -> VersionList:
    model = await run_in_threadpool(services.registry.model_with_aliases, tenant.id, name)
    pointing: dict[int, list[str]] = {}
    for alias in model.aliases:
        pointing.setdefault(alias.version_id, []).append(alias.name)
    versions = [
        VersionSummary(
            version=v.number,
            status=v.status,
            target=v.target,
            precision=v.precision,
            created_at=v.created_at,
            aliases=pointing.get(v.id, []),
            error=v.error,
        )
        for v in model.versions
    ]
    return VersionList(name=model.name, versions=versions, aliases=[_alias(model.name, a) for a in model.aliases])


@router.delete("/{name}/versions/{number}", response_model=VersionDeleted)
async def delete_version(name: str, number: int, tenant: CurrentTenant, services: ServicesDep) -> VersionDeleted:
    version_id = await run_in_threadpool(services.registry.delete_version, tenant.id, name, number)
    services.compiler.cancel([version_id])
    services.engine.forget(version_id)
    return VersionDeleted(model=name, version=number, deleted=True)


@router.put("/{name}/aliases/{alias}", response_model=AliasPublic)
async def set_alias(
    name: str, alias: str, body: AliasUpdate, tenant: CurrentTenant, services: ServicesDep
) -> AliasPublic:
    found = await run_in_threadpool(services.registry.set_alias, tenant.id, name, alias, body.version)
    return _alias(name, found)


@router.post("/{name}/aliases/{alias}/rollback", response_model=AliasPublic)
async def rollback_alias(name: str, alias: str, tenant: CurrentTenant, services: ServicesDep) -> AliasPublic:
    found = await run_in_threadpool(services.registry.rollback_alias, tenant.id, name, alias)
    return _alias(name, found)


@router.delete("/{name}/aliases/{alias}", response_model=AliasDeleted)
async def delete_alias(name: str, alias: str, tenant: CurrentTenant, services: ServicesDep) -> AliasDeleted:
    await run_in_threadpool(services.registry.delete_alias, tenant.id, name, alias)
    return AliasDeleted(model=name, alias=alias, deleted=True)
