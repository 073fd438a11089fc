"""Tenants: per-tenant admission (request rate, jobs in flight) and API keys."""

from __future__ import annotations

import time

import redis

from stoker.adapters.store.keys import API_KEYS_KEY, api_key_key, tenant_jobs_key, tenant_rate_key
from stoker.core.tenancy import ApiKey, LimitVerdict, TenantLimits

# Per-tenant admission, atomic across API replicas: the request rate as GCRA (one theoretical arrival time per
# tenant, in Redis time, so replicas' clocks do not matter) and, for a new job, a slot among the tenant's
# unfinished jobs. A refused request changes nothing but the removal of slots whose hold ran out.
_ADMIT_TENANT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local rate, burst, max_jobs = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat
if rate > 0 then
  local interval = 1 / rate
  tat = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now) + interval
  local wait = tat - burst * interval - now
  if wait > 0 then return {'rate', string.format('%.6f', wait)} end
end
if max_jobs > 0 and ARGV[4] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_jobs then return {'in_flight', '0'} end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
end
if tat then redis.call('SET', KEYS[1], string.format('%.6f', tat), 'PX', math.ceil((tat - now) * 1000) + 1000) end
return {'ok', '0'}
"""


class TenantRepository:
    """Per-tenant limits and API key records (hashes of secrets, never secrets)."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._admit_tenant = client.register_script(_ADMIT_TENANT)

    def admit_tenant(
        self, tenant: str, limits: TenantLimits, job_id: str | None = None, hold_s: float = 0
    ) -> LimitVerdict:
        """Check a tenant's request against its limits and count it; with job_id, also hold an in-flight slot for
        the new job (for at most hold_s, until create_job ties it to the job's deadline). Refused: nothing counted.
        """
        args = [limits.rate_per_s, limits.burst, limits.max_in_flight, job_id or "", hold_s]
        outcome, wait = self._admit_tenant(keys=[tenant_rate_key(tenant), tenant_jobs_key(tenant)], args=args)
        return LimitVerdict.from_script(outcome.decode(), float(wait))

    def release_slot(self, tenant: str, job_id: str) -> None:
        """Give back a slot held for a job that was never accepted."""
        self.redis.zrem(tenant_jobs_key(tenant), job_id)

    def jobs_in_flight(self, tenant: str) -> list[str]:
        """Ids of the tenant's jobs holding an in-flight slot now."""
        return [raw.decode() for raw in self.redis.zrangebyscore(tenant_jobs_key(tenant), time.time(), "+inf")]

    def put_api_key(self, key: ApiKey) -> None:
        """Store a key's record (the hash of its secret, never the secret)."""
        fields: dict[str | bytes, str | bytes | float | int] = {
            "tenant": key.tenant,
            "hash": key.secret_hash,
            "created": repr(key.created),
            "revoked": int(key.revoked),
        }
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(api_key_key(key.key_id), mapping=fields)
            pipe.sadd(API_KEYS_KEY, key.key_id)
            pipe.execute()

    def get_api_key(self, key_id: str) -> ApiKey | None:
        """A key's record by its id; None if there is none."""
        raw = self.redis.hgetall(api_key_key(key_id))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return ApiKey(
            key_id=key_id,
            tenant=fields["tenant"],
            secret_hash=fields["hash"],
            created=float(fields["created"]),
            revoked=fields.get("revoked") == "1",
        )

    def api_keys(self) -> list[ApiKey]:
        """Every key's record, oldest first."""
        found = (self.get_api_key(raw.decode()) for raw in self.redis.smembers(API_KEYS_KEY))
        return sorted((key for key in found if key is not None), key=lambda key: key.created)

    def revoke_api_key(self, key_id: str) -> bool:
        """Revoke a key from now on; False if there is no such key."""
        if not self.redis.exists(api_key_key(key_id)):
            return False
        self.redis.hset(api_key_key(key_id), "revoked", 1)
        return True
