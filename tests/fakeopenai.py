"""A small OpenAI-compatible chat-completions server on loopback, for testing the `openai` backend; with
`generate`, vLLM's token-in, token-out endpoint too (`/inference/v1/generate`), which checks each `GenerateRequest`
against the JSON Schema exported from vLLM's own (`tests/fixtures/vllm_render/generate_request.schema.json`) and
decodes every picture's tensors with stoker's decoder of vLLM's format, answering in vLLM's response shapes."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from stoker.adapters.vllm_render import ItemElement, decode_item
from tests.serving import serve

#: vLLM's `GenerateRequest` as JSON Schema (`tests/fixtures/vllm_render/export_schema.py` wrote it from vLLM).
GENERATE_SCHEMA = json.loads(
    (Path(__file__).parent / "fixtures" / "vllm_render" / "generate_request.schema.json").read_text()
)
GENERATE_VALIDATOR = jsonschema.Draft202012Validator(GENERATE_SCHEMA)


#: What vLLM 0.33.0's `vllm serve` answers on its scale-out routes when started without `--enable-scale-out`
#: (`vllm/entrypoints/scale_out/factories.py`, `register_scale_out_api_routers`).
SCALE_OUT_OFF = {
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
}


@dataclass(frozen=True)
class Generated:
    """One `GenerateRequest` the fake took: its body, and each picture's item decoded (tensors and fields)."""

    body: dict[str, Any]
    items: list[dict[str, ItemElement]]


@dataclass(frozen=True)
class Picture:
    """One `image_url` part as the fake decoded it: the data URL's media type, the picture's format and size, and
    the part's `uuid` (vLLM's per-item cache key)."""

    media_type: str
    format: str
    size: tuple[int, int]
    uuid: str | None


