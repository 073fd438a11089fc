"""Idempotency keys: claimed by the first request that carries one, then remembered with the job it made."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import idempotency_key, recent_request_key, settled_channel
from stoker.core.idempotency import CLAIM_PREFIX, Remembered

# Written over only by the request holding the claim; a claim it gives up is deleted only if still its own. Either
# way the requests waiting on the claim hear of it at once (ARGV[4], a channel the API's announcements listen to).
_IF_CLAIMED_BY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
redis.call('PUBLISH', ARGV[4], '')
return 1
"""

# A claim's lifetime is extended only by the request holding it: a lapsed claim another request took stays theirs.
_RENEW_IF_CLAIMED_BY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('EXPIRE', KEYS[1], ARGV[2])
"""


class IdempotencyKeys:
    """One string per (tenant, key): `claim:<job id>` while the first request is taken in, then the job it made."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._if_claimed_by = client.register_script(_IF_CLAIMED_BY)
        self._renew_if_claimed_by = client.register_script(_RENEW_IF_CLAIMED_BY)

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

    def renew(self, digest: str, job_id: str, ttl_s: int) -> bool:
        """Give this request's claim `ttl_s` more; False if the claim was no longer its own (lapsed, taken over,
        or settled)."""
        args = [CLAIM_PREFIX + job_id, ttl_s]
        return bool(self._renew_if_claimed_by(keys=[idempotency_key(digest)], args=args))

    def remember(self, digest: str, remembered: Remembered, ttl_s: int) -> bool:
        """Turn this request's claim into the job it made, for `ttl_s`; False if the claim was no longer its own."""
        job_id = remembered.job_id
        args = [CLAIM_PREFIX + job_id, remembered.dump(), ttl_s, settled_channel(job_id)]
        return bool(self._if_claimed_by(keys=[idempotency_key(digest)], args=args))

    def release(self, digest: str, job_id: str) -> None:
        """Give up a claim whose request made no job (refused, failed), so a retry may claim it."""
        args = [CLAIM_PREFIX + job_id, "", 0, settled_channel(job_id)]
        self._if_claimed_by(keys=[idempotency_key(digest)], args=args)

    @staticmethod
    def queue_recent(pipe: redis.Redis[bytes], digest: str, job_id: str, ttl_s: int) -> None:
        """Remember for `ttl_s` that the request with this digest (one without a key) made `job_id` (the latest
        such request's job, when several were alike): queued onto `pipe`, the transaction that makes the job."""
        pipe.set(recent_request_key(digest), job_id, ex=ttl_s)

    def recent(self, digest: str) -> str | None:
        """The job the latest request with this digest made, while it is remembered."""
        raw = self.redis.get(recent_request_key(digest))
        return raw.decode() if raw is not None else None
