"""Request-scoped dependencies: a handler declares what it needs by type."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from api.services import Services
from cloud.auth import authenticate
from cloud.db import Tenant


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def get_tenant(
    request: Request, services: ServicesDep, authorization: Annotated[str | None, Header()] = None
) -> Tenant:
    # requests with a body were authenticated before it was read (api.main.GuardedBody)
    tenant = getattr(request.state, "tenant", None)
    return tenant if tenant is not None else authenticate(services.db, authorization)


CurrentTenant = Annotated[Tenant, Depends(get_tenant)]