@dataclass
class FakeServer:
    """What the fake saw, and how it should behave."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    #: Every picture received, decoded, in arrival order.
    pictures: list[Picture] = field(default_factory=list)
    delay_s: float = 0.0
    #: Answer this status to any request whose text contains the key.
    fail_on: dict[str, int] = field(default_factory=dict)
    #: What a streamed answer (`stream: true`) is made of, piece by piece.
    pieces: list[str] = field(default_factory=lambda: ["Hel", "lo ", "from ", "the ", "fake."])
    #: Each `image_embeds` part received, decoded as vLLM decodes it: (shape, dtype).
    embeds: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    #: Whether it offers vLLM's `/inference/v1/generate` (without: 404, as a server that has no such route).
    generate: bool = False
    #: Without `generate`: answer as vLLM 0.33.0's `vllm serve` does without `--enable-scale-out` (403), not 404.
    scale_out_off: bool = False
    #: Every request to the generate endpoint, answered or not.
    generate_calls: int = 0
    #: Every `GenerateRequest` that was schema-valid and whose items decoded, in arrival order.
    generated: list[Generated] = field(default_factory=list)
    #: What a streamed generate answer (`output_mode: tokens`) is made of: token ids, chunk by chunk.
    stream_tokens: list[list[int]] = field(default_factory=lambda: [[1], [2, 3]])
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _without_generate(state: FakeServer) -> JSONResponse:
    """A server without the generate endpoint: vLLM's 403 for scale-out routes switched off, or a plain 404."""
    if state.scale_out_off:
        return JSONResponse(SCALE_OUT_OFF, status_code=403)
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def _app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions", response_model=None)
    async def complete(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        with state.lock:
            state.bodies.append(body)
            state.in_flight += 1
            state.most_in_flight = max(state.most_in_flight, state.in_flight)
        try:
            if state.delay_s:
                await _sleep(state.delay_s)
            user = body["messages"][-1]["content"]
            text = user if isinstance(user, str) else " ".join(p.get("text", "") for p in user)
            for key, status in state.fail_on.items():
                if key in text:
                    return JSONResponse({"error": {"message": "no"}}, status_code=status)
            images = [] if isinstance(user, str) else [p for p in user if p["type"] == "image_url"]
            embeds = [] if isinstance(user, str) else [_embeds(p) for p in user if p["type"] == "image_embeds"]
            pictures = [_picture(p) for p in images]
            with state.lock:
                state.pictures += pictures
                state.embeds.extend((tuple(e.shape), str(e.dtype)) for e in embeds)
            answer = f"fake saw {len(pictures)} image(s)"
            usage = {"prompt_tokens": len(text.split()), "completion_tokens": 5}
            if body.get("stream"):
                called = _forced(body)
                chunks = _chunks(state.pieces, usage) if called is None else _call_chunks(called, usage)
                return StreamingResponse(chunks, media_type="text/event-stream")
            return JSONResponse({"choices": _choices(body, answer), "usage": usage})
        finally:
            with state.lock:
                state.in_flight -= 1

    @app.post("/inference/v1/generate", response_model=None)
    async def generate(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        with state.lock:
            state.generate_calls += 1
        if not state.generate:
            return _without_generate(state)
        error = _invalid(body)
        if error:
            return JSONResponse({"error": {"message": error, "type": "BadRequestError"}}, status_code=400)
        items = [decode_item(item) for item in ((body.get("features") or {}).get("kwargs_data") or {}).get("image", [])]
        with state.lock:
            state.generated.append(Generated(body, items))
        if body.get("stream"):
            chunks = _token_chunks(body["request_id"], state.stream_tokens, len(body["token_ids"]))
            return StreamingResponse(chunks, media_type="text/event-stream")
        return JSONResponse(_derendered(body, len(items)))

    return app


def _invalid(body: dict[str, Any]) -> str | None:
    """What vLLM would refuse in a `GenerateRequest` (its schema; placeholders within the tokens; a derendered answer
    streamed; a picture's item that does not decode), or None."""
    errors = sorted(GENERATE_VALIDATOR.iter_errors(body), key=lambda e: list(e.path))
    if errors:
        return f"schema: {errors[0].message} at {list(errors[0].path)}"
    if body.get("output_mode") == "derender" and body.get("stream"):
        return "output_mode='derender' does not support stream"
    features = body.get("features") or {}
    for ranges in (features.get("mm_placeholders") or {}).values():
        if any(r["offset"] + r["length"] > len(body["token_ids"]) for r in ranges):
            return "mm_placeholders must remain within the token_ids sequence"
    try:
        for item in (features.get("kwargs_data") or {}).get("image", []):
            decode_item(item)
    except ValueError as exc:
        return str(exc)
    return None


def _derendered(body: dict[str, Any], pictures: int) -> dict[str, Any]:
    """A whole answer in `output_mode: derender`: per choice its tokens and the parsed message (a call of the forced
    tool when `parse_context` forces one)."""
    context = body.get("parse_context") or {}
    called = _forced(context)
    sampling = body["sampling_params"]
    choices = []
    for index in range(int(sampling.get("n", 1))):
        text = f"fake generated with {pictures} image(s)" + (f" (choice {index})" if index else "")
        message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        if called is not None:
            call = {
                "id": "call_gen",
                "type": "function",
                "function": {"name": called, "arguments": '{"city": "Bergen"}'},
            }
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        choice = {"index": index, "token_ids": [7, 8, 9], "message": message}
        choice["finish_reason"] = "tool_calls" if called else "stop"
        if sampling.get("logprobs") is not None:
            top = int(sampling["logprobs"])
            entries = [_logprob(word, -0.25) for word in text.split()]
            choice["logprobs"] = {"content": [{**e, "top_logprobs": [e] * top} for e in entries]}
        choices.append(choice)
    usage = {
        "prompt_tokens": len(body["token_ids"]),
        "completion_tokens": 3,
        "total_tokens": len(body["token_ids"]) + 3,
    }
    return {"request_id": body["request_id"], "output_mode": "derender", "choices": choices, "usage": usage}


def _token_chunks(request_id: str, chunks: list[list[int]], prompt_tokens: int) -> Iterator[str]:
    """A streamed answer in `output_mode: tokens` as vLLM sends it: each chunk's new token ids, a last chunk with the
    finish reason, the usage, [DONE]."""
    for ids in chunks:
        choice = {"index": 0, "token_ids": ids, "finish_reason": None}
        yield f"data: {json.dumps({'request_id': request_id, 'output_mode': 'tokens', 'choices': [choice]})}\n\n"
    last = {"index": 0, "token_ids": [], "finish_reason": "length"}
    yield f"data: {json.dumps({'request_id': request_id, 'choices': [last]})}\n\n"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(map(len, chunks))}
    yield f"data: {json.dumps({'request_id': request_id, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def _choices(body: dict[str, Any], answer: str) -> list[dict[str, Any]]:
    """`n` choices (the request's, or one), each with a made-up logprob per word when `logprobs` was asked; a
    request that forces a call (a named function, or `required`: the first tool) gets that call instead."""
    called = _forced(body)
    if called is not None:
        call = {"id": "call_fake", "type": "function", "function": {"name": called, "arguments": '{"city": "Oslo"}'}}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return [{"index": 0, "message": message, "finish_reason": "tool_calls"}]
    choices = []
    for index in range(int(body.get("n") or 1)):
        text = f"{answer} (choice {index})" if index else answer
        choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text}}
        if body.get("logprobs"):
            top = int(body.get("top_logprobs") or 0)
            entries = [_logprob(word, -0.5) for word in text.split()]
            choice["logprobs"] = {"content": [{**e, "top_logprobs": [e] * top} for e in entries]}
        choices.append({**choice, "finish_reason": "stop"})
    return choices


