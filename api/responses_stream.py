"""A streamed response (`POST /v1/responses` with `stream: true`): the Responses API's events
(`stoker.core.response_events`) over the chat's stream of a job's answer (`api.chat.stream_job`).

As the chat's stream, it starts once the job's inputs are read (its headers then say whether it is degraded, and a
job that failed on an input is refused before the stream starts); a stored response is kept whole once its stream
ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from api.announcements import POLL_S
from api.chat import cut_by_stop, job_failure, refusal, stopping_answer, stream_job, wait_job
from api.context import ApiContext
from api.disconnects import ClientWatch
from api.headers import JOB_ID, job_headers
from stoker.adapters.store.responses import ResponseRepository, StoredResponse
from stoker.core.errors import ClientGone
from stoker.core.jobs import Job
from stoker.core.response_events import ResponseEvents
from stoker.core.responses import finished, response_object

#: The key of a body that carries several events (one piece may open the message before its delta).
_EVENTS = "events"


async def start_stream(
    context: ApiContext,
    client: ClientWatch,
    job: Job,
    tenant: str,
    until: float,
    stored: StoredResponse,
    extra: dict[str, str],
) -> Any:
    """The response's events, once the job's inputs are read; or the refusal of a job that failed on one."""
    if job.inputs:
        settled = await wait_job(context, client, job.id, tenant, until, settled=True)
        if settled is None:
            return JSONResponse(ClientGone().envelope(), status_code=499, headers={JOB_ID: job.id, **extra})
        if cut_by_stop(context.announcements, settled, until, settled=True):
            return stopping_answer(settled, extra)
        failure = job_failure(settled) if settled.terminal else None
        if failure is not None:
            return refusal(failure, {**job_headers(settled), **extra})
        job = settled
    settings = context.settings
    stopping = anyio.Event()  # set by sse-starlette when the server is asked to stop
    return EventSourceResponse(
        _events(context, job.id, tenant, until, stored, stopping),
        ping=settings.sse_keepalive_s,
        headers={**job_headers(job), **extra},
        sep="\n",
        shutdown_event=stopping,
        shutdown_grace_period=settings.stop_grace_s + POLL_S + 1.0,  # as the chat's stream (`api.chat`)
    )


async def _events(
    context: ApiContext, job_id: str, tenant: str, until: float, stored: StoredResponse, stopping: anyio.Event
) -> AsyncIterator[dict[str, str]]:
    """`stream_job`'s events as the Responses API's: each body of several events sent as those events, by name;
    an error (the server stopping) as it is; no `[DONE]`, which the Responses API does not send."""
    response_id, request = f"resp_{job_id}", stored.request
    started = response_object(response_id, stored.created_at, request, "in_progress", [])
    events = ResponseEvents(started, gated=bool(request.tools) and request.tool_choice != "none")

    def piece(text: str) -> dict[str, Any]:
        return {_EVENTS: events.text(text)}

    def closing(job: Job, streamed: bool) -> list[dict[str, Any]]:
        final = finished(response_id, stored.created_at, request, job)
        if job.terminal:
            ended.append(stored.model_copy(update={"response": final}))
        return [{_EVENTS: events.finish(final)}]

    ended: list[StoredResponse] = []
    sent = stream_job(
        context, job_id, tenant, until, stopping, opening=[{_EVENTS: events.opening()}], piece=piece, closing=closing
    )
    async for event in sent:
        if event["data"] == "[DONE]":
            continue
        body = json.loads(event["data"])
        for one in body.get(_EVENTS, [body]):
            yield {"event": one.get("type", "error"), "data": json.dumps(one, separators=(",", ":"))}
    if ended and request.store:  # kept whole now, rather than when it is next read
        repository = ResponseRepository(context.store.client, ttl_s=context.settings.job_ttl_s)
        await run_in_threadpool(repository.put, response_id, tenant, ended[0])
