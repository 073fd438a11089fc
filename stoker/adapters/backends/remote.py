"""The `openai` backend: an OpenAI-compatible chat-completions server (`vllm serve`, …) as the device.

Each batch's requests go out concurrently (at most `max_in_flight` at a time) with the chat as text turns, each
decoded picture in the turn it came with as an `image_url` part: a base64 data URL of the decoded original
(EXIF-rotated, at the served model's own size, never a thumbnail; PNG, or the best JPEG within the stage cache's
value limit where the PNG is over it: the CPU stage made it, this worker only reads it) and stoker's content hash
as vLLM's per-item `uuid`, so vLLM's processor cache keys agree across its API servers; and the request's own
generation parameters; the server batches them itself. A request whose client reads a stream is asked for as a
stream, and every piece is handed to `pieces` as it arrives. Server answers map onto the error taxonomy: overload
and unreachability are transient (retried with backoff, then `model_unavailable`; a stream that already sent pieces
is not retried), anything else is `inference_failed` for that request alone.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from stoker.adapters.backends.vlm import VisionEncoder, tensor_base64
from stoker.core.errors import InferenceFailed, ModelUnavailable, StokerError
from stoker.core.model import EncoderUse, GenerationParams, ModelRequest, Outcome, Prediction

log = logging.getLogger(__name__)

#: Statuses that mean "not now": retried, then model_unavailable.
TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})


@dataclass(frozen=True)
class Call:
    """One request as it goes out: its body, and where its pieces go when it is streamed."""

    body: dict[str, Any]
    stream_to: str | None = None
    #: Per picture sent as embeddings (content hash): whether they came from the cache.
    encoder: dict[str, EncoderUse] = field(default_factory=dict)


class OpenAIPredictor:
    """Requests to an OpenAI-compatible server, behind the same hook contract as a local model."""

    #: Each request is its own call: any mix of sampling parameters is fine.
    mixes_sampling = True

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        max_new_tokens: int,
        max_in_flight: int = 8,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        images: Callable[[str, str], bytes | None] | None = None,
        attempts: int = 3,
        pieces: Callable[[str, str], None] | None = None,
        batch_priority: int | None = None,
        max_tokens_cap: int | None = None,
        embedder: VisionEncoder | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"openai:{model}"
        self.max_new_tokens = max_new_tokens
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.images = images
        self.attempts = attempts
        self.pieces = pieces
        #: The `priority` a batch line is sent with (an interactive request: 0); None: no priority is sent.
        self.batch_priority = batch_priority
        self.max_tokens_cap = max_tokens_cap or max_new_tokens
        #: With `--enable-mm-embeds` on the server: pictures go as their vision embeddings, made (or cached) here.
        self.embedder = embedder
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None

    def setup(self, device: str) -> None:
        """Open a connection pool sized to the in-flight bound (the device is the server's)."""
        self.close()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=self.timeout_s, limits=limits)
        self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="openai")
        if self.embedder is not None:
            self.embedder.setup(device)
        log.info("openai backend: %s model %s, %d in flight", self.base_url, self.model, self.max_in_flight)

    def close(self) -> None:
        """Close the connections and the request threads."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def batch(self, requests: Sequence[ModelRequest]) -> list[Call]:
        """One chat-completions call per request."""
        calls = []
        for r in requests:
            used: dict[str, EncoderUse] = {}
            streamed = self.pieces is not None and r.params.calls == "none"  # calls come whole (see _Streamed)
            calls.append(Call(self.body(r, used), r.stream_to if streamed else None, used))
        return calls

    def body(self, request: ModelRequest, used: dict[str, EncoderUse] | None = None) -> dict[str, Any]:
        """The request as the server takes it: the chat's turns, each user turn with the pictures it carried (a
        request whose turns name none: every picture on the last user turn), and its generation parameters.
        With an embedder, a request's pictures go as embeddings (`used` says which hit the cache)."""
        named = any("images" in m for m in request.messages)
        embeds = self._embeds_for(request, named, {} if used is None else used)
        messages = [self._message(m, request.scope, embeds) for m in request.messages]
        if request.images and not named and messages and messages[-1]["role"] == "user":
            messages[-1] = self._message({**messages[-1], "images": request.images}, request.scope, embeds)
        params = request.params
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": params.new_tokens(self.max_new_tokens, self.max_tokens_cap),
            "temperature": params.temperature,
        }
        if params.top_p != 1:
            body["top_p"] = params.top_p
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.n > 1:
            body["n"] = params.n
        if params.logprobs:
            body |= {"logprobs": True, "top_logprobs": params.top_logprobs}
        if self.batch_priority is not None:  # vLLM's priority scheduling: lower runs first, and may preempt
            body["priority"] = self.batch_priority if request.background else 0
        return body | _structured(request.params)

    def _embeds_for(
        self, request: ModelRequest, named: bool, used: dict[str, EncoderUse]
    ) -> dict[str, EncoderUse] | None:
        """Whether a request's pictures go as embeddings (`used`, which records their cache use): with an embedder,
        when one turn carries them all (vLLM takes `image_embeds` parts in one message of a request); None: they go
        as pictures."""
        turns = sum(1 for m in request.messages if m.get("images")) if named else int(bool(request.images))
        if self.embedder is None or turns != 1:
            if self.embedder is not None and turns > 1:
                log.info("pictures on %d turns: sent as pictures, not embeddings", turns)
            return None
        return used

    def _message(
        self, message: dict[str, Any], scope: str, embeds: dict[str, EncoderUse] | None = None
    ) -> dict[str, Any]:
        """A text turn; one that carried pictures becomes text and image parts (each with its content hash as
        vLLM's `uuid`), or, with `embeds`, text and `image_embeds` parts."""
        if embeds is not None and message.get("images"):
            return self._embeds_message(message, scope, embeds)
        calls = {k: message[k] for k in ("tool_calls", "tool_call_id") if message.get(k)}
        text = {"role": message["role"], "content": message["content"], **calls}
        pictures = [(d, url) for d in message.get("images", []) if (url := self._data_url(d, scope))]
        if not pictures:
            return text
        parts: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}]
        parts += [{"type": "image_url", "image_url": {"url": url}, "uuid": digest} for digest, url in pictures]
        return {"role": message["role"], "content": parts}

    def _embeds_message(self, message: dict[str, Any], scope: str, used: dict[str, EncoderUse]) -> dict[str, Any]:
        """A turn whose pictures go as vLLM's `image_embeds` parts: each picture's embeddings (tokens × the text
        model's hidden size, checked against the model), `torch.save`d and base64-encoded, with its content hash
        as the item's uuid."""
        assert self.embedder is not None
        parts: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}]
        for digest in message["images"]:
            tensor, use = self.embedder.embeddings(digest, scope)
            self.embedder.check(tensor)
            used.setdefault(digest, use)
            parts.append({"type": "image_embeds", "image_embeds": tensor_base64(tensor), "uuid": digest})
        return {"role": message["role"], "content": parts}

    def _data_url(self, digest: str, scope: str) -> str | None:
        picture = self.images(digest, scope) if self.images else None
        if picture is None:
            log.info("picture %s is gone (cache and job store); sending the text alone", digest[:12])
            return None
        kind = "png" if picture.startswith(b"\x89PNG") else "jpeg"
        return f"data:image/{kind};base64," + base64.b64encode(picture).decode()

    def predict(self, batch: list[Call]) -> list[Outcome]:
        """All requests concurrently, at most max_in_flight at a time; each ends as a prediction or an error."""
        if self._pool is None:
            raise ModelUnavailable("the openai backend was not set up")
        return list(self._pool.map(self._complete, batch))

    def unbatch(self, output: list[Outcome]) -> list[Outcome]:
        """Already one outcome per request."""
        return output

    def _complete(self, call: Call) -> Outcome:
        error: StokerError = ModelUnavailable("no attempt made")
        sent = [0]
        for attempt in range(self.attempts):
            try:
                answer = self._stream(call, sent) if call.stream_to else self._post(call.body)
                return replace(answer, encoder=call.encoder) if call.encoder else answer
            except StokerError as exc:
                if exc.permanent or sent[0]:  # a stream that sent pieces cannot be taken back: no retry
                    return exc
                error = exc
                time.sleep(min(0.5 * 2**attempt, 5.0))
        return error

    def _post(self, body: dict[str, Any]) -> Prediction:
        assert self._client is not None
        try:
            response = self._client.post("/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise ModelUnavailable(f"the inference server timed out: {exc}", stage="infer") from exc
        except httpx.TransportError as exc:
            raise ModelUnavailable(f"the inference server cannot be reached: {exc}", stage="infer") from exc
        _check(response, response.text)
        return _prediction(response.json())

    def _stream(self, call: Call, sent: list[int]) -> Prediction:
        """The answer as a stream: each piece goes on as it arrives; the whole answer is returned at the end."""
        assert self._client is not None
        assert self.pieces is not None
        assert call.stream_to is not None
        body = {**call.body, "stream": True, "stream_options": {"include_usage": True}}
        answer = _Streamed()
        try:
            with self._client.stream("POST", "/chat/completions", json=body) as response:
                _check(response, response.read().decode(errors="replace") if response.status_code != 200 else "")
                for chunk in _sse_chunks(response.iter_lines()):
                    piece = answer.add(chunk)
                    if piece:
                        self.pieces(call.stream_to, piece)
                        sent[0] += 1
        except httpx.TimeoutException as exc:
            raise ModelUnavailable(f"the inference server timed out: {exc}", stage="infer") from exc
        except httpx.TransportError as exc:
            raise ModelUnavailable(f"the inference server cannot be reached: {exc}", stage="infer") from exc
        return answer.prediction()


def _check(response: httpx.Response, detail: str) -> None:
    """Overload and unavailability are transient; any other answer but 200 fails the request."""
    if response.status_code in TRANSIENT_STATUS:
        raise ModelUnavailable(f"the inference server answered {response.status_code}", stage="infer")
    if response.status_code != 200:
        raise InferenceFailed(f"the inference server answered {response.status_code}: {detail[:200]}", stage="infer")


def _sse_chunks(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a Server-Sent Events stream of chat-completion chunks, up to `[DONE]`.

    By hand: the stream is `data: <json>` lines, and an SSE client library would be one more dependency for
    three lines of parsing."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments (keep-alives), other fields
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise InferenceFailed(f"the inference server sent a malformed chunk: {data[:80]}", stage="infer") from exc
        if "error" in chunk:
            raise InferenceFailed(f"the inference server failed mid-stream: {chunk['error']}", stage="infer")
        yield chunk


class _Streamed:
    """A streamed answer put back together: text, finish reason, usage."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish_reason = "stop"
        self.usage: dict[str, Any] = {}

    def add(self, chunk: dict[str, Any]) -> str:
        """Take one chunk; its piece of text ('' for none)."""
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            piece = str((choice.get("delta") or {}).get("content") or "")
            self.text.append(piece)
            return piece
        return ""

    def prediction(self) -> Prediction:
        """The whole answer."""
        return Prediction(
            text="".join(self.text).strip(),
            prompt_tokens=int(self.usage.get("prompt_tokens", 0)),
            completion_tokens=int(self.usage.get("completion_tokens", 0)),
            finish_reason="length" if self.finish_reason == "length" else "stop",
        )


def _prediction(data: dict[str, Any]) -> Prediction:
    """The server's answer: its first choice, the others (`n`) after it, each with its logprobs if it sent them."""
    try:
        choices = sorted(data["choices"], key=lambda c: int(c.get("index", 0)))
        first, *more = [_choice(c) for c in choices]
        usage = data.get("usage") or {}
    except (KeyError, ValueError, TypeError) as exc:
        raise InferenceFailed(f"the inference server's answer has no message: {exc!r}", stage="infer") from exc
    tokens = int(usage.get("completion_tokens", 0))
    return replace(first, prompt_tokens=int(usage.get("prompt_tokens", 0)), completion_tokens=tokens, more=tuple(more))


def _choice(choice: dict[str, Any]) -> Prediction:
    text = choice["message"]["content"] or ""
    logprobs = (choice.get("logprobs") or {}).get("content")
    calls = choice["message"].get("tool_calls") or None
    ending = choice.get("finish_reason")
    return Prediction(
        text=str(text).strip(),
        prompt_tokens=0,
        completion_tokens=0,
        finish_reason="tool_calls" if calls else "length" if ending == "length" else "stop",
        logprobs=list(logprobs) if logprobs is not None else None,
        tool_calls=[dict(c) for c in calls] if calls else None,
    )


def _structured(params: GenerationParams) -> dict[str, Any]:
    """A request's tools, tool choice and answer format, as the server takes them (it constrains its own
    decoding: vLLM's structured outputs and tool parsers)."""
    body: dict[str, Any] = {}
    if params.tools:
        body["tools"] = [t.model_dump(exclude_none=True) for t in params.tools]
    if params.tool_choice is not None:
        choice = params.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
    if params.response_format is not None:
        body["response_format"] = params.response_format.model_dump(exclude_none=True, by_alias=True)
    return body
