"""The job store: every Redis key stoker writes is laid out and read here, and nowhere else."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from stoker.core.media import ContentHash
from stoker.deadlines import Deadline, JobClock
from stoker.jobs import (
    STAMPS,
    BatchInfo,
    ErrorInfo,
    InputRecord,
    Job,
    JobStatus,
    ResultInfo,
    compute_timings,
    preprocess_share,
)
from stoker.predictor import ModelRequest
from stoker.tenancy import DEFAULT_TENANT, ApiKey, LimitVerdict, TenantLimits

PREFIX = "stoker"


def job_key(job_id: str) -> str:
    """Hash holding one job's record, fields written by whichever stage owns them."""
    return f"{PREFIX}:job:{job_id}"


def input_ref(index: int) -> str:
    """Field of a job's hash holding one input's record."""
    return f"input:{index}"


def frame_ref(index: int, frame: int) -> str:
    """Field holding one keyframe of a video input."""
    return f"input:{index}:frame:{frame}"


def deliveries_key(task_id: str) -> str:
    """How many times a task message was delivered to a worker."""
    return f"{PREFIX}:deliveries:{task_id}"


def tokens_key(job_id: str) -> str:
    """The job's tokenized prompt, ready for the model."""
    return f"{PREFIX}:job:{job_id}:tokens"


def done_channel(job_id: str) -> str:
    """Pub/sub channel announcing that a job reached a terminal status."""
    return f"{PREFIX}:job:{job_id}:done"


def blob_key(digest: ContentHash) -> str:
    """Raw input bytes, addressed by content."""
    return f"{PREFIX}:blob:{digest}"


def cache_key(stage: str, version: str, digest: str, fingerprint: str, scope: str, part: str = "value") -> str:
    """A cached stage result: stage : stage version : content BLAKE3 : parameter fingerprint : scope (: part).

    The scope is the tenant whose entry it is (or the one shared scope, when sharing is on).
    """
    return f"{PREFIX}:cache:{stage}:{version}:{digest}:{fingerprint}:{scope}:{part}"


def cache_lease_key(stage: str, version: str, digest: str, fingerprint: str, scope: str) -> str:
    """The single-flight lease of whoever is computing that result now."""
    return f"{PREFIX}:lease:{stage}:{version}:{digest}:{fingerprint}:{scope}"


def api_key_key(key_id: str) -> str:
    """Hash holding one API key: its tenant, the hash of its secret (never the secret), created, revoked."""
    return f"{PREFIX}:apikey:{key_id}"


def tenant_rate_key(tenant: str) -> str:
    """A tenant's request-rate state: the theoretical arrival time of its next request (GCRA)."""
    return f"{PREFIX}:tenant:{tenant}:rate"


def tenant_jobs_key(tenant: str) -> str:
    """A tenant's unfinished jobs, scored by when their slot is given back even if no end is ever written."""
    return f"{PREFIX}:tenant:{tenant}:in-flight"


#: Every job not yet terminal, scored by when the reaper should next look at it.
ACTIVE_KEY = f"{PREFIX}:active"
#: Lease held by the one reaper that acts at a time.
REAPER_LEASE_KEY = f"{PREFIX}:reaper"
CACHE_STATS_KEY = f"{PREFIX}:cache-stats"
#: Per queue: messages drained, ever (workers count, the API turns it into rates).
DRAINED_KEY = f"{PREFIX}:drained"
#: Jobs accepted, and finished per terminal status, ever.
JOB_COUNTS_KEY = f"{PREFIX}:jobs-by-status"
#: Per queue: jobs refused at admission because of it.
REFUSED_KEY = f"{PREFIX}:refused"
#: The inference device's accounting (busy seconds).
DEVICE_KEY = f"{PREFIX}:device"
#: The fingerprint of the workers' whole preprocessing configuration, as they last published it.
PIPELINE_IDENTITY_KEY = f"{PREFIX}:pipeline-identity"
#: Ids of every API key ever created (revoked ones included).
API_KEYS_KEY = f"{PREFIX}:apikeys"
#: A job's in-flight slot is given back this long after its deadline even if no terminal status was written
#: (every job gets one, from a worker, the watchdog or the reaper: this only bounds a leak).
IN_FLIGHT_GRACE_S = 600


