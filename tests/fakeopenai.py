"""A small OpenAI-compatible chat-completions server on loopback, for testing the `openai` backend."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from tests.serving import serve


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
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> JSONResponse:
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
                return StreamingResponse(_chunks(state.pieces, usage), media_type="text/event-stream")
            return JSONResponse({"choices": _choices(body, answer), "usage": usage})
        finally:
            with state.lock:
                state.in_flight -= 1

    return app


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


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


@contextmanager
def fake_openai_server() -> Iterator[FakeServer]:
    """Serve the fake on a free loopback port for the duration of the block."""
    state = FakeServer()
    with serve(_app(state)) as base:
        state.url = f"{base}/v1"
        yield state
