"""Completion callbacks: which ended jobs are due a delivery, how each delivery stands, and tenants' secrets."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import (
    CALLBACKS_DUE_KEY,
    callback_secret_key,
    job_key,
    previous_callback_secret_key,
)
from stoker.core.callbacks import new_secret
from stoker.core.jobs import CallbackState

#: KEYS: current, previous; ARGV: the new secret, the grace in seconds, what stood in for a missing current ("" for
#: nothing). The replaced secret (or its stand-in) stays as the previous one for the grace, then expires; a rotation
#: within the grace drops the older previous secret, a grace of 0 drops the replaced one at once.
_ROTATE = """
local old = redis.call('GET', KEYS[1])
if not old and ARGV[3] ~= '' then old = ARGV[3] end
redis.call('SET', KEYS[1], ARGV[1])
if old and tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[2], old, 'EX', ARGV[2])
else
  redis.call('DEL', KEYS[2])
end
return 1
"""


class CallbackRepository:
    """The due list (the finish script adds to it), the state in each job's record, and per-tenant secrets."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._rotate = client.register_script(_ROTATE)

    def due(self, now: float, limit: int = 100) -> list[str]:
        """Jobs whose callback should be sent now."""
        return [raw.decode() for raw in self.redis.zrangebyscore(CALLBACKS_DUE_KEY, "-inf", now, start=0, num=limit)]

    def take(self, job_id: str) -> bool:
        """Take a due callback off the list; True for exactly one taker."""
        return bool(self.redis.zrem(CALLBACKS_DUE_KEY, job_id))

    def put_back(self, job_id: str, at: float) -> None:
        """A callback that could not be handed on: due again at `at`."""
        self.redis.zadd(CALLBACKS_DUE_KEY, {job_id: at})

    def state(self, job_id: str) -> CallbackState | None:
        """How a job's callback stands; None for a job without one (or gone)."""
        raw = self.redis.hget(job_key(job_id), "callback")
        return CallbackState.model_validate_json(raw) if raw else None

    def record(self, job_id: str, state: CallbackState) -> None:
        """Write how a job's callback stands (only into a record that still exists)."""
        if self.redis.exists(job_key(job_id)):
            self.redis.hset(job_key(job_id), "callback", state.model_dump_json())

    def secret(self, tenant: str) -> str:
        """The tenant's current callback secret, made on first use (shown by `stoker keys create`)."""
        return self.live_secrets(tenant)[0]

    def live_secrets(self, tenant: str, fallback: str | None = None) -> list[str]:
        """The secrets the tenant's callbacks are signed with now: its current one first (made on first use, unless
        `fallback` stands in for a missing one), then the one a rotation replaced, while its grace lasts."""
        current_key, previous_key = callback_secret_key(tenant), previous_callback_secret_key(tenant)
        if fallback is None:
            self.redis.set(current_key, new_secret(), nx=True)
        current, previous = self.redis.mget(current_key, previous_key)
        first = current.decode() if current else fallback
        assert first is not None
        return [first, *([previous.decode()] if previous else [])]

    def rotate(self, tenant: str, grace_s: int, fallback: str | None = None) -> str:
        """Give the tenant a new secret and return it; the one it replaces (or `fallback`, standing in for a missing
        one) still signs, beside the new, for `grace_s` seconds."""
        secret = new_secret()
        keys = [callback_secret_key(tenant), previous_callback_secret_key(tenant)]
        self._rotate(keys=keys, args=[secret, grace_s, fallback or ""])
        return secret
