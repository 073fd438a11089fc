"""Taking a job in, whichever front it came through (`POST /v1/jobs`, `/v1/chat/completions`): admission control,
the tenant's in-flight slot, the record and inputs written, the first message published, at once.

A job with nothing left to preprocess (text only, or every input cached in its tenant's scope) skips the CPU
queues: its prompt, from the cache or tokenized here, goes straight to the inference queue.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis
from fastapi import Request
from opentelemetry.trace import SpanKind
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State

from api import idempotency
from api.intake import AcceptedRequest
from api.tenancy import admit, charge, release
from stoker.adapters.cache import StageCache
from stoker.adapters.metrics import ADMISSIONS, STAGE_SECONDS
from stoker.adapters.store import Store
from stoker.adapters.store.clients import StoreOutOfMemory
from stoker.adapters.tracing import carrier, trace_id_hex, tracer
from stoker.core.cachekeys import CacheAddress, PipelineContext, prompt_address
from stoker.core.deadlines import deadline_for
from stoker.core.errors import BrokerUnavailable, Overloaded, RateLimited, StokerError, StoreFull
from stoker.core.jobs import ChatTurn, ErrorInfo, InputRecord, Job
from stoker.core.model import ModelRequest
from stoker.core.prompting import Attachment, attachment_for, model_request
from stoker.core.queues import job_messages
from stoker.core.tenancy import cache_scope
from stoker.settings import ApiSettings
from tasks.pipeline import Start, Submitter

log = logging.getLogger(__name__)
#: Response header on a submission answered with the job an earlier one (same Idempotency-Key) made.
REPLAYED = "Idempotent-Replayed"


@dataclass(frozen=True)
class Submitted:
    """A submission's job, and whether it is one an earlier request with the same Idempotency-Key made."""

    job: Job
    replayed: bool = False


async def submit_job(request: Request, tenant: str, read: Callable[[], Awaitable[AcceptedRequest]]) -> Submitted:
    """Admit, read (with `read`), store and enqueue one job; the job as it now stands.

    While a queue is over its limit the job is refused before its body is read (429 with Retry-After from the
    queue's measured drain rate, nothing written); so is one over its tenant's rate or jobs in flight. With an
    `Idempotency-Key` that already made a job, that job comes back instead (`api.idempotency`): counted against
    the tenant's rate like any request, but taking no in-flight slot and never refused for queue pressure.
    """
    state = request.app.state
    settings: ApiSettings = state.settings
    job_id = uuid.uuid4().hex
    key = idempotency.key_of(request, tenant)
    if key is None:
        return Submitted(await _submit(request, tenant, read, job_id))
    await _within_rate(request, tenant)  # before the key is looked at: a replay costs the rate too
    claim_s = settings.idempotency_claim_s
    remembered = await idempotency.claim(state.store, state.announcements, key, job_id, claim_s)
    if remembered is not None:
        return Submitted(await idempotency.replay(state.store, remembered, tenant, read), replayed=True)
    async with idempotency.holding(state.store, key, job_id, claim_s) as claim:
        return Submitted(await _submit(request, tenant, read, job_id, claim))


async def _submit(
    request: Request,
    tenant: str,
    read: Callable[[], Awaitable[AcceptedRequest]],
    job_id: str,
    claim: idempotency.Claim | None = None,
) -> Job:
    """Take one new job in: queue pressure and the tenant's slot checked, its body read, the job made; with
    `claim`, the key it holds, remembered as naming the job once it is made."""
    state = request.app.state
    settings: ApiSettings = state.settings
    await _refuse_under_pressure(state)
    await admit(request, tenant, job_id, rated=claim is not None)  # a keyed request's rate was counted already
    try:
        accepted = await read()
        if claim is not None:
            await claim.confirm()  # the key is still ours: no other request made its job meanwhile
        job = await run_in_threadpool(_admit, state, accepted, settings, job_id=job_id, tenant=tenant)
    except Exception as exc:
        await release(request, tenant, job_id)  # not accepted after all: its in-flight slot is free again
        if isinstance(exc, BrokerUnavailable):
            ADMISSIONS.labels("unavailable").inc()
        raise
    ADMISSIONS.labels("accepted").inc()
    if claim is not None:  # accepted: the key names this job from now on
        await claim.remember(settings, accepted)
    return job


async def _within_rate(request: Request, tenant: str) -> None:
    """Count a submission against its tenant's rate alone (429 over it, a refused submission like any other)."""
    try:
        await admit(request, tenant)
    except RateLimited:
        ADMISSIONS.labels("rate_limited").inc()
        raise


async def _refuse_under_pressure(state: State) -> None:
    """503 while the job store is nearly full; 429 while a queue is over its limit, with Retry-After from its
    measured drain rate. Nothing written."""
    full = state.monitor.store_full()
    if full is not None:
        ADMISSIONS.labels("refused").inc()
        raise StoreFull(f"the job store holds {full.used >> 20} MiB of its {full.limit >> 20} MiB: try again soon")
    refusal = state.monitor.refusal()
    if refusal is None:
        return
    ADMISSIONS.labels("refused").inc()
    await run_in_threadpool(state.store.stats.count_refusal, refusal.queue)
    raise Overloaded(
        f"queue {refusal.queue} holds {refusal.depth} messages (limit {refusal.limit})",
        retry_after_s=refusal.retry_after_s,
    )


