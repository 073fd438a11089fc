"""vLLM's render protocol on stoker's API: `POST /v1/chat/completions/render` and `POST /v1/completions/render` take
the bodies of the chat and completions endpoints and answer vLLM's `GenerateRequest` JSON (a list of one for a
completion), rendered as vLLM 0.33.0's render tier renders them (`stoker.adapters.render`): token ids, each picture's
placeholder range, hash and tensors in vLLM's encoding, sampling parameters, parse context.

A render is a tenant's request like any other (its key, its rate, 429 while the queues or the store are full). A
picture is a data URL; its rendering is kept in the stage cache by its content hash in the tenant's scope, so a
repeated picture costs a cache read and one tenant never learns what another sent. A picture that cannot be read is a
structured 4xx naming its part (`param`) and its error code, unless the body asks `stoker_on_input_error: degrade`:
it is then left out (`x-stoker-degraded` names its code).
"""

from __future__ import annotations

import base64
import binascii
import functools
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext, Context
from api.schemas import error_responses
from api.tenancy import within_rate
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.render import ITEM, Rendered, RenderedPicture, Renderer
from stoker.adapters.vllm_render import features, generate_request, parse_context, sampling_params
from stoker.core.errors import InvalidRequest, ModelNotFound, Overloaded, StokerError, StoreFull
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.core.media import content_hash
from stoker.core.tenancy import cache_scope

router = APIRouter()
DEGRADED = "x-stoker-degraded"


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


@functools.cache
def _renderer(model_path: str, dtype: str) -> Renderer:
    """The served model's renderer, loaded once per process (the tokenizer and image processor: seconds)."""
    return Renderer(model_path, dtype)


async def renderer(context: Context) -> Renderer:
    """The renderer of the model this API serves, loaded off the loop on first use."""
    settings = context.settings
    path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
    return await run_in_threadpool(_renderer, path, "bfloat16")


def _refuse_under_pressure(context: ApiContext) -> None:
    """503 while the store is nearly full, 429 while a queue is over its limit: a render is refused like a job."""
    if context.monitor.store_full() is not None:
        raise StoreFull("the job store is nearly full: try again soon")
    refusal = context.monitor.refusal()
    if refusal is not None:
        message = f"queue {refusal.queue} holds {refusal.depth} messages (limit {refusal.limit})"
        raise Overloaded(message, retry_after_s=refusal.retry_after_s)


@router.post("/v1/chat/completions/render", responses=error_responses(400, 401, 404, 413, 415, 422, 429, 503))
async def render_chat(
    body: ChatRenderCreate, context: Context, tenant: Annotated[str, Depends(within_rate)]
) -> JSONResponse:
    """The chat rendered into vLLM's `GenerateRequest`."""
    _refuse_under_pressure(context)
    _check_model(context, body.model)
    model = await renderer(context)
    scope = cache_scope(tenant, context.settings.cache_shared)
    messages, pictures, degraded = await _pictures(context, model, body, scope)
    rendered = await run_in_threadpool(
        model.chat,
        messages,
        [p.layout for _, p in pictures],
        body.tools,
        body.add_generation_prompt,
        body.continue_final_message,
    )
    sampling = _sampling(body, model, rendered, body.max_completion_tokens or body.max_tokens)
    if body.logprobs:
        sampling["logprobs"] = body.top_logprobs or 0
    if body.tools and body.tool_choice != "none":
        sampling["skip_special_tokens"] = False
    hashes = [model.picture_hash(digest) for digest, _ in pictures]
    answer = generate_request(
        body.request_id or f"chatcmpl-{uuid.uuid4().hex}",
        rendered.token_ids,
        sampling,
        model=body.model,
        mm_features=features(hashes, rendered.placeholders, [p.item for _, p in pictures]),
        parse_context=_parse_context(body),
        stream=body.stream,
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    return JSONResponse(answer, headers={DEGRADED: ",".join(degraded)} if degraded else None)


@router.post("/v1/completions/render", responses=error_responses(400, 401, 404, 413, 415, 422, 429, 503))
async def render_completion(
    body: CompletionRenderCreate, context: Context, tenant: Annotated[str, Depends(within_rate)]
) -> JSONResponse:
    """The completion rendered into vLLM's `GenerateRequest` (a list of one, as vLLM answers)."""
    _refuse_under_pressure(context)
    _check_model(context, body.model)
    model = await renderer(context)
    rendered = await run_in_threadpool(model.completion, body.prompt)
    sampling = _sampling(body, model, rendered, body.max_tokens)
    request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    answer = generate_request(
        request_id,
        rendered.token_ids,
        sampling,
        model=body.model,
        stream=body.stream,
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    return JSONResponse([answer])


def _check_model(context: ApiContext, name: str) -> None:
    if name != context.settings.public_model_name:
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


async def _pictures(
    context: ApiContext, model: Renderer, body: ChatRenderCreate, scope: str
) -> tuple[list[dict[str, Any]], list[tuple[str, RenderedPicture]], list[str]]:
    """The messages with each picture part made an image part, the pictures (content hash, rendering) in order, and
    the codes of the pictures left out (`degrade`)."""
    messages: list[dict[str, Any]] = []
    pictures: list[tuple[str, RenderedPicture]] = []
    degraded: list[str] = []
    for i, message in enumerate(body.messages):
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            try:
                pictures.append(await _picture(context, model, part, where, scope))
            except StokerError as exc:
                if body.stoker_on_input_error == "fail" or not exc.permanent:
                    raise
                degraded.append(exc.code)
                continue
            parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    return messages, pictures, degraded


async def _picture(
    context: ApiContext, model: Renderer, part: dict[str, Any], where: str, scope: str
) -> tuple[str, RenderedPicture]:
    """One picture part's rendering: from the stage cache by its content hash (in the tenant's scope), or decoded
    and prepared now and cached. Its errors name the part."""
    if not model.sees:
        raise InvalidRequest(
            f"{where}: the model `{context.settings.public_model_name}` reads no pictures", param=where
        )
    data = _data_url(str((part.get("image_url") or {}).get("url") or ""), where)
    digest = content_hash(data)
    params = DecodeParams()
    address = model.picture_address(digest, repr(params), scope)
    cached = await run_in_threadpool(context.cache.get_bytes, address, ITEM)
    if cached is not None:
        context.cache.record("render", hit=True, cost_s=0.0)
        return digest, RenderedPicture.from_bytes(cached)
    started = time.perf_counter()
    try:
        picture = await run_in_threadpool(lambda: model.picture(decode_rgb(data, params)))
    except StokerError as exc:
        exc.param = where
        exc.message = f"{where}: {exc.message}"
        raise
    limit = context.settings.cache_max_tensor_bytes
    await run_in_threadpool(context.cache.put_bytes, address, picture.to_bytes(), ITEM, limit)
    context.cache.record("render", hit=False, cost_s=time.perf_counter() - started)
    return digest, picture


def _data_url(url: str, where: str) -> bytes:
    header, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep or not header.endswith(";base64"):
        raise InvalidRequest(f"{where}: a render takes a picture as a base64 data URL", param=where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{where}: not valid base64", param=where) from exc
