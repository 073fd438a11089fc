"""HTTP routes: submit a job, read it (optionally long-polling), health and readiness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api import idempotency
from api.context import ApiContext, Context, reread
from api.disconnects import ClientWatch, watching
from api.headers import SHOULD_RETRY, job_headers
from api.intake import read_request
from api.pressure import QueueMonitor
from api.schemas import JobList, JobPublic, error_responses
from api.submission import REPLAYED, cancel, submit_job
from api.tenancy import authenticate, within_rate
from stoker.adapters.store import Store
from stoker.adapters.store.keys import ENDED
from stoker.core.batching import idle_gap_summary
from stoker.core.errors import BrokerUnavailable, Cancelled, InvalidRequest, JobAlreadyEnded, JobNotFound
from stoker.core.idempotency import RETRY_COUNT_HEADER, is_automatic_retry
from stoker.core.jobs import JOB_ID, Cursor, Job, JobStatus, new_job_id

log = logging.getLogger(__name__)
router = APIRouter()
#: The longest ?wait= a request may name (the `max_long_poll_s` setting may cut it shorter).
MAX_WAIT_S = 30.0
#: `?wait=S` as OpenAPI documents it; the routes read it themselves (`wait_of`).
WAIT_PARAMETER = {
    "name": "wait",
    "in": "query",
    "required": False,
    "description": "Seconds to hold the answer until the job has ended (long-poll).",
    "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S, "default": 0},
}


def wait_of(request: Request) -> float:
    """The request's `?wait=S` (0 without one), or 422 `invalid_request`. Read here rather than declared as a
    FastAPI query parameter: FastAPI's validation of that one float took 7 % of the API's CPU per submission
    (its dependency solving, measured under admission load with `python -m bench.cost --admission-s`:
    docs/bench/log/2026-12-03-cost-one-request-per-job.md)."""
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    try:
        wait = float(raw)
    except ValueError:
        raise InvalidRequest(f"wait must be a number of seconds, not {raw[:40]!r}") from None
    if not 0 <= wait <= MAX_WAIT_S:  # NaN fails this too
        raise InvalidRequest(f"wait must be from 0 to {MAX_WAIT_S:g} seconds")
    return wait


async def job_id_of_path(job_id: str) -> str:
    """The path's job id, when it has the shape of one (32 lowercase hex digits, as intake makes them).

    Anything else is answered exactly like an unknown job (404 `job_not_found`), before any store call: an id such
    as `<id>:tokens` would otherwise name another key of that job in Redis, and how that read fails would tell a
    live job of another tenant from an unknown one. Async, so FastAPI checks it on the loop, not in its thread
    pool."""
    if not JOB_ID.fullmatch(job_id):
        raise JobNotFound(f"no job {job_id}")
    return job_id


#: A job id from the path, checked after the API key (a request without one is 401 whatever id it names).
JobId = Annotated[str, Depends(job_id_of_path)]


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobPublic,
    responses={
        200: {"model": JobPublic, "description": "The job, ended within `wait`"},
        **error_responses(401, 413, 415, 422, 429, 503),
    },
    openapi_extra={"parameters": [WAIT_PARAMETER]},
)
async def create_job(request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> JSONResponse:
    """Accept a job: validate, store inputs and the job record, enqueue, answer 202 at once; with ?wait=S, hold
    the answer until the job is terminal (then 200 with its result) or S seconds pass (then 202 as it stands).

    While a queue is over its limit the job is refused before its body is read: 429 with Retry-After from the
    queue's measured drain rate, and nothing written. So is a job over its tenant's request rate or jobs in flight
    (429 `rate_limited` / `too_many_jobs_in_flight`).
    """
    wait = wait_of(request)  # before anything is read or made
    key = idempotency.key_of(request.headers, tenant)
    retried = is_automatic_retry(request.headers.get(RETRY_COUNT_HEADER))
    job_id = new_job_id()
    # A POST that waits watches its job from before the job exists, so the job that admission reads back is a read
    # made while watching: the wait needs no read of its own to start from.
    watch = context.announcements.watch(job_id, only=ENDED) if wait > 0 else contextlib.nullcontext()
    with watch as heard:
        submitted = await submit_job(
            context, tenant, key, lambda: read_request(request, context.settings), retried, job_id, watched=wait > 0
        )
        job: Job = submitted.job
        if heard is not None and not job.terminal:
            # One request instead of a POST and a long-poll: the same wait as `GET ?wait=`, once the body is read
            async with watching(request.receive) as client:
                if job.id == job_id:
                    job = await _wait_on(context, client, heard, job, time.monotonic() + wait, tenant)
                else:  # an earlier request's job (an Idempotency-Key, a retry), read before this watch began
                    job = await _wait_terminal(context, client, job.id, wait, tenant)
    headers = {"Location": f"/v1/jobs/{job.id}", **job_headers(job)}
    if submitted.replayed:  # the job an earlier request with this Idempotency-Key made
        headers[REPLAYED] = "true"
    # 202 Accepted unless the answer is the job's end that a `wait` asked for (or a replay): a POST that did not wait
    # answers its job as admission wrote it, whatever a fast device did with it since.
    status = 200 if submitted.replayed or (wait > 0 and job.terminal) else 202
    return JSONResponse(job.model_dump(mode="json"), status_code=status, headers=headers)


@router.get(
    "/v1/jobs",
    response_model=JobList,
    responses=error_responses(401, 422, 429),
)
async def list_jobs(
    context: Context,
    tenant: Annotated[str, Depends(within_rate)],
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: str | None = None,
) -> JobList:
    """The tenant's recent jobs (as long as their records live, `STOKER_JOB_TTL_S`), newest first, `limit` a page,
    only those in `status` if given; pass `next_cursor` back as `cursor` for the next page."""
    start = Cursor.decode(cursor) if cursor else None
    jobs, last = await run_in_threadpool(_page, context.store, tenant, status, limit, start)
    return JobList(data=jobs, next_cursor=last.encode() if last else None)


#: Entries one list request looks through at most for a status filter (a sparse status costs pages, not time).
MAX_SCAN = 1000


def _page(
    store: Store, tenant: str, status: str | None, limit: int, cursor: Cursor | None
) -> tuple[list[JobPublic], Cursor | None]:
    """A page of the tenant's jobs after `cursor`, and where the next one starts (None when nothing is left)."""
    found: list[JobPublic] = []
    scanned = 0
    while len(found) < limit and scanned < MAX_SCAN:
        entries = store.jobs.page(tenant, cursor, limit - len(found) if status is None else 100)
        if not entries:
            return found, None
        for entry, job in zip(entries, store.jobs.load_many([e.job_id for e in entries]), strict=True):
            cursor, scanned = entry, scanned + 1
            if job is not None and job.tenant == tenant and status in (None, job.status):
                found.append(JobPublic.model_validate(job.model_dump()))
                if len(found) == limit:
                    break
    return found, cursor if cursor and store.jobs.page(tenant, cursor, 1) else None


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobPublic,
    responses=error_responses(401, 404, 422, 429),
    openapi_extra={"parameters": [WAIT_PARAMETER]},
)
async def get_job(
    request: Request, response: Response, context: Context, tenant: Annotated[str, Depends(within_rate)], job_id: JobId
) -> Job:
    """The job (as `JobPublic`); with ?wait=S, hold the answer until the job is terminal or S seconds pass.
    Another tenant's job is answered exactly like an unknown one (404)."""
    wait = wait_of(request)
    if wait > 0:
        async with watching(request.receive) as client:
            job = await _wait_terminal(context, client, job_id, wait, tenant)
    else:
        job = _found(job_id, await context.loop.jobs.load_job(job_id), tenant)
    response.headers.update(job_headers(job))
    return job