def cancel(store: Store, job_id: str, reason: StokerError) -> bool:
    """End a job that has not ended as `cancelled` (with why), once: its in-flight slot and share are given back,
    its stages still queued are skipped when they arrive, a running OCR stops, and it never reaches the model (a
    batch already on the device finishes, and its answer is not written). False if it had already ended."""
    return store.jobs.finish(job_id, "cancelled", error=ErrorInfo(**reason.to_dict()))


def _admit(state: State, accepted: AcceptedRequest, settings: ApiSettings, *, job_id: str, tenant: str) -> Job:
    """Write inputs and record before enqueueing, so no worker can see a job that is not stored.

    A job whose inputs are all preprocessed in the cache (in its tenant's scope), or that has none, skips the CPU
    preprocessing queues: its prompt, from the cache or tokenized here, goes straight to the inference queue.
    """
    store: Store = state.store
    submitter: Submitter = state.submitter
    records = [
        InputRecord(index=i, kind=item.kind, content_hash=item.digest, size_bytes=len(item.data), url=item.url)
        for i, item in enumerate(accepted.inputs)
    ]
    scope = cache_scope(tenant, settings.cache_shared)
    start, records, request = _shortcut(state, accepted, records, scope, job_id)
    kinds = [(r.kind, r.url is not None) for r in records]
    stored = sum(len(item.data) for item in accepted.inputs if item.url is None)
    charge(state, tenant, job_id, job_messages(kinds, start, settings.video_keyframes), stored)
    now = time.time()
    deadline = deadline_for(now, accepted.deadline_ms, settings.infer_reserve_ms)
    attributes: dict[str, str | int] = {
        "stoker.job_id": job_id,
        "stoker.inputs": len(records),
        "stoker.enters_at": start,
    }
    with tracer.start_as_current_span("job", kind=SpanKind.SERVER, attributes=attributes) as span:
        trace_id = trace_id_hex(span)
        traced = (trace_id, carrier()) if trace_id else None
        try:
            # The record first: one too large (`record_too_large`) is refused before any byte is stored.
            store.jobs.create_job(
                job_id,
                accepted.prompt,
                records,
                now,
                deadline,
                accepted.deadline_ms,
                traced,
                tenant=tenant,
                chat=accepted.chat,
                callback_url=accepted.callback_url,
            )
            for item in accepted.inputs:
                if item.url is None:  # a URL input's bytes are stored by the worker that fetches them
                    store.blobs.put_blob(item.digest, item.data, job_id)
            if request is not None:
                store.jobs.hand_off(job_id, request, rev=None)
        except StoreOutOfMemory as exc:  # full before the monitor saw it: refused, not lost
            raise StoreFull("the job store is full: try again soon") from exc
        except redis.RedisError as exc:
            raise BrokerUnavailable("the job store cannot be reached") from exc
        try:
            tokens = len(request.prompt_ids) if request else None
            submitter.submit(job_id, records, start=start, deadline=deadline.at, prompt_tokens=tokens)
        except Exception as exc:
            log.warning("could not enqueue job %s: %r", job_id, exc)
            store.jobs.delete_job(job_id)
            store.blobs.release(job_id)
            raise BrokerUnavailable("the broker cannot be reached") from exc
    job = store.jobs.load_job(job_id)
    assert job is not None
    return job


def _shortcut(
    state: State, accepted: AcceptedRequest, records: list[InputRecord], scope: str, job_id: str
) -> tuple[Start, list[InputRecord], ModelRequest | None]:
    """How far a job may skip: to inference when every input is cached (or it has none) and its prompt is cached
    or can be tokenized here; to tokenize when only its inputs are cached."""
    cache: StageCache = state.cache
    context = cache.context()
    if context is None or any(r.url is not None for r in records):  # nothing is known of a URL's content yet
        return "preprocess", records, None
    filled = cache.get_inputs(context.identity, records, scope) if records else []
    if filled is None:
        return "preprocess", records, None
    filled = [f.model_copy(update={"size_bytes": r.size_bytes}) for f, r in zip(filled, records, strict=True)]
    attachments = [attachment_for(r) for r in filled]
    turns = accepted.chat.turns if accepted.chat else None
    address = prompt_address(context, accepted.prompt, attachments, scope, turns)
    found = cache.get_json(address)
    if found is not None:
        cache.record("tokenize", hit=True, cost_s=float(found.get("_cost_s", 0.0)))
    elif state.monitor.room_for_inference():
        found = _tokenize_here(state, context, address, accepted.prompt, attachments, turns)
    if found is None:
        return "tokenize", filled, None
    return "infer", filled, model_request(found, filled, scope, accepted.chat, job_id)


def _tokenize_here(
    state: State,
    context: PipelineContext,
    address: CacheAddress,
    prompt: str,
    attachments: list[Attachment],
    turns: list[ChatTurn] | None,
) -> dict[str, Any] | None:
    """The tokenize stage's work, done in this (pool) thread; cached like the stage's own. None: not possible here."""
    started = time.perf_counter()
    built = state.prompts.build(context, prompt, attachments, turns)
    if built is None:
        return None
    cost = time.perf_counter() - started
    value = {"ids": built.ids, "messages": built.messages}
    state.cache.put_json(address, {**value, "_cost_s": cost})
    state.cache.record("tokenize", hit=False, cost_s=cost)
    STAGE_SECONDS.labels("tokenize", "miss").observe(cost)
    return value
