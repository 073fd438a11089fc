"""Job records: created by the API, filled in by each stage, handed to inference once, ended once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, Literal

import redis
import redis.asyncio as aioredis
from redis.client import Pipeline, PubSub
from redis.exceptions import NoScriptError

from stoker.adapters.store.blobs import RELEASE_BLOBS
from stoker.adapters.store.keys import (
    ACTIVE_KEY,
    CALLBACKS_DUE_KEY,
    CANCELLED_CHANNEL,
    IN_FLIGHT_GRACE_S,
    JOB_COUNTS_KEY,
    PROGRESS_FIELD,
    band_ref,
    bands_in_ref,
    done_channel,
    handed_off_channel,
    input_ref,
    job_blobs_key,
    job_key,
    tenant_index_key,
    tenant_jobs_key,
    tokens_key,
)
from stoker.adapters.store.tenants import DROP_JOB, RESULTS, result_keys, tenant_keys
from stoker.core.deadlines import Deadline
from stoker.core.errors import RecordTooLarge, ResultTooLarge
from stoker.core.jobs import (
    MAX_RECORD_BYTES,
    STAMPS,
    TERMINAL,
    BatchInfo,
    CallbackState,
    Conversation,
    Cursor,
    ErrorInfo,
    InputRecord,
    Job,
    JobClass,
    JobStatus,
    ResultInfo,
    compute_timings,
    preprocess_share,
)
from stoker.core.model import EncoderUse, ModelRequest
from stoker.core.tenancy import DEFAULT_TENANT

#: Lua: the terminal statuses (written once, never changed), from the core's one list.
TERMINAL_LUA = "local TERMINAL = {" + ", ".join(f"{status} = true" for status in sorted(TERMINAL)) + "}\n"

# An input record is written only while its job is still preprocessing: once the prompt was built from the
# records, a stage finishing late must not change what the job says it used. `rev` counts the writes, and the
# progress stamp says when the last one was (the reaper re-sends a preprocessing job that stopped moving).
# Nor once the job ended (cancelled while a stage ran): no half-written record.
_PUT_INPUT = (
    TERMINAL_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then return 0 end
if TERMINAL[redis.call('HGET', KEYS[1], 'status')] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'rev', 1)
return 1
"""
)

# Lua: a job's writes as it goes to inference: its request stored, its stamps and status, a new look by the
# reaper (`_HAND_OFF` after its checks; `_CREATE` for a new job that skips preprocessing).
_HAND_OVER = """
local function hand_over(job, tokens, active, id, request, now, ttl, channel)
  redis.call('SET', tokens, request, 'EX', ttl)
  redis.call('HSETNX', job, 'ts:started', now)
  redis.call('HSET', job, 'ts:preprocessed', now, 'status', 'inferring')
  redis.call('ZADD', active, 'XX', now, id)  -- the reaper re-plans it now: redrive time, deadline
  redis.call('PUBLISH', channel, '')  -- a chat waiting for its inputs to settle starts its answer now
end
"""

# The one hand-over from preprocessing to inference. 'stale': a record changed since the prompt was built.
_HAND_OFF = (
    TERMINAL_LUA
    + _HAND_OVER
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then
  return 'done'
end
if TERMINAL[redis.call('HGET', KEYS[1], 'status')] then return 'done' end
if ARGV[5] == '0' and (redis.call('HGET', KEYS[1], 'rev') or '0') ~= ARGV[1] then return 'stale' end
hand_over(KEYS[1], KEYS[2], KEYS[3], ARGV[6], ARGV[2], ARGV[3], ARGV[4], ARGV[7])
return 'ok'
"""
)

# A terminal status is written once: whoever comes second (a late batch, the reaper, the watchdog) changes nothing.
# What the job held of its tenant's limits (in-flight slot, queue messages, stored bytes) is given back with it,
# and the result it keeps (ARGV[4] bytes; 0: none, or no tenant to charge) is charged to the tenant for as long as
# the record lives (`RESULTS`).
_FINISH = (
    DROP_JOB
    + RESULTS
    + RELEASE_BLOBS
    + TERMINAL_LUA
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or TERMINAL[status] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
drop(KEYS[6], KEYS[7], KEYS[8], ARGV[1], ARGV[3])
if tonumber(ARGV[4]) > 0 then hold_result(KEYS[11], KEYS[12], KEYS[1], ARGV[1], tonumber(ARGV[4])) end
release_blobs(KEYS[10], ARGV[1])
if redis.call('HEXISTS', KEYS[1], 'callback') == 1 then  -- its client asked to be told: due now
  local clock = redis.call('TIME')
  redis.call('ZADD', KEYS[9], tonumber(clock[1]) + tonumber(clock[2]) / 1000000, ARGV[1])
end
-- announced only where a client waits on it (`watched`): an API process wakes for no job nobody waits on; the
-- announcement is the ended record (its fields and values in turn, `ended_job`), so a waiter answers without a read
if redis.call('HEXISTS', KEYS[1], 'watched') == 1 then
  redis.call('PUBLISH', KEYS[4], cjson.encode(redis.call('HGETALL', KEYS[1])))
end
"""
    # a cancelled job is announced to the inference consumers too, which drop it if they hold it
    + f"if ARGV[2] == 'cancelled' then redis.call('PUBLISH', '{CANCELLED_CHANNEL}', ARGV[1]) end\n"
    + "return 1\n"
)

