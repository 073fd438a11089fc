"""vLLM's render protocol on stoker's API: `POST /v1/chat/completions/render` and `POST /v1/completions/render` take
the bodies of the chat and completions endpoints and answer vLLM's `GenerateRequest` JSON (a list of one for a
completion), rendered as vLLM 0.33.0's render tier renders them (`stoker.adapters.render`): token ids, each picture's
placeholder range, hash and tensors in vLLM's encoding, sampling parameters, parse context.

A render is a job (`Conversation.render`) taken in like a chat (`api.submission`: its key, its tenant's rate and
slots, 429 with Retry-After under queue pressure, the deadline and the reaper), whose answer is its pictures'
renderings instead of a model call: the CPU workers decode and render each picture into the stage cache, by its
content hash in the tenant's scope (a picture the tenant sent before is a cache read there, the stage's work not
done again), and the job ends at its hand-off, before the inference queue (`stoker.runtime.stages.tokenization`).
This API then only assembles the `GenerateRequest`: the chat template over the messages, and the renderings read from
the cache.
A picture that cannot be read is a structured 4xx naming its part (`param`) and its error code, unless the body asks
`stoker_on_input_error: degrade`: it is then left out (`x-stoker-degraded` names its code). An answer says nothing of
where a picture's rendering came from: one tenant's render is the same whether or not the picture was seen before.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from api.chat import answer_deadline, job_failure, wait_job
from api.context import ApiContext, Context
from api.disconnects import watching
from api.headers import SHOULD_RETRY, job_headers
from api.intake import AcceptedRequest, first_error, validate_inputs
from api.limits import read_json_body
from api.schemas import error_responses
from api.submission import submit_job
from api.tenancy import authenticate
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.render import ITEM, Rendered, RenderedPicture, Renderer
from stoker.adapters.vllm_render import (
    WireItem,
    features,
    generate_request,
    parse_context,
    request_json_pieces,
    sampling_params,
)
from stoker.core.errors import (
    ClientGone,
    InvalidRequest,
    ModelNotFound,
    RenderingLost,
    error_envelope,
)
from stoker.core.jobs import Conversation, InputRecord, Job
from stoker.core.tenancy import cache_scope
from stoker.settings import ApiSettings

router = APIRouter()
RESPONSES = error_responses(400, 401, 404, 413, 415, 422, 429, 499, 503, 504)


class RenderBody(BaseModel):
    """What both render endpoints read of a body (the rest is accepted and left alone, as vLLM's render does)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    request_id: str | None = None

    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRenderCreate(RenderBody):
    """A chat completion's body, with vLLM's template switches and stoker's choice on an unreadable picture."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    stoker_on_input_error: Literal["fail", "degrade"] = "fail"


class CompletionRenderCreate(RenderBody):
    """A completion's body: one prompt."""

    prompt: str = Field(min_length=1)


_Body = TypeVar("_Body", ChatRenderCreate, CompletionRenderCreate)


@functools.cache
def _renderer(model_path: str, dtype: str) -> Renderer:
    """The served model's renderer, loaded once per process (the tokenizer and image processor: seconds)."""
    return Renderer(model_path, dtype)


async def renderer(context: ApiContext) -> Renderer:
    """The renderer of the model this API serves, loaded off the loop on first use."""
    settings = context.settings
    path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
    return await run_in_threadpool(_renderer, path, "bfloat16")


@dataclass
class _Read:
    """A render's body as read by its job's intake: the body, and where each of its pictures is (`param`)."""

    body: ChatRenderCreate | CompletionRenderCreate | None = None
    parts: list[str] = field(default_factory=list)


@router.post("/v1/chat/completions/render", responses=RESPONSES)
async def render_chat(request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]) -> Response:
    """The chat rendered into vLLM's `GenerateRequest`."""
    model = await renderer(context)
    read = _Read()

    async def accept() -> AcceptedRequest:
        raw = await read_json_body(request, context.settings.max_json_values)
        read.body, accepted, read.parts = await run_in_threadpool(_accept_chat, raw, context.settings, model)
        scope = cache_scope(tenant, context.settings.cache_shared)
        return replace(accepted, rendered=await run_in_threadpool(_all_rendered, context, model, accepted, scope))

    job = await _render_job(context, request, tenant, accept)
    failed = _refusal(job, read.parts)
    if failed is not None:
        return failed
    assert isinstance(read.body, ChatRenderCreate)
    answer = await _assemble_chat(context, model, read.body, job, tenant)
    pieces = await run_in_threadpool(request_json_pieces, answer)  # the bytes JSONResponse would write, in pieces
    length = {"content-length": str(sum(len(piece) for piece in pieces))}  # so it is sent whole, not chunked
    return StreamingResponse(_each(pieces), media_type="application/json", headers=job_headers(job) | length)


