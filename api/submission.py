"""Taking a job in, whichever front it came through (`POST /v1/jobs`, `/v1/chat/completions`): admission control,
the tenant's in-flight slot, the record and inputs written, the first message published, at once.

A job with nothing left to preprocess (text only, or every input cached in its tenant's scope) skips the CPU
queues: its prompt, from the cache or tokenized here, goes straight to the inference queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import redis
from opentelemetry.trace import SpanKind
from starlette.concurrency import run_in_threadpool

from api import idempotency
from api.context import ApiContext
from api.intake import AcceptedRequest
from api.tenancy import admit, charge, release
from stoker.adapters.cache import COST_FIELD
from stoker.adapters.metrics import ADMISSIONS, STAGE_SECONDS, cache_label
from stoker.adapters.store import Store
from stoker.adapters.store.clients import StoreOutOfMemory
from stoker.adapters.store.idempotency import IdempotencyKeys
from stoker.adapters.store.jobs import NewJob, Queued, Required
from stoker.adapters.tracing import carrier, trace_id_hex, tracer
from stoker.core.cached_prompt import CachedPrompt
from stoker.core.cachekeys import CacheAddress, PipelineContext, prompt_address, prompt_worth_caching
from stoker.core.costs import SizeBounds, size_class
from stoker.core.deadlines import Deadline, deadline_for
from stoker.core.errors import BrokerUnavailable, ClientGone, Overloaded, RateLimited, StokerError, StoreFull
from stoker.core.idempotency import recent_digest
from stoker.core.jobs import (
    ChatTurn,
    ErrorInfo,
    InputRecord,
    Job,
    JobClass,
    final_status,
    input_failure,
    new_job_id,
    renders_pictures,
)
from stoker.core.model import ModelRequest
from stoker.core.prompting import Attachment, attachment_for, offered_tools
from stoker.core.queues import job_messages
from stoker.core.tenancy import cache_scope
from stoker.core.tools import ToolSpec
from tasks.pipeline import Start

log = logging.getLogger(__name__)
#: Response header on a submission answered with the job an earlier one (same Idempotency-Key) made.
REPLAYED = "Idempotent-Replayed"


@dataclass(frozen=True)
class Submitted:
    """A submission's job, and whether it is one an earlier request with the same Idempotency-Key made."""

    job: Job
    replayed: bool = False


async def submit_job(
    context: ApiContext,
    tenant: str,
    key: idempotency.Key | None,
    read: Callable[[], Awaitable[AcceptedRequest]],
    retried: bool = False,
    job_id: str | None = None,
    watched: bool = False,
) -> Submitted:
    """Admit, read (with `read`), store and enqueue one job (named `job_id` if given); the job as it was accepted
    (read back with its record, in the same round trip).

    While a queue is over its limit the job is refused before its body is read (429 with Retry-After from the
    queue's measured drain rate, nothing written); so is one over its tenant's rate or jobs in flight. With an
    `Idempotency-Key` (`key`) that already made a job, that job comes back instead (`api.idempotency`): counted
    against the tenant's rate like any request, but taking no in-flight slot and never refused for queue pressure.
    Without a key, a client's automatic retry (`retried`) of a request that made a job a moment ago gets that job
    back the same way (`_submit_unkeyed`). `watched`: the request waits on the job it makes (its end is announced).
    """
    job_id = job_id or new_job_id()
    if key is None:
        return await _submit_unkeyed(context, tenant, _ReadOnce(read), job_id, retried, watched)
    await _within_rate(context, tenant)  # before the key is looked at: a replay costs the rate too
    store, claim_s = context.store, context.settings.idempotency_claim_s
    remembered = await idempotency.claim(store, context.announcements, key, job_id, claim_s)
    if remembered is not None:
        return Submitted(await idempotency.replay(context.loop.jobs, remembered, tenant, read), replayed=True)
    async with idempotency.holding(store, key, job_id, claim_s) as claim:
        return Submitted(await _submit(context, tenant, read, job_id, claim, watched=watched))


@dataclass
class _ReadOnce:
    """A request's body, read and checked on first use and handed out again after."""

    read: Callable[[], Awaitable[AcceptedRequest]]
    accepted: AcceptedRequest | None = None

    async def __call__(self) -> AcceptedRequest:
        if self.accepted is None:
            self.accepted = await self.read()
        return self.accepted


