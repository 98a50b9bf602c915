"""API keys: created for a tenant, stored as hashes, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select

from cloud.db import ApiKey, Database, Tenant
from cloud.errors import Unauthorized

KEY_PREFIX = "lc_"


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


def authenticate(db: Database, authorization: str | None) -> Tenant:
    if not authorization:
        raise Unauthorized("missing Authorization header; send 'Authorization: Bearer <api key>'")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("malformed Authorization header; send 'Authorization: Bearer <api key>'")
    with db.session() as session:
        row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key.strip())))
        if row is None:
            raise Unauthorized("invalid API key")
        return row.tenant
