"""OpenAI's Chat Completions in front of the pipeline: `POST /v1/chat/completions` and `GET /v1/models`.

A chat is a stoker job like any other (same intake, tenant auth, admission control, cache, stages, batching and
deadline; `GET /v1/jobs/{id}` shows it); this front holds the connection until the job ends and answers in
OpenAI's shape, or streams it as Server-Sent Events: once the job's inputs are read, the role chunk, comment
keep-alives while it waits for the model, then the answer piece by piece where the backend streams (the `openai`
backend passes the server's stream on) or in one piece. Every answer names its job (`x-stoker-job-id`) and the codes
of the inputs that could not be read (`x-stoker-degraded`). A client that goes away gives its job up: it is ended
before the model.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from api import idempotency
from api.announcements import POLL_S, Announcements
from api.chat_intake import ON_INPUT_ERROR_HEADER, on_input_error_header, read_chat
from api.chat_schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionCreate,
    Choice,
    ChoiceLogprobs,
    InputFacts,
    ModelCard,
    ModelList,
    StokerFacts,
    Usage,
    chunk,
)
from api.context import ApiContext, Context, reread
from api.disconnects import ClientWatch, watching
from api.headers import JOB_ID, SHOULD_RETRY, job_headers, retry_headers
from api.intake import AcceptedRequest
from api.schemas import error_responses
from api.submission import REPLAYED, cancel, submit_job
from api.tenancy import authenticate, within_rate
from stoker.adapters.store import Store
from stoker.core.errors import (
    ClientGone,
    DeadlineExceeded,
    ModelNotFound,
    ServerStopping,
    StokerError,
    error_envelope,
)
from stoker.core.idempotency import RETRY_COUNT_HEADER, is_automatic_retry
from stoker.core.jobs import ChoiceInfo, ErrorInfo, Job, degraded_codes
from stoker.core.tool_stream import ToolCallStream
from stoker.core.tools import drop_unclosed_call
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)
router = APIRouter()

#: How long after its deadline an answer is waited for (the reaper ends an overdue job within it).
DEADLINE_SLACK_S = 5.0


def answer_deadline(job: Job, settings: ApiSettings) -> float:
    """The monotonic time until which a job's answer is waited for: its deadline, and the reaper's slack after it."""
    return time.monotonic() + (job.deadline_ms or settings.deadline_ms) / 1000 + DEADLINE_SLACK_S


_STARTED = int(time.time())


@router.get("/v1/models", response_model=ModelList, dependencies=[Depends(within_rate)])
async def list_models(context: Context) -> ModelList:
    """The model served here, in OpenAI's list shape, with the most new tokens one answer may have."""
    return ModelList(data=[_card(context)])


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    dependencies=[Depends(within_rate)],
    responses=error_responses(401, 404, 429),
)
async def retrieve_model(model_id: str, context: Context) -> ModelCard:
    """The model served here by its id (`client.models.retrieve`); any other id is 404 `model_not_found`. The path
    takes an id with slashes, as a Hugging Face name has."""
    if model_id != context.settings.public_model_name:
        raise ModelNotFound(f"the model `{model_id}` does not exist here", param="model")
    return _card(context)