async def _wait_terminal(context: ApiContext, client: ClientWatch, job_id: str, wait: float, tenant: str) -> Job:
    """The job once terminal, or as it stands after `wait` seconds (at most `max_long_poll_s`), or when the client
    left (the job goes on: only a chat's own client gives its job up). Woken by this process's one announcement
    listener, and looking at least every second anyway: no connection is held per wait, and a Redis that restarted
    mid-wait costs latency, never a hang."""
    until = time.monotonic() + wait
    with context.announcements.watch(job_id, only=ENDED) as event:
        job = _found(job_id, await context.loop.jobs.watch_job(job_id), tenant)
        return await _wait_on(context, client, event, job, until, tenant)


async def _wait_on(
    context: ApiContext, client: ClientWatch, event: asyncio.Event, job: Job, until: float, tenant: str
) -> Job:
    """The job (as read while `event` watched it) once terminal, or as it stands at `until` (at most
    `max_long_poll_s` from now), or when the client left, or by the stop's grace once the server stops."""
    until = min(until, time.monotonic() + context.settings.max_long_poll_s)
    announcements = context.announcements
    client.wakes.add(event)
    try:
        while not job.terminal and not client.left and (remaining := announcements.until(until) - time.monotonic()) > 0:
            await announcements.wait(event, remaining)
            job = _found(job.id, await reread(context, job.id), tenant)
    finally:
        client.wakes.discard(event)
    return job


