"""The cost benchmark's load generator (`bench.rawload`) against a real HTTP/1.1 server: keep-alive exchanges,
what each client got, and every accepted job waited for."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar
from urllib.parse import parse_qs

import httptools
import pytest

from bench import rawload
from tests.serving import serve_handler


def _write(
    handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str], length: int | None = None
) -> None:
    """An answer of `body`, its Content-Length `length` (the body's own unless given)."""
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    handler.end_headers()
    handler.wfile.write(body)


class JobsHandler(BaseHTTPRequestHandler):
    """`POST /v1/jobs` answers 202 with a job named after its prompt (429 for a prompt that says so); `GET
    /v1/jobs/{id}` answers the job succeeded, or 404 for one never made. One connection serves many requests."""

    protocol_version = "HTTP/1.1"
    made: ClassVar[set[str]] = set()
    connections: ClassVar[set[int]] = set()

    def do_POST(self) -> None:
        JobsHandler.connections.add(id(self.connection))
        length = int(self.headers["Content-Length"])
        prompt = parse_qs(self.rfile.read(length).decode())["prompt"][0]
        if "busy" in prompt:
            self._answer(429, {"error": {"code": "queue_full"}})
            return
        job_id = prompt.replace(" ", "-")
        JobsHandler.made.add(job_id)
        self._answer(202, {"id": job_id, "status": "queued"})

    def do_GET(self) -> None:
        job_id = self.path.split("?")[0].rsplit("/", 1)[-1]
        if job_id in JobsHandler.made:
            self._answer(200, {"id": job_id, "status": "succeeded"})
        else:
            self._answer(404, {"error": {"code": "not_found"}})

    def _answer(self, status: int, body: dict[str, object]) -> None:
        _write(self, status, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def log_message(self, format: str, *args: object) -> None:  # the base class names it so
        return


@pytest.fixture
def server() -> Iterator[str]:
    JobsHandler.made, JobsHandler.connections = set(), set()
    with serve_handler("127.0.0.1", JobsHandler) as port:
        yield f"http://127.0.0.1:{port}"


def _form(n: int) -> tuple[str, str, bytes]:
    prompt = f"job {n}" if n % 5 else f"busy {n}"  # every fifth is refused
    return "POST", "/v1/jobs", f"prompt={prompt.replace(' ', '+')}".encode()


def test_clients_send_each_request_once_over_kept_connections_and_count_what_they_got(server: str) -> None:
    tally = rawload.run(server, _form, clients=3, seconds=0.5)
    sent = tally.statuses[202] + tally.statuses[429]
    assert tally.statuses[202] > 10
    assert not tally.errors
    assert sorted(tally.accepted) == sorted(JobsHandler.made)  # every 202's job id, once each
    assert len(set(tally.accepted)) == len(tally.accepted)
    assert tally.statuses[429] == sent // 5  # n = 1 .. sent, between the clients, each once
    assert len(JobsHandler.connections) == 3  # one kept-alive connection per client


def test_every_accepted_job_is_waited_for_and_counted_by_how_it_ended(server: str) -> None:
    tally = rawload.run(server, _form, clients=2, seconds=0.2)
    ended = rawload.wait_all(server, [*tally.accepted, "never-made"], clients=4)
    assert ended == {"succeeded": len(tally.accepted), "HTTP 404": 1}


class AnswersHandler(BaseHTTPRequestHandler):
    """`POST /big/{n}` answers 200 with n bytes; `POST /refuse` a 429 with Retry-After; `POST /overlong` a body of
    more bytes than its Content-Length says; `POST /hang-up` closes the connection unanswered."""

    protocol_version = "HTTP/1.1"
    connections: ClassVar[int] = 0

    def setup(self) -> None:  # once per connection
        AnswersHandler.connections += 1
        super().setup()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/hang-up":
            self.close_connection = True
            return
        if self.path == "/refuse":
            _write(self, 429, b'{"error":{"code":"queue_full"}}', {"Retry-After": "3"})
            return
        size = int(self.path.rsplit("/", 1)[-1]) if self.path.startswith("/big/") else 10
        body = bytes(i % 251 for i in range(size))
        _write(self, 200, body + (b"surplus" if self.path == "/overlong" else b""), {}, len(body))

    def log_message(self, format: str, *args: object) -> None:  # the base class names it so
        return


@pytest.fixture
def answers() -> Iterator[str]:
    AnswersHandler.connections = 0
    with serve_handler("127.0.0.1", AnswersHandler) as port:
        yield f"http://127.0.0.1:{port}"


def _exchanges(base: str, paths: list[str], ok_body: bool) -> list[rawload.Reply | BaseException]:
    """Each path posted in turn on `Connections` (one at a time: kept-alive connections reused)."""
    connections = rawload.Connections(base, ok_body=ok_body)

    async def main() -> list[rawload.Reply | BaseException]:
        out: list[rawload.Reply | BaseException] = []
        for path in paths:
            try:
                out.append(await connections.exchange(connections.request("POST", path, b"{}", "application/json"), 10))
            except (OSError, httptools.HttpParserError) as exc:
                out.append(exc)
        connections.close()
        return out

    return asyncio.run(main())


def test_kept_connections_read_answers_of_megabytes_whole_over_one_connection(answers: str) -> None:
    size = 3 * rawload.READ_BYTES + 12_345  # several reads, the last one partial
    replies = _exchanges(answers, [f"/big/{size}", "/big/7", f"/big/{size}"], ok_body=True)
    expected = bytes(i % 251 for i in range(size))
    assert [r.body if isinstance(r, rawload.Reply) else r for r in replies] == [expected, expected[:7], expected]
    assert [r.length for r in replies if isinstance(r, rawload.Reply)] == [size, 7, size]
    assert AnswersHandler.connections == 1


def test_a_200_body_not_kept_is_counted_whole_and_a_refusal_is_kept(answers: str) -> None:
    size = 2 * rawload.READ_BYTES + 1
    replies = _exchanges(answers, [f"/big/{size}", "/refuse", "/big/5"], ok_body=False)
    assert [(r.status, r.body, r.length, r.retry_after) for r in replies if isinstance(r, rawload.Reply)] == [
        (200, b"", size, None),
        (429, b'{"error":{"code":"queue_full"}}', 31, b"3"),
        (200, b"", 5, None),
    ]
    assert AnswersHandler.connections == 1


def test_a_connection_that_hangs_up_or_overruns_its_length_fails_that_exchange_alone(answers: str) -> None:
    replies = _exchanges(answers, ["/hang-up", "/big/4", "/overlong", "/big/6"], ok_body=False)
    hung_up, first, overlong, last = replies
    assert isinstance(hung_up, ConnectionError)
    assert isinstance(overlong, httptools.HttpParserError)
    assert [(r.status, r.length) for r in (first, last) if isinstance(r, rawload.Reply)] == [(200, 4), (200, 6)]
    assert AnswersHandler.connections == 3  # a connection that failed is not used again
