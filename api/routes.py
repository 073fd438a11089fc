"""HTTP routes: submit a job, read it (optionally long-polling), health and readiness."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from kombu.connection import Connection
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.concurrency import run_in_threadpool

from api.intake import AcceptedRequest, read_request
from api.pressure import QueueMonitor
from api.schemas import ErrorPublic, JobPublic
from stoker.cache import StageCache, prompt_address
from stoker.core.prompting import attachment_for
from stoker.deadlines import deadline_for
from stoker.errors import BrokerUnavailable, JobNotFound, Overloaded
from stoker.jobs import InputRecord, Job, image_hashes
from stoker.metrics import ADMISSIONS
from stoker.predictor import ModelRequest
from stoker.settings import ApiSettings
from stoker.store import JobStore, done_channel
from stoker.tracing import carrier, trace_id_hex, tracer
from tasks.pipeline import Start, Submitter

log = logging.getLogger(__name__)
router = APIRouter()
MAX_WAIT_S = 30.0


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobPublic,
    responses={
        413: {"model": ErrorPublic},
        415: {"model": ErrorPublic},
        422: {"model": ErrorPublic},
        429: {"model": ErrorPublic},
        503: {"model": ErrorPublic},
    },
)
async def create_job(request: Request) -> JSONResponse:
    """Accept a job: validate, store inputs and the job record, enqueue, answer 202 at once.

    While a queue is over its limit the job is refused before its body is read: 429 with Retry-After from the
    queue's measured drain rate, and nothing written.
    """
    settings: ApiSettings = request.app.state.settings
    refusal = request.app.state.monitor.refusal()
    if refusal is not None:
        ADMISSIONS.labels("refused").inc()
        await run_in_threadpool(request.app.state.store.count_refusal, refusal.queue)
        raise Overloaded(
            f"queue {refusal.queue} holds {refusal.depth} messages (limit {refusal.limit})",
            retry_after_s=refusal.retry_after_s,
        )
    accepted = await read_request(request, settings)
    state = request.app.state
    try:
        job = await run_in_threadpool(_admit, state.store, state.cache, state.submitter, accepted, settings)
    except BrokerUnavailable:
        ADMISSIONS.labels("unavailable").inc()
        raise
    ADMISSIONS.labels("accepted").inc()
    return JSONResponse(job.model_dump(mode="json"), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})


def _admit(
    store: JobStore, cache: StageCache, submitter: Submitter, accepted: AcceptedRequest, settings: ApiSettings
) -> Job:
    """Write inputs and record before enqueueing, so no worker can see a job that is not stored.

    A job whose inputs are all preprocessed in the cache skips the CPU preprocessing queues; one whose whole
    prompt was tokenized before goes straight to the inference queue.
    """
    job_id = uuid.uuid4().hex
    records = [
        InputRecord(index=i, kind=item.kind, content_hash=item.digest, size_bytes=len(item.data))
        for i, item in enumerate(accepted.inputs)
    ]
    start, records, request = _shortcut(cache, accepted.prompt, records)
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
                store.put_blob(item.digest, item.data)
            store.create_job(job_id, accepted.prompt, records, now, deadline, accepted.deadline_ms, traced)
            if request is not None:
                store.hand_off(job_id, request, rev=None)
        except redis.RedisError as exc:
            raise BrokerUnavailable("the job store cannot be reached") from exc
        try:
            tokens = len(request.prompt_ids) if request else None
            submitter.submit(job_id, records, start=start, deadline=deadline.at, prompt_tokens=tokens)
        except Exception as exc:
            log.warning("could not enqueue job %s: %r", job_id, exc)
            store.delete_job(job_id)
            raise BrokerUnavailable("the broker cannot be reached") from exc
    job = store.load_job(job_id)
    assert job is not None
    return job


def _shortcut(
    cache: StageCache, prompt: str, records: list[InputRecord]
) -> tuple[Start, list[InputRecord], ModelRequest | None]:
    """How far the cache lets a job skip: to tokenize (every input cached), or to inference (its prompt too)."""
    context = cache.context()
    if context is None:
        return "preprocess", records, None
    filled = cache.get_inputs(context.identity, records) if records else []
    if filled is None:
        return "preprocess", records, None
    filled = [f.model_copy(update={"size_bytes": r.size_bytes}) for f, r in zip(filled, records, strict=True)]
    found = cache.get_json(prompt_address(context, prompt, [attachment_for(r) for r in filled]))
    if found is None:
        return "tokenize", filled, None
    cache.record("tokenize", hit=True, cost_s=float(found.get("_cost_s", 0.0)))
    request = ModelRequest([int(i) for i in found["ids"]], found.get("messages", []), image_hashes(filled))
    return "infer", filled, request


@router.get("/v1/jobs/{job_id}", response_model=JobPublic, responses={404: {"model": ErrorPublic}})
async def get_job(request: Request, job_id: str, wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0) -> JobPublic:
    """The job; with ?wait=S, hold the answer until the job is terminal or S seconds pass."""
    store: JobStore = request.app.state.store
    if wait > 0:
        return await _wait_terminal(request, store, job_id, wait)
    return _found(job_id, await run_in_threadpool(store.load_job, job_id))


async def _wait_terminal(request: Request, store: JobStore, job_id: str, wait: float) -> JobPublic:
    deadline = time.monotonic() + wait
    pubsub = request.app.state.aioredis.pubsub()
    try:
        await pubsub.subscribe(done_channel(job_id))  # subscribe first, then look: no missed announcement
        job = _found(job_id, await run_in_threadpool(store.load_job, job_id))
        while not job.terminal and (remaining := deadline - time.monotonic()) > 0:
            await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(remaining, 1.0))
            job = _found(job_id, await run_in_threadpool(store.load_job, job_id))
        return job
    finally:
        await pubsub.aclose()


def _found(job_id: str, job: Job | None) -> JobPublic:
    if job is None:
        raise JobNotFound(f"no job {job_id}")
    return JobPublic.model_validate(job.model_dump())


@router.get("/v1/stats")
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
    counters = await run_in_threadpool(request.app.state.store.counters)
    return {
        "sampled_at": snapshot.at,
        "queues": {q.name: {"depth": q.depth, "limit": q.limit, "drain_per_s": q.drain_per_s} for q in snapshot.queues},
        "infer_watermarks": {"high": settings.infer_high_watermark, "low": settings.infer_low_watermark},
        **counters,
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
        run_in_threadpool(_broker_ok, settings.broker_url),
        run_in_threadpool(_store_ok, request.app.state.store),
    )
    body = {"broker": "ok" if broker else "unreachable", "store": "ok" if store else "unreachable"}
    return JSONResponse(body, status_code=200 if broker and store else 503)


def _broker_ok(url: str) -> bool:
    try:
        with Connection(url, connect_timeout=2) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1, timeout=2)
        return True
    except Exception:
        return False


def _store_ok(store: JobStore) -> bool:
    try:
        return bool(store.redis.ping())
    except redis.RedisError:
        return False
