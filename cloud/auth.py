"""API keys: created for a tenant (or for an operator), stored as hashes, looked up by hash,
listed and revoked by operators."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from cloud.db import AdminKey, ApiKey, Database, Tenant
from cloud.errors import Conflict, Forbidden, InvalidRequest, NotFound, Unauthorized

KEY_PREFIX = "lc_"
# operators' keys look different, so one pasted in the wrong place is easy to spot
ADMIN_KEY_PREFIX = "lca_"
# the characters of a key kept in clear, so an operator can tell keys apart
_SHOWN = 10
# a tenant's name appears in bills, CSV files and metric labels: checked whole (fullmatch)
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def hash_key(key: str) -> str:
    # keys are 256-bit random tokens, so a fast hash is enough (no dictionary to attack)
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(db: Database, tenant_name: str) -> str:
    """A new key for the tenant (created if new). The key is returned once, never stored."""
    if not TENANT_NAME.fullmatch(tenant_name):
        raise InvalidRequest(
            f"tenant name {tenant_name!r} is invalid: use 1-128 ASCII letters (A-Z, a-z), digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with db.session() as session:
        tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is None:
            tenant = Tenant(name=tenant_name)
            session.add(tenant)
            session.flush()
        session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:_SHOWN]))
    return key


def create_admin_key(db: Database, name: str) -> str:
    """A new operator key, held by `name`; returned once, never stored."""
    key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)
    with db.session() as session:
        session.add(AdminKey(name=name, key_hash=hash_key(key), prefix=key[:_SHOWN]))
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
    """The tenant whose key was sent; an operator's key is refused (403), anything else is 401."""
    key = bearer_key(authorization)
    key_hash = hash_key(key)
    with db.session() as session:
        tenant = session.scalar(
            select(Tenant).join(ApiKey, ApiKey.tenant_id == Tenant.id).where(ApiKey.key_hash == key_hash)
        )
        if tenant is not None:
            return tenant
        # only a key that looks like an operator's costs a second lookup
        if key.startswith(ADMIN_KEY_PREFIX) and session.scalar(
            select(AdminKey.id).where(AdminKey.key_hash == key_hash)
        ) is not None:
            raise Forbidden(
                "this is an operator key: it works on /v1/admin only; the tenant routes need a tenant's key "
                "(`luminal-cloud admin create-key --tenant NAME`)"
            )
    raise Unauthorized("invalid API key")


@dataclass(frozen=True)
class KeyInfo:
    """What an operator may see of a key: never the key, nor its hash."""

    id: int
    # the key's first characters, as shown when it was made
    prefix: str
    # the tenant it acts for; for an operator key, who holds it
    owner: str
    created_at: datetime


def list_keys(db: Database, tenant_name: str | None = None) -> list[KeyInfo]:
    """Tenants' keys, oldest first; one tenant's if named (NotFound if there is no such tenant)."""
    query = select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id).order_by(ApiKey.id)
    with db.session() as session:
        if tenant_name is not None:
            if session.scalar(select(Tenant.id).where(Tenant.name == tenant_name)) is None:
                raise NotFound(f"tenant: no tenant named {tenant_name!r}", parameter="tenant")
            query = query.where(Tenant.name == tenant_name)
        return [KeyInfo(key.id, key.prefix, name, key.created_at) for key, name in session.execute(query)]


def list_admin_keys(db: Database) -> list[KeyInfo]:
    with db.session() as session:
        keys = session.scalars(select(AdminKey).order_by(AdminKey.id))
        return [KeyInfo(key.id, key.prefix, key.name, key.created_at) for key in keys]


def revoke_key(db: Database, prefix_or_id: str) -> KeyInfo:
    """Deletes a tenant's key, named by its id, its prefix or the whole key. NotFound when none
    matches, Conflict naming them when a prefix matches several."""
    return _revoke_key(db, prefix_or_id)[0]


def _revoke_key(db: Database, prefix_or_id: str) -> tuple[KeyInfo, str]:
    matches = _matcher(prefix_or_id)
    with db.session() as session:
        rows = session.execute(
            select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id).order_by(ApiKey.id)
        )
        found = [(key, KeyInfo(key.id, key.prefix, name, key.created_at)) for key, name in rows if matches(key)]
        key, info = _one(found, prefix_or_id, "tenant key")
        key_hash = key.key_hash
        session.delete(key)
    return info, key_hash


def revoke_admin_key(db: Database, prefix_or_id: str) -> KeyInfo:
    """revoke_key() for operator keys."""
    matches = _matcher(prefix_or_id)
    with db.session() as session:
        keys = session.scalars(select(AdminKey).order_by(AdminKey.id))
        found = [(key, KeyInfo(key.id, key.prefix, key.name, key.created_at)) for key in keys if matches(key)]
        key, info = _one(found, prefix_or_id, "operator key")
        session.delete(key)
    return info


def _matcher(prefix_or_id: str):
    # compared here rather than with LIKE, which ignores case on SQLite (keys are case-sensitive);
    # an operator's listing is small
    if prefix_or_id.isdigit():
        return lambda key: key.id == int(prefix_or_id)
    if len(prefix_or_id) > _SHOWN:  # longer than any stored prefix: the key itself
        key_hash = hash_key(prefix_or_id)
        return lambda key: key.key_hash == key_hash
    return lambda key: key.prefix.startswith(prefix_or_id)


def _one[T](found: list[tuple[T, KeyInfo]], prefix_or_id: str, kind: str) -> tuple[T, KeyInfo]:
    if not found:
        raise NotFound(f"no {kind} matches {prefix_or_id!r} (give its id, its first characters as listed, or the whole key)")
    if len(found) > 1:
        named = ", ".join(f"{info.prefix} (id {info.id}, {info.owner})" for _, info in found[:10])
        more = f" and {len(found) - 10} more" if len(found) > 10 else ""
        raise Conflict(
            f"{prefix_or_id!r} matches {len(found)} {kind}s: {named}{more}; give a longer prefix or the id",
            matches=[info.id for _, info in found],
        )
    return found[0]


class Authenticator:
    """authenticate() that remembers each key's tenant for `ttl_s`: every request names its key,
    and a database round trip per request costs more than the rest of a small model's request.
    A key revoked through this object is refused at once; one deleted from the database by
    anything else (the command line, another gateway) keeps working here for up to `ttl_s`."""

    def __init__(self, db: Database, ttl_s: float = 5.0, max_keys: int = 10_000) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        # authorization header -> (expires, tenant, the key's hash)
        self._tenants: dict[str, tuple[float, Tenant, str]] = {}
        # hashes of keys revoked here: a lookup that raced the revocation must not cache one again
        self._revoked: set[str] = set()

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
        key_hash = hash_key(bearer_key(authorization))
        if key_hash in self._revoked:
            raise Unauthorized("invalid API key")
        if len(self._tenants) >= self.max_keys:
            self._tenants.clear()  # many keys at once is rare: start over rather than track age
        self._tenants[authorization or ""] = (time.monotonic() + self.ttl_s, tenant, key_hash)
        return tenant

    def revoke(self, prefix_or_id: str) -> KeyInfo:
        """revoke_key(), and the key forgotten here, so that its next request is refused."""
        revoked, revoked_hash = _revoke_key(self.db, prefix_or_id)
        self._revoked.add(revoked_hash)
        for header, (_, _, key_hash) in list(self._tenants.items()):
            if key_hash == revoked_hash:
                self._tenants.pop(header, None)
        return revoked
