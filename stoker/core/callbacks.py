"""Completion callbacks: how the POST a worker sends when a job ends is signed and checked, and when to try again.

Signed like Stripe's and Svix's webhooks: HMAC-SHA256, keyed by the tenant's callback secret, over
`<timestamp>.<body>`; the timestamp travels in `X-Stoker-Timestamp` and the signature, `v1=<hex>`, in
`X-Stoker-Signature`. A receiver recomputes it over the raw body, compares in constant time, and refuses a
timestamp too far from its own clock (a replayed old delivery).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

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


def verify(
    secret: str, timestamp: str, body: bytes, signature: str, now: float, tolerance_s: int = TOLERANCE_S
) -> bool:
    """Whether a delivery is genuine and recent: what a receiver checks before it trusts the body."""
    if not timestamp.isdigit() or abs(now - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


def backoff_s(attempt: int, base_s: float, cap_s: float = 600.0) -> float:
    """How long to wait after failed attempt number `attempt` (1, 2, …): base, doubling, capped."""
    return float(min(base_s * 2 ** (attempt - 1), cap_s))