def _card(context: ApiContext) -> ModelCard:
    settings = context.settings
    return ModelCard(id=settings.public_model_name, created=_STARTED, max_tokens_cap=settings.max_tokens_cap)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=error_responses(400, 401, 404, 413, 415, 422, 429, 499, 503, 504),
)
async def chat_completions(request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Any:
    """Run the chat as a stoker job and answer when it ends (or stream the answer with `stream: true`)."""
    settings = context.settings
    spec: list[ChatCompletionCreate] = []
    chosen = on_input_error_header(request.headers.get(ON_INPUT_ERROR_HEADER))

    async def read() -> AcceptedRequest:
        parsed, accepted = await read_chat(request, settings, chosen)
        spec.append(parsed)
        return accepted

    key = idempotency.key_of(request.headers, tenant)
    retried = is_automatic_retry(request.headers.get(RETRY_COUNT_HEADER))
    submitted = await submit_job(context, tenant, key, read, retried)
    job, replayed = submitted.job, {REPLAYED: "true"} if submitted.replayed else {}
    until = answer_deadline(job, settings)
    async with watching(request.receive) as client:
        if spec[0].stream:
            return await _start_stream(context, client, job, tenant, until, spec[0], replayed)
        ended = await wait_job(context, client, job.id, tenant, until)
        if ended is not None and cut_by_stop(context.announcements, ended, until):
            return stopping_answer(ended, replayed)
    return _answer(job.id, ended, settings.public_model_name, replayed)


def _answer(job_id: str, job: Job | None, model: str, extra: dict[str, str]) -> JSONResponse:
    """The ended job as a `chat.completion`, or as the error it ended with (499 when its client left)."""
    if job is None:
        return JSONResponse(ClientGone().envelope(), status_code=499, headers={JOB_ID: job_id, **extra})
    headers = {**job_headers(job), **extra}
    failure = job_failure(job)
    if failure is not None:
        return refusal(failure, headers)
    return JSONResponse(completion(job, model).model_dump(mode="json"), headers=headers)


def stopping_answer(job: Job, extra: dict[str, str]) -> JSONResponse:
    """The answer to a chat whose wait the server's stop ended: 503 `server_stopping`, which the openai client
    retries (an automatic retry, recognised by its fingerprint, waits on this same job wherever it lands); its job
    goes on, its answer at `/v1/jobs/{id}`."""
    stopping = server_stopped(job.id)
    headers = {**job_headers(job), **extra, **retry_headers(stopping)}
    return JSONResponse(stopping.envelope(), status_code=stopping.http_status, headers=headers)


def refusal(failure: tuple[int, dict[str, Any]], headers: dict[str, str]) -> JSONResponse:
    """A job's failure as an answer. The client is told a retry will not help: the same request retried within
    the retry window gets this same job back."""
    status, body = failure
    return JSONResponse(body, status_code=status, headers={**headers, SHOULD_RETRY: "false"})


async def _start_stream(
    context: ApiContext,
    client: ClientWatch,
    job: Job,
    tenant: str,
    until: float,
    spec: ChatCompletionCreate,
    extra: dict[str, str],
) -> Any:
    """A streamed `chat.completion.chunk` answer (`open_stream`)."""
    usage = bool(spec.stream_options and spec.stream_options.include_usage)
    model = context.settings.public_model_name

    def events(settled: Job, stopping: anyio.Event) -> AsyncIterator[dict[str, str]]:
        return _stream(context, settled.id, tenant, model, until, usage, stopping, _offered(settled))

    return await open_stream(context, client, job, tenant, until, extra, events)


#: A stream's events of a job whose inputs are read, ending once `stopping` (the server's stop) is set.
StreamEvents = Callable[[Job, anyio.Event], AsyncIterator[dict[str, str]]]


async def open_stream(
    context: ApiContext,
    client: ClientWatch,
    job: Job,
    tenant: str,
    until: float,
    extra: dict[str, str],
    events: StreamEvents,
) -> JSONResponse | EventSourceResponse:
    """A streamed answer (a chat's, a response's), started once the job's inputs are read (as vLLM reads a
    request's images before its stream starts): its headers then say whether it is degraded, and a job that failed
    on an input is refused (422) before the stream starts; 499 when the client left meanwhile, 503 when the server
    is stopping."""
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
        events(job, stopping),
        ping=settings.sse_keepalive_s,
        headers={**job_headers(job), **extra},
        sep="\n",
        shutdown_event=stopping,
        # sse-starlette would cut the stream at once on a stop; it waits this long instead, by when the stream has
        # ended it (`stream_job` sees the stop within one poll of its job)
        shutdown_grace_period=settings.stop_grace_s + POLL_S + 1.0,
    )


async def wait_job(
    context: ApiContext, client: ClientWatch, job_id: str, tenant: str, until: float, settled: bool = False
) -> Job | None:
    """The job once it ended (with `settled`: once its inputs were read and it went on to the model), or as it
    stands at `until`; None if the client went away first: the job is then given up."""
    store, announcements = context.store, context.announcements
    with announcements.watch(job_id) as event:
        client.wakes.add(event)
        job = await load_job(context, job_id, tenant, watch=True)
        while not _reached(job, settled) and (remaining := announcements.until(until) - time.monotonic()) > 0:
            await announcements.wait(event, remaining)
            if client.left:
                await run_in_threadpool(give_up, store, job_id)
                return None
            job = _own(await reread(context, job_id), job_id, tenant)
        client.wakes.discard(event)
    return job


def _reached(job: Job, settled: bool) -> bool:
    return job.terminal or (settled and job.status == "inferring")


def cut_by_stop(announcements: Announcements, job: Job, until: float, settled: bool = False) -> bool:
    """Whether the server's stop, not the job (its end, or with `settled` its inputs read) nor `until`, ended a wait
    on it."""
    return not _reached(job, settled) and announcements.stopped_before(until)


