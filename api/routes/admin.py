"""The operators' view across tenants and their keys, for operator keys only (a tenant's key gets 403)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Path, Query, Response
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentOperator, ServicesDep
from api.schemas import ApiKeyList, ApiKeyPublic, ApiKeyRevoked, UsageReport
from api.usage_report import (
    CSV_RESPONSES,
    FORMAT_HELP,
    FROM_HELP,
    TO_HELP,
    build_report,
    csv_response,
    parse_period,
    wants_csv,
)
from cloud.auth import KeyInfo, list_keys
from cloud.db import Database, Tenant
from cloud.errors import NotFound

router = APIRouter(prefix="/v1/admin", tags=["admin"])

# each group_by, as the ledger's dimensions: a model's name means something within its tenant
_DIMENSIONS = {"tenant": ("tenant",), "model": ("tenant", "model"), "day": ("day",)}


@router.get("/usage", response_model=UsageReport, response_model_exclude_none=True, responses=CSV_RESPONSES)
async def usage_of_every_tenant(
    _operator: CurrentOperator,
    services: ServicesDep,
    start: Annotated[str | None, Query(alias="from", description=FROM_HELP)] = None,
    end: Annotated[str | None, Query(alias="to", description=TO_HELP)] = None,
    tenant: Annotated[str | None, Query(description="one tenant's usage, by name (default: every tenant)")] = None,
    group_by: Annotated[
        Literal["tenant", "model", "day"], Query(description="rows per tenant, tenant and model, or UTC day")
    ] = "tenant",
    format: Annotated[Literal["json", "csv"] | None, Query(description=FORMAT_HELP)] = None,
    accept: Annotated[str | None, Header()] = None,
) -> UsageReport | Response:
    period = parse_period(start, end)
    tenant_id = None if tenant is None else await run_in_threadpool(_tenant_id, services.db, tenant)
    dimensions = _DIMENSIONS[group_by]
    report = await build_report(services.ledger, dimensions, group_by, tenant, tenant_id, period)
    return csv_response(report, dimensions) if wants_csv(format, accept) else report


def _public(key: KeyInfo) -> ApiKeyPublic:
    return ApiKeyPublic(id=key.id, prefix=key.prefix, tenant=key.owner, created_at=key.created_at)


@router.get("/keys", response_model=ApiKeyList)
async def list_api_keys(
    _operator: CurrentOperator,
    services: ServicesDep,
    tenant: Annotated[str | None, Query(description="one tenant's keys, by name (default: every tenant's)")] = None,
) -> ApiKeyList:
    keys = await run_in_threadpool(list_keys, services.db, tenant)
    return ApiKeyList(keys=[_public(key) for key in keys])


@router.delete("/keys/{key_id}", response_model=ApiKeyRevoked)
async def revoke_api_key(
    key_id: Annotated[str, Path(description="the key's id, its prefix as listed, or the whole key")],
    _operator: CurrentOperator,
    services: ServicesDep,
) -> ApiKeyRevoked:
    # through the gateway's authenticator, so that its cache forgets the key at once
    revoked = await run_in_threadpool(services.auth.revoke, key_id)
    return ApiKeyRevoked(**_public(revoked).model_dump())


def _tenant_id(db: Database, name: str) -> int:
    with db.session() as session:
        found = session.scalar(select(Tenant.id).where(Tenant.name == name))
    if found is None:
        raise NotFound(f"tenant: no tenant named {name!r}", parameter="tenant")
    return found