async def _each(pieces: list[bytes]) -> AsyncIterator[bytes]:
    """The pieces, as an async iterator: Starlette takes the next piece of a plain one on its thread pool."""
    for piece in pieces:
        yield piece


@router.post("/v1/completions/render", responses=RESPONSES)
async def render_completion(
    request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]
) -> JSONResponse:
    """The completion rendered into vLLM's `GenerateRequest` (a list of one, as vLLM answers)."""
    model = await renderer(context)
    read = _Read()

    async def accept() -> AcceptedRequest:
        raw = await read_json_body(request, context.settings.max_json_values)
        read.body, accepted = await run_in_threadpool(_accept_completion, raw, context.settings)
        return accepted

    job = await _render_job(context, request, tenant, accept)
    failed = _refusal(job, [])
    if failed is not None:
        return failed
    body = read.body
    assert isinstance(body, CompletionRenderCreate)
    rendered = await run_in_threadpool(model.completion, body.prompt)
    sampling = _sampling(body, model, rendered, body.max_tokens)
    answer = generate_request(
        body.request_id or f"cmpl-{job.id}",
        rendered.token_ids,
        sampling,
        model=body.model,
        stream=body.stream,
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    return JSONResponse([answer], headers=job_headers(job))


async def _render_job(
    context: ApiContext,
    request: Request,
    tenant: str,
    accept: Callable[[], Awaitable[AcceptedRequest]],
) -> Job:
    """Take the render in as a job (admission, slots, the record and its first message) and wait for its end (or
    its deadline); a client gone meanwhile gives the job up (499)."""
    submitted = await submit_job(context, tenant, None, accept, watched=True)
    job = submitted.job
    until = answer_deadline(job, context.settings)
    async with watching(request.receive) as client:
        ended = await wait_job(context, client, job.id, tenant, until)
    if ended is None:
        raise ClientGone(stage="api")
    return ended


def _refusal(job: Job, parts: list[str]) -> JSONResponse | None:
    """Why an ended render has no answer, or None: a picture that failed a render asked to fail on one is a 422
    naming its part and code; anything else as the chat's answer would say it."""
    headers = {**job_headers(job), SHOULD_RETRY: "false"}
    failed = next((r for r in job.inputs if r.status == "failed"), None)
    if job.status == "failed" and failed is not None and failed.error is not None and failed.index < len(parts):
        where = parts[failed.index]
        message = f"{where}: {failed.error.message}"
        body = error_envelope(422, failed.error.code, message, param=where, stage=failed.error.stage)
        return JSONResponse(body, status_code=422, headers=headers)
    if job.status in ("succeeded", "degraded"):
        return None
    status, body = job_failure(job) or (500, error_envelope(500, "internal_error", "the render ended unanswered"))
    return JSONResponse(body, status_code=status, headers=headers)


def _accept_chat(
    raw: bytes, settings: ApiSettings, model: Renderer
) -> tuple[ChatRenderCreate, AcceptedRequest, list[str]]:
    """The body, the render job it makes (its pictures as inputs, sniffed and hashed as a chat's are), and each
    picture's part (`messages[i].content[j]`)."""
    body = _validated(ChatRenderCreate, raw)
    _check_model(settings, body.model)
    parts: list[str] = []
    pictures: list[bytes] = []
    for i, message in enumerate(body.messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}]"
                if not model.sees:
                    raise InvalidRequest(f"{where}: the model `{body.model}` reads no pictures", param=where)
                pictures.append(_data_url(str((part.get("image_url") or {}).get("url") or ""), where))
                parts.append(where)
    inputs = validate_inputs([("image", data) for data in pictures], settings)
    chat = Conversation(turns=[], on_input_error=body.stoker_on_input_error, render=True)
    return body, AcceptedRequest(prompt="", inputs=inputs, deadline_ms=settings.deadline_ms, chat=chat), parts


def _all_rendered(context: ApiContext, model: Renderer, accepted: AcceptedRequest, scope: str) -> dict[str, str] | None:
    """Where the render's pictures are, as their records would say, when the stage cache holds every one of them
    rendered in `scope` (by the decode parameters the workers published, by this renderer); else None, and the CPU
    stage renders what is missing. Existence only: the answer reads them as a stage-rendered render's does."""
    pipeline = context.cache.context()
    if not accepted.inputs or pipeline is None or not pipeline.render_decode:
        return None
    decode = pipeline.render_decode
    addresses = [model.picture_address(item.digest, decode, scope) for item in accepted.inputs]
    return {"render": model.identity, "decode": decode} if context.cache.has_all(addresses, part=ITEM) else None


