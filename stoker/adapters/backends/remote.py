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

With `STOKER_OPENAI_PROTOCOL` `generate` (or `auto`, while the server offers it), a request is instead rendered here
(`RequestRendering`: token ids, each picture's tensors from the stage cache, never a picture) and POSTed as vLLM's
`GenerateRequest` to `/inference/v1/generate` at the server's root (the base URL less its `/v1`); the answer comes
back as a parsed chat message (`output_mode: derender`), or streamed as tokens detokenized here
(`stoker.adapters.backends.generated`). In `auto`, a server that does not offer it (404, or vLLM's 403 when started
without `--enable-scale-out`) gets chat completions from then on (logged once, counted in
`stoker_openai_generate_fallbacks_total`).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import httpx

from stoker.adapters.backends.chat_answers import StreamedChat, answer_of, sse_chunks
from stoker.adapters.backends.generated import StreamedTokens, chat_completion
from stoker.adapters.backends.vlm import VisionEncoder, tensor_base64
from stoker.adapters.metrics import OPENAI_GENERATE_FALLBACKS
from stoker.adapters.vllm_render import request_json
from stoker.core.errors import ImageTensorsMissing, InferenceFailed, ModelUnavailable, StokerError
from stoker.core.model import EncoderUse, GenerationParams, ModelRequest, Outcome, Prediction

log = logging.getLogger(__name__)

#: Statuses that mean "not now": retried, then model_unavailable.
TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})
#: vLLM's token-in, token-out endpoint, at the server's root.
GENERATE_PATH = "/inference/v1/generate"
#: A generate request's body is written by `request_json` (its pictures' base64 copied in, not scanned by json).
_JSON = {"content-type": "application/json"}
ServerProtocol = Literal["auto", "generate", "chat"]


class RequestRendering(Protocol):
    """What renders a request into vLLM's `GenerateRequest` (`stoker.adapters.generate.RequestRenderer`)."""

    def body(self, request: ModelRequest, *, max_tokens: int, priority: int, stream: bool) -> dict[str, Any]:
        """The request's `GenerateRequest` JSON."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Answer tokens as text."""
        ...


class _NoGenerate(Exception):
    """The server does not offer the generate endpoint: 404, or vLLM's 403 for scale-out routes switched off."""


#: What vLLM 0.33.0's `vllm serve` answers (403) on its scale-out routes, `/inference/v1/generate` among them, when
#: it was started without `--enable-scale-out` (`vllm/entrypoints/scale_out/factories.py`).
SCALE_OUT_OFF = "Scale-out endpoints are disabled"


