"""How the API is served: uvicorn's config built from settings in one place, so that `stoker api` (what `stoker up`,
the Dockerfile, Compose and Kubernetes all run) bounds what one connection may cost the one event loop.

uvicorn's defaults bound nothing of a request's head: httptools (its default parser, where installed) buffers a
header value or a request target of any length, at a cost that grows with the square of its length (a 64 MiB
header held the loop for seconds), and no clock limits how long a head may take to arrive. h11 refuses a head past
`max_incomplete_event_size`; the clock is `HeadBoundedProtocol`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import sys
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from api.app import create_app
from stoker.core.errors import HeadersTooLarge, MalformedRequest, RequestTimeout, StokerError
from stoker.settings import ApiSettings


def serve(settings: ApiSettings) -> None:
    """Serve the API for these settings until a signal stops it."""
    ApiServer(server_config(settings)).run()


class ApiServer(uvicorn.Server):
    """uvicorn's server with its housekeeping loop once a second instead of ten times (an idle API should cost
    next to nothing), woken at once by the signal that stops it.

    uvicorn's loop only renews the Date header (once a second either way) and looks for a request to stop; the
    signal handler sets that request and, here, wakes the loop, so a stop is still seen at once."""

    #: Seconds between two rounds of the loop.
    tick_s = 1.0
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

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


def server_config(settings: ApiSettings, app: FastAPI | None = None) -> ApiServerConfig:
    """uvicorn's config for the API (its app built from settings unless given): h11 with a bounded head, a
    deadline on the head, and no WebSocket protocol (no route serves one)."""
    return ApiServerConfig(
        create_app(settings) if app is None else app,
        header_timeout_s=settings.header_timeout_s,
        host=settings.host,
        port=settings.port,
        http=HeadBoundedProtocol,
        ws="none",
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=settings.keep_alive_s,
        access_log=settings.access_log,
        # No `limit_concurrency`: uvicorn counts open connections against it, so connections that trickle their
        # heads would get every other client a 503 until the header timeout closes them.
    )


class ApiServerConfig(uvicorn.Config):
    """uvicorn's config and the one bound it has no option for: how long a request's head may take to arrive."""

    def __init__(self, app: FastAPI, *, header_timeout_s: float, **options: Any) -> None:
        super().__init__(app, **options)
        self.header_timeout_s = header_timeout_s


class HeadBoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head, and stoker's structured errors for a head
    refused.

    uvicorn times out only idle kept-alive connections: one that sends its head a byte at a time, or opens and sends
    nothing, is held open for ever. h11 is sans-I/O and has no clock, so the deadline is kept here: armed when a
    connection opens and when a kept-alive one starts its next request, cancelled once h11 has the whole head.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not isinstance(config, ApiServerConfig):
            raise TypeError("HeadBoundedProtocol needs an ApiServerConfig: it holds the header timeout")
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout_s = config.header_timeout_s
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection: its first head is due within the header timeout."""
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Bytes of a head keep its deadline; the whole head cancels it."""
        if self.head_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or h11 refused it)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is gone: so is its deadline."""
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Answer a head h11 refused in stoker's error shape, with the status h11 suggests (431 for a head over
        the limit) instead of uvicorn's plain-text 400."""
        # uvicorn calls this only from its `except h11.RemoteProtocolError`: the exception in hand says why.
        refused = sys.exception()
        status = refused.error_status_hint if isinstance(refused, h11.RemoteProtocolError) else 400
        self._refuse(HeadersTooLarge() if status == 431 else MalformedRequest())

    def _arm(self) -> None:
        self.head_deadline = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_late(self) -> None:
        self.head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(RequestTimeout(f"the request's head did not arrive within {self.header_timeout_s:g} s"))

    def _refuse(self, error: StokerError) -> None:
        """Answer with error (its JSON envelope) and close the connection."""
        body = json.dumps(error.envelope()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = http.HTTPStatus(error.http_status).phrase.encode()
        answer = (h11.Response(status_code=error.http_status, headers=headers, reason=reason), h11.Data(data=body))
        # h11 refuses a second answer on a connection already answering one: closing it is then all that is left
        with contextlib.suppress(h11.LocalProtocolError):
            self.transport.write(b"".join(self.conn.send(event) or b"" for event in (*answer, h11.EndOfMessage())))
        self.transport.close()