async def _submit_unkeyed(
    context: ApiContext, tenant: str, read: _ReadOnce, job_id: str, retried: bool, watched: bool
) -> Submitted:
    """A request without an Idempotency-Key: a new job, remembered by the request's fingerprint for a short
    while; an automatic retry of an identical request within that while gets its job back (the openai client
    retries a 5xx or a dropped connection twice, sending no key). The retry's body is read before queue pressure
    is looked at: a replay makes no job, so it is never refused for pressure."""
    window_s = context.settings.retry_window_s
    if retried and window_s > 0:
        accepted = await read()
        digest = recent_digest(tenant, idempotency.fingerprint(accepted))
        earlier = await run_in_threadpool(_recent_job, context.store, digest, tenant)
        if earlier is not None:
            log.info("job %s answers an automatic retry of the request that made it", earlier.id)
            return Submitted(earlier, replayed=True)
    return Submitted(await _submit(context, tenant, read, job_id, remember_s=max(window_s, 0), watched=watched))


def _recent_job(store: Store, digest: str, tenant: str) -> Job | None:
    """The job an identical request of this tenant made a moment ago, unless its client gave it up (then the
    retry, from that same client, is its new attempt)."""
    job_id = store.idempotency.recent(digest)
    job = store.jobs.load_job(job_id) if job_id is not None else None
    if job is None or job.tenant != tenant:
        return None
    if job.status == "cancelled" and job.error is not None and job.error.code == ClientGone.code:
        return None
    return job


async def _submit(
    context: ApiContext,
    tenant: str,
    read: Callable[[], Awaitable[AcceptedRequest]],
    job_id: str,
    claim: idempotency.Claim | None = None,
    remember_s: int = 0,
    watched: bool = False,
) -> Job:
    """Take one new job in: queue pressure and the tenant's slot checked, its body read, the job made; with
    `claim`, the key it holds, remembered as naming the job once it is made; with `remember_s`, the request's
    fingerprint remembered as having made the job, written with its record (`_recent_note`)."""
    await _refuse_under_pressure(context)
    await admit(context, tenant, job_id, rated=claim is not None)  # a keyed request's rate was counted already
    try:
        accepted = await read()
        if claim is not None:
            await claim.confirm()  # the key is still ours: no other request made its job meanwhile
        job = await _take_in(context, accepted, job_id=job_id, tenant=tenant, remember_s=remember_s, watched=watched)
    except Exception as exc:
        await release(context, tenant, job_id)  # not accepted after all: its in-flight slot is free again
        if isinstance(exc, BrokerUnavailable):
            ADMISSIONS.labels("unavailable").inc()
        raise
    ADMISSIONS.labels("accepted").inc()
    if claim is not None:  # accepted: the key names this job from now on
        await claim.remember(context.settings, accepted)
    return job


async def _within_rate(context: ApiContext, tenant: str) -> None:
    """Count a submission against its tenant's rate alone (429 over it, a refused submission like any other)."""
    try:
        await admit(context, tenant)
    except RateLimited:
        ADMISSIONS.labels("rate_limited").inc()
        raise


async def _refuse_under_pressure(context: ApiContext) -> None:
    """503 while the job store is nearly full; 429 while a queue is over its limit, with Retry-After from its
    measured drain rate. Nothing written."""
    context.monitor.touch()  # a monitor that slowed down while nothing happened samples at its own pace again
    full = context.monitor.store_full()
    if full is not None:
        ADMISSIONS.labels("refused").inc()
        raise StoreFull(f"the job store holds {full.used >> 20} MiB of its {full.limit >> 20} MiB: try again soon")
    refusal = context.monitor.refusal()
    if refusal is None:
        return
    ADMISSIONS.labels("refused").inc()
    await run_in_threadpool(context.store.stats.count_refusal, refusal.queue)
    raise Overloaded(
        f"queue {refusal.queue} holds {refusal.depth} messages (limit {refusal.limit})",
        retry_after_s=refusal.retry_after_s,
    )


async def submit_line(context: ApiContext, tenant: str, job_id: str, accepted: AcceptedRequest, batch_id: str) -> Job:
    """A batch's line taken in as a job through the same intake as an interactive request: its tenant's in-flight
    slot and fair share, the record (of class `batch`), the inputs, the first message at the batch class's broker
    priority. What a client waits on is left out: the line's request was checked at `accept_chat` already, and the
    batch feeder only feeds into room under the queues' watermarks, so the admission limits are not met here."""
    await admit(context, tenant, job_id, rated=True)  # a line is not a request: the tenant's rate is not counted
    try:
        job = await _take_in(context, accepted, job_id=job_id, tenant=tenant, batch_id=batch_id)
    except Exception:
        await release(context, tenant, job_id)
        raise
    ADMISSIONS.labels("batch_line").inc()
    return job