async def load_job(context: ApiContext, job_id: str, tenant: str, watch: bool = False) -> Job:
    """The job; with `watch`, the read a wait starts from, which marks the job as waited on (its end is announced:
    `LoopJobs.watch_job`), so later reads of the same wait need not."""
    reads = context.loop.jobs
    return _own(await (reads.watch_job(job_id) if watch else reads.load_job(job_id)), job_id, tenant)


def _own(job: Job | None, job_id: str, tenant: str) -> Job:
    """The job read for its tenant's wait; one expired under us is said to have failed, never a crash."""
    if job is None or job.tenant != tenant:
        return Job(id=job_id, status="failed", prompt="", inputs=[], error=ErrorInfo(**ClientGone().to_dict()))
    return job


def give_up(store: Store, job_id: str) -> None:
    """End a job nobody waits for any more: it never reaches the model (a batch already running finishes, and
    its answer is not written)."""
    if cancel(store, job_id, ClientGone(stage="api")):
        log.info("job %s cancelled: its client went away", job_id)


def job_failure(job: Job) -> tuple[int, dict[str, Any]] | None:
    """Why a job has no answer, as an HTTP status and error body: its own error (an unreadable input's code, 422,
    for a chat that asked to fail on one), or the deadline when it had not ended in time."""
    if not job.terminal:
        return _status_and_body(DeadlineExceeded("the job did not end within its deadline"))
    if job.result is not None:
        return None
    info = job.error or ErrorInfo(code="internal_error", message="the job ended without an answer")
    if job.chat and job.chat.on_input_error == "fail" and info.code in degraded_codes(job.inputs):
        return 422, error_envelope(422, info.code, info.message, stage=info.stage)
    return _status_and_body(_as_error(info))


def _status_and_body(error: StokerError) -> tuple[int, dict[str, Any]]:
    return error.http_status, error.envelope()


def _as_error(info: ErrorInfo) -> StokerError:
    """A stored error as the taxonomy's class of its code (its HTTP status with it)."""
    found = next((c for c in _error_classes() if c.code == info.code), StokerError)
    return found(info.message, stage=info.stage)


def _error_classes() -> list[type[StokerError]]:
    classes, todo = [], [StokerError]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


def completion(job: Job, model: str) -> ChatCompletion:
    """The ended job as OpenAI's `chat.completion`."""
    assert job.result is not None
    result = job.result
    first = {"text": result.text, "finish_reason": result.finish_reason, "logprobs": result.logprobs}
    answers = [ChoiceInfo(**first, tool_calls=result.tool_calls)]
    return ChatCompletion(
        id=f"chatcmpl-{job.id}",
        created=int(time.time()),
        model=model,
        choices=[_choice(index, answer, bool(_offered(job))) for index, answer in enumerate([*answers, *result.more])],
        usage=usage_of(job),
        stoker=facts(job),
    )


def _choice(index: int, answer: ChoiceInfo, offered: bool) -> Choice:
    """One answer as a choice. Of a chat that offered tools, a call the answer opened and never closed (cut by its
    token limit: `finish_reason` `length`) is dropped, never shown as the model's raw markup."""
    logprobs = ChoiceLogprobs(content=answer.logprobs) if answer.logprobs is not None else None
    text = drop_unclosed_call(answer.text) if offered and not answer.tool_calls else answer.text
    content = None if answer.tool_calls and not text else text
    message = AssistantMessage(content=content, tool_calls=answer.tool_calls)
    return Choice(index=index, message=message, finish_reason=answer.finish_reason, logprobs=logprobs)


def usage_of(job: Job) -> Usage:
    prompt, done = (job.result.prompt_tokens, job.result.completion_tokens) if job.result else (0, 0)
    return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def facts(job: Job) -> StokerFacts:
    """stoker's account of the job: status, each input and its error code, timings."""
    inputs = [
        InputFacts(
            index=r.index, kind=r.kind, status=r.status, error_code=r.error.code if r.error else None, text=r.text
        )
        for r in job.inputs
    ]
    return StokerFacts(job_id=job.id, status=job.status, inputs=inputs, timings_ms=job.timings_ms)


def _offered(job: Job) -> list[str]:
    """The names of the tools the chat's answer may call (none: its answer is text)."""
    params = job.chat.params if job.chat is not None else None
    return [t.function.name for t in params.tools] if params is not None and params.calls != "none" else []


