"""Upload slots: how many uploads a tenant, and the gateway, have in flight at once.

An upload holds a slot from before its body is read until its response is sent; one past the
tenant's limit (or the gateway's) gets 429 with Retry-After at once and costs the gateway no
body. The counts are this gateway's: behind several gateways a tenant may have this many on each.
"""

from __future__ import annotations

from collections import Counter

from api.errors import error_response
from cloud.settings import Settings

# what a refused upload is told to wait: an upload's check and store take seconds
UPLOAD_RETRY_AFTER_S = 5


class UploadSlots:
    """ASGI middleware around the app, inside the one that authenticates (it reads the tenant
    that one put in the scope)."""

    def __init__(self, app, settings: Settings) -> None:
        self.app = app
        self.per_tenant = settings.max_uploads_per_tenant
        self.in_all = settings.max_concurrent_uploads
        self._held: Counter[int] = Counter()  # tenant id -> uploads in flight

    async def __call__(self, scope, receive, send):
        tenant = scope.get("state", {}).get("tenant")
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/models" or tenant is None:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(tenant.id)
        if refusal is not None:
            headers = {"Retry-After": str(UPLOAD_RETRY_AFTER_S)}
            await error_response(scope["path"], 429, "overloaded", refusal, headers, retry_after=UPLOAD_RETRY_AFTER_S)(
                scope, receive, send
            )
            return
        self._held[tenant.id] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._held[tenant.id] -= 1
            if not self._held[tenant.id]:
                del self._held[tenant.id]

    def _refusal(self, tenant_id: int) -> str | None:
        if self._held[tenant_id] >= self.per_tenant:
            return (
                f"this tenant already has {self._held[tenant_id]} uploads in flight, its limit: "
                f"retry after {UPLOAD_RETRY_AFTER_S} s"
            )
        if self._held.total() >= self.in_all:
            return f"the server is taking {self.in_all} uploads already: retry after {UPLOAD_RETRY_AFTER_S} s"
        return None