# A job deleted gives back its result's charge (`RESULTS`).
_DROP_RESULT = RESULTS + "drop_result(KEYS[1], KEYS[2], ARGV[1])\n"

# One band of a page OCR'd in bands (`stoker.runtime.bands`): kept beside the page's record while the job is still
# preprocessing; the answer is how many of the page's bands are in, so the one that brings in the last joins them.
# A band that comes in is progress too, stamped like an input record.
_PUT_BAND = (
    TERMINAL_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'ts:preprocessed') == 1 then return -1 end
if TERMINAL[redis.call('HGET', KEYS[1], 'status')] then return -1 end
redis.call('HSET', KEYS[1], ARGV[4], ARGV[5])
if redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  return redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
end
return tonumber(redis.call('HGET', KEYS[1], ARGV[3]) or '0')
"""
)

# Only a queued job starts: a cancel (or any ending) that came first holds, and its stages see it ended.
_START = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'preprocessing', 'ts:started', ARGV[1])
return 1
"""

# A client is about to wait on the job: its end is announced from now on (`_FINISH`); the job as it stands, read in
# the same step, so an end after this read is never missed and one before it is in what it returns. A job that is
# unknown (never made by watching it) or already ended (its record no longer changes) is only read.
_WATCH = (
    TERMINAL_LUA
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if status and not TERMINAL[status] then redis.call('HSET', KEYS[1], 'watched', '1') end
return redis.call('HGETALL', KEYS[1])
"""
)

# A new job, in one step: its record, its place on the reaper's watch list and in its tenant's indexes, its count;
# with a model request (a job that skips preprocessing), its hand-off to inference (`hand_over`, as `_HAND_OFF`
# hands over once its checks pass: a record just made has nothing to check); the record as written. One command
# where each of these was one of the transaction's: a redis-py transaction reads and parses every command's answer
# on its own, and on a loaded API that cost three times the commands themselves.
# KEYS: the record, the watch list, the tenant's jobs and listing, the counts[, the request].
# ARGV: ttl, first look, in-flight until, accepted, the listing's oldest kept, id, 2 × fields, fields…
#       [, the request, now, the hand-off's channel].
_CREATE = (
    _HAND_OVER
    + """
local job, ttl, id, n = KEYS[1], ARGV[1], ARGV[6], tonumber(ARGV[7])
redis.call('HSET', job, unpack(ARGV, 8, 7 + n))
redis.call('EXPIRE', job, ttl)
redis.call('ZADD', KEYS[2], ARGV[2], id)
redis.call('ZADD', KEYS[3], 'XX', ARGV[3], id)
redis.call('ZADD', KEYS[4], ARGV[4], id)  -- the listing: entries older than the records go, the index with its last
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[5])
redis.call('EXPIRE', KEYS[4], ttl)
redis.call('HINCRBY', KEYS[5], 'accepted', 1)
if KEYS[6] then hand_over(job, KEYS[6], KEYS[2], id, ARGV[8 + n], ARGV[9 + n], ttl, ARGV[10 + n]) end
return redis.call('HGETALL', job)
"""
)
#: The new-job script's SHA-1, as redis-py's `Script` names it (a new job's transaction calls it by it).
_CREATE_SHA = hashlib.sha1(_CREATE.encode()).hexdigest()  # the name Redis gives a script

HandOff = Literal["ok", "stale", "done"]
#: Another repository's commands, queued onto a transaction of this one's (so that both go in one round trip).
Queued = Callable[["Pipeline[bytes]"], Any]


@dataclass(frozen=True)
class Required:
    """Another repository's write that a new job is not made without (its uploads' bytes), queued into the job's
    transaction: an error of its is the job's. Its commands are one bare `EVALSHA`; a store that forgot its scripts
    answers NOSCRIPT, and `alone` then writes it on its own (which loads the script)."""

    queue: Queued
    alone: Callable[[], Any]


@dataclass(frozen=True)
class Pending:
    """A job waiting for the model, as the inference consumer loads it: its request and its record."""

    job: Job
    request: ModelRequest
    #: When preprocessing handed it over (its wait for a batch starts there), and its deadline, if any.
    preprocessed: float | None
    deadline: float | None
    trace: dict[str, str] | None
    #: Its timestamps so far (name → time), so its timings can be told once it ends without reading it back.
    stamps: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Ending:
    """A terminal status to write for one job, with what goes with it."""

    job_id: str
    tenant: str
    status: JobStatus
    result: ResultInfo | None = None
    error: ErrorInfo | None = None
    batch: BatchInfo | None = None
    #: More timestamps to write with it (name → time), e.g. when its batch started and ended.
    stamps: dict[str, float] = field(default_factory=dict)
    #: Per picture the model read (content hash): whether its vision embeddings hit the cache.
    encoder: dict[str, EncoderUse] = field(default_factory=dict)


@dataclass(frozen=True)
class NewJob:
    """What a new job's record is written from (`JobRepository.create`)."""

    prompt: str
    inputs: Sequence[InputRecord]
    accepted: float
    deadline: Deadline
    deadline_ms: int
    _: KW_ONLY
    tenant: str
    #: (trace id, context carrier) of its root span, when traced.
    trace: tuple[str, dict[str, str]] | None = None
    chat: Conversation | None = None
    callback_url: str | None = None
    job_class: JobClass = "interactive"
    batch_id: str | None = None
    look_at: float | None = None
    request: ModelRequest | None = None
    required: Sequence[Required] = ()
    also: Sequence[Queued] = ()
    watched: bool = False

    def fields(self) -> dict[str | bytes, str | bytes | float | int]:
        """The record's fields, as written."""
        fields: dict[str | bytes, str | bytes | float | int] = {
            "prompt": self.prompt,
            "tenant": self.tenant,
            "status": "queued",
            "ts:accepted": repr(self.accepted),
            "deadline": repr(self.deadline.at),
            "preprocess_by": repr(self.deadline.preprocess_by),
            "deadline_ms": self.deadline_ms,
        }
        if self.watched:
            fields["watched"] = 1
        if self.chat is not None:
            fields["chat"] = self.chat.model_dump_json()
        if self.batch_id is not None:
            fields["class"], fields["batch_id"] = self.job_class, self.batch_id
        if self.callback_url is not None:  # delivered once the job ends (the finish script queues it)
            fields["callback"] = CallbackState(url=self.callback_url).model_dump_json()
        if self.trace:
            fields["trace_id"] = self.trace[0]
            fields["trace_context"] = json.dumps(self.trace[1])
        for record in self.inputs:
            fields[input_ref(record.index)] = record.model_dump_json()
        return fields


