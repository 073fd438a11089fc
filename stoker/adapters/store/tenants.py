"""Tenants: per-tenant admission (request rate, jobs in flight) and API keys."""

from __future__ import annotations

import time

import redis
import redis.asyncio as aioredis

from stoker.adapters.store.keys import (
    API_KEYS_KEY,
    BUSY_TENANTS_KEY,
    api_key_key,
    tenant_jobs_key,
    tenant_rate_key,
    tenant_result_bytes_key,
    tenant_results_key,
    tenant_usage_key,
)
from stoker.core.tenancy import ApiKey, LimitVerdict, TenantLimits, TenantUsage, hash_secret

#: Lua: forget what one job of a tenant held (its in-flight slot, messages and bytes), once; used wherever a job
#: stops counting: it ended (the finish script), it was not accepted after all, or its hold ran out.
#: KEYS: in-flight, usage, busy tenants; then drop(job, tenant).
DROP_JOB = """
local function drop(inflight, usage, busy, job, tenant)
  redis.call('ZREM', inflight, job)
  local m = tonumber(redis.call('HGET', usage, 'm:' .. job) or '0')
  local b = tonumber(redis.call('HGET', usage, 'b:' .. job) or '0')
  if redis.call('HDEL', usage, 'm:' .. job, 'b:' .. job) == 0 then return end
  -- 0 - x, never -x: Lua's -0 is "-0", which HINCRBY refuses
  local left = redis.call('HINCRBY', usage, 'messages', 0 - m)
  redis.call('HINCRBY', usage, 'bytes', 0 - b)
  if left <= 0 then redis.call('ZREM', busy, tenant) else redis.call('ZADD', busy, left, tenant) end
end
"""

#: Stored results let go of at most this many at a time (`RESULTS`' trim): one script never walks a long list.
TRIM_AT_ONCE = 512

#: Lua: the bytes a tenant's stored results hold, for its result quota. A result lives as long as its job's record
#: (`job_ttl_s` from acceptance), long after the job stopped counting as in flight, so it is charged apart from
#: `DROP_JOB`'s usage: per tenant, a sorted set of its jobs with a result, each scored by when its record expires
#: (KEYS `held`), and a hash of each one's bytes (`b:<id>`) with their total (`bytes`, KEYS `sizes`).
#: Why this and not counters per expiry bucket, which Redis would drop by itself: a bucket is let go of only when
#: the whole bucket expires (a result would count up to a bucket's width past its record), and a job deleted early
#: could not take back its bytes without knowing its bucket. Here each entry is let go of at its record's own
#: expiry, by whichever script next looks (admission, a finish, a usage read: each trims what expired first), or
#: with its job (`drop_result`); an entry and the total change in the same script, so they cannot part; a result
#: is charged once per job (HSETNX), and both keys expire when their last entry does, so a tenant that stops
#: leaves nothing behind. A result is charged only where its record has a lifetime (every record has one).
RESULTS = f"""
local function trim_results(held, sizes, now)
  local gone = redis.call('ZRANGEBYSCORE', held, '-inf', now, 'LIMIT', 0, {TRIM_AT_ONCE})
  if #gone == 0 then return end
  local freed = 0
  for _, job in ipairs(gone) do
    freed = freed + tonumber(redis.call('HGET', sizes, 'b:' .. job) or '0')
    redis.call('HDEL', sizes, 'b:' .. job)
  end
  redis.call('ZREM', held, unpack(gone))
  redis.call('HINCRBY', sizes, 'bytes', 0 - freed)
end
local function hold_result(held, sizes, record, job, bytes)
  local ttl = redis.call('PTTL', record)
  if bytes <= 0 or ttl <= 0 then return end
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
  trim_results(held, sizes, now)
  if redis.call('HSETNX', sizes, 'b:' .. job, bytes) == 0 then return end
  redis.call('ZADD', held, string.format('%.3f', now + ttl / 1000), job)
  redis.call('HINCRBY', sizes, 'bytes', bytes)
  local last = math.ceil(tonumber(redis.call('ZRANGE', held, -1, -1, 'WITHSCORES')[2]))
  redis.call('EXPIREAT', held, last)
  redis.call('EXPIREAT', sizes, last)
end
local function drop_result(held, sizes, job)
  local bytes = redis.call('HGET', sizes, 'b:' .. job)
  if not bytes then return end
  redis.call('HDEL', sizes, 'b:' .. job)
  redis.call('ZREM', held, job)
  redis.call('HINCRBY', sizes, 'bytes', 0 - tonumber(bytes))
end
"""

