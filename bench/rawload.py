"""HTTP/1.1 clients that cost next to nothing, for a load generator that shares the stack's cores: closed-loop
clients here (`run`, `wait_all`), and the kept-alive connections (`Connections`) they and the open loops of
`bench.drive` and `bench.render` exchange on.

httpx spends about 0.8 ms of CPU per request here (its request and response models, h11 in pure Python, a thread
per client): at the hundreds of requests a second the admission phase sends, that is a fifth of a two-core machine
taken from the stack it measures (docs/bench/log/2026-12-04-cost-free-load-generator-and-admission.md). These
clients are coroutines on one event loop, each on a keep-alive connection (the closed-loop ones one each; the open
loops' share theirs), writing requests built as bytes and reading responses with httptools (llhttp,
the C parser uvicorn uses). No HTTP client library offers that: they all build request and response objects per
exchange, which is the cost to avoid. The requests are the same bytes a client library would send.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

#: Builds the n-th request: method, target, and a urlencoded form (None: no body).
Request = Callable[[int], tuple[str, str, bytes | None]]


class Reply(NamedTuple):
    """One response: its status, its body (empty for a 200 read without its body), its Retry-After header (None
    without one), and its body's length in bytes."""

    status: int
    body: bytes
    retry_after: bytes | None = None
    length: int = 0


class _Response:
    """httptools' callbacks for one response: its body, its Retry-After, and whether it is complete. With
    `ok_body=False` a 200's body is counted, not kept: a client reading 25 MB answers would otherwise spend more CPU
    gathering them than the server under test spends on some of its steps. Such a body of a known length is not
    parsed either, once its head is in: what arrives is counted against its Content-Length (`take`), so it is
    copied once, from the kernel, and never again."""

    def __init__(self, ok_body: bool = True) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body = bytearray()
        self.length = 0
        self.keep = True
        self.ok_body = ok_body
        self.retry_after: bytes | None = None
        self.declared: int | None = None
        self.counting = False
        self.complete = False

    def take(self, data: bytes | memoryview) -> None:
        """What arrived of the response: parsed, or only counted once its head says it is a 200 of a known length
        that is not kept. More bytes than that length are an HttpParserError: one request is in flight at a time."""
        if not self.counting:
            self.parser.feed_data(data)
            self.counting = not (self.keep or self.complete) and self.declared is not None
            return
        self.length += len(data)
        if self.length > (self.declared or 0):
            raise httptools.HttpParserError("more bytes than the response's Content-Length")
        self.complete = self.length == self.declared

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"retry-after":
            self.retry_after = value
        elif lowered == b"content-length":
            self.declared = int(value)

    def on_headers_complete(self) -> None:
        self.keep = self.ok_body or self.parser.get_status_code() != 200

    def on_body(self, body: bytes) -> None:
        self.length += len(body)
        if self.keep:
            self.body += body

    def on_message_complete(self) -> None:
        self.complete = True

    def reply(self) -> Reply:
        """The response as read."""
        return Reply(self.parser.get_status_code(), bytes(self.body), self.retry_after, self.length)


def encode(
    host: str, method: str, target: str, form: bytes | None, kind: str = "application/x-www-form-urlencoded"
) -> bytes:
    """One HTTP/1.1 request, keep-alive; `form` is its body, of content type `kind`."""
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"
    if form is None:
        return f"{head}\r\n".encode()
    return f"{head}Content-Type: {kind}\r\nContent-Length: {len(form)}\r\n\r\n".encode() + form


class _Connection(asyncio.BufferedProtocol):
    """One kept-alive connection, read straight into one buffer of its own (the event loop's `recv_into`), one
    exchange at a time: a response arrives at one copy, from the kernel, where a `StreamReader` copies each read
    twice more (into its buffer, then out as bytes). Measured on a 2-core VM, 25 MB answers over loopback: 13-16 ms
    of the client's CPU an answer through a `StreamReader` and httptools' body callbacks, 5.1-5.2 ms here."""

    def __init__(self, ok_body: bool) -> None:
        self.ok_body = ok_body
        self.buffer = bytearray(READ_BYTES)
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None
        self.answered: asyncio.Future[Reply] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.response is None or self.answered is None or self.answered.done():
            self._end(ConnectionError("bytes that answer no request"))
            return
        try:
            self.response.take(memoryview(self.buffer)[:nbytes])
        except httptools.HttpParserError as exc:
            self._end(exc)
            return
        if self.response.complete:
            self.answered.set_result(self.response.reply())

    def eof_received(self) -> bool:
        self._end(ConnectionError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or ConnectionError("the server closed the connection"))

    async def exchange(self, request: bytes) -> Reply:
        """Send one request; its response."""
        assert self.transport is not None
        self.response = _Response(self.ok_body)
        self.answered = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.answered

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _end(self, exc: BaseException) -> None:
        """The exchange in flight fails with `exc`, and the connection is closed."""
        self.lost = True
        if self.answered is not None and not self.answered.done():
            self.answered.set_exception(exc)
        self.close()