#: A script's keys and arguments.
ScriptCall = tuple[list[str], list[Any]]


def _queue_new_job(
    pipe: Pipeline[bytes] | aioredis.client.Pipeline[bytes],
    job_id: str,
    new: NewJob,
    ttl_s: int,
    max_record_bytes: int,
) -> ScriptCall:
    """Queue a new job's transaction into `pipe` (sync or asyncio: commands only queue): the new-job script (its
    record, its places in the watch list and its tenant's indexes, its hand-off with a request, the record read
    back), then `required`, then `also` (a record over `max_record_bytes` is refused first, nothing queued). The
    script's call, to make it again on its own."""
    fields = new.fields()
    check_record_size(fields, max_record_bytes)
    deadline, accepted, tenant = new.deadline, new.accepted, new.tenant
    keys = [job_key(job_id), ACTIVE_KEY, tenant_jobs_key(tenant), tenant_index_key(tenant), JOB_COUNTS_KEY]
    first_look = min(deadline.preprocess_by, new.look_at or deadline.preprocess_by)
    args: list[Any] = [ttl_s, repr(first_look), repr(deadline.at + IN_FLIGHT_GRACE_S), repr(accepted)]
    args += [repr(accepted - ttl_s), job_id, 2 * len(fields), *(x for pair in fields.items() for x in pair)]
    if new.request is not None:
        keys.append(tokens_key(job_id))
        args += [new.request.to_json(), repr(time.time()), handed_off_channel(job_id)]
    pipe.evalsha(_CREATE_SHA, len(keys), *keys, *args)
    for need in new.required:
        need.queue(pipe)  # type: ignore[arg-type]  # a queued write only queues, on either kind of pipeline
    for queue in new.also:
        queue(pipe)  # type: ignore[arg-type]
    return keys, args