@dataclass(frozen=True)
class Call:
    """One request as it goes out: the request, where its pieces go when it is streamed, and its bodies once made."""

    request: ModelRequest
    stream_to: str | None = None
    #: Per picture sent as embeddings (content hash): whether they came from the cache.
    encoder: dict[str, EncoderUse] = field(default_factory=dict)
    #: The request's bodies by protocol (`chat`, `generate`), each made once, on its first attempt.
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)


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
        rendering: RequestRendering | None = None,
        protocol: ServerProtocol = "auto",
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
        #: How requests reach the server (`STOKER_OPENAI_PROTOCOL`); without a renderer, always chat completions.
        self.rendering = rendering
        self.protocol: ServerProtocol = protocol if rendering is not None else "chat"
        self._protocol_lock = threading.Lock()
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
        """One call per request (its body is made when it goes out, for the protocol it goes by)."""
        return [Call(r, r.stream_to if self.pieces is not None else None) for r in requests]

    def generate_body(self, request: ModelRequest, stream: bool = False) -> dict[str, Any]:
        """The request as vLLM's `GenerateRequest`, with its new tokens, priority and streaming."""
        assert self.rendering is not None
        max_tokens = request.params.new_tokens(self.max_new_tokens, self.max_tokens_cap)
        return self.rendering.body(request, max_tokens=max_tokens, priority=self._priority(request), stream=stream)

    def _priority(self, request: ModelRequest) -> int:
        """vLLM's priority scheduling: lower runs first, and may preempt; a batch line's is the configured one."""
        return self.batch_priority if self.batch_priority is not None and request.background else 0

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
        if self.batch_priority is not None:  # a server without priority scheduling refuses one other than 0
            body["priority"] = self._priority(request)
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
                answer = self._answer(call, sent)
                return replace(answer, encoder=call.encoder) if call.encoder else answer
            except StokerError as exc:
                if exc.permanent or sent[0]:  # a stream that sent pieces cannot be taken back: no retry
                    return exc
                error = exc
                time.sleep(min(0.5 * 2**attempt, 5.0))
        return error

    def _answer(self, call: Call, sent: list[int]) -> Prediction:
        """The request's answer by the protocol it goes by: generate while the server offers it, else chat. In
        `auto`, a request with a picture that has no rendering here (the CPU stage did not render it, and it cannot
        be rendered again: a served model whose pictures this worker cannot render) goes by chat completions."""
        if self.protocol != "chat":
            try:
                return self._generate(call, sent)
            except _NoGenerate:
                self._fall_back()
            except ImageTensorsMissing as exc:
                if self.protocol == "generate":
                    raise
                log.info("openai backend: %s: this request goes by chat completions", exc.message)
        if "chat" not in call.bodies:
            call.bodies["chat"] = self.body(call.request, call.encoder)
        body = call.bodies["chat"]
        return self._stream(body, call.stream_to, sent) if call.stream_to else self._post(body)

    def _fall_back(self) -> None:
        """A server without the generate endpoint: `auto` goes on by chat completions (said once, counted per
        request); `generate` fails the request."""
        if self.protocol == "generate":
            raise InferenceFailed(
                f"the inference server does not offer {GENERATE_PATH}: start vLLM with --enable-scale-out, or set "
                "STOKER_OPENAI_PROTOCOL=chat",
                stage="infer",
            )
        OPENAI_GENERATE_FALLBACKS.inc()
        with self._protocol_lock:
            if self.protocol == "auto":
                self.protocol = "chat"
                log.warning(
                    "openai backend: %s does not offer %s: chat completions from now on", self.base_url, GENERATE_PATH
                )

    def _generate(self, call: Call, sent: list[int]) -> Prediction:
        """One request through vLLM's generate endpoint: a parsed message, or a stream of tokens. A request that
        offers tools is answered whole: a forced call's tokens are its arguments alone (vLLM's structured outputs),
        which only the server's parsing (`derender`) makes a call of."""
        assert self.rendering is not None
        streamed = call.stream_to is not None and call.request.params.calls == "none"
        if "generate" not in call.bodies:
            call.bodies["generate"] = self.generate_body(call.request, stream=streamed)
        url = self.base_url.removesuffix("/v1") + GENERATE_PATH
        with _reaching_the_server():
            if streamed:
                return self._generate_stream(url, call, sent)
            response = self._http().post(url, content=request_json(call.bodies["generate"]), headers=_JSON)
        _check_generate(response, response.text)
        return answer_of(chat_completion(response.json(), self.rendering.detokenize))

    def _generate_stream(self, url: str, call: Call, sent: list[int]) -> Prediction:
        """The answer's tokens as they come, detokenized here; each piece goes on at once."""
        assert self.rendering is not None
        assert call.stream_to is not None
        answer = StreamedTokens(self.rendering.detokenize, call.request.params.stop)
        with self._http().stream("POST", url, content=request_json(call.bodies["generate"]), headers=_JSON) as response:
            _check_generate(response, response.read().decode(errors="replace") if response.status_code != 200 else "")
            for chunk in sse_chunks(response.iter_lines()):
                self._hand_on(call.stream_to, answer.add(chunk), sent)
        self._hand_on(call.stream_to, answer.rest(), sent)
        return answer.prediction()

    def _hand_on(self, job_id: str, piece: str, sent: list[int]) -> None:
        if piece:
            assert self.pieces is not None
            self.pieces(job_id, piece)
            sent[0] += 1

    def _http(self) -> httpx.Client:
        if self._client is None:
            raise ModelUnavailable("the openai backend was not set up")
        return self._client

    def _post(self, body: dict[str, Any]) -> Prediction:
        assert self._client is not None
        try:
            response = self._client.post("/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise ModelUnavailable(f"the inference server timed out: {exc}", stage="infer") from exc
        except httpx.TransportError as exc:
            raise ModelUnavailable(f"the inference server cannot be reached: {exc}", stage="infer") from exc
        _check(response, response.text)
        return answer_of(response.json())

    def _stream(self, body: dict[str, Any], stream_to: str, sent: list[int]) -> Prediction:
        """The answer as a stream: each piece goes on as it arrives; the whole answer is returned at the end."""
        assert self._client is not None
        assert self.pieces is not None
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        answer = StreamedChat()
        try:
            with self._client.stream("POST", "/chat/completions", json=body) as response:
                _check(response, response.read().decode(errors="replace") if response.status_code != 200 else "")
                for chunk in sse_chunks(response.iter_lines()):
                    self._hand_on(stream_to, answer.add(chunk), sent)
            self._hand_on(stream_to, answer.rest(), sent)
        except httpx.TimeoutException as exc:
            raise ModelUnavailable(f"the inference server timed out: {exc}", stage="infer") from exc
        except httpx.TransportError as exc:
            raise ModelUnavailable(f"the inference server cannot be reached: {exc}", stage="infer") from exc
        return answer.prediction()


@contextmanager
def _reaching_the_server() -> Iterator[None]:
    """Timeouts and unreachability as the error taxonomy has them: transient."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ModelUnavailable(f"the inference server timed out: {exc}", stage="infer") from exc
    except httpx.TransportError as exc:
        raise ModelUnavailable(f"the inference server cannot be reached: {exc}", stage="infer") from exc


def _check_generate(response: httpx.Response, detail: str) -> None:
    """As `_check`; a server without the generate endpoint raises `_NoGenerate`: 404, or vLLM's 403 saying its
    scale-out routes are off (any other 403 is a refusal like another)."""
    if response.status_code == 404 or (response.status_code == 403 and SCALE_OUT_OFF in detail):
        raise _NoGenerate
    _check(response, detail)


def _check(response: httpx.Response, detail: str) -> None:
    """Overload and unavailability are transient; any other answer but 200 fails the request."""
    if response.status_code in TRANSIENT_STATUS:
        raise ModelUnavailable(f"the inference server answered {response.status_code}", stage="infer")
    if response.status_code != 200:
        raise InferenceFailed(f"the inference server answered {response.status_code}: {detail[:200]}", stage="infer")


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
