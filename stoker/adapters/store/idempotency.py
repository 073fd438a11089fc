"""Idempotency keys: claimed by the first request that carries one, then remembered with the job it made."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import idempotency_key
from stoker.core.idempotency import CLAIM_PREFIX, Remembered

# Written over only by the request holding the claim; a claim it gives up is deleted only if still its own.
_IF_CLAIMED_BY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""


class IdempotencyKeys:
    """One string per (tenant, key): `claim:<job id>` while the first request is taken in, then the job it made."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._if_claimed_by = client.register_script(_IF_CLAIMED_BY)

    def claim(self, digest: str, job_id: str, ttl_s: int) -> Remembered | str | None:
        """Claim a key for a new job: None if claimed now; else what holds it (the job it made, or the claim of a
        request still being taken in, as the job id it will have)."""
        key = idempotency_key(digest)
        if self.redis.set(key, CLAIM_PREFIX + job_id, nx=True, ex=ttl_s):
            return None
        raw = self.redis.get(key)
        if raw is None:  # released between the two calls: try again
            return self.claim(digest, job_id, ttl_s)
        value = raw.decode()
        return value.removeprefix(CLAIM_PREFIX) if value.startswith(CLAIM_PREFIX) else Remembered.load(value)

    def remember(self, digest: str, remembered: Remembered, ttl_s: int) -> bool:
        """Turn this request's claim into the job it made, for `ttl_s`; False if the claim was no longer its own."""
        args = [CLAIM_PREFIX + remembered.job_id, remembered.dump(), ttl_s]
        return bool(self._if_claimed_by(keys=[idempotency_key(digest)], args=args))

    def release(self, digest: str, job_id: str) -> None:
        """Give up a claim whose request made no job (refused, failed), so a retry may claim it."""
        self._if_claimed_by(keys=[idempotency_key(digest)], args=[CLAIM_PREFIX + job_id, "", 0])