def _created(job_id: str, results: list[Any], new: NewJob) -> tuple[Job | None, list[Required]]:
    """The new job from its transaction's answers (`_queue_new_job`), and the required writes to make again on
    their own (the store answered NOSCRIPT: it forgot its scripts). The job is None when the new-job script was
    answered NOSCRIPT: the caller makes it on its own (which loads the script). Errors are raised; `also`'s are
    theirs."""
    made = results[0]
    alone = _settle(results[1 : 1 + len(new.required)], new.required)
    if isinstance(made, NoScriptError):
        return None, alone
    if isinstance(made, Exception):
        raise made
    return job_from_fields(job_id, _pairs(made)), alone


class JobRepository:
    """One hash per job (`keys.job_key`), its model request, and its place on the reaper's watch list."""

    def __init__(
        self,
        client: redis.Redis[bytes],
        *,
        ttl_s: int,
        max_record_bytes: int = MAX_RECORD_BYTES,
        max_result_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_record_bytes = max_record_bytes
        #: The most a stored result may hold: one over it is not written, and its job fails `result_too_large`.
        self.max_result_bytes = max_result_bytes
        self._put_input = client.register_script(_PUT_INPUT)
        self._create = client.register_script(_CREATE)
        self._hand_off = client.register_script(_HAND_OFF)
        self._finish = client.register_script(_FINISH)
        self._watch = client.register_script(_WATCH)
        self._start = client.register_script(_START)
        self._put_band = client.register_script(_PUT_BAND)
        self._drop_result = client.register_script(_DROP_RESULT)

    def create(self, job_id: str, new: NewJob) -> Job:
        """Write a new job record atomically, in status queued, and put it under the reaper's watch (its first look
        at `look_at`, at the latest when the preprocessing budget is spent); the job as written, read back in the
        same transaction.

        A job that skips preprocessing comes with its model `request`: it is handed over to inference in the same
        transaction. `required` (its uploads' bytes) and `also` queue other repositories' writes into it: an error
        of a required one is raised, one of `also`'s is theirs (the job is made). One round trip in all: on a
        loaded API each round trip costs more CPU than any command in it. `watched`: its client waits on it from
        the start (a POST that waits), so its end is announced (`watch_job` marks one a client waits on later).

        The tenant's in-flight slot for it (taken at admission, if its limit is on) is now held until the job ends,
        or at the latest until a grace period after its deadline. `LoopJobs.create` is its asyncio twin.
        """
        with self.redis.pipeline(transaction=True) as pipe:
            keys, args = _queue_new_job(pipe, job_id, new, self.ttl_s, self.max_record_bytes)
            results = pipe.execute(raise_on_error=False)
        created, alone = _created(job_id, results, new)
        for need in alone:
            need.alone()
        if created is None:  # the store forgot its scripts: this loads it
            created = job_from_fields(job_id, _pairs(self._create(keys=keys, args=args)))
        return created

    def delete_job(self, job_id: str) -> None:
        """Forget a job that was never enqueued (its blobs: `BlobRepository.release`), and any result of its that
        its tenant was charged for."""
        tenant = self.tenant(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(job_key(job_id), tokens_key(job_id))
            pipe.zrem(ACTIVE_KEY, job_id)
            if tenant is not None:
                self._drop_result(keys=result_keys(tenant), args=[job_id], client=pipe)
            pipe.execute()

    def mark_started(self, job_id: str) -> bool:
        """The first stage to run for a job moves it from queued to preprocessing; True if this call did. A job
        that ended first (cancelled while its messages waited) stays as it ended."""
        return bool(self._start(keys=[job_key(job_id)], args=[repr(time.time())]))

    def get_input(self, job_id: str, ref: str) -> InputRecord | None:
        """One input's (or keyframe's) record, by its field name."""
        raw = self.redis.hget(job_key(job_id), ref)
        return InputRecord.model_validate_json(raw) if raw else None

    def put_input(self, job_id: str, ref: str, record: InputRecord) -> bool:
        """Replace one record, unless the job already went to inference (or is gone); True if written. The job's
        progress stamp (`PROGRESS_FIELD`) is written with it.

        Each record has a single writer at a time (its own chain; the reaper only after a cut-off).
        """
        args = [ref, record.model_dump_json(), PROGRESS_FIELD, repr(time.time())]
        return bool(self._put_input(keys=[job_key(job_id)], args=args))

    def put_band(self, job_id: str, ref: str, band: int, record: InputRecord) -> int:
        """Keep one band's outcome of a page OCR'd in bands; how many of its bands are in now (a band redelivered
        counts once), or -1 when the job went on without it (handed over, ended or gone)."""
        args = [band_ref(ref, band), record.model_dump_json(), bands_in_ref(ref), PROGRESS_FIELD, repr(time.time())]
        return int(self._put_band(keys=[job_key(job_id)], args=args))

    def bands(self, job_id: str, ref: str, count: int) -> list[InputRecord | None]:
        """The outcomes of a page's bands, in order (None: not in)."""
        raw = self.redis.hmget(job_key(job_id), [band_ref(ref, band) for band in range(count)])
        return [InputRecord.model_validate_json(r) if r else None for r in raw]

    def clear_bands(self, job_id: str, ref: str, count: int) -> None:
        """Forget a page's band outcomes once its record holds their joined text."""
        self.redis.hdel(job_key(job_id), *(band_ref(ref, band) for band in range(count)), bands_in_ref(ref))

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
        keys, args = _hand_off_call(job_id, request, rev, self.ttl_s)
        result = self._hand_off(keys=keys, args=args)
        outcome = result.decode() if isinstance(result, bytes) else str(result)
        assert outcome in ("ok", "stale", "done"), outcome
        return outcome  # type: ignore[return-value]

    def get_request(self, job_id: str) -> ModelRequest | None:
        """The job's model request, or None once it ended (or was never handed over)."""
        raw = self.redis.get(tokens_key(job_id))
        return ModelRequest.from_json(raw) if raw else None

    def trace_context(self, job_id: str) -> dict[str, str] | None:
        """The job's stored trace context (a W3C traceparent carrier), for spans that run outside its messages."""
        raw = self.redis.hget(job_key(job_id), "trace_context")
        return dict(json.loads(raw)) if raw else None

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: ResultInfo | None = None,
        error: ErrorInfo | None = None,
        batch: BatchInfo | None = None,
    ) -> bool:
        """Write a terminal status with its result or error and announce it; False if the job had already ended.
        A result over `max_result_bytes` is not written: the job fails `result_too_large` instead."""
        tenant = self.tenant(job_id) or DEFAULT_TENANT  # never changes once written: safe to read first
        ending = Ending(job_id, tenant, status, result=result, error=error, batch=batch)
        return bool(self._finish(*_finish_call(ending, time.time(), self.max_result_bytes)))

    def finish_many(self, endings: Sequence[Ending], also: Sequence[Queued] = ()) -> list[bool]:
        """End many jobs in one pipelined round trip (the inference consumer's writer), with `also` queued after
        them (the batch's counters, the consumer letting go of its jobs); True where written. As `finish`, a result
        over `max_result_bytes` ends its job `result_too_large`."""
        now = time.time()
        calls = [_finish_call(ending, now, self.max_result_bytes) for ending in endings]
        # EVALSHA straight into the pipeline: a script run through a pipeline (`client=pipe`) has redis-py send a
        # SCRIPT EXISTS round trip before every batch. The store only forgets the script when it restarts empty
        # or is flushed; those jobs are then ended by the script itself, which loads it on NOSCRIPT.
        with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(self._finish.sha, len(keys), *keys, *args)  # type: ignore[attr-defined]  # not in the stubs
            for queue in also:
                queue(pipe)
            results = pipe.execute(raise_on_error=False)
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError) and i < len(calls):
                keys, args = calls[i]
                results[i] = self._finish(keys=keys, args=args)
            elif isinstance(result, Exception):
                raise result
        return [bool(x) for x in results[: len(calls)]]

    @contextlib.contextmanager
    def cancellations(self) -> Iterator[PubSub]:
        """A subscription to every job cancelled from now on (each message's data is its id)."""
        feed = self.redis.pubsub()
        try:
            feed.subscribe(CANCELLED_CHANNEL)
            yield feed
        finally:
            feed.close()

    def stamp_many(self, job_ids: Sequence[str], name: str, at: float, also: Sequence[Queued] = ()) -> None:
        """The same timestamp on many jobs, with `also`, in one pipelined round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hset(job_key(job_id), f"ts:{name}", repr(at))
            for queue in also:
                queue(pipe)
            pipe.execute()

    def load_pending(self, job_ids: Sequence[str], also: Sequence[Queued] = ()) -> dict[str, Pending | None]:
        """Many jobs' model requests with their records, in one pipelined round trip (`also` queued before the
        reads): what a batch needs, so the consumer reads nothing more per job. None for a job with no request left
        (ended, or never handed over)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for queue in also:
                queue(pipe)
            first = len(pipe)
            for job_id in job_ids:
                pipe.get(tokens_key(job_id))
                pipe.hgetall(job_key(job_id))
            raw = pipe.execute()[first:]
        return {job_id: _pending(job_id, raw[2 * i], raw[2 * i + 1]) for i, job_id in enumerate(job_ids)}

    def load_job(self, job_id: str) -> Job | None:
        """The job as clients see it, assembled from its record; None if unknown."""
        raw = self.redis.hgetall(job_key(job_id))
        return job_from_fields(job_id, raw) if raw else None

    def watch_job(self, job_id: str) -> Job | None:
        """`load_job` for a client that is about to wait on the job: its end is announced from this read on (one
        nobody waits on is not announced). One round trip, as `load_job`."""
        raw = self._watch(keys=[job_key(job_id)])
        return job_from_fields(job_id, _pairs(raw)) if raw else None

    def page(self, tenant: str, cursor: Cursor | None, count: int) -> list[Cursor]:
        """Up to `count` of a tenant's jobs, newest first, after `cursor` (None: from the newest): each as the
        cursor that points at it (when it was accepted, its id). Redis orders equal times by id, reversed here."""
        top = "+inf" if cursor is None else repr(cursor.accepted)
        # Entries at the cursor's own time may come before it: ask for enough to step over them.
        raw = self.redis.zrevrangebyscore(
            tenant_index_key(tenant), top, "-inf", start=0, num=count + 64, withscores=True
        )
        entries = [Cursor(float(score), member.decode()) for member, score in raw]
        return [e for e in entries if cursor is None or e.after(cursor)][:count]

    def load_many(self, job_ids: Sequence[str]) -> list[Job | None]:
        """Many jobs as clients see them, in one round trip; None for one whose record is gone."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(job_key(job_id))
            found = pipe.execute()
        return [job_from_fields(job_id, raw) if raw else None for job_id, raw in zip(job_ids, found, strict=True)]

    def tenant(self, job_id: str) -> str | None:
        """The tenant a job belongs to; None if the job is unknown."""
        raw = self.redis.hget(job_key(job_id), "tenant")
        return raw.decode() if raw is not None else None

    def conversation(self, job_id: str) -> Conversation | None:
        """A chat job's turns and parameters (a render's among them); None for another job or an unknown one."""
        raw = self.redis.hget(job_key(job_id), "chat")
        return Conversation.model_validate_json(raw) if raw is not None else None


class LoopJobs:
    """A job's record made and read on an asyncio loop: what the API does per request (a new job, a long-poll's
    first look, a `GET`, a waiter woken by something other than the job's end).

    The API's routes run on one event loop; a call of the synchronous client has to leave it for a pool thread
    and come back. That hop cost the API about four times the CPU of the call itself, measured on its own
    (8 concurrent requests, one `HGETALL` each: 180-240 µs of CPU from anyio's pool, 45 µs from the loop;
    docs/bench/log/2026-12-05-cost-store-calls-on-the-loop.md), so
    the calls every request makes go over an asyncio client of the loop's own. Same records, same scripts:
    `JobRepository.create`, `load_job` and `watch_job` are their synchronous twins."""

    def __init__(self, client: aioredis.Redis[bytes], *, ttl_s: int, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_record_bytes = max_record_bytes
        self._watch = client.register_script(_WATCH)
        self._create = client.register_script(_CREATE)

    async def create(self, job_id: str, new: NewJob) -> Job:
        """`JobRepository.create`, on the loop: the new job, as written."""
        async with self.redis.pipeline(transaction=True) as pipe:
            keys, args = _queue_new_job(pipe, job_id, new, self.ttl_s, self.max_record_bytes)
            results = await pipe.execute(raise_on_error=False)
        created, alone = _created(job_id, results, new)
        for need in alone:  # the store forgot its scripts (after a restart): rare, and the writes are synchronous
            await asyncio.to_thread(need.alone)
        if created is None:
            created = job_from_fields(job_id, _pairs(await self._create(keys=keys, args=args)))
        return created

    async def load_job(self, job_id: str) -> Job | None:
        """`JobRepository.load_job`, on the loop."""
        raw = await self.redis.hgetall(job_key(job_id))
        return job_from_fields(job_id, raw) if raw else None

    async def watch_job(self, job_id: str) -> Job | None:
        """`JobRepository.watch_job`, on the loop: the job, whose end is announced from this read on."""
        raw = await self._watch(keys=[job_key(job_id)])
        return job_from_fields(job_id, _pairs(raw)) if raw else None

    async def aclose(self) -> None:
        """Close the client's connections (its pool too: one given to a client is not closed with it)."""
        await self.redis.aclose(close_connection_pool=True)  # type: ignore[attr-defined]  # the stubs lag