def cancel(store: Store, job_id: str, reason: StokerError) -> bool:
    """End a job that has not ended as `cancelled` (with why), once: its in-flight slot and share are given back,
    its stages still queued are skipped when they arrive, a running OCR stops, and it never reaches the model (a
    batch already on the device finishes, and its answer is not written). False if it had already ended."""
    return store.jobs.finish(job_id, "cancelled", error=ErrorInfo(**reason.to_dict()))


@dataclass(frozen=True)
class PlannedJob:
    """A job being taken in: its inputs' records, where it enters the pipeline, and when it must be answered."""

    job_id: str
    tenant: str
    accepted: AcceptedRequest
    records: list[InputRecord]
    #: The first stage it runs: `preprocess`, or a later one when its inputs (and prompt) are cached.
    start: Start
    #: Its model request, when it skips straight to inference.
    model_request: ModelRequest | None
    created_at: float
    deadline: Deadline
    #: The batch it is a line of (then of class `batch`); None for an interactive job.
    batch_id: str | None = None
    #: When the reaper first looks whether a stage has started it (a first message lost with a worker is re-sent).
    look_at: float | None = None
    #: Its client waits on it from the start (a POST with `?wait=`): its end is announced.
    watched: bool = False

    @property
    def job_class(self) -> JobClass:
        """Interactive, or a batch line."""
        return "interactive" if self.batch_id is None else "batch"


async def _take_in(
    context: ApiContext,
    accepted: AcceptedRequest,
    *,
    job_id: str,
    tenant: str,
    batch_id: str | None = None,
    remember_s: int = 0,
    watched: bool = False,
) -> Job:
    """Write record and inputs before enqueueing, so no worker can see a job that is not stored; the job as
    written (read back with its record, before its first message: what a worker does with it after, a client
    sees on its next read, or hears of while it waits).

    A job whose inputs are all preprocessed in the cache (in its tenant's scope), or that has none, skips the CPU
    preprocessing queues: its prompt, from the cache or tokenized here, goes straight to the inference queue.

    On the serving loop: the tenant charged, the record written and the first message pushed over the loop's own
    clients (`ApiContext.loop`), the cache looked up there too, a short prompt tokenized there; only a long
    prompt's tokenizing leaves it, and the cache's pipeline identity once a second.
    """
    planned = replace(await _plan(context, accepted, job_id, tenant), batch_id=batch_id, watched=watched)
    await _charge_tenant(context, planned)
    with _job_span(planned) as traced:
        # Shielded: a request cancelled meanwhile (its server stopping) still makes the job whole, record and
        # message, as the pool thread this ran on before did; never a record whose message was never sent.
        return await asyncio.shield(_make(context, planned, traced, _recent_note(planned, remember_s)))


async def _make(
    context: ApiContext, planned: PlannedJob, traced: tuple[str, dict[str, str]] | None, also: Sequence[Queued]
) -> Job:
    """The job's record written, then its first message published; the job as written. A render served from the
    cache is ended instead: its answer is what the cache holds, and no stage runs for it."""
    job = await _write_job(context, planned, traced, also)
    if planned.start == "ended":
        await run_in_threadpool(_end_rendered, context, planned)
        return job
    await _enqueue(context, planned)
    return job


def _end_rendered(context: ApiContext, planned: PlannedJob) -> None:
    """End a render served from the cache, each picture counted a hit of the render stage as the stage counts one."""
    context.store.jobs.finish(planned.job_id, final_status(planned.records))
    for _ in planned.records:
        context.cache.record("render", hit=True, cost_s=0.0)


def _recent_note(planned: PlannedJob, window_s: int) -> list[Queued]:
    """Remember, by the request's fingerprint, that it made this job, for its deadline and `window_s` more (a
    request without an Idempotency-Key: its client's automatic retry gets the job back). Written with the record;
    if that one write fails, a retry makes another job, no worse."""
    if window_s <= 0:
        return []
    digest = recent_digest(planned.tenant, idempotency.fingerprint(planned.accepted))
    ttl_s = math.ceil(planned.accepted.deadline_ms / 1000) + window_s
    return [functools.partial(IdempotencyKeys.queue_recent, digest=digest, job_id=planned.job_id, ttl_s=ttl_s)]


