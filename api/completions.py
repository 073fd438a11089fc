"""OpenAI's legacy Completions in front of the pipeline: `POST /v1/completions`.

A completion is a chat job of one raw prompt: the model continues the prompt as it was sent, without the chat
template (`stoker.core.prompting.raw_prompt`). It goes the chat's way (tenant auth, admission, cache, batching,
deadline, `x-stoker-*` headers; `api.chat` holds the wait and its endings) and is answered as a `text_completion`,
or streamed as `text_completion` chunks ending with `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from api import idempotency
from api.announcements import POLL_S
from api.chat import (
    answer_deadline,
    cut_by_stop,
    facts,
    job_failure,
    refusal,
    stopping_answer,
    stream_job,
    usage_of,
    wait_job,
)
from api.chat_intake import ON_INPUT_ERROR_HEADER, OnInputError, accept_spec, on_input_error_header
from api.chat_schemas import ChatCompletionCreate
from api.completion_schemas import (
    Completion,
    CompletionChoice,
    CompletionCreate,
    completion_chunk,
    completion_logprobs,
)
from api.context import ApiContext, Context
from api.disconnects import ClientWatch, watching
from api.headers import JOB_ID, job_headers
from api.intake import AcceptedRequest, first_error
from api.limits import read_json_body
from api.schemas import error_responses
from api.submission import REPLAYED, submit_job
from api.tenancy import authenticate
from stoker.core.errors import ClientGone, InvalidRequest
from stoker.core.idempotency import RETRY_COUNT_HEADER, is_automatic_retry
from stoker.core.jobs import ChoiceInfo, Job
from stoker.settings import ApiSettings

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses=error_responses(400, 401, 404, 413, 415, 422, 429, 499, 503, 504),
)
async def completions(request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """Run the completion as a stoker job and answer when it ends (or stream it with `stream: true`)."""
    settings = context.settings
    spec: list[ChatCompletionCreate] = []
    chosen = on_input_error_header(request.headers.get(ON_INPUT_ERROR_HEADER))

    async def read() -> AcceptedRequest:
        body = await read_json_body(request, settings.max_json_values)
        parsed, accepted = await run_in_threadpool(accept_completion, body, settings, chosen)
        spec.append(parsed)
        return accepted

    key = idempotency.key_of(request.headers, tenant)
    retried = is_automatic_retry(request.headers.get(RETRY_COUNT_HEADER))
    submitted = await submit_job(context, tenant, key, read, retried)
    job, replayed = submitted.job, {REPLAYED: "true"} if submitted.replayed else {}
    until = answer_deadline(job, settings)
    async with watching(request.receive) as client:
        if spec[0].stream:
            usage = bool(spec[0].stream_options and spec[0].stream_options.include_usage)
            return _start_stream(context, client, job, tenant, until, usage, replayed)
        ended = await wait_job(context, client, job.id, tenant, until)
        if ended is not None and cut_by_stop(context.announcements, ended, until):
            return stopping_answer(ended, replayed)
    return _answer(job.id, ended, settings.public_model_name, replayed)


def accept_completion(
    body: bytes, settings: ApiSettings, on_input_error: OnInputError | None = None
) -> tuple[ChatCompletionCreate, AcceptedRequest]:
    """The request as the chat it runs as, and the job it makes (the chat's checks and limits)."""
    try:
        chat = ChatCompletionCreate.model_validate(CompletionCreate.model_validate_json(body).as_chat())
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc
    return chat, accept_spec(chat, settings, on_input_error, raw=True)


def _answer(job_id: str, job: Job | None, model: str, extra: dict[str, str]) -> JSONResponse:
    """The ended job as a `text_completion`, or as the error it ended with (499 when its client left)."""
    if job is None:
        return JSONResponse(ClientGone().envelope(), status_code=499, headers={JOB_ID: job_id, **extra})
    headers = {**job_headers(job), **extra}
    failure = job_failure(job)
    if failure is not None:
        return refusal(failure, headers)
    return JSONResponse(completion(job, model).model_dump(mode="json"), headers=headers)


def completion(job: Job, model: str) -> Completion:
    """The ended job as OpenAI's `text_completion`."""
    assert job.result is not None
    result = job.result
    first = ChoiceInfo(text=result.text, finish_reason=result.finish_reason, logprobs=result.logprobs)
    return Completion(
        id=f"cmpl-{job.id}",
        created=int(time.time()),
        model=model,
        choices=[_choice(index, answer) for index, answer in enumerate([first, *result.more])],
        usage=usage_of(job),
        stoker=facts(job),
    )


def _choice(index: int, answer: ChoiceInfo) -> CompletionChoice:
    logprobs = completion_logprobs(answer.logprobs) if answer.logprobs is not None else None
    return CompletionChoice(index=index, text=answer.text, logprobs=logprobs, finish_reason=answer.finish_reason)


def _start_stream(
    context: ApiContext, client: ClientWatch, job: Job, tenant: str, until: float, usage: bool, extra: dict[str, str]
) -> EventSourceResponse:
    """The answer streamed (a completion has no inputs to read first: it starts at once)."""
    settings = context.settings
    stopping = anyio.Event()  # set by sse-starlette when the server is asked to stop
    events = _stream(context, job.id, tenant, settings.public_model_name, until, usage, stopping)
    return EventSourceResponse(
        events,
        ping=settings.sse_keepalive_s,
        headers={**job_headers(job), **extra},
        sep="\n",
        shutdown_event=stopping,
        shutdown_grace_period=settings.stop_grace_s + POLL_S + 1.0,  # as the chat's stream (`api.chat`)
    )


def _stream(
    context: ApiContext, job_id: str, tenant: str, model: str, until: float, usage: bool, stopping: anyio.Event
) -> AsyncIterator[dict[str, str]]:
    """The answer as `text_completion` chunks, piece by piece where the backend streams, then the finish reason
    (and usage), ending with `[DONE]`: the chat's stream (`api.chat.stream_job`) in a completion's chunks."""
    ids = (f"cmpl-{job_id}", int(time.time()), model)

    def piece(text: str) -> dict[str, Any]:
        return completion_chunk(*ids, text)

    def closing(job: Job, streamed: bool) -> list[dict[str, Any]]:
        return _closing(job, ids, streamed, usage)

    return stream_job(context, job_id, tenant, until, stopping, opening=[], piece=piece, closing=closing)


def _closing(job: Job, ids: tuple[str, int, str], streamed: bool, usage: bool) -> list[dict[str, Any]]:
    """What ends a stream: the answer (if it was not streamed), the finish reason and usage; or the error."""
    failure = job_failure(job)
    if failure is not None:
        return [failure[1]]
    result = job.result
    assert result is not None
    bodies = [] if streamed or not result.text else [completion_chunk(*ids, result.text)]
    bodies.append(completion_chunk(*ids, "", finish_reason=result.finish_reason))
    if usage:
        bodies.append(completion_chunk(*ids, usage=usage_of(job)))
    return bodies
