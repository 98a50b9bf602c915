"""API keys: created for a tenant (or for an operator), stored as hashes, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import select

from cloud.db import AdminKey, ApiKey, Database, Tenant
from cloud.errors import Forbidden, Unauthorized

KEY_PREFIX = "lc_"
# operators' keys look different, so one pasted in the wrong place is easy to spot
ADMIN_KEY_PREFIX = "lca_"


def hash_key(key: str) -> str:
    # keys are 256-bit random tokens, so a fast hash is enough (no dictionary to attack)
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(db: Database, tenant_name: str) -> str:
    """A new key for the tenant (created if new). The key is returned once, never stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with db.session() as session:
        tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            tenant = Tenant(name=tenant_name)
            session.add(tenant)
            session.flush()
        session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10]))
    return key


def create_admin_key(db: Database, name: str) -> str:
    """A new operator key, held by `name`; returned once, never stored."""
    key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)
    with db.session() as session:
        session.add(AdminKey(name=name, key_hash=hash_key(key), prefix=key[:10]))
    return key


def bearer_key(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized("missing Authorization header; send 'Authorization: Bearer <api key>'")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("malformed Authorization header; send 'Authorization: Bearer <api key>'")
    return key.strip()


def authenticate_admin(db: Database, authorization: str | None) -> AdminKey:
    """The operator key sent; a tenant's key is refused (403), anything else is 401."""
    key_hash = hash_key(bearer_key(authorization))
    with db.session() as session:
        admin = session.scalar(select(AdminKey).where(AdminKey.key_hash == key_hash))
        if admin is not None:
            return admin
        if session.scalar(select(ApiKey.id).where(ApiKey.key_hash == key_hash)) is not None:
            raise Forbidden(
                "a tenant's API key cannot use the operator routes; "
                "create an operator key with `luminal-cloud admin create-key --admin`"
            )
    raise Unauthorized("invalid API key")


def authenticate(db: Database, authorization: str | None) -> Tenant:
    key = bearer_key(authorization)
    with db.session() as session:
        tenant = session.scalar(
            select(Tenant).join(ApiKey, ApiKey.tenant_id == Tenant.id).where(ApiKey.key_hash == hash_key(key))
        )
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant


class Authenticator:
    """authenticate() that remembers each key's tenant for `ttl_s`: every request names its key,
    and a database round trip per request costs more than the rest of a small model's request.
    A key deleted from the database keeps working here for up to `ttl_s`."""

    def __init__(self, db: Database, ttl_s: float = 5.0, max_keys: int = 10_000) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._tenants: dict[str, tuple[float, Tenant]] = {}  # authorization header -> (expires, tenant)

    def cached(self, authorization: str | None) -> Tenant | None:
        """The tenant if this header was authenticated lately; no I/O, safe on the event loop."""
        found = self._tenants.get(authorization or "")
        if found is None or found[0] < time.monotonic():
            return None
        return found[1]

    def __call__(self, authorization: str | None) -> Tenant:
        tenant = self.cached(authorization)
        if tenant is not None:
            return tenant
        tenant = authenticate(self.db, authorization)
        if len(self._tenants) >= self.max_keys:
            self._tenants.clear()  # many keys at once is rare: start over rather than track age
        self._tenants[authorization or ""] = (time.monotonic() + self.ttl_s, tenant)
        return tenant