def check_record_size(fields: Mapping[str | bytes, str | bytes | float | int], limit: int) -> None:
    """Refuse a record (or the part of one known so far) whose fields pass `limit` bytes (413 `record_too_large`)."""
    size = sum(
        len(str(name)) + len(value if isinstance(value, bytes) else str(value).encode())
        for name, value in fields.items()
    )
    if size > limit:
        raise RecordTooLarge(f"the job's record would hold {size} bytes (limit {limit})")


def _settle(results: list[Any], required: Sequence[Required]) -> list[Required]:
    """The answers to a new job's writes, `required`'s last: an error is raised; the required writes the store
    answered NOSCRIPT (it forgot its scripts), to be written again alone."""
    made = len(results) - len(required)
    for result in results[:made]:
        if isinstance(result, Exception):
            raise result
    alone = []
    for need, result in zip(required, results[made:], strict=True):
        if isinstance(result, NoScriptError):
            alone.append(need)
        elif isinstance(result, Exception):
            raise result
    return alone


def _hand_off_call(job_id: str, request: ModelRequest, rev: int | None, ttl_s: int) -> tuple[list[str], list[Any]]:
    """The hand-off script's keys and arguments (`JobRepository.hand_off`)."""
    args = [rev or 0, request.to_json(), repr(time.time()), ttl_s, "1" if rev is None else "0", job_id]
    args.append(handed_off_channel(job_id))
    return [job_key(job_id), tokens_key(job_id), ACTIVE_KEY], args