async def _plan(context: ApiContext, accepted: AcceptedRequest, job_id: str, tenant: str) -> PlannedJob:
    """The job's input records, how far it may skip (in its tenant's cache scope), and its deadline from now."""
    settings = context.settings
    bounds = SizeBounds(settings.small_pixels, settings.large_pixels, settings.small_audio_s, settings.large_audio_s)
    records = [
        InputRecord(
            index=i,
            kind=item.kind,
            content_hash=item.digest,
            size_bytes=len(item.data),
            url=item.url,
            size_class=size_class(item.kind, item.data, item.format, bounds),
            speech=item.speech,
        )
        for i, item in enumerate(accepted.inputs)
    ]
    scope = cache_scope(tenant, settings.cache_shared)
    start, records, request = await _shortcut(context, accepted, records, scope, job_id)
    now = time.time()
    deadline = deadline_for(now, accepted.deadline_ms, settings.infer_reserve_ms)
    look_at = now + context.settings.redrive_after_s
    return PlannedJob(job_id, tenant, accepted, records, start, request, now, deadline, look_at=look_at)


async def _charge_tenant(context: ApiContext, planned: PlannedJob) -> None:
    """Count the job's queue messages and the input bytes stored here against its tenant (raise if over)."""
    kinds = [(r.kind, r.url is not None) for r in planned.records]
    messages = job_messages(kinds, planned.start, context.settings.video_keyframes)
    stored = sum(len(item.data) for item in planned.accepted.inputs if item.url is None)
    await charge(context, planned.tenant, planned.job_id, messages, stored)


@contextlib.contextmanager
def _job_span(planned: PlannedJob) -> Iterator[tuple[str, dict[str, str]] | None]:
    """The job's root span, open while it is written and enqueued; yields its trace (id, carrier) when traced."""
    attributes: dict[str, str | int] = {
        "stoker.job_id": planned.job_id,
        "stoker.inputs": len(planned.records),
        "stoker.enters_at": planned.start,
    }
    with tracer.start_as_current_span("job", kind=SpanKind.SERVER, attributes=attributes) as span:
        trace_id = trace_id_hex(span)
        yield (trace_id, carrier()) if trace_id else None


async def _write_job(
    context: ApiContext, planned: PlannedJob, traced: tuple[str, dict[str, str]] | None, also: Sequence[Queued]
) -> Job:
    """The record, with the uploads' bytes, the hand-off to inference of a job that skips preprocessing, and
    `also`; the job as written. A store that is full or away is answered as such (`store_full`,
    `broker_unavailable`)."""
    try:
        return await context.loop.jobs.create(planned.job_id, _new_job(context.store, planned, traced, also))
    except StoreOutOfMemory as exc:  # full before the monitor saw it: refused, not lost
        raise StoreFull("the job store is full: try again soon") from exc
    except redis.RedisError as exc:
        raise BrokerUnavailable("the job store cannot be reached") from exc


def _new_job(
    store: Store, planned: PlannedJob, traced: tuple[str, dict[str, str]] | None, also: Sequence[Queued]
) -> NewJob:
    """The job's record, written in one transaction with its uploads' bytes, its hand-off and `also`: one too
    large (`record_too_large`) is refused before any byte is stored."""
    accepted = planned.accepted
    return NewJob(
        accepted.prompt,
        planned.records,
        planned.created_at,
        planned.deadline,
        accepted.deadline_ms,
        trace=traced,
        tenant=planned.tenant,
        chat=accepted.chat,
        callback_url=accepted.callback_url,
        job_class=planned.job_class,
        batch_id=planned.batch_id,
        look_at=planned.look_at,
        request=planned.model_request,
        required=_uploads(store, planned),
        also=also,
        watched=planned.watched,
    )


def _uploads(store: Store, planned: PlannedJob) -> list[Required]:
    """The uploaded inputs' bytes, each blob held by the job, written with its record; a URL input's bytes are
    stored by the worker that fetches them."""
    job_id = planned.job_id
    return [
        Required(
            functools.partial(store.blobs.queue_put, digest=item.digest, data=item.data, job_id=job_id),
            functools.partial(store.blobs.put_blob, item.digest, item.data, job_id),
        )
        for item in planned.accepted.inputs
        if item.url is None
    ]


async def _enqueue(context: ApiContext, planned: PlannedJob) -> None:
    """Publish the job's first message (on the loop, where the submitter can: `Submitter.submit_on`); if
    that fails, the job is unmade (record and blobs gone) and the broker answered as away."""
    job_id, request, submitter = planned.job_id, planned.model_request, context.submitter
    start, deadline, job_class = planned.start, planned.deadline.at, planned.job_class
    tokens = len(request.prompt_ids) if request else None
    try:
        await submitter.submit_on(context.loop.broker, job_id, planned.records, start, deadline, tokens, job_class)
    except Exception as exc:
        log.warning("could not enqueue job %s: %r", job_id, exc)
        await run_in_threadpool(unmake, context.store, job_id)
        raise BrokerUnavailable("the broker cannot be reached") from exc