def _forced(body: dict[str, Any]) -> str | None:
    """The function a chat body (or a `GenerateRequest`'s `parse_context`) forces a call of, if any."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    if isinstance(choice, dict):
        return str(choice["function"]["name"])
    return str(tools[0]["function"]["name"]) if choice == "required" and tools else None


def _logprob(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode())}


def _picture(part: dict[str, Any]) -> Picture:
    """Decode an `image_url` part's data URL, as vLLM would."""
    head, data = part["image_url"]["url"].split(",", 1)
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    media_type = head.removeprefix("data:").removesuffix(";base64")
    return Picture(media_type, str(image.format), image.size, part.get("uuid"))


def _embeds(part: dict[str, Any]) -> Any:
    """An `image_embeds` part's tensor, read as vLLM reads it: base64 of `torch.save` bytes, `weights_only`."""
    import torch  # only the tests that send embeddings need it

    return torch.load(io.BytesIO(base64.b64decode(part["image_embeds"])), weights_only=True)


def _chunks(pieces: list[str], usage: dict[str, int]) -> Iterator[str]:
    """A chat-completion stream as vLLM sends it: role, pieces, finish, usage, [DONE]."""
    deltas: list[dict[str, Any]] = [{"role": "assistant"}, *({"content": p} for p in pieces)]
    for delta in deltas:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]})}\n\n"
    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'length'}]})}\n\n"
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def _call_chunks(name: str, usage: dict[str, int]) -> Iterator[str]:
    """A forced call streamed as vLLM streams one: role, the call's id, type and name, its arguments in fragments,
    finish, usage, [DONE]."""
    opening = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": name, "arguments": ""}}
    fragments = [{"index": 0, "function": {"arguments": part}} for part in ('{"city"', ': "Os', 'lo"}')]
    deltas: list[dict[str, Any]] = [{"role": "assistant"}, *({"tool_calls": [c]} for c in [opening, *fragments])]
    for delta in deltas:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]})}\n\n"
    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'tool_calls'}]})}\n\n"
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


@contextmanager
def fake_openai_server(generate: bool = False, scale_out_off: bool = False) -> Iterator[FakeServer]:
    """Serve the fake on a free loopback port for the duration of the block (`generate`: with vLLM's generate
    endpoint)."""
    state = FakeServer(generate=generate, scale_out_off=scale_out_off)
    with serve(_app(state)) as base:
        state.url = f"{base}/v1"
        yield state
