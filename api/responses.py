"""OpenAI's Responses API in front of the pipeline: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel` and `GET /v1/responses/{id}/input_items`.

A response is a chat job (`stoker.core.responses` makes the request the chat it runs as): the chat's tenant auth,
admission, cache, stages, batching, deadline and `x-stoker-*` headers, and its wait and endings (`api.chat`). A
response is kept for its tenant (`store`, the default) for `job_ttl_s`, so that a later request may follow it
(`previous_response_id`); another tenant's is answered as one that does not exist.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api import idempotency
from api.chat import answer_deadline, cut_by_stop, job_failure, load_job, refusal, stopping_answer, wait_job
from api.chat_intake import ON_INPUT_ERROR_HEADER, OnInputError, accept_spec, on_input_error_header
from api.chat_schemas import ChatCompletionCreate
from api.context import ApiContext, Context
from api.disconnects import watching
from api.headers import JOB_ID, job_headers
from api.intake import AcceptedRequest, first_error
from api.limits import read_json_body
from api.responses_stream import start_stream
from api.schemas import error_responses
from api.submission import REPLAYED, Submitted, cancel, submit_job
from api.tenancy import authenticate
from stoker.adapters.store.responses import ResponseRepository, StoredResponse
from stoker.core.errors import Cancelled, ClientGone, InvalidRequest, ResponseNotFound
from stoker.core.idempotency import RETRY_COUNT_HEADER, is_automatic_retry
from stoker.core.jobs import JOB_ID as JOB_ID_FORM
from stoker.core.responses import ResponseCreate, as_history, finished, input_messages, response_object
from stoker.settings import ApiSettings

router = APIRouter()
ERRORS = error_responses(400, 401, 404, 413, 415, 422, 429, 499, 503, 504)


@router.post("/v1/responses", responses=ERRORS)
async def create_response(request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """Run the response as a stoker job and answer when it ends (or stream its events with `stream: true`)."""
    settings = context.settings
    taken: list[tuple[ResponseCreate, list[dict[str, Any]]]] = []
    chosen = on_input_error_header(request.headers.get(ON_INPUT_ERROR_HEADER))

    async def read() -> AcceptedRequest:
        body = await read_json_body(request, settings.max_json_values)
        parsed = await run_in_threadpool(_parse, body)
        history = await _history(context, tenant, parsed.previous_response_id)
        chat, accepted = await run_in_threadpool(accept_response, parsed, history, settings, chosen)
        turns = chat.model_dump(exclude_none=True)["messages"]
        taken.append((parsed, turns[1:] if parsed.instructions else turns))  # instructions are not carried on
        return accepted

    key = idempotency.key_of(request.headers, tenant)
    retried = is_automatic_retry(request.headers.get(RETRY_COUNT_HEADER))
    submitted = await submit_job(context, tenant, key, read, retried)
    return await _answer(context, request, tenant, submitted, taken[0])


def _parse(body: bytes) -> ResponseCreate:
    try:
        return ResponseCreate.model_validate_json(body)
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc


def accept_response(
    parsed: ResponseCreate, history: list[dict[str, Any]], settings: ApiSettings, on_input_error: OnInputError | None
) -> tuple[ChatCompletionCreate, AcceptedRequest]:
    """The chat a response runs as, and the job it makes (the chat's checks and limits)."""
    try:
        chat = ChatCompletionCreate.model_validate(parsed.as_chat(history))
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc
    return chat, accept_spec(chat, settings, on_input_error)


async def _answer(
    context: ApiContext,
    request: Request,
    tenant: str,
    submitted: Submitted,
    taken: tuple[ResponseCreate, list[dict[str, Any]]],
) -> Any:
    """Keep the response (with `store`), then wait for its job and answer, or stream it."""
    parsed, messages = taken
    job, replayed = submitted.job, {REPLAYED: "true"} if submitted.replayed else {}
    response_id, created_at = f"resp_{job.id}", time.time()
    own = StoredResponse(job_id=job.id, created_at=created_at, request=parsed, messages=messages)
    if isinstance(parsed.input, list):
        own.input_items = parsed.input
    repository = _responses(context)
    if parsed.store:
        await run_in_threadpool(repository.put, response_id, tenant, own)
    until = answer_deadline(job, context.settings)
    async with watching(request.receive) as client:
        if parsed.stream:
            return await start_stream(context, client, job, tenant, until, own, replayed)
        ended = await wait_job(context, client, job.id, tenant, until)
        if ended is not None and cut_by_stop(context.announcements, ended, until):
            return stopping_answer(ended, replayed)
    if ended is None:
        return JSONResponse(ClientGone().envelope(), status_code=499, headers={JOB_ID: job.id, **replayed})
    headers = {**job_headers(ended), **replayed}
    body = finished(response_id, created_at, parsed, ended) if ended.terminal else None
    if body is not None and parsed.store:
        await run_in_threadpool(repository.put, response_id, tenant, own.model_copy(update={"response": body}))
    failure = job_failure(ended)  # a job that has not ended by its deadline, or ended without an answer
    if failure is not None:
        return refusal(failure, headers)
    assert body is not None  # an ended job with an answer
    return JSONResponse(body, headers=headers)


def _responses(context: ApiContext) -> ResponseRepository:
    return ResponseRepository(context.store.client, ttl_s=context.settings.job_ttl_s)


async def _history(context: ApiContext, tenant: str, previous: str | None) -> list[dict[str, Any]]:
    """The conversation a response follows: the previous response's turns and its output, as chat messages."""
    if previous is None:
        return []
    stored = await _stored(context, tenant, previous, param="previous_response_id")
    if stored.response is None:
        raise InvalidRequest(f"the response {previous} has not ended yet", param="previous_response_id")
    return as_history(stored.messages, stored.response["output"])


async def _stored(context: ApiContext, tenant: str, response_id: str, param: str | None = None) -> StoredResponse:
    """The tenant's stored response, made whole from its job once that ended; 404 if there is none."""
    known = JOB_ID_FORM.fullmatch(response_id.removeprefix("resp_"))  # no other id names a key of the store
    stored = await run_in_threadpool(_responses(context).get, response_id, tenant) if known else None
    if stored is None:
        raise ResponseNotFound(f"no response {response_id[:80]}", param=param)
    if stored.response is None:
        job = await load_job(context, stored.job_id, tenant)
        if job.terminal:
            stored.response = finished(response_id, stored.created_at, stored.request, job)
            await run_in_threadpool(_responses(context).put, response_id, tenant, stored)
    return stored


@router.get("/v1/responses/{response_id}", responses=error_responses(401, 404, 429))
async def retrieve_response(response_id: str, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """A stored response: its answer once its job ended, `in_progress` before."""
    stored = await _stored(context, tenant, response_id)
    return stored.response or _in_progress(response_id, stored)


def _in_progress(response_id: str, stored: StoredResponse) -> dict[str, Any]:
    return response_object(response_id, stored.created_at, stored.request, "in_progress", [])


@router.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 429))
async def delete_response(response_id: str, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """Forget a stored response (its job is not touched)."""
    await _stored(context, tenant, response_id)
    await run_in_threadpool(_responses(context).delete, response_id, tenant)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", responses=error_responses(401, 404, 429))
async def cancel_response(response_id: str, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """Cancel a response whose job has not ended (its job is cancelled); one that ended is answered as it is."""
    stored = await _stored(context, tenant, response_id)
    if stored.response is not None:
        return stored.response
    await run_in_threadpool(cancel, context.store, stored.job_id, Cancelled("cancelled by its client", stage="api"))
    return (await _stored(context, tenant, response_id)).response or _in_progress(response_id, stored)


@router.get("/v1/responses/{response_id}/input_items", responses=error_responses(401, 404, 429))
async def list_input_items(response_id: str, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """A stored response's input, as items (a string input is one user message), newest first as OpenAI lists
    them by default."""
    stored = await _stored(context, tenant, response_id)
    items = stored.input_items or [_as_item(m) for m in input_messages(stored.request.input)]
    data = [{"id": f"item_{response_id}_{n}", "type": "message", **item} for n, item in enumerate(items)][::-1]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False}


def _as_item(message: dict[str, Any]) -> dict[str, Any]:
    """A string input's one message as an input item (its text an `input_text` part)."""
    return {**message, "content": [{"type": "input_text", "text": message["content"]}]}