def _accept_completion(raw: bytes, settings: ApiSettings) -> tuple[CompletionRenderCreate, AcceptedRequest]:
    body = _validated(CompletionRenderCreate, raw)
    _check_model(settings, body.model)
    chat = Conversation(turns=[], on_input_error="fail", render=True)
    return body, AcceptedRequest(prompt="", inputs=[], deadline_ms=settings.deadline_ms, chat=chat)


def _validated(schema: type[_Body], raw: bytes) -> _Body:
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc


async def _assemble_chat(
    context: ApiContext, model: Renderer, body: ChatRenderCreate, job: Job, tenant: str
) -> dict[str, Any]:
    """The `GenerateRequest` of an ended render: its pictures' renderings read from the cache (those that failed
    left out), the messages through the chat template."""
    scope = cache_scope(tenant, context.settings.cache_shared)
    pictures = [await _cached(context, model, r, scope) for r in job.inputs if r.status == "ok"]
    kept = iter(r.status == "ok" for r in job.inputs)
    messages = [_with_pictures(m, kept) for m in body.messages]
    rendered = await run_in_threadpool(
        model.chat,
        messages,
        [p.layout for p in pictures],
        body.tools,
        body.add_generation_prompt,
        body.continue_final_message,
    )
    sampling = _sampling(body, model, rendered, body.max_completion_tokens or body.max_tokens)
    if body.logprobs:
        sampling["logprobs"] = body.top_logprobs or 0
    if body.tools and body.tool_choice != "none":
        sampling["skip_special_tokens"] = False
    hashes = [model.picture_hash(r.content_hash) for r in job.inputs if r.status == "ok"]
    return generate_request(
        body.request_id or f"chatcmpl-{job.id}",
        rendered.token_ids,
        sampling,
        model=body.model,
        mm_features=features(hashes, rendered.placeholders, await run_in_threadpool(_wires, pictures)),
        parse_context=_parse_context(body),
        stream=body.stream,
        priority=body.priority,
        cache_salt=body.cache_salt,
    )


def _wires(pictures: list[RenderedPicture]) -> list[WireItem]:
    """The pictures' items as sent: their lookups and base64, milliseconds a picture, made off the event loop."""
    return [p.wire for p in pictures]


def _with_pictures(message: dict[str, Any], kept: Any) -> dict[str, Any]:
    """A message with each picture part an image part for the template, and a picture that failed left out."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image_url":
            if next(kept):
                parts.append({"type": "image"})
            continue
        parts.append(part)
    return {**message, "content": parts}


async def _cached(context: ApiContext, model: Renderer, record: InputRecord, scope: str) -> RenderedPicture:
    """A picture's rendering as the CPU stage cached it (where its record says), read from the cache."""
    made = record.prepared or {}
    if made.get("render") != model.identity:
        raise RenderingLost(f"input {record.index} was rendered by another renderer: send the render again")
    address = model.picture_address(record.content_hash, str(made.get("decode")), scope)
    found = await run_in_threadpool(context.cache.get_bytes, address, ITEM)
    if found is None:
        raise RenderingLost(f"input {record.index}'s rendering left the cache: send the render again")
    return await run_in_threadpool(RenderedPicture.from_bytes, found)


def _check_model(settings: ApiSettings, name: str) -> None:
    if name != settings.public_model_name:
        raise ModelNotFound(f"the model `{name}` does not exist here", param="model")


def _sampling(body: RenderBody, model: Renderer, rendered: Rendered, asked: int | None) -> dict[str, Any]:
    """The sampling parameters vLLM's render writes: new tokens as asked, else what the context leaves."""
    room = model.max_model_len - len(rendered.token_ids)
    if room <= 0 or (asked is not None and asked > room):
        raise InvalidRequest(f"the prompt is {len(rendered.token_ids)} tokens: no room for {asked or 1} more")
    temperature = 1.0 if body.temperature is None else body.temperature
    return sampling_params(
        max_tokens=asked or room,
        temperature=temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stops(),
        n=body.n,
        stream=body.stream,
    )


def _parse_context(body: ChatRenderCreate) -> dict[str, Any]:
    """What a generate server needs to read the answer back (`ParseContext`)."""
    calls = sum(len(m.get("tool_calls") or []) for m in body.messages if m.get("role") == "assistant")
    return parse_context(
        body.tools,
        body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        history_tool_call_cnt=calls,
    )


def _data_url(url: str, where: str) -> bytes:
    header, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep or not header.endswith(";base64"):
        raise InvalidRequest(f"{where}: a render takes a picture as a base64 data URL", param=where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{where}: not valid base64", param=where) from exc
