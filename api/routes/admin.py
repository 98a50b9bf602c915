"""The operators' view across tenants, for operator keys only (a tenant's key gets 403)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Response
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentOperator, ServicesDep
from api.schemas import UsageReport
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


def _tenant_id(db: Database, name: str) -> int:
    with db.session() as session:
        found = session.scalar(select(Tenant.id).where(Tenant.name == name))
    if found is None:
        raise NotFound(f"tenant: no tenant named {name!r}", parameter="tenant")
    return found