#: Lua: the most queue messages a tenant may hold: capacity x min(max share, 1/n), n the busy tenants with it.
_SHARE = """
local function share(busy, tenant, capacity, max_share)
  local n = redis.call('ZCARD', busy)
  if not redis.call('ZSCORE', busy, tenant) then n = n + 1 end
  return math.max(1, math.floor(capacity * math.min(max_share, 1 / n)))
end
"""

#: Lua, with a key's record (KEYS[7]) and the hash of the secret presented (ARGV[11]): the key is checked before
#: anything is counted. A key revoked or presented with another secret is 'unauthorized'; one with no record, or
#: whose record names another tenant than the caller passed (a stale hint), is 'moved'. Either counts nothing.
_KEY_CHECK = """
if KEYS[7] then
  local record = redis.call('HMGET', KEYS[7], 'tenant', 'hash', 'revoked')
  if not record[2] or record[1] ~= ARGV[6] then return {'moved', '0'} end
  -- digests of the two hashes compared, not the hashes: how far a comparison runs tells nothing of a stored prefix
  if record[3] == '1' or redis.sha1hex(record[2]) ~= redis.sha1hex(ARGV[11]) then return {'unauthorized', '0'} end
end
"""

# Per-tenant admission before a body is read, atomic across API replicas: the request rate as GCRA (one
# theoretical arrival time per tenant, in Redis time, so replicas' clocks do not matter) and, for a new job, a slot
# among the tenant's unfinished jobs, unless those already hold its fair share of the queues or its stored bytes,
# or its stored results hold their quota (then: the seconds until the first of them expires). A refused request
# changes nothing but forgetting jobs whose hold ran out and results that expired. Given a key's record, the key
# is checked first (`_KEY_CHECK`): the API's check and count of a request in one round trip.
_ADMIT_TENANT = (
    DROP_JOB
    + RESULTS
    + _SHARE
    + _KEY_CHECK
    + """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local rate, burst, max_jobs = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local job, hold, tenant = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local capacity, max_share, max_bytes = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local tat
if rate > 0 then
  local interval = 1 / rate
  tat = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now) + interval
  local wait = tat - burst * interval - now
  if wait > 0 then return {'rate', string.format('%.6f', wait)} end
end
if job ~= '' then
  for _, lapsed in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
    drop(KEYS[2], KEYS[3], KEYS[4], lapsed, tenant)
  end
  if max_jobs > 0 and redis.call('ZCARD', KEYS[2]) >= max_jobs then return {'in_flight', '0'} end
  local used = tonumber(redis.call('HGET', KEYS[3], 'messages') or '0')
  if capacity > 0 and used > 0 and used >= share(KEYS[4], tenant, capacity, max_share) then
    return {'share', '0'}
  end
  if max_bytes > 0 and tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0') >= max_bytes then
    return {'bytes', '0'}
  end
  local max_results = tonumber(ARGV[10])
  if max_results > 0 then
    trim_results(KEYS[5], KEYS[6], now)
    if tonumber(redis.call('HGET', KEYS[6], 'bytes') or '0') >= max_results then
      local first = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')[2]
      return {'results', string.format('%.6f', (tonumber(first) or now) - now)}
    end
  end
  redis.call('ZADD', KEYS[2], now + hold, job)
end
if tat then redis.call('SET', KEYS[1], string.format('%.6f', tat), 'PX', math.ceil((tat - now) * 1000) + 1000) end
return {'ok', '0'}
"""
)

# Once a job's body is read and its shape known: charge what it fans out into and the bytes it stores, unless that
# takes its tenant over its fair share (a tenant with nothing in flight always gets one job in) or its byte cap.
_CHARGE_JOB = (
    _SHARE
    + """
local tenant, job, messages, bytes = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local capacity, max_share, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local used = tonumber(redis.call('HGET', KEYS[1], 'messages') or '0')
if capacity > 0 and used > 0 and used + messages > share(KEYS[2], tenant, capacity, max_share) then
  return 'share'
end
local stored = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
if max_bytes > 0 and stored + bytes > max_bytes then
  if stored == 0 then return 'too_big' end
  return 'bytes'
end
redis.call('HSET', KEYS[1], 'm:' .. job, messages, 'b:' .. job, bytes, 'cap', max_bytes)
redis.call('HINCRBY', KEYS[1], 'bytes', bytes)
redis.call('ZADD', KEYS[2], redis.call('HINCRBY', KEYS[1], 'messages', messages), tenant)
return 'ok'
"""
)

