"""Idempotent submissions: the key a client sends with a request, and what a retry is compared by. No I/O.

A retried POST with the same `Idempotency-Key` (per tenant) gets the job the first one made instead of a second
job; the same key with a different request is refused, so a client bug cannot silently get someone else's answer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from stoker.core.errors import InvalidRequest

#: The header, as Stripe and the IETF draft name it.
HEADER = "Idempotency-Key"
#: Printable ASCII without spaces, at most 255 characters (a UUID is the usual choice).
_KEY = re.compile(r"[\x21-\x7e]{1,255}")
#: What a key's stored value starts with while its first request is still being taken in.
CLAIM_PREFIX = "claim:"


def check_key(key: str) -> str:
    """The key, if it is one; InvalidRequest otherwise."""
    if not _KEY.fullmatch(key):
        raise InvalidRequest(f"{HEADER} must be 1-255 printable characters without spaces", param=HEADER)
    return key


def key_digest(tenant: str, key: str) -> str:
    """Where a tenant's key is kept: a digest, so keys of any shape make fixed, safe store keys."""
    return hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()


def request_fingerprint(
    prompt: str,
    inputs: Sequence[tuple[str, str, str | None]],
    deadline_ms: int,
    chat: str | None = None,
    callback_url: str | None = None,
) -> str:
    """A digest of a request as normalised by intake (inputs by kind and content hash or URL, not by how they
    were encoded): a multipart and a JSON body of the same job compare equal."""
    parts = {"prompt": prompt, "inputs": list(inputs), "deadline_ms": deadline_ms, "chat": chat, "cb": callback_url}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Remembered:
    """The job a key made, and the fingerprint of the request that made it."""

    job_id: str
    fingerprint: str

    def dump(self) -> str:
        """As stored."""
        return json.dumps({"job": self.job_id, "request": self.fingerprint})

    @classmethod
    def load(cls, raw: str) -> Remembered:
        """From what was stored."""
        value = json.loads(raw)
        return cls(str(value["job"]), str(value["request"]))
