"""The caller's bill: billed execution seconds and cost per model and version."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, ServicesDep
from api.schemas import UsageItem, UsageReport

router = APIRouter(prefix="/v1", tags=["usage"])


@router.get("/usage", response_model=UsageReport)
async def usage(tenant: CurrentTenant, services: ServicesDep) -> UsageReport:
    rows = await run_in_threadpool(services.ledger.summary, tenant.id)
    items = [UsageItem(**row) for row in rows]
    return UsageReport(
        tenant=tenant.name,
        items=items,
        total_billed_seconds=sum(i.billed_seconds for i in items),
        total_cost=sum(i.cost for i in items),
    )
