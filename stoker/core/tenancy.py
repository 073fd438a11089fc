"""Tenants: API keys (format, hashing, verification), per-tenant limits and cache scopes. Pure values, no I/O.

A key is `stk_<key id>_<secret>`. The store keeps, under the key id, only a hash of the secret and the tenant it
belongs to; a presented key is looked up by its id and its secret compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
from dataclasses import dataclass
from typing import Literal

#: Every key starts with this, so a leaked one is recognisable (secret scanners, logs).
KEY_PREFIX = "stk"
#: With authentication off, every job belongs to this tenant.
DEFAULT_TENANT = "local"
#: The cache scope every tenant shares when cache sharing is on.
SHARED_SCOPE = "shared"
#: Tenant names go into Redis keys: letters, digits, `.`, `_` and `-`, at most 64.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
#: Seconds a client refused for too many jobs in flight is told to wait: jobs end in seconds, not minutes.
IN_FLIGHT_RETRY_S = 2


@dataclass(frozen=True)
class ApiKey:
    """A stored API key: never the secret, only its hash."""

    key_id: str
    tenant: str
    secret_hash: str
    created: float
    revoked: bool = False


@dataclass(frozen=True)
class IssuedKey:
    """A key as created: the record to store, and the key itself, shown once to whoever created it."""

    record: ApiKey
    token: str


def check_tenant(name: str) -> str:
    """The tenant name, if it is one; ValueError otherwise."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant must be 1-64 letters, digits, '.', '_' or '-' (got {name!r})")
    return name


def hash_secret(secret: str) -> str:
    """The stored form of a key's secret.

    SHA-256 and not a slow password hash (bcrypt, argon2): the secret is 256 random bits from `secrets`, not a
    human choice, so there is no dictionary to try and a fast hash is as good as a slow one; it keeps verification
    cheap on every request.
    """
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_key(tenant: str, now: float) -> IssuedKey:
    """A new random key for a tenant; never for the reserved tenant (`DEFAULT_TENANT`: auth off, and records
    written before tenants existed), whose jobs would otherwise be shared with anyone holding such a key."""
    if tenant == DEFAULT_TENANT:
        raise ValueError(f"tenant {DEFAULT_TENANT!r} is reserved (it owns every job when auth is off)")
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    record = ApiKey(key_id=key_id, tenant=check_tenant(tenant), secret_hash=hash_secret(secret), created=now)
    return IssuedKey(record=record, token=f"{KEY_PREFIX}_{key_id}_{secret}")


def parse_key(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    parts = token.split("_", 2)  # the id is hex; the secret may itself hold '_'
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not _KEY_ID.fullmatch(parts[1]) or not parts[2]:
        return None
    return parts[1], parts[2]


def key_id_of(token_or_id: str) -> str | None:
    """The key id named by a whole key or by the id alone."""
    if _KEY_ID.fullmatch(token_or_id):
        return token_or_id
    parsed = parse_key(token_or_id)
    return parsed[0] if parsed else None


#: Compared against when a key id is unknown, so an unknown id costs the same work as a wrong secret.
_NO_HASH = hash_secret(secrets.token_urlsafe(32))


def verify(secret: str, stored: ApiKey | None) -> str | None:
    """The tenant a key's secret opens, or None (unknown id, wrong secret, revoked key)."""
    matches = hmac.compare_digest(hash_secret(secret), stored.secret_hash if stored else _NO_HASH)
    if stored is None or stored.revoked or not matches:
        return None
    return stored.tenant


def cache_scope(tenant: str, shared: bool) -> str:
    """The namespace of a tenant's stage-cache entries: its own, or one for everyone when sharing is on.

    The prefix keeps a tenant named "shared" out of the shared scope.
    """
    return SHARED_SCOPE if shared else f"tenant-{tenant}"


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may do: requests per second (with a burst), unfinished jobs at once, its share of the queues,
    the input bytes its unfinished jobs may hold and the bytes its stored results may hold; 0 is no limit.

    Fair share: the tenant's unfinished jobs may fan out into at most `share_capacity` × min(`max_share`, 1/n)
    queue messages, n being the tenants with unfinished jobs (itself included). Below the global queue limit a
    busy tenant is refused before the others are: one tenant alone cannot fill the queues for everyone. A tenant
    with nothing in flight is always admitted, however many messages its job fans out into.
    """

    rate_per_s: float
    burst: int
    max_in_flight: int
    share_capacity: int = 0
    max_share: float = 0.0
    max_stored_bytes: int = 0
    #: Its jobs' stored results (kept with their records, `job_ttl_s`), together; at it, new jobs are refused.
    max_result_bytes: int = 0


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant's unfinished jobs hold: queue messages they fan out into, input bytes they stored; how many
    tenants have unfinished jobs; and the results its jobs' records keep (how many, and their bytes)."""

    messages: int
    stored_bytes: int
    busy_tenants: int
    result_bytes: int = 0
    results: int = 0


@dataclass(frozen=True)
class LimitVerdict:
    """Whether a tenant's request goes ahead, and if not, which limit it hit and when to come back (or, for a
    request checked with its key, that the key does not open)."""

    outcome: Literal["ok", "rate", "in_flight", "share", "bytes", "too_big", "results", "unauthorized"]
    retry_after_s: int = 0

    @classmethod
    def from_script(cls, outcome: str, wait_s: float) -> LimitVerdict:
        """From what the store's admission script answered: an outcome and the seconds until it would pass."""
        if outcome == "ok":
            return cls("ok")
        if outcome in ("rate", "results"):  # the rate's next slot, or when the first stored result expires
            return cls(outcome, retry_after(wait_s))  # type: ignore[arg-type]
        if outcome == "unauthorized":  # the key checked with the request: revoked, or another secret
            return cls("unauthorized")
        if outcome in ("in_flight", "share", "bytes", "too_big"):
            return cls(outcome, IN_FLIGHT_RETRY_S)  # type: ignore[arg-type]
        raise ValueError(f"unknown admission outcome {outcome!r}")


def retry_after(wait_s: float) -> int:
    """Retry-After in whole seconds, never 0 (the header's unit; rounding down would send the client back early)."""
    return max(1, math.ceil(wait_s))