# A worker about to store a URL input's download: count its bytes against the job's tenant, unless that passes
# the cap the API wrote. A job the API does not account for (auth off, or already ended) stores freely.
_CHARGE_BYTES = """
local job, bytes = ARGV[1], tonumber(ARGV[2])
if redis.call('HEXISTS', KEYS[1], 'm:' .. job) == 0 then return 'free' end
local cap = tonumber(redis.call('HGET', KEYS[1], 'cap') or '0')
if cap > 0 and tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0') + bytes > cap then return 'over' end
redis.call('HINCRBY', KEYS[1], 'b:' .. job, bytes)
redis.call('HINCRBY', KEYS[1], 'bytes', bytes)
return 'ok'
"""

_RELEASE = (
    DROP_JOB
    + """
drop(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
"""
)

# What a tenant holds now, its stored results trimmed of those that expired first.
_USAGE = (
    RESULTS
    + """
local clock = redis.call('TIME')
trim_results(KEYS[3], KEYS[4], tonumber(clock[1]) + tonumber(clock[2]) / 1000000)
local usage = redis.call('HMGET', KEYS[1], 'messages', 'bytes')
local held = redis.call('HGET', KEYS[4], 'bytes') or '0'
return {usage[1] or '0', usage[2] or '0', redis.call('ZCARD', KEYS[2]), held, redis.call('ZCARD', KEYS[3])}
"""
)


def tenant_keys(tenant: str) -> list[str]:
    """The keys DROP_JOB works on, for one tenant: in-flight, usage, busy tenants."""
    return [tenant_jobs_key(tenant), tenant_usage_key(tenant), BUSY_TENANTS_KEY]


def result_keys(tenant: str) -> list[str]:
    """The keys RESULTS works on, for one tenant: its stored results by expiry, and their bytes."""
    return [tenant_results_key(tenant), tenant_result_bytes_key(tenant)]