def _finish_call(ending: Ending, now: float, max_result_bytes: int) -> tuple[list[str], list[str | int]]:
    """Keys and arguments of the finish-once script for one ending (a result over `max_result_bytes` ends its job
    failed instead, `_bounded`)."""
    ending, result, size = _bounded(ending, max_result_bytes)
    fields = {"status": ending.status, "ts:done": repr(now)}
    fields.update({f"ts:{name}": repr(at) for name, at in ending.stamps.items()})
    if result is not None:
        fields["result"] = result
    for name, value in (("error", ending.error), ("batch", ending.batch)):
        if value is not None:
            fields[name] = value.model_dump_json()
    if ending.encoder:
        fields["encoder"] = json.dumps(ending.encoder, sort_keys=True)
    job_id = ending.job_id
    keys = [job_key(job_id), tokens_key(job_id), ACTIVE_KEY, done_channel(job_id), JOB_COUNTS_KEY]
    keys += [*tenant_keys(ending.tenant), CALLBACKS_DUE_KEY, job_blobs_key(job_id), *result_keys(ending.tenant)]
    charged = size if ending.tenant != DEFAULT_TENANT else 0  # without keys there are no tenants to charge
    return keys, [job_id, ending.status, ending.tenant, charged, *(x for pair in fields.items() for x in pair)]


