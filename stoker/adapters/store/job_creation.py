"""A new job's record: written in one step (one round trip, with other repositories' writes it needs), on a
thread or on the API's event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.client import Pipeline
from redis.exceptions import NoScriptError

from stoker.adapters.store.job_records import Queued, ScriptCall, job_from_fields, pairs, tenant_of
from stoker.adapters.store.job_scripts import CREATE, CREATE_SHA, DROP_RESULT, WATCH
from stoker.adapters.store.keys import (
    ACTIVE_KEY,
    IN_FLIGHT_GRACE_S,
    JOB_COUNTS_KEY,
    handed_off_channel,
    input_ref,
    job_key,
    tenant_index_key,
    tenant_jobs_key,
    tokens_key,
)
from stoker.adapters.store.tenants import result_keys
from stoker.core.deadlines import Deadline
from stoker.core.errors import RecordTooLarge
from stoker.core.jobs import MAX_RECORD_BYTES, CallbackState, Conversation, InputRecord, Job, JobClass
from stoker.core.model import ModelRequest


@dataclass(frozen=True)
class Required:
    """Another repository's write that a new job is not made without (its uploads' bytes), queued into the job's
    transaction: an error of its is the job's. Its commands are one bare `EVALSHA`; a store that forgot its scripts
    answers NOSCRIPT, and `alone` then writes it on its own (which loads the script)."""

    queue: Queued
    alone: Callable[[], Any]


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
    pipe.evalsha(CREATE_SHA, len(keys), *keys, *args)
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
    return job_from_fields(job_id, pairs(made)), alone


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


def check_record_size(fields: Mapping[str | bytes, str | bytes | float | int], limit: int) -> None:
    """Refuse a record (or the part of one known so far) whose fields pass `limit` bytes (413 `record_too_large`)."""
    size = sum(
        len(str(name)) + len(value if isinstance(value, bytes) else str(value).encode())
        for name, value in fields.items()
    )
    if size > limit:
        raise RecordTooLarge(f"the job's record would hold {size} bytes (limit {limit})")


class JobCreation:
    """New job records (made in one step with their places in the watch list and their tenant's indexes) and their
    deletion."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_record_bytes = max_record_bytes
        self._create = client.register_script(CREATE)
        self._drop_result = client.register_script(DROP_RESULT)

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
            created = job_from_fields(job_id, pairs(self._create(keys=keys, args=args)))
        return created

    def delete_job(self, job_id: str) -> None:
        """Forget a job that was never enqueued (its blobs: `BlobRepository.release`), and any result of its that
        its tenant was charged for."""
        tenant = tenant_of(self.redis, job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(job_key(job_id), tokens_key(job_id))
            pipe.zrem(ACTIVE_KEY, job_id)
            if tenant is not None:
                self._drop_result(keys=result_keys(tenant), args=[job_id], client=pipe)
            pipe.execute()


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
        self._watch = client.register_script(WATCH)
        self._create = client.register_script(CREATE)

    async def create(self, job_id: str, new: NewJob) -> Job:
        """`JobRepository.create`, on the loop: the new job, as written."""
        async with self.redis.pipeline(transaction=True) as pipe:
            keys, args = _queue_new_job(pipe, job_id, new, self.ttl_s, self.max_record_bytes)
            results = await pipe.execute(raise_on_error=False)
        created, alone = _created(job_id, results, new)
        for need in alone:  # the store forgot its scripts (after a restart): rare, and the writes are synchronous
            await asyncio.to_thread(need.alone)
        if created is None:
            created = job_from_fields(job_id, pairs(await self._create(keys=keys, args=args)))
        return created

    async def load_job(self, job_id: str) -> Job | None:
        """`JobRepository.load_job`, on the loop."""
        raw = await self.redis.hgetall(job_key(job_id))
        return job_from_fields(job_id, raw) if raw else None

    async def watch_job(self, job_id: str) -> Job | None:
        """`JobRepository.watch_job`, on the loop: the job, whose end is announced from this read on."""
        raw = await self._watch(keys=[job_key(job_id)])
        return job_from_fields(job_id, pairs(raw)) if raw else None

    async def aclose(self) -> None:
        """Close the client's connections (its pool too: one given to a client is not closed with it)."""
        await self.redis.aclose(close_connection_pool=True)  # type: ignore[attr-defined]  # the stubs lag
