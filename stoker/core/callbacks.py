"""Completion callbacks: how the POST a worker sends when a job ends is signed and checked, and when to try again.

Signed like Stripe's and Svix's webhooks: HMAC-SHA256, keyed by the tenant's callback secret, over
`<timestamp>.<body>`; the timestamp travels in `X-Stoker-Timestamp` and the signature, `v1=<hex>`, in
`X-Stoker-Signature`. A receiver recomputes it over the raw body, compares in constant time, and refuses a
timestamp too far from its own clock (a replayed old delivery).

Each tenant has a secret of its own. While a rotated-out secret is in its grace period the header carries one
signature per live secret, the new one first, comma-separated as Stripe does (`v1=<new>,v1=<old>`): a receiver
accepts the delivery when any of them is right, so it can switch to the new secret at any moment of the grace.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from stoker.core.tenancy import DEFAULT_TENANT

SIGNATURE_HEADER = "X-Stoker-Signature"
TIMESTAMP_HEADER = "X-Stoker-Timestamp"
#: A receiver accepts a delivery signed at most this long ago (or ahead, for clocks that differ).
TOLERANCE_S = 300


def new_secret() -> str:
    """A tenant's callback secret: 256 random bits."""
    return "whsec_" + secrets.token_urlsafe(32)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for a body sent at `timestamp` (whole seconds since the epoch)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={digest}"


def signature_header(live: Sequence[str], timestamp: int, body: bytes) -> str:
    """The signature header's value: one `v1=` signature per live secret of the tenant (the current one first)."""
    if not live:
        raise ValueError("a callback is signed with at least one secret")
    return ",".join(sign(secret, timestamp, body) for secret in live)


def verify(
    secret: str, timestamp: str, body: bytes, signature: str, now: float, tolerance_s: int = TOLERANCE_S
) -> bool:
    """Whether a delivery is genuine and recent: what a receiver checks before it trusts the body. `signature` is
    the whole header; any one of its signatures made with `secret` will do (several during a rotation)."""
    if not timestamp.isdigit() or abs(now - int(timestamp)) > tolerance_s:
        return False
    expected = sign(secret, int(timestamp), body)
    # Every entry is compared, in constant time each: how many there are is no secret, which one matched is.
    matches = [hmac.compare_digest(expected, entry.strip()) for entry in signature.split(",")]
    return any(matches)


def deployment_fallback(tenant: str, configured: str | None) -> str | None:
    """The deprecated deployment-wide secret (`STOKER_CALLBACK_SECRET`): it stands in for the default tenant's own
    (auth off, one client) until that tenant has one, and never signs another tenant's callbacks, whose receivers
    would otherwise all hold one key and could forge each other's deliveries."""
    return configured if tenant == DEFAULT_TENANT else None


def backoff_s(attempt: int, base_s: float, cap_s: float = 600.0) -> float:
    """How long to wait after failed attempt number `attempt` (1, 2, …): base, doubling, capped."""
    return float(min(base_s * 2 ** (attempt - 1), cap_s))
