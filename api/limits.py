"""Request body limits enforced while the body streams in, whatever Content-Length claims: its bytes (every body)
and the values a JSON body holds."""

from __future__ import annotations

import json
import re

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stoker.core.errors import PayloadTooLarge, UnsupportedMediaType


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


#: The bytes that open a JSON value after the first, outside strings: each element but the first follows a comma,
#: each container's first member follows its bracket (an empty container counts one too: an overcount, never an
#: undercount).
_VALUE_OPENERS = b",[{"
#: The body of a JSON string: up to (not including) its closing quote, or to the chunk's end but for a lone backslash
#: that ends the chunk (escapes are skipped in pairs, so an escaped quote never ends it). Possessive, as every
#: pattern here: none backtracks into what it took, so a scan is linear whatever the bytes.
_BODY = rb'[^"\\]*+(?:\\.[^"\\]*+)*+'
#: A whole JSON string, quotes included.
_STRING = re.compile(rb'"' + _BODY + rb'"', re.DOTALL)
#: The rest of a string begun in an earlier chunk (its body).
_STRING_REST = re.compile(_BODY, re.DOTALL)
#: A chunk that begins outside strings: bytes outside strings and whole strings, then perhaps a string cut by the
#: chunk's end (group 1: its body; group 2: a lone backslash that ends the chunk and escapes the next one's first byte).
_CHUNK = re.compile(rb'(?:[^"]*+"' + _BODY + rb'")*+[^"]*+(?:"(' + _BODY + rb")(\\?))?", re.DOTALL)


class JsonValueCounter:
    """Counts the values of a JSON text as it streams in, a chunk at a time, never those in its strings (a CSV
    prompt's commas are not values).

    Hand-written because nothing cheaper does it: the standard library parses only whole texts, and a streaming
    parser (ijson, a new dependency) hands Python an event per value, slower than this count, which stays in C:
    `re` finds where a string cut by the chunk's end begins and removes the whole strings before it,
    `bytes.translate` counts the openers left. What is carried from one chunk to the next is whether it ended inside
    a string, and whether a backslash there escapes the next chunk's first byte.

    A valid text of n values holds at most 2n strings (each is a value or a member's key): `strings` bounds an
    invalid one that is all strings."""

    def __init__(self) -> None:
        #: Values so far (the text's first, and one per opener outside strings).
        self.values = 1
        #: Strings begun so far.
        self.strings = 0
        self._in_string = False
        self._escaped = False

    def feed(self, chunk: bytes) -> None:
        """Count the values and strings that begin in the next chunk."""
        if not chunk:
            return
        start = self._string_end(chunk) if self._in_string else 0
        if self._in_string:
            return
        if chunk.find(b"\\", start) < 0:
            self._feed_plain(chunk, start)
            return
        shape = _CHUNK.fullmatch(chunk, start)
        assert shape is not None  # the pattern takes any bytes
        end = len(chunk)
        if shape.group(1) is not None:  # a string begins and runs past the chunk's end
            end = shape.start(1) - 1
            self._in_string, self._escaped = True, bool(shape.group(2))
            self.strings += 1
        outside, whole = _STRING.subn(b"", chunk[start:end])
        self.strings += whole
        self.values += len(outside) - len(outside.translate(None, _VALUE_OPENERS))

    def _string_end(self, chunk: bytes) -> int:
        """Where, in a chunk that begins inside a string, that string ends (just after its closing quote); the
        chunk's length if it does not."""
        start = 0
        if self._escaped:
            start, self._escaped = 1, False
        if chunk.find(b"\\", start) < 0:  # no escape (inline media, base64): memchr finds its end, faster than `re`
            quote = chunk.find(b'"', start)
            if quote < 0:
                return len(chunk)
            self._in_string = False
            return quote + 1
        rest = _STRING_REST.match(chunk, start)
        assert rest is not None  # the pattern takes the empty string
        end = rest.end()
        if end < len(chunk) and chunk[end] == ord('"'):
            self._in_string = False
            return end + 1
        self._escaped = end < len(chunk)  # stopped at a backslash that ends the chunk: it escapes the next byte
        return len(chunk)

    def _feed_plain(self, chunk: bytes, start: int) -> None:
        """`feed` for the rest of a chunk, from `start` (outside strings), that holds no backslash: every quote
        opens or closes a string, so splitting at them leaves the bytes outside strings at the even places. `split`
        and `join` run at memchr's speed where `re` steps byte by byte (a picture's 270 KB of base64 in one chunk:
        4 ms)."""
        pieces = chunk[start:].split(b'"')
        quotes = len(pieces) - 1
        self.strings += (quotes + 1) // 2
        self._in_string = quotes % 2 == 1
        outside = b"".join(pieces[::2])
        self.values += len(outside) - len(outside.translate(None, _VALUE_OPENERS))


async def read_json_body(request: Request, max_values: int) -> bytes:
    """A JSON request's body (`read_json`); 415 unless it says it is JSON."""
    if not request.headers.get("content-type", "").startswith("application/json"):
        raise UnsupportedMediaType("send application/json")
    return await read_json(request, max_values)


async def read_json(request: Request, max_values: int) -> bytes:
    """A JSON body, refused (PayloadTooLarge) as soon as it holds more than max_values values, before the rest is
    read: parsing holds the GIL for a time that grows with the values (a million cost seconds of every request's
    latency, even parsed in a thread), and counting is one pass over each chunk as it arrives
    (`JsonValueCounter`)."""
    chunks, counter = [], JsonValueCounter()
    async for chunk in request.stream():
        counter.feed(chunk)
        if counter.values > max_values or counter.strings > 2 * max_values:
            raise PayloadTooLarge(f"the JSON body holds more than {max_values} values", param="body")
        chunks.append(chunk)
    return b"".join(chunks)