# An input record is written only while its job is still preprocessing: once the prompt was built from the
# records, a stage finishing late must not change what the job says it used. `rev` counts the writes.
_PUT_INPUT = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'rev', 1)
return 1
"""

# The one hand-over from preprocessing to inference. 'stale': a record changed since the prompt was built.
_HAND_OFF = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then
  return 'done'
end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'succeeded' or status == 'degraded' or status == 'failed' then return 'done' end
if ARGV[5] == '0' and (redis.call('HGET', KEYS[1], 'rev') or '0') ~= ARGV[1] then return 'stale' end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
redis.call('HSETNX', KEYS[1], 'ts:started', ARGV[3])
redis.call('HSET', KEYS[1], 'ts:preprocessed', ARGV[3], 'status', 'inferring')
redis.call('ZADD', KEYS[3], 'XX', ARGV[3], ARGV[6])  -- the reaper re-plans it now: redrive time, deadline
return 'ok'
"""

# A terminal status is written once: whoever comes second (a late batch, the reaper, the watchdog) changes nothing.
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'succeeded' or status == 'degraded' or status == 'failed' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
redis.call('ZREM', KEYS[6], ARGV[1])  -- the tenant's in-flight slot, given back exactly when the job ends
redis.call('PUBLISH', KEYS[4], ARGV[2])
return 1
"""

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

# Take or renew a lease held under a token.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

HandOff = Literal["ok", "stale", "done"]


class JobStore:
    """Synchronous access to jobs, blobs and artefacts in Redis."""

    def __init__(self, client: redis.Redis[bytes], *, blob_ttl_s: int, job_ttl_s: int) -> None:
        self.redis = client
        self.blob_ttl_s = blob_ttl_s
        self.job_ttl_s = job_ttl_s
        self._put_input = client.register_script(_PUT_INPUT)
        self._hand_off = client.register_script(_HAND_OFF)
        self._finish = client.register_script(_FINISH)
        self._lease = client.register_script(_LEASE)
        self._admit_tenant = client.register_script(_ADMIT_TENANT)

    @classmethod
    def from_url(
        cls, url: str, *, blob_ttl_s: int, job_ttl_s: int, retries: int = 1, tls: Mapping[str, Any] | None = None
    ) -> JobStore:
        """Connect lazily to the store at url; each command rides out a broken connection `retries` times.

        Workers pass many retries (with backoff capped at 1 s) so a Redis restart stalls them instead of failing
        their tasks; the API passes few, so a client learns of an outage in time to retry elsewhere. `tls`: the
        options of a `rediss://` url (`CommonSettings.redis_tls`).
        """
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=2,
            socket_timeout=10,
            health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **(tls or {}),
        )
        return cls(client, blob_ttl_s=blob_ttl_s, job_ttl_s=job_ttl_s)

    # -- blobs and artefacts -------------------------------------------------------------------------------
    def put_blob(self, digest: ContentHash, data: bytes) -> None:
        """Store input bytes once; a repeat only refreshes their lifetime."""
        key = blob_key(digest)
        if not self.redis.set(key, data, ex=self.blob_ttl_s, nx=True):
            self.redis.expire(key, self.blob_ttl_s)

    def get_blob(self, digest: ContentHash) -> bytes | None:
        """Input bytes, or None when they expired."""
        return self._get_bytes(blob_key(digest))

    def _get_bytes(self, key: str) -> bytes | None:
        value = self.redis.get(key)
        return bytes(value) if value is not None else None

    def count_delivery(self, task_id: str) -> int:
        """Count one more delivery of a task message; returns how many there have been."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(deliveries_key(task_id))
            pipe.expire(deliveries_key(task_id), self.job_ttl_s)
            count, _ = pipe.execute()
        return int(count)

    # -- jobs ---------------------------------------------------------------------------------------------
    def create_job(
        self,
        job_id: str,
        prompt: str,
        inputs: Iterable[InputRecord],
        accepted: float,
        deadline: Deadline,
        deadline_ms: int,
        trace: tuple[str, dict[str, str]] | None = None,
        *,
        tenant: str,
    ) -> None:
        """Write a new job record atomically, in status queued, and put it under the reaper's watch.

        The tenant's in-flight slot for it (taken at admission, if its limit is on) is now held until the job ends,
        or at the latest until a grace period after its deadline.
        """
        fields: dict[str | bytes, str | bytes | float | int] = {
            "prompt": prompt,
            "tenant": tenant,
            "status": "queued",
            "ts:accepted": repr(accepted),
            "deadline": repr(deadline.at),
            "preprocess_by": repr(deadline.preprocess_by),
            "deadline_ms": deadline_ms,
        }
        if trace:  # (trace id, context carrier)
            fields["trace_id"] = trace[0]
            fields["trace_context"] = json.dumps(trace[1])
        for record in inputs:
            fields[input_ref(record.index)] = record.model_dump_json()
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(job_key(job_id), mapping=fields)
            pipe.expire(job_key(job_id), self.job_ttl_s)
            pipe.zadd(ACTIVE_KEY, {job_id: deadline.preprocess_by})
            pipe.zadd(tenant_jobs_key(tenant), {job_id: deadline.at + IN_FLIGHT_GRACE_S}, xx=True)
            pipe.hincrby(JOB_COUNTS_KEY, "accepted", 1)
            pipe.execute()

    def delete_job(self, job_id: str) -> None:
        """Forget a job that was never enqueued."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(job_key(job_id), tokens_key(job_id))
            pipe.zrem(ACTIVE_KEY, job_id)
            pipe.execute()

    def mark_started(self, job_id: str) -> None:
        """The first stage to run for a job moves it to preprocessing."""
        if self.redis.hsetnx(job_key(job_id), "ts:started", repr(time.time())):
            self.redis.hset(job_key(job_id), "status", "preprocessing")

    def stamp(self, job_id: str, name: str, at: float | None = None, status: JobStatus | None = None) -> None:
        """Record a timestamp, and optionally a status change, in one round trip."""
        fields: dict[str | bytes, str | bytes | float | int] = {f"ts:{name}": repr(time.time() if at is None else at)}
        if status:
            fields["status"] = status
        self.redis.hset(job_key(job_id), mapping=fields)

    def get_stamp(self, job_id: str, name: str) -> float | None:
        """One timestamp of a job, or None if not reached yet."""
        raw = self.redis.hget(job_key(job_id), f"ts:{name}")
        return float(raw) if raw else None

    def get_input(self, job_id: str, ref: str) -> InputRecord | None:
        """One input's (or keyframe's) record, by its field name."""
        raw = self.redis.hget(job_key(job_id), ref)
        return InputRecord.model_validate_json(raw) if raw else None

    def put_input(self, job_id: str, ref: str, record: InputRecord) -> bool:
        """Replace one record, unless the job already went to inference (or is gone); True if written.

        Each record has a single writer at a time (its own chain; the reaper only after a cut-off).
        """
        return bool(self._put_input(keys=[job_key(job_id)], args=[ref, record.model_dump_json()]))

    def load_for_handoff(self, job_id: str) -> tuple[Job | None, int]:
        """The job, and the revision of its input records to hand over against."""
        raw = self.redis.hgetall(job_key(job_id))
        if not raw:
            return None, 0
        return job_from_fields(job_id, raw), int(raw.get(b"rev", b"0"))

    def hand_off(self, job_id: str, request: ModelRequest, rev: int | None) -> HandOff:
        """Store the model request and move the job to inferring, once; rev None hands over whatever changed.

        'stale' when an input record changed after `rev` (build the prompt again); 'done' when someone already
        handed the job over or it ended.
        """
        args = [rev or 0, request.to_json(), repr(time.time()), self.job_ttl_s, "1" if rev is None else "0", job_id]
        result = self._hand_off(keys=[job_key(job_id), tokens_key(job_id), ACTIVE_KEY], args=args)
        outcome = result.decode() if isinstance(result, bytes) else str(result)
        assert outcome in ("ok", "stale", "done"), outcome
        return outcome  # type: ignore[return-value]

    def get_request(self, job_id: str) -> ModelRequest | None:
        """The job's model request, or None once it ended (or was never handed over)."""
        raw = self.redis.get(tokens_key(job_id))
        return ModelRequest.from_json(raw) if raw else None

    def count_drained(self, queue: str, n: int = 1) -> None:
        """n more messages taken off a queue and done with: the drain rate is measured from this counter."""
        self.redis.hincrby(DRAINED_KEY, queue, n)

    def drained(self) -> dict[str, int]:
        """How many messages each queue has drained, ever."""
        return {k.decode(): int(v) for k, v in self.redis.hgetall(DRAINED_KEY).items()}

    def trace_context(self, job_id: str) -> dict[str, str] | None:
        """The job's stored trace context (a W3C traceparent carrier), for spans that run outside its messages."""
        raw = self.redis.hget(job_key(job_id), "trace_context")
        return dict(json.loads(raw)) if raw else None

    def job_counts(self) -> dict[str, int]:
        """Jobs accepted, and finished per terminal status, ever."""
        return {k.decode(): int(v) for k, v in self.redis.hgetall(JOB_COUNTS_KEY).items()}

    def count_refusal(self, queue: str) -> None:
        """One more job refused (429) because of this queue."""
        self.redis.hincrby(REFUSED_KEY, queue, 1)

    def counters(self) -> dict[str, dict[str, float]]:
        """Operator counters: messages drained and jobs refused per queue, device seconds busy."""
        refused = {k.decode(): float(v) for k, v in self.redis.hgetall(REFUSED_KEY).items()}
        device = {k.decode(): float(v) for k, v in self.redis.hgetall(DEVICE_KEY).items()}
        drained = {k: float(v) for k, v in self.drained().items()}
        return {"drained": drained, "refused": refused, "device": device}

    def add_device_time(self, busy_s: float) -> None:
        """Seconds the inference device spent on batches."""
        self.redis.hincrbyfloat(DEVICE_KEY, "busy_s", busy_s)

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: ResultInfo | None = None,
        error: ErrorInfo | None = None,
        batch: BatchInfo | None = None,
    ) -> bool:
        """Write a terminal status with its result or error and announce it; False if the job had already ended."""
        fields: dict[str, str] = {"status": status, "ts:done": repr(time.time())}
        if result:
            fields["result"] = result.model_dump_json()
        if error:
            fields["error"] = error.model_dump_json()
        if batch:
            fields["batch"] = batch.model_dump_json()
        tenant = self.tenant(job_id) or DEFAULT_TENANT  # never changes once written: safe to read first
        keys = [job_key(job_id), tokens_key(job_id), ACTIVE_KEY, done_channel(job_id), JOB_COUNTS_KEY]
        keys.append(tenant_jobs_key(tenant))
        args = [job_id, status, *(x for pair in fields.items() for x in pair)]
        return bool(self._finish(keys=keys, args=args))

    # -- the reaper's view -----------------------------------------------------------------------------------
    def clock(self, job_id: str) -> JobClock:
        """Where a job stands against its deadlines."""
        names = ("status", "deadline", "preprocess_by", "ts:preprocessed", "ts:infer_start", "redrives")
        raw = dict(zip(names, self.redis.hmget(job_key(job_id), names), strict=True))

        def number(name: str) -> float | None:
            value = raw[name]
            return float(value) if value is not None else None

        return JobClock(
            status=raw["status"].decode() if raw["status"] is not None else None,
            deadline=number("deadline") or 0.0,
            preprocess_by=number("preprocess_by") or 0.0,
            preprocessed=number("ts:preprocessed"),
            infer_start=number("ts:infer_start"),
            redrives=int(number("redrives") or 0),
        )

    def preprocessing_open(self, job_id: str, now: float | None = None) -> bool:
        """Whether a stage may still work for this job: not handed to inference, preprocessing budget left."""
        budget, handed = self.redis.hmget(job_key(job_id), ["preprocess_by", "ts:preprocessed"])
        if handed is not None:
            return False
        return budget is None or (time.time() if now is None else now) < float(budget)

    def due_jobs(self, now: float, limit: int = 200) -> list[str]:
        """Jobs the reaper should look at now."""
        return [raw.decode() for raw in self.redis.zrangebyscore(ACTIVE_KEY, "-inf", now, start=0, num=limit)]

    def watch_next(self, job_id: str, at: float | None) -> None:
        """When the reaper looks at a job again; None forgets it. A job that ended meanwhile stays forgotten."""
        if at is None:
            self.redis.zrem(ACTIVE_KEY, job_id)
        else:
            self.redis.zadd(ACTIVE_KEY, {job_id: at}, xx=True)

    def count_redrive(self, job_id: str) -> None:
        """One more re-send of a job to the inference queue."""
        self.redis.hincrby(job_key(job_id), "redrives", 1)

    def take_lease(self, key: str, token: str, ttl_s: float) -> bool:
        """Take or renew an exclusive lease; False while someone else holds it."""
        return bool(self._lease(keys=[key], args=[token, int(ttl_s * 1000)]))

    def load_job(self, job_id: str) -> Job | None:
        """The job as clients see it, assembled from its record; None if unknown."""
        raw = self.redis.hgetall(job_key(job_id))
        return job_from_fields(job_id, raw) if raw else None

    # -- tenants -------------------------------------------------------------------------------------------
    def tenant(self, job_id: str) -> str | None:
        """The tenant a job belongs to; None if the job is unknown."""
        raw = self.redis.hget(job_key(job_id), "tenant")
        return raw.decode() if raw is not None else None

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