def _bounded(ending: Ending, max_result_bytes: int) -> tuple[Ending, str | None, int]:
    """The ending as written, with its result as stored and that result's bytes: a result of more than
    `max_result_bytes` is not stored, and the job fails `result_too_large` (stage `infer`) rather than keep a part
    of its answers: a client that asked for logprobs gets all of them or a reason."""
    if ending.result is None:
        return ending, None, 0
    result = ending.result.model_dump_json()
    size = len(result.encode())
    if size <= max_result_bytes:
        return ending, result, size
    reason = ResultTooLarge(
        f"the answer is {size} bytes, more than the {max_result_bytes} a job's result may hold: ask for fewer "
        "answers, tokens or logprobs",
        stage="infer",
    )
    return replace(ending, status="failed", result=None, error=ErrorInfo(**reason.to_dict())), None, 0


def _pending(job_id: str, tokens: bytes | None, raw: dict[bytes, bytes]) -> Pending | None:
    if not tokens or not raw:
        return None

    def number(name: bytes) -> float | None:
        value = raw.get(name)
        return float(value) if value is not None else None

    context = raw.get(b"trace_context")
    trace = dict(json.loads(context)) if context else None
    job = job_from_fields(job_id, raw)
    stamps = {name: float(raw[f"ts:{name}".encode()]) for name in STAMPS if f"ts:{name}".encode() in raw}
    request = ModelRequest.from_json(tokens)
    return Pending(job, request, number(b"ts:preprocessed"), number(b"deadline"), trace, stamps)


