"""HTTP routes: submit a job, read it (optionally long-polling), health and readiness."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from kombu.connection import Connection
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State

from api.intake import AcceptedRequest, read_request
from api.pressure import QueueMonitor
from api.schemas import ErrorPublic, JobPublic
from api.tenancy import admit, authenticate, release, within_rate
from stoker.adapters.cache import StageCache
from stoker.adapters.metrics import ADMISSIONS, STAGE_SECONDS
from stoker.adapters.store import Store
from stoker.adapters.store.keys import done_channel
from stoker.adapters.tracing import carrier, trace_id_hex, tracer
from stoker.core.batching import idle_gap_summary
from stoker.core.cachekeys import CacheAddress, PipelineContext, prompt_address
from stoker.core.deadlines import deadline_for
from stoker.core.errors import BrokerUnavailable, JobNotFound, Overloaded
from stoker.core.jobs import InputRecord, Job, image_hashes
from stoker.core.model import ModelRequest
from stoker.core.prompting import Attachment, attachment_for
from stoker.core.tenancy import cache_scope
from stoker.settings import ApiSettings
from tasks.pipeline import Start, Submitter

log = logging.getLogger(__name__)
router = APIRouter()
MAX_WAIT_S = 30.0
#: How much longer than its wait a long-poll may take before it gives up on the announcement channel.
LISTEN_SLACK_S = 2.0


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobPublic,
    responses={
        401: {"model": ErrorPublic},
        413: {"model": ErrorPublic},
        415: {"model": ErrorPublic},
        422: {"model": ErrorPublic},
        429: {"model": ErrorPublic},
        503: {"model": ErrorPublic},
    },
)
async def create_job(request: Request, tenant: Annotated[str, Depends(authenticate)]) -> JSONResponse:
    """Accept a job: validate, store inputs and the job record, enqueue, answer 202 at once.

    While a queue is over its limit the job is refused before its body is read: 429 with Retry-After from the
    queue's measured drain rate, and nothing written. So is a job over its tenant's request rate or jobs in flight
    (429 `rate_limited` / `too_many_jobs_in_flight`).
    """
    settings: ApiSettings = request.app.state.settings
    refusal = request.app.state.monitor.refusal()
    if refusal is not None:
        ADMISSIONS.labels("refused").inc()
        await run_in_threadpool(request.app.state.store.stats.count_refusal, refusal.queue)
        raise Overloaded(
            f"queue {refusal.queue} holds {refusal.depth} messages (limit {refusal.limit})",
            retry_after_s=refusal.retry_after_s,
        )
    job_id = uuid.uuid4().hex
    await admit(request, tenant, job_id)
    state = request.app.state
    try:
        accepted = await read_request(request, settings)
        job = await run_in_threadpool(_admit, state, accepted, settings, job_id=job_id, tenant=tenant)
    except Exception as exc:
        await release(request, tenant, job_id)  # not accepted after all: its in-flight slot is free again
        if isinstance(exc, BrokerUnavailable):
            ADMISSIONS.labels("unavailable").inc()
        raise
    ADMISSIONS.labels("accepted").inc()
    return JSONResponse(job.model_dump(mode="json"), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})


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
    start, records, request = _shortcut(state, accepted.prompt, records, cache_scope(tenant, settings.cache_shared))
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
            for item in accepted.inputs:
                if item.url is None:  # a URL input's bytes are stored by the worker that fetches them
                    store.blobs.put_blob(item.digest, item.data)
            store.jobs.create_job(
                job_id, accepted.prompt, records, now, deadline, accepted.deadline_ms, traced, tenant=tenant
            )
            if request is not None:
                store.jobs.hand_off(job_id, request, rev=None)
        except redis.RedisError as exc:
            raise BrokerUnavailable("the job store cannot be reached") from exc
        try:
            tokens = len(request.prompt_ids) if request else None
            submitter.submit(job_id, records, start=start, deadline=deadline.at, prompt_tokens=tokens)
        except Exception as exc:
            log.warning("could not enqueue job %s: %r", job_id, exc)
            store.jobs.delete_job(job_id)
            raise BrokerUnavailable("the broker cannot be reached") from exc
    job = store.jobs.load_job(job_id)
    assert job is not None
    return job


def _shortcut(
    state: State, prompt: str, records: list[InputRecord], scope: str
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
    address = prompt_address(context, prompt, attachments, scope)
    found = cache.get_json(address)
    if found is not None:
        cache.record("tokenize", hit=True, cost_s=float(found.get("_cost_s", 0.0)))
    elif state.monitor.room_for_inference():
        found = _tokenize_here(state, context, address, prompt, attachments)
    if found is None:
        return "tokenize", filled, None
    request = ModelRequest([int(i) for i in found["ids"]], found.get("messages", []), image_hashes(filled), scope)
    return "infer", filled, request


def _tokenize_here(
    state: State, context: PipelineContext, address: CacheAddress, prompt: str, attachments: list[Attachment]
) -> dict[str, Any] | None:
    """The tokenize stage's work, done in this (pool) thread; cached like the stage's own. None: not possible here."""
    started = time.perf_counter()
    built = state.prompts.build(context, prompt, attachments)
    if built is None:
        return None
    cost = time.perf_counter() - started
    value = {"ids": built.ids, "messages": built.messages}
    state.cache.put_json(address, {**value, "_cost_s": cost})
    state.cache.record("tokenize", hit=False, cost_s=cost)
    STAGE_SECONDS.labels("tokenize", "miss").observe(cost)
    return value


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobPublic,
    responses={401: {"model": ErrorPublic}, 404: {"model": ErrorPublic}, 429: {"model": ErrorPublic}},
)
async def get_job(
    request: Request,
    job_id: str,
    tenant: Annotated[str, Depends(within_rate)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0,
) -> JobPublic:
    """The job; with ?wait=S, hold the answer until the job is terminal or S seconds pass. Another tenant's job is
    answered exactly like an unknown one (404)."""
    store: Store = request.app.state.store
    if wait > 0:
        return await _wait_terminal(request, store, job_id, wait, tenant)
    return _found(job_id, await run_in_threadpool(store.jobs.load_job, job_id), tenant)


async def _wait_terminal(request: Request, store: Store, job_id: str, wait: float, tenant: str) -> JobPublic:
    """The job once terminal, or as it stands after `wait` seconds. Every await on the announcement channel is
    bounded: a Redis that restarted or stopped answering mid-wait costs this request its wait, never a hang."""
    try:
        async with asyncio.timeout(wait + LISTEN_SLACK_S):
            return await _listen(request, store, job_id, wait, tenant)
    except (TimeoutError, redis.RedisError, OSError) as exc:
        log.info("long-poll on job %s fell back to one read: %r", job_id, exc)
    return _found(job_id, await run_in_threadpool(store.jobs.load_job, job_id), tenant)


async def _listen(request: Request, store: Store, job_id: str, wait: float, tenant: str) -> JobPublic:
    deadline = time.monotonic() + wait
    pubsub = request.app.state.aioredis.pubsub()
    try:
        await pubsub.subscribe(done_channel(job_id))  # subscribe first, then look: no missed announcement
        job = _found(job_id, await run_in_threadpool(store.jobs.load_job, job_id), tenant)
        while not job.terminal and (remaining := deadline - time.monotonic()) > 0:
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(remaining, 1.0))
            job = _found(job_id, await run_in_threadpool(store.jobs.load_job, job_id), tenant)
        return job
    finally:
        await pubsub.aclose()


def _found(job_id: str, job: Job | None, tenant: str) -> JobPublic:
    """The job as its tenant sees it; anyone else learns nothing, not even that it exists."""
    if job is None or job.tenant != tenant:
        raise JobNotFound(f"no job {job_id}")
    return JobPublic.model_validate(job.model_dump())


@router.get("/v1/stats", dependencies=[Depends(within_rate)])
async def stats(request: Request) -> dict[str, Any]:
    """Queue depths, limits and drain rates; the inference watermarks; device time; refusals."""
    monitor: QueueMonitor = request.app.state.monitor
    snapshot = monitor.fresh()
    if snapshot is None:
        try:
            snapshot = await run_in_threadpool(monitor.sample)
        except Exception as exc:
            raise BrokerUnavailable("the broker cannot be reached") from exc
    settings: ApiSettings = request.app.state.settings
    counters = await run_in_threadpool(request.app.state.store.stats.counters)
    gaps = await run_in_threadpool(request.app.state.store.stats.device_gaps)
    return {
        "sampled_at": snapshot.at,
        "queues": {q.name: {"depth": q.depth, "limit": q.limit, "drain_per_s": q.drain_per_s} for q in snapshot.queues},
        "infer_watermarks": {"high": settings.infer_high_watermark, "low": settings.infer_low_watermark},
        **counters,
        "device_idle_gap": idle_gap_summary(gaps),
    }


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this API process, and job counts of the whole deployment."""
    own = await run_in_threadpool(generate_latest, REGISTRY)
    jobs = await run_in_threadpool(generate_latest, request.app.state.metrics)
    return Response(own + jobs, media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when both the broker and the job store answer."""
    settings: ApiSettings = request.app.state.settings
    broker, store = await asyncio.gather(
        run_in_threadpool(_broker_ok, settings.broker_url, settings.redis_tls(settings.broker_url)),
        run_in_threadpool(_store_ok, request.app.state.store),
    )
    body = {"broker": "ok" if broker else "unreachable", "store": "ok" if store else "unreachable"}
    return JSONResponse(body, status_code=200 if broker and store else 503)


def _broker_ok(url: str, tls: dict[str, Any]) -> bool:
    try:
        with Connection(url, connect_timeout=2, ssl=tls or False) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:
        return False


def _store_ok(store: Store) -> bool:
    try:
        return bool(store.client.ping())
    except redis.RedisError:
        return False