def job_from_fields(job_id: str, raw: dict[bytes, bytes]) -> Job:
    """Assemble a Job from the fields of its Redis hash."""
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    inputs = _nest_inputs({k: InputRecord.model_validate_json(v) for k, v in fields.items() if k.startswith("input:")})
    stamps = {name: float(fields[f"ts:{name}"]) for name in STAMPS if f"ts:{name}" in fields}
    timings = compute_timings(stamps)
    return Job(
        id=job_id,
        status=fields.get("status", "queued"),
        prompt=fields.get("prompt", ""),
        inputs=inputs,
        result=ResultInfo.model_validate_json(fields["result"]) if "result" in fields else None,
        error=ErrorInfo.model_validate_json(fields["error"]) if "error" in fields else None,
        batch=BatchInfo.model_validate_json(fields["batch"]) if "batch" in fields else None,
        timings_ms=timings,
        deadline_ms=int(fields["deadline_ms"]) if "deadline_ms" in fields else None,
        preprocess_share=preprocess_share(timings),
        trace_id=fields.get("trace_id"),
        tenant=fields.get("tenant", DEFAULT_TENANT),
    )


def _nest_inputs(records: dict[str, InputRecord]) -> list[InputRecord]:
    """Top-level inputs in order, each video carrying its filled keyframes."""
    top = {ref: r for ref, r in records.items() if ref.count(":") == 1}
    for ref, frame in sorted(records.items(), key=lambda item: item[1].index):
        parent = ref.rsplit(":frame:", 1)[0]
        if ref.count(":") == 3 and parent in top and frame.status != "skipped":
            top[parent].frames = [*(top[parent].frames or []), frame]
    return sorted(top.values(), key=lambda r: r.index)