def ended_job(job_id: str, announced: bytes) -> Job | None:
    """The job as the announcement of its end carries it (a watched job's ended record, `_FINISH`: a JSON array of
    its hash's fields and values in turn); None for an announcement that carries no record."""
    try:
        flat = json.loads(announced)
    except ValueError:
        return None
    if not isinstance(flat, list) or not flat or len(flat) % 2:
        return None
    return _job_from_text(job_id, _pairs(flat))


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """A hash's fields and values, given in turn (as a script's `HGETALL` returns them), as a mapping."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def job_from_fields(job_id: str, raw: dict[bytes, bytes]) -> Job:
    """Assemble a Job from the fields of its Redis hash."""
    return _job_from_text(job_id, {k.decode(): v.decode() for k, v in raw.items()})


def _job_from_text(job_id: str, fields: dict[str, str]) -> Job:
    """Assemble a Job from the fields of its Redis hash, decoded."""
    inputs = _nest_inputs({k: InputRecord.model_validate_json(v) for k, v in fields.items() if k.startswith("input:")})
    if "encoder" in fields:
        _mark_encoder(inputs, json.loads(fields["encoder"]))
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
        chat=Conversation.model_validate_json(fields["chat"]) if "chat" in fields else None,
        callback=CallbackState.model_validate_json(fields["callback"]) if "callback" in fields else None,
        tenant=fields.get("tenant", DEFAULT_TENANT),
        job_class=fields.get("class", "interactive"),
        batch_id=fields.get("batch_id"),
    )


def _mark_encoder(records: Iterable[InputRecord], used: dict[str, EncoderUse]) -> None:
    """Each picture (or keyframe) the model read says whether its vision embeddings hit the cache: one field
    written when the job ended, not one write per input."""
    for record in records:
        record.encoder = used.get(record.content_hash, record.encoder)
        _mark_encoder(record.frames or [], used)


def _nest_inputs(records: dict[str, InputRecord]) -> list[InputRecord]:
    """Top-level inputs in order, each video carrying its filled keyframes."""
    top = {ref: r for ref, r in records.items() if ref.count(":") == 1}
    for ref, frame in sorted(records.items(), key=lambda item: item[1].index):
        parent = ref.rsplit(":frame:", 1)[0]
        if ref.count(":") == 3 and parent in top and frame.status != "skipped":
            top[parent].frames = [*(top[parent].frames or []), frame]
    return sorted(top.values(), key=lambda r: r.index)