def unmake(store: Store, job_id: str) -> None:
    """Forget a job whose first message was never sent: its record, and its hold on the uploads it stored."""
    store.jobs.delete_job(job_id)
    store.blobs.release(job_id)


async def _shortcut(
    context: ApiContext, accepted: AcceptedRequest, records: list[InputRecord], scope: str, job_id: str
) -> tuple[Start, list[InputRecord], ModelRequest | None]:
    """How far a job may skip: to inference when every input is cached (or it has none) and its prompt is cached
    or can be tokenized here; to tokenize when only its inputs are cached."""
    if accepted.chat is not None and accepted.chat.render:
        if not renders_pictures(accepted.chat, records):
            return "preprocess", records, None  # a transcription, or a picture to fetch first
        if accepted.rendered is not None and records:
            return "ended", [_rendered(r, accepted.rendered) for r in records], None
        return "render", records, None  # it ends at its hand-off; its stages look in the cache themselves
    cache = context.cache
    pipeline = cache.context() if cache.context_fresh() else await run_in_threadpool(cache.context)
    if pipeline is None or any(r.url is not None for r in records):  # nothing is known of a URL's content yet
        return "preprocess", records, None
    filled = await context.loop.cache.get_inputs(pipeline.identity, records, scope)
    if filled is None:
        return "preprocess", records, None
    filled = [f.model_copy(update={"size_bytes": r.size_bytes}) for f, r in zip(filled, records, strict=True)]
    if accepted.chat and accepted.chat.on_input_error == "fail" and input_failure(filled):
        return "tokenize", filled, None  # where a job that fails on an unreadable input ends, before the model
    found = await _tokenized(context, pipeline, accepted, [attachment_for(r) for r in filled], scope)
    if found is None:
        return "tokenize", filled, None
    return "infer", filled, found.request(scope, accepted.chat, job_id)


def _rendered(record: InputRecord, where: dict[str, str]) -> InputRecord:
    """A picture the cache holds rendered, as its render stage would have left its record."""
    return record.model_copy(update={"status": "ok", "prepared": dict(where), "cache_hit": {"render": True}})


async def _tokenized(
    context: ApiContext, pipeline: PipelineContext, accepted: AcceptedRequest, attachments: list[Attachment], scope: str
) -> CachedPrompt | None:
    """The job's prompt, tokenized, while the inference queue has room: from the cache, or here (a short text-only
    prompt is not looked up, `prompt_worth_caching`: tokenizing it again costs less). None: the tokenize stage
    makes it."""
    if not context.monitor.room_for_inference():
        return None  # a cached prompt too: it must not overtake the jobs held for the inference queue
    turns = accepted.chat.turns if accepted.chat else None
    tools = offered_tools(accepted.chat)
    trim = accepted.chat is not None and accepted.chat.truncate
    address: CacheAddress | None = None
    if prompt_worth_caching(accepted.prompt, attachments, turns, tools, context.settings.api_tokenize_cache_min_chars):
        address = prompt_address(pipeline, accepted.prompt, attachments, scope, turns, tools, trim=trim)
        found = await context.loop.cache.get_json(address)
        if found is not None:
            context.cache.record("tokenize", hit=True, cost_s=float(found.get(COST_FIELD, 0.0)))
            return CachedPrompt.from_dict(found)
    return await _tokenize_here(context, pipeline, address, accepted.prompt, attachments, turns, tools, trim)


async def _tokenize_here(
    context: ApiContext,
    pipeline: PipelineContext,
    address: CacheAddress | None,
    prompt: str,
    attachments: list[Attachment],
    turns: list[ChatTurn] | None,
    tools: Sequence[ToolSpec],
    trim: bool = False,
) -> CachedPrompt | None:
    """The tokenize stage's work, done here (`trim`: a prompt over the context fitted to it, not refused); cached
    like the stage's own at `address` (None: a prompt too short to be worth caching, `prompt_worth_caching`, which
    is tokenized on the loop itself: `PromptBuilder.build_here`). None: not possible here."""
    started = time.perf_counter()
    prompts = context.prompts
    if address is None:
        built = prompts.build_here(pipeline, prompt, attachments, turns, tools, trim)
    else:
        built = await prompts.build_off_loop(pipeline, prompt, attachments, turns, tools, trim)
    if built is None:
        return None
    cost = time.perf_counter() - started
    value = CachedPrompt.of(built)
    if address is not None:
        await context.loop.cache.put_miss(address, value.to_dict(), cost)
    STAGE_SECONDS.labels("tokenize", cache_label(False if address is not None else None)).observe(cost)
    return value
