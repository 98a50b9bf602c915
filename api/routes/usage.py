"""The caller's bill: requests, billed execution seconds and cost over a period, grouped by
model, version or day, as JSON or CSV."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Response

from api.deps import CurrentTenant, ServicesDep
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

router = APIRouter(prefix="/v1", tags=["usage"])

# each group_by, as the ledger's dimensions
_DIMENSIONS = {"model": ("model",), "version": ("model", "version"), "day": ("day",)}


@router.get("/usage", response_model=UsageReport, response_model_exclude_none=True, responses=CSV_RESPONSES)
async def usage(
    tenant: CurrentTenant,
    services: ServicesDep,
    start: Annotated[str | None, Query(alias="from", description=FROM_HELP)] = None,
    end: Annotated[str | None, Query(alias="to", description=TO_HELP)] = None,
    group_by: Annotated[Literal["model", "version", "day"], Query(description="rows per model, version or UTC day")]
    = "version",
    format: Annotated[Literal["json", "csv"] | None, Query(description=FORMAT_HELP)] = None,
    accept: Annotated[str | None, Header()] = None,
) -> UsageReport | Response:
    period = parse_period(start, end)
    dimensions = _DIMENSIONS[group_by]
    report = await build_report(services.ledger, dimensions, group_by, tenant.name, tenant.id, period)
    return csv_response(report, dimensions) if wants_csv(format, accept) else report
