"""Fence: uvicorn's server and its httptools protocol, subclassed where uvicorn has no option for what stoker needs.
The one module that overrides uvicorn's hooks.

Mirrors uvicorn 0.55 (`UVICORN_VERSIONS`; written against 0.55.0). `tests/unit/test_fence_uvicorn.py` checks each
thing below against the installed uvicorn and fails, naming it, on a release that changes it:

- `HttpToolsProtocol`'s constructor and the hooks `HeadBoundedProtocol` overrides, with the arguments it expects:
  the asyncio protocol's `connection_made`, `data_received`, `connection_lost`; the parser's callbacks
  `on_message_begin`, `on_url`, `on_header`, `on_headers_complete`, `on_body`, `on_message_complete`; the private
  `_start_asgi_task` (how a request's app is run) and `send_400_response` (called from its `except
  httptools.HttpParserError`);
- what it reads of uvicorn's state: the protocol's `cycle`, `transport` and `loop`, and a `RequestResponseCycle`'s
  `response_started`, `response_complete`, `keep_alive` and `message_event`;
- `Server.main_loop`, `Server.on_tick(counter)` (the Date header renewed on multiples of 10; True once asked to
  stop) and `Server.handle_exit(sig, frame)`, which `ApiServer` overrides.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from stoker.core.errors import HeadersTooLarge, MalformedRequest, RequestTimeout, StokerError

#: The uvicorn releases this module mirrors: a release outside them fails `tests/unit/test_fence_uvicorn.py` until
#: every check there passes on it and this range is widened.
UVICORN_VERSIONS = ">=0.55,<0.56"
#: uvicorn's hooks `HeadBoundedProtocol` overrides.
PROTOCOL_HOOKS = (
    "__init__",
    "connection_made",
    "data_received",
    "connection_lost",
    "on_message_begin",
    "on_url",
    "on_header",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "_start_asgi_task",
    "send_400_response",
)
#: uvicorn's hooks `ApiServer` overrides.
SERVER_HOOKS = ("__init__", "main_loop", "handle_exit")


class ApiServer(uvicorn.Server):
    """uvicorn's server with its housekeeping loop once a second instead of ten times (an idle API should cost
    next to nothing), woken at once by the signal that stops it, which it also tells the app (`on_stop`, on the
    serving loop).

    uvicorn's loop only renews the Date header (once a second either way) and looks for a request to stop; the
    signal handler sets that request and, here, wakes the loop, so a stop is still seen at once. On a stop uvicorn
    takes no new connections and waits for the requests in flight: `on_stop` is how the requests that wait on a job
    learn to answer within the stop's grace (`Announcements.stop`)."""

    #: Seconds between two rounds of the loop.
    tick_s = 1.0
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    async def main_loop(self) -> None:
        """Each round does what uvicorn's loop does every tenth round of its own: renew the Date header, and stop
        when asked to."""
        self._wake, self._loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # uvicorn renews the Date header on multiples of 10
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.tick_s)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A stop signal: uvicorn's handling, then wake the loop that looks for it."""
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
            if self.on_stop is not None:
                self._loop.call_soon_threadsafe(self.on_stop)


class ApiServerConfig(uvicorn.Config):
    """uvicorn's config and the bounds it has no option for with httptools: how long a request's head may take to
    arrive, and how many bytes it may have; how long its body may take (`body_timeout_s`, and as long again as its
    bytes so far take at `body_min_bytes_per_s`; 0: no such allowance)."""

    def __init__(
        self,
        app: FastAPI,
        *,
        header_timeout_s: float,
        max_head_bytes: int,
        body_timeout_s: float = 30.0,
        body_min_bytes_per_s: int = 64 * 1024,
        **options: Any,
    ) -> None:
        super().__init__(app, **options)
        self.header_timeout_s = header_timeout_s
        self.max_head_bytes = max_head_bytes
        self.body_timeout_s = body_timeout_s
        self.body_min_bytes_per_s = body_min_bytes_per_s


class HeadBoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on each request's head in bytes and in time, and stoker's
    structured errors for a head refused.

    httptools has neither bound: it buffers a head of any length, and uvicorn times out only idle kept-alive
    connections, so one that sends its head a byte at a time, or opens and sends nothing, is held open for ever.
    Both are kept here, around the parser's own callbacks:
    - the deadline is armed when a connection opens and when a kept-alive one starts its next head, and cancelled
      once the parser has the whole head;
    - a head that completes is measured from what the parser hands over (its target and header lines) and refused
      431 past the bound, before any route sees it;
    - a head still incomplete is counted in the chunks fed to the parser, and refused 431 once they pass the bound
      (the parser buffers an unfinished line whole: this is what keeps it from growing without bound). A head that
      begins mid-chunk (a pipelined request) is counted from the next chunk on, so a pipelined request is never
      refused for the body before it.

    A body still arriving after the chunk that completed its head has a deadline too (`body_timeout_s` from the
    head's end, and as long again as its bytes so far take at `body_min_bytes_per_s`), cancelled once it is in. Past
    it, the route reading the body gets `RequestTimeout` from its `receive` (answered 408 in the error shape, as any
    error) and the connection is closed after the answer; a body whose answer went out before it was read (a 401,
    say, or a 413) is no longer waited for: the connection is closed.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not isinstance(config, ApiServerConfig):
            raise TypeError("HeadBoundedProtocol needs an ApiServerConfig: it holds the head's bounds")
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s = config.header_timeout_s
        self.max_head_bytes = config.max_head_bytes
        self.head_deadline: asyncio.TimerHandle | None = None
        #: No head is complete since the last request ended (or the connection opened): the next is awaited.
        self.awaiting_head = True
        #: The awaited head's first bytes have come (the parser began its message).
        self.head_begun = False
        #: Bytes of the awaited head fed so far, in whole chunks (see the class's note).
        self.head_bytes = 0
        #: Bytes of the current head's target and header lines, as the parser hands them over.
        self.head_lines_bytes = 0
        #: Set by the parser when a head completes during the chunk being fed.
        self._head_completed = False
        self.body_timeout_s = config.body_timeout_s
        self.body_min_bytes_per_s = config.body_min_bytes_per_s
        self.body_deadline: asyncio.TimerHandle | None = None
        #: When the current request's head completed (the loop's clock), and the bytes of its body since.
        self.body_began = 0.0
        self.body_bytes = 0
        #: The request whose body passed its deadline: its `receive` raises `RequestTimeout`.
        self.late_cycle: RequestResponseCycle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection: its first head is due within the header timeout."""
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Feed the parser; count the bytes of a head still incomplete, and refuse it past its bound."""
        in_head = self.awaiting_head
        if in_head and self.head_deadline is None:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        self._head_completed = False
        super().data_received(data)
        if self.awaiting_head and not self.transport.is_closing():
            if in_head and not self._head_completed:
                self.head_bytes += len(data)
                if self.head_bytes > self.max_head_bytes:
                    self._refuse(HeadersTooLarge())
            elif self.head_begun and self.head_deadline is None:
                self._arm()  # a pipelined request's head began after the one before it ended
        elif self.body_deadline is None and not self.transport.is_closing():
            self._arm_body()  # the head is in and its body goes on past this chunk

    def on_message_begin(self) -> None:
        """A request's first bytes: its head is measured from here."""
        self.head_lines_bytes, self.head_begun = 0, True
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        """A piece of the request target (the parser may hand it over in several)."""
        self.head_lines_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """A header line, with its ": " and line end."""
        self.head_lines_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The whole head is in: refused if over the bound (the parser stops, and `send_400_response` answers),
        otherwise its deadline and its count end and the request goes on."""
        if self.head_lines_bytes > self.max_head_bytes:
            raise HeadersTooLarge()
        self.awaiting_head, self.head_begun, self._head_completed, self.head_bytes = False, False, True, 0
        self.body_began, self.body_bytes = self.loop.time(), 0
        self._disarm()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """A piece of the request's body: counted towards its deadline's allowance."""
        self.body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The request's body is in: its deadline ends, and the next bytes begin the next head."""
        self.awaiting_head = True
        self._disarm_body()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is gone: so are its deadlines."""
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        """Run the app for a request with a `receive` that raises `RequestTimeout` once the request's body is late."""

        async def bounded(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
            async def receive_in_time() -> Any:
                if self.late_cycle is not cycle:
                    message = await receive()
                    if self.late_cycle is not cycle:
                        return message
                raise RequestTimeout(f"the request's body did not arrive within {self.body_timeout_s:g} s")

            await app(scope, receive_in_time, send)

        super()._start_asgi_task(cycle, bounded)

    def send_400_response(self, msg: str) -> None:
        """Answer a request the parser refused in stoker's error shape instead of uvicorn's plain-text 400: 431
        where it was `on_headers_complete` that stopped it over the bound."""
        # uvicorn calls this only from its `except httptools.HttpParserError`: the exception in hand says why, and
        # an exception raised in one of the parser's callbacks is its context.
        refused = sys.exception()
        cause = refused.__context__ if refused is not None else None
        self._refuse(cause if isinstance(cause, HeadersTooLarge) else MalformedRequest())

    def _arm(self) -> None:
        self.head_deadline = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _arm_body(self) -> None:
        self.body_deadline = self.loop.call_at(self.body_began + self.body_timeout_s, self._body_late)

    def _disarm_body(self) -> None:
        if self.body_deadline is not None:
            self.body_deadline.cancel()
            self.body_deadline = None

    def _body_late(self) -> None:
        """The body's deadline came: put off by what its bytes so far allow, or refused."""
        self.body_deadline = None
        if self.awaiting_head or self.transport.is_closing():
            return
        allowed = self.body_bytes / self.body_min_bytes_per_s if self.body_min_bytes_per_s else 0.0
        due = self.body_began + self.body_timeout_s + allowed
        if self.loop.time() < due:
            self.body_deadline = self.loop.call_at(due, self._body_late)
            return
        cycle = self.cycle
        if cycle is None or cycle.response_started:  # answered (or answering) already: the rest is not waited for
            self.transport.close()
            return
        cycle.keep_alive = False  # whatever the answer, the connection closes after it
        self.late_cycle = cycle
        cycle.message_event.set()  # wakes the route waiting for the body, whose `receive` now raises

    def _head_late(self) -> None:
        self.head_deadline = None
        if self.awaiting_head and not self.transport.is_closing():
            self._refuse(RequestTimeout(f"the request's head did not arrive within {self.header_timeout_s:g} s"))

    def _refuse(self, error: StokerError) -> None:
        """Answer with error (its JSON envelope) and close the connection; only close it where a response is
        already under way on it (a pipelined request's head refused while the one before is answered)."""
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(error.envelope()).encode()
            status = http.HTTPStatus(error.http_status)
            head = (
                f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode("ascii") + body)
        self.transport.close()
