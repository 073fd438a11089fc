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
from starlette.concurrency import run_in_threadpool

from api.chat import open_stream, stream_job
from api.context import ApiContext
from api.disconnects import ClientWatch
from stoker.adapters.store.responses import ResponseRepository, StoredResponse
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
    """The response's events, once the job's inputs are read (`api.chat.open_stream`); or the refusal of a job
    that failed on one."""

    def events(settled: Job, stopping: anyio.Event) -> AsyncIterator[dict[str, str]]:
        return _events(context, settled.id, tenant, until, stored, stopping)

    return await open_stream(context, client, job, tenant, until, extra, events)


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