def _stream(
    context: ApiContext,
    job_id: str,
    tenant: str,
    model: str,
    until: float,
    usage: bool,
    stopping: anyio.Event,
    tools: list[str],
) -> AsyncIterator[dict[str, str]]:
    """The answer as `chat.completion.chunk` events: the assistant's role, its pieces, its end (`stream_job`). With
    `tools` offered, the pieces are read for calls (`ToolCallStream`): text goes out as content while it is text, and
    a call as `tool_calls` deltas once the model opens it."""
    completion_id, created = f"chatcmpl-{job_id}", int(time.time())
    calls = ToolCallStream(tools) if tools else None

    def piece(text: str) -> list[dict[str, Any]]:
        deltas = calls.feed(text) if calls is not None else [{"content": text}]
        return [chunk(completion_id, created, model, delta) for delta in deltas]

    def closing(job: Job, streamed: bool) -> list[dict[str, Any]]:
        held = [chunk(completion_id, created, model, d) for d in calls.close()] if calls is not None else []
        called = calls is not None and calls.called
        return held + _closing(job, completion_id, created, model, streamed, usage, called)

    opening = [chunk(completion_id, created, model, {"role": "assistant", "content": ""})]
    return stream_job(context, job_id, tenant, until, stopping, opening=opening, piece=piece, closing=closing)


async def stream_job(
    context: ApiContext,
    job_id: str,
    tenant: str,
    until: float,
    stopping: anyio.Event,
    *,
    opening: list[dict[str, Any]],
    piece: Callable[[str], dict[str, Any] | list[dict[str, Any]]],
    closing: Callable[[Job, bool], list[dict[str, Any]]],
) -> AsyncIterator[dict[str, str]]:
    """A job's answer as server-sent events, for every endpoint that streams one (chat completions, completions):
    the `opening` bodies, each piece as the backend streams it (`piece` makes its body, or the bodies it makes, none
    while it holds the piece back), then what `closing` makes
    of the ended job (told whether pieces were streamed), ending with `[DONE]`; keep-alive comments come from the
    response itself while this waits.

    Once the server is asked to stop (`Announcements.stop`, or sse-starlette's `stopping` under another server),
    the stream goes on for `stop_grace_s` for its job to end; one still waiting then ends with a `server_stopping`
    error (the openai client raises it), and its job goes on: the server leaving is not the client leaving, so the
    job is not given up."""
    store, announcements = context.store, context.announcements
    ended = False
    try:
        for body in opening:
            yield _event(body)
        streamed, after = False, "0-0"
        with announcements.watch(job_id) as event:
            first = True
            while True:
                job = await load_job(context, job_id, tenant, watch=first)  # first: an ended job's pieces are stored
                first = False
                pieces, after = await run_in_threadpool(store.answers.read, job_id, after)
                for text in pieces:
                    streamed = True
                    made = piece(text)
                    for body in made if isinstance(made, list) else [made]:
                        yield _event(body)
                if stopping.is_set():
                    announcements.stop()  # a stop only sse-starlette saw (the API served by another server)
                if job.terminal or (remaining := announcements.until(until) - time.monotonic()) <= 0:
                    break
                await announcements.wait(event, remaining)
        stopped = cut_by_stop(announcements, job, until)
        for body in [server_stopped(job_id).envelope()] if stopped else closing(job, streamed):
            yield _event(body)
        ended = True
        yield {"data": "[DONE]"}
    finally:
        if not ended and announcements.stop_by is None and not stopping.is_set():  # the client went away mid-stream
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(give_up, store, job_id)


def server_stopped(job_id: str) -> ServerStopping:
    """What ends an answer (a stream, or a wait) the server stopped before its job ended."""
    message = f"the server is stopping; job {job_id} goes on: read its answer at /v1/jobs/{job_id}"
    return ServerStopping(message, stage="api")


def _closing(
    job: Job, completion_id: str, created: int, model: str, streamed: bool, usage: bool, called: bool = False
) -> list[dict[str, Any]]:
    """What ends a stream: the answer (if it was not streamed) and its calls (unless they were, `called`), the
    finish reason and usage; or the error."""
    failure = job_failure(job)
    if failure is not None:
        return [failure[1]]
    result = job.result
    assert result is not None
    bodies = []
    text = drop_unclosed_call(result.text) if _offered(job) and not result.tool_calls else result.text
    if not streamed and (text or not result.tool_calls):  # an answer of calls alone has no content
        bodies.append(chunk(completion_id, created, model, {"content": text}))
    if result.tool_calls and not called:  # whole, in one delta: a backend that parses the calls from the whole answer
        calls = [{"index": i, **call} for i, call in enumerate(result.tool_calls)]
        bodies.append(chunk(completion_id, created, model, {"tool_calls": calls}))
    bodies.append(chunk(completion_id, created, model, {}, finish_reason=result.finish_reason))
    if usage:
        bodies.append(chunk(completion_id, created, model, usage=usage_of(job)))
    return bodies


def _event(body: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(body, separators=(",", ":"))}