#: What one read of a connection takes at most.
READ_BYTES = 1 << 20


class Connections:
    """Kept-alive connections to one server, shared by the coroutines of one event loop: an exchange takes an idle
    one (or opens one) and puts it back once its response is in; a connection that failed or timed out is closed.
    One left idle longer than `idle_s` is closed rather than reused, well before the server's keep-alive ends.
    `ok_body=False`: a 200's body is read and counted, not kept (`Reply.length`)."""

    def __init__(self, base: str, idle_s: float = 30.0, ok_body: bool = True) -> None:
        parts = urlsplit(base)
        self.host, self.port, self.netloc = parts.hostname or "127.0.0.1", parts.port or 80, parts.netloc
        self.idle_s = idle_s
        self.ok_body = ok_body
        self._idle: list[tuple[_Connection, float]] = []

    def request(
        self, method: str, target: str, body: bytes | None = None, kind: str = "application/x-www-form-urlencoded"
    ) -> bytes:
        """A request to this server, as bytes to hand to `exchange`."""
        return encode(self.netloc, method, target, body, kind)

    async def exchange(self, request: bytes, timeout_s: float | None = None) -> Reply:
        """Send `request` on a kept-alive connection; its response, or TimeoutError after `timeout_s` (None: no
        limit)."""
        connection = await self._take()
        try:
            async with asyncio.timeout(timeout_s):
                reply = await connection.exchange(request)
        except BaseException:
            connection.close()
            raise
        self._idle.append((connection, time.monotonic()))
        return reply

    def close(self) -> None:
        """Close every idle connection."""
        for connection, _ in self._idle:
            connection.close()
        self._idle.clear()

    async def _take(self) -> _Connection:
        while self._idle:
            connection, since = self._idle.pop()  # the last put back: the others age out
            if time.monotonic() - since < self.idle_s and not connection.lost:
                return connection
            connection.close()
        ok_body = self.ok_body
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: _Connection(ok_body), self.host, self.port
        )
        return connection


@dataclass
class Tally:
    """What the clients got: statuses, and the ids of the jobs accepted (202)."""

    statuses: Counter[int] = field(default_factory=Counter)
    accepted: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


async def _client(base: str, request: Request, numbers: Iterator[int], stop_at: float, tally: Tally) -> None:
    connections = Connections(base)  # one client, one kept-alive connection
    try:
        while time.monotonic() < stop_at:
            n = next(numbers)  # taken only to be sent: the numbers sent are 1, 2, ... with no gap
            try:
                status, body, *_ = await connections.exchange(connections.request(*request(n)))
            except (OSError, ConnectionError, httptools.HttpParserError) as exc:
                tally.errors[type(exc).__name__] += 1
                return
            tally.statuses[status] += 1
            if status == 202:
                tally.accepted.append(json.loads(body)["id"])
    finally:
        connections.close()


def run(base: str, request: Request, clients: int, seconds: float) -> Tally:
    """`clients` closed-loop clients sending `request(n)` (n = 1, 2, ... between them) for `seconds`."""
    tally = Tally()
    numbers = itertools.count(1)  # shared: each n is sent once

    async def main() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_client(base, request, numbers, stop_at, tally) for _ in range(clients)))

    asyncio.run(main())
    return tally


def wait_all(base: str, job_ids: list[str], clients: int = 16, wait_s: int = 30) -> Counter[str]:
    """Each job's status once it has ended, or after `wait_s` (a long-poll per job, `clients` at a time): how many
    have which status."""
    statuses: Counter[str] = Counter()
    pending = iter(job_ids)  # shared: each job is asked for once

    async def client() -> None:
        connections = Connections(base)  # one client, one kept-alive connection
        try:
            for job_id in pending:
                request = connections.request("GET", f"/v1/jobs/{job_id}?wait={wait_s}")
                status, body, *_ = await connections.exchange(request)
                statuses[str(json.loads(body)["status"]) if status == 200 else f"HTTP {status}"] += 1
        finally:
            connections.close()

    async def main() -> None:
        await asyncio.gather(*(client() for _ in range(clients)))

    asyncio.run(main())
    return statuses