@router.delete(
    "/v1/jobs/{job_id}",
    response_model=JobPublic,
    responses=error_responses(401, 404, 409, 429),
)
async def cancel_job(
    context: Context, tenant: Annotated[str, Depends(within_rate)], job_id: JobId
) -> JobPublic | JSONResponse:
    """Cancel a job that has not ended: it ends `cancelled` at once, its remaining work is skipped or stopped, and
    it never reaches the model. 409 `job_already_ended` if it had ended, with `job` {id, status} beside the error;
    another tenant's job is 404 like an unknown one."""
    store = context.store
    _found(job_id, await context.loop.jobs.load_job(job_id), tenant)
    cancelled = await run_in_threadpool(cancel, store, job_id, Cancelled("cancelled by its client", stage="api"))
    job = _found(job_id, await context.loop.jobs.load_job(job_id), tenant)
    if not cancelled:
        error = JobAlreadyEnded(f"job {job_id} already ended: {job.status}")
        body = {**error.envelope(), "job": {"id": job_id, "status": job.status}}
        return JSONResponse(body, status_code=409, headers={**job_headers(job), SHOULD_RETRY: "false"})
    return JSONResponse(job.model_dump(mode="json"), headers=job_headers(job))


def _found(job_id: str, job: Job | None, tenant: str) -> JobPublic:
    """The job as its tenant sees it; anyone else learns nothing, not even that it exists."""
    if job is None or job.tenant != tenant:
        raise JobNotFound(f"no job {job_id}")
    return JobPublic.model_validate(job.model_dump())


@router.get("/v1/stats")
async def stats(context: Context, tenant: Annotated[str, Depends(within_rate)]) -> dict[str, Any]:
    """Queue depths, limits and drain rates; the inference watermarks; device time; refusals; with keys on, what
    the caller's tenant holds against its limits."""
    monitor, settings = context.monitor, context.settings
    snapshot = monitor.fresh()
    if snapshot is None:
        try:
            snapshot = await run_in_threadpool(monitor.sample)
        except Exception as exc:
            raise BrokerUnavailable("the broker cannot be reached") from exc
    counters = await run_in_threadpool(context.store.stats.counters)
    gaps = await run_in_threadpool(context.store.stats.device_gaps)
    return {
        "sampled_at": snapshot.at,
        "queues": {q.name: {"depth": q.depth, "limit": q.limit, "drain_per_s": q.drain_per_s} for q in snapshot.queues},
        "infer_watermarks": {
            "high": settings.infer_high_watermark,
            "low": settings.infer_low_watermark,
            "held": snapshot.held,  # interactive jobs are held for the low watermark (the API sends its own too)
        },
        **counters,
        "device_idle_gap": idle_gap_summary(gaps),
        "classes": {"batch": await run_in_threadpool(context.store.openai_batches.line_stats)},
        **({"tenant": await _tenant_usage(context, tenant)} if settings.auth else {}),
    }


async def _tenant_usage(context: ApiContext, tenant: str) -> dict[str, Any]:
    """What a tenant holds now against its limits: queue messages and input bytes of its unfinished jobs, and its
    stored results (how many, their bytes), with each limit (0: none)."""
    usage = await run_in_threadpool(context.store.tenants.usage, tenant)
    limits = context.settings.tenant_limits
    return {
        "name": tenant,
        "queue_messages": usage.messages,
        "stored_bytes": usage.stored_bytes,
        "max_stored_bytes": limits.max_stored_bytes,
        "results": usage.results,
        "result_bytes": usage.result_bytes,
        "max_result_bytes": limits.max_result_bytes,
    }


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(context: Context) -> JSONResponse:
    """Ready when both the broker and the job store answer."""
    broker, store = await asyncio.gather(
        _within(run_in_threadpool(_broker_ok, context.monitor), 3.0),
        _within(run_in_threadpool(_store_ok, context.store), context.settings.store_timeout_s + 1),
    )
    body = {"broker": "ok" if broker else "unreachable", "store": "ok" if store else "unreachable"}
    return JSONResponse(body, status_code=200 if broker and store else 503)


async def _within(check: Awaitable[bool], timeout_s: float) -> bool:
    """A readiness check's answer; False when it does not come in time (a stopped server accepts connections
    and then never answers)."""
    try:
        return await asyncio.wait_for(check, timeout_s)
    except TimeoutError:
        return False


def _broker_ok(monitor: QueueMonitor) -> bool:
    """The broker answered the queue monitor within the last second, or answers it now (over the monitor's one
    connection: a readiness probe opens none of its own)."""
    latest = monitor.latest
    if latest is not None and time.time() - latest.at <= 1.0:
        return True
    try:
        monitor.sample()
        return True
    except Exception:
        return False


def _store_ok(store: Store) -> bool:
    try:
        return bool(store.client.ping())
    except redis.RedisError:
        return False
