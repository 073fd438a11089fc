"""Completion callbacks: which ended jobs are due a delivery, how each delivery stands, and tenants' secrets."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import CALLBACKS_DUE_KEY, callback_secret_key, job_key
from stoker.core.callbacks import new_secret
from stoker.core.jobs import CallbackState


class CallbackRepository:
    """The due list (the finish script adds to it), the state in each job's record, and per-tenant secrets."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client

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
        """The tenant's callback secret, made on first use (shown by `stoker keys create`)."""
        key = callback_secret_key(tenant)
        self.redis.set(key, new_secret(), nx=True)
        raw = self.redis.get(key)
        assert raw is not None
        return raw.decode()
