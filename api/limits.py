"""Request body limits enforced while the body streams in, whatever Content-Length claims: its bytes (every body)
and the values a JSON body holds."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stoker.core.errors import PayloadTooLarge


class BodyLimitMiddleware:
    """Refuse bodies over max_bytes: at once from Content-Length, or as soon as the stream passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        #: Paths with a limit of their own (a file upload's, streamed to storage).
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Wrap receive so that reading past the limit raises PayloadTooLarge."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope["path"], self.max_bytes)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _reject(send, limit)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            return message

        await self.app(scope, limited, send)


async def _reject(send: Send, limit: int) -> None:
    payload = json.dumps(PayloadTooLarge(f"request body exceeds {limit} bytes").envelope()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": payload})


#: The bytes that open a JSON value after the first: each element but the first follows a comma, each container's
#: first member follows its bracket (counted inside strings too: an overcount, never an undercount).
_VALUE_OPENERS = b",[{"


async def read_json(request: Request, max_values: int) -> bytes:
    """A JSON body, refused (PayloadTooLarge) as soon as it holds more than max_values values, before the rest is
    read: parsing holds the GIL for a time that grows with the values (a million cost seconds of every request's
    latency, even parsed in a thread), and counting is one pass over each chunk as it arrives."""
    chunks, values = [], 1
    async for chunk in request.stream():
        values += len(chunk) - len(chunk.translate(None, _VALUE_OPENERS))
        if values > max_values:
            raise PayloadTooLarge(f"the JSON body holds more than {max_values} values", param="body")
        chunks.append(chunk)
    return b"".join(chunks)
