"""The `openai` backend: an OpenAI-compatible chat-completions server (`vllm serve`, …) as the device.

Each batch's requests go out concurrently (at most `max_in_flight` at a time) with the chat as text and every
decoded picture as a base64 JPEG data URL of the *preprocessed* image; the server batches them itself. Server
answers map onto the error taxonomy: overload and unreachability are transient (retried with backoff, then
`model_unavailable`), anything else is `inference_failed` for that request alone.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from stoker.core.errors import InferenceFailed, ModelUnavailable, StokerError
from stoker.core.model import ModelRequest, Outcome, Prediction

log = logging.getLogger(__name__)

#: Statuses that mean "not now": retried, then model_unavailable.
TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})


class OpenAIPredictor:
    """Requests to an OpenAI-compatible server, behind the same hook contract as a local model."""

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
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None

    def setup(self, device: str) -> None:
        """Open a connection pool sized to the in-flight bound (the device is the server's)."""
        self.close()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=self.timeout_s, limits=limits)
        self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="openai")
        log.info("openai backend: %s model %s, %d in flight", self.base_url, self.model, self.max_in_flight)

    def close(self) -> None:
        """Close the connections and the request threads."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def batch(self, requests: Sequence[ModelRequest]) -> list[dict[str, Any]]:
        """One chat-completions body per request."""
        return [self.body(r) for r in requests]

    def body(self, request: ModelRequest) -> dict[str, Any]:
        """The request as the server takes it: text turns, the user turn carrying the pictures."""
        messages: list[dict[str, Any]] = [dict(m) for m in request.messages]
        pictures = [self._data_url(digest, request.scope) for digest in request.images]
        pictures = [p for p in pictures if p]
        if pictures and messages and messages[-1]["role"] == "user":
            text = messages[-1]["content"]
            parts = [
                {"type": "text", "text": text},
                *({"type": "image_url", "image_url": {"url": p}} for p in pictures),
            ]
            messages[-1] = {"role": "user", "content": parts}
        return {"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens, "temperature": 0}

    def _data_url(self, digest: str, scope: str) -> str | None:
        jpeg = self.images(digest, scope) if self.images else None
        if jpeg is None:
            log.info("picture %s is no longer cached; sending the text alone", digest[:12])
            return None
        return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()

    def predict(self, batch: list[dict[str, Any]]) -> list[Outcome]:
        """All requests concurrently, at most max_in_flight at a time; each ends as a prediction or an error."""
        if self._pool is None:
            raise ModelUnavailable("the openai backend was not set up")
        return list(self._pool.map(self._complete, batch))

    def unbatch(self, output: list[Outcome]) -> list[Outcome]:
        """Already one outcome per request."""
        return output

    def _complete(self, body: dict[str, Any]) -> Outcome:
        error: StokerError = ModelUnavailable("no attempt made")
        for attempt in range(self.attempts):
            try:
                return self._post(body)
            except StokerError as exc:
                if exc.permanent:
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
        if response.status_code in TRANSIENT_STATUS:
            raise ModelUnavailable(f"the inference server answered {response.status_code}", stage="infer")
        if response.status_code != 200:
            detail = response.text[:200]
            raise InferenceFailed(f"the inference server answered {response.status_code}: {detail}", stage="infer")
        return _prediction(response.json())


def _prediction(data: dict[str, Any]) -> Prediction:
    try:
        text = data["choices"][0]["message"]["content"] or ""
        usage = data.get("usage") or {}
    except (KeyError, IndexError, TypeError) as exc:
        raise InferenceFailed(f"the inference server's answer has no message: {exc}", stage="infer") from exc
    return Prediction(
        text=str(text).strip(),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
    )
