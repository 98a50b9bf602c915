"""Request-scoped dependencies: a handler declares what it needs by type."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from api.services import Services
from cloud.auth import authenticate_admin
from cloud.db import AdminKey, Tenant


async def get_services(request: Request) -> Services:
    # async: FastAPI runs a plain def dependency in a worker thread, a hand-off per request
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


async def get_tenant(
    request: Request, services: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> Tenant:
    # requests with a body were authenticated before it was read (api.main.GuardedBody)
    tenant = getattr(request.state, "tenant", None) or services.auth.cached(authorization)
    return tenant if tenant is not None else await run_in_threadpool(services.auth, authorization)


CurrentTenant = Annotated[Tenant, Depends(get_tenant)]


async def get_operator(services: ServicesDep, authorization: Annotated[str | None, Header()] = None) -> AdminKey:
    # operator routes are rare: no cache, so a revoked operator key stops at once
    return await run_in_threadpool(authenticate_admin, services.db, authorization)


CurrentOperator = Annotated[AdminKey, Depends(get_operator)]