class TenantRepository:
    """Per-tenant limits and API key records (hashes of secrets, never secrets)."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._admit_tenant = client.register_script(_ADMIT_TENANT)
        self._charge_job = client.register_script(_CHARGE_JOB)
        self._charge_bytes = client.register_script(_CHARGE_BYTES)
        self._release = client.register_script(_RELEASE)
        self._usage = client.register_script(_USAGE)

    def admit_tenant(
        self, tenant: str, limits: TenantLimits, job_id: str | None = None, hold_s: float = 0
    ) -> LimitVerdict:
        """Check a tenant's request against its limits and count it; with job_id, also hold an in-flight slot for
        the new job (for at most hold_s, until the job's record ties it to its deadline). Refused: nothing counted.
        """
        keys, args = _admit_call(tenant, limits, job_id, hold_s)
        outcome, wait = self._admit_tenant(keys=keys, args=args)
        return LimitVerdict.from_script(outcome.decode(), float(wait))

    def charge_job(self, tenant: str, job_id: str, messages: int, stored_bytes: int, limits: TenantLimits) -> str:
        """Count what an admitted job fans out into and the bytes it stores against its tenant: "ok", or why not
        ("share", "bytes", or "too_big" when the job alone passes the byte cap). Refused: nothing counted."""
        keys, args = _charge_call(tenant, job_id, messages, stored_bytes, limits)
        outcome: bytes = self._charge_job(keys=keys, args=args)
        return outcome.decode()

    def charge_bytes(self, tenant: str, job_id: str, stored_bytes: int) -> bool:
        """Count bytes a worker is about to store for a job (a URL download); False if that passes the cap."""
        outcome: bytes = self._charge_bytes(keys=[tenant_usage_key(tenant)], args=[job_id, stored_bytes])
        return outcome != b"over"

    def release_slot(self, tenant: str, job_id: str) -> None:
        """Give back what a job held that was never accepted after all (its slot, messages and bytes)."""
        self._release(keys=tenant_keys(tenant), args=[job_id, tenant])

    def jobs_in_flight(self, tenant: str) -> list[str]:
        """Ids of the tenant's jobs holding an in-flight slot now."""
        return [raw.decode() for raw in self.redis.zrangebyscore(tenant_jobs_key(tenant), time.time(), "+inf")]

    def usage(self, tenant: str) -> TenantUsage:
        """What the tenant's unfinished jobs hold now, how many tenants have some, and what its stored results
        hold (those that expired let go of first)."""
        keys = [tenant_usage_key(tenant), BUSY_TENANTS_KEY, *result_keys(tenant)]
        messages, stored, busy, held, results = (int(x) for x in self._usage(keys=keys))
        return TenantUsage(messages, stored, busy, result_bytes=held, results=results)

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
        return _api_key(key_id, self.redis.hgetall(api_key_key(key_id)))

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


class LoopTenants:
    """The tenant calls the API makes per request (its key, its limits, a new job's charge), on an asyncio loop:
    `TenantRepository`'s, without the hop to a pool thread that cost the API about four times the call's CPU
    (`stoker.adapters.store.jobs.LoopJobs` says how it was measured). Same scripts, same keys."""

    #: Key ids whose tenant is remembered (`tenant_hints`), at most.
    MAX_HINTS = 4096

    def __init__(self, client: aioredis.Redis[bytes]) -> None:
        self.redis = client
        self._admit_tenant = client.register_script(_ADMIT_TENANT)
        self._charge_job = client.register_script(_CHARGE_JOB)
        #: Key ids to the tenant their record named when last read here. A hint, never a verdict: the admission
        #: script checks the record itself (`admit_key`), so a revoked key is refused at its next request.
        self.tenant_hints: dict[str, str] = {}

    async def get_api_key(self, key_id: str) -> ApiKey | None:
        """`TenantRepository.get_api_key`, on the loop; the key's tenant is remembered for `admit_key`."""
        key = _api_key(key_id, await self.redis.hgetall(api_key_key(key_id)))
        if key is not None:
            if len(self.tenant_hints) >= self.MAX_HINTS:
                del self.tenant_hints[next(iter(self.tenant_hints))]  # the oldest hint
            self.tenant_hints[key_id] = key.tenant
        return key

    async def admit_key(self, key_id: str, secret: str, limits: TenantLimits) -> tuple[str, LimitVerdict] | None:
        """A request with a key whose record this process has read: the key checked and the request counted
        against its tenant's rate in one script, nothing counted unless the key opens (`unauthorized` for a
        revoked key or another secret). None where the key's tenant is not known here, or its record is gone or
        changed: read the key (`get_api_key`)."""
        tenant = self.tenant_hints.get(key_id)
        if tenant is None:
            return None
        keys, args = _admit_call(tenant, limits, None, 0)
        outcome, wait = await self._admit_tenant(keys=[*keys, api_key_key(key_id)], args=[*args, hash_secret(secret)])
        if outcome == b"moved":  # no record, or another tenant's: the caller reads it (and refuses what it must)
            self.tenant_hints.pop(key_id, None)
            return None
        return tenant, LimitVerdict.from_script(outcome.decode(), float(wait))

    async def admit_tenant(
        self, tenant: str, limits: TenantLimits, job_id: str | None = None, hold_s: float = 0
    ) -> LimitVerdict:
        """`TenantRepository.admit_tenant`, on the loop."""
        keys, args = _admit_call(tenant, limits, job_id, hold_s)
        outcome, wait = await self._admit_tenant(keys=keys, args=args)
        return LimitVerdict.from_script(outcome.decode(), float(wait))

    async def charge_job(self, tenant: str, job_id: str, messages: int, stored_bytes: int, limits: TenantLimits) -> str:
        """`TenantRepository.charge_job`, on the loop."""
        keys, args = _charge_call(tenant, job_id, messages, stored_bytes, limits)
        outcome: bytes = await self._charge_job(keys=keys, args=args)
        return outcome.decode()


def _admit_call(
    tenant: str, limits: TenantLimits, job_id: str | None, hold_s: float
) -> tuple[list[str], list[str | float | int]]:
    """The admission script's keys and arguments."""
    args: list[str | float | int] = [
        limits.rate_per_s,
        limits.burst,
        limits.max_in_flight,
        job_id or "",
        hold_s,
        tenant,
        limits.share_capacity,
        limits.max_share,
        limits.max_stored_bytes,
        limits.max_result_bytes,
    ]
    return [tenant_rate_key(tenant), *tenant_keys(tenant), *result_keys(tenant)], args


def _charge_call(
    tenant: str, job_id: str, messages: int, stored_bytes: int, limits: TenantLimits
) -> tuple[list[str], list[str | float | int]]:
    """The charge script's keys and arguments."""
    args: list[str | float | int] = [
        tenant,
        job_id,
        messages,
        stored_bytes,
        limits.share_capacity,
        limits.max_share,
        limits.max_stored_bytes,
    ]
    return [tenant_usage_key(tenant), BUSY_TENANTS_KEY], args


def _api_key(key_id: str, raw: dict[bytes, bytes]) -> ApiKey | None:
    """A key's record from its hash's fields; None for no fields."""
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
