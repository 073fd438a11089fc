"""The benchmark's open-loop load generator (`bench.drive`) against a real HTTP/1.1 server: each request sent at its
time as a form (a multipart one with its media), refusals waited out for their Retry-After, every accepted job
long-polled until it ends, over kept-alive connections."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from bench import drive as driving
from bench.workload import Media, Request
from tests.serving import serve_handler

#: The Retry-After the server sends with its one refusal.
RETRY_AFTER_S = 0.3


class Server(BaseHTTPRequestHandler):
    """`POST /v1/jobs`: 202 with a job named after the request's number (its prompt), except the first try of
    request 1, refused 429; `GET /v1/jobs/{id}?wait=`: `queued` on a job's first poll, `succeeded` on the next;
    `GET /v1/stats`: an idle stack's."""

    protocol_version = "HTTP/1.1"
    posts: ClassVar[dict[str, list[float]]] = {}
    media: ClassVar[dict[str, bytes]] = {}
    polls: ClassVar[dict[str, int]] = {}
    connections: ClassVar[set[int]] = set()
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        prompt, media = _form(self.headers["Content-Type"], body)
        with self.lock:
            Server.connections.add(id(self.connection))
            tries = Server.posts.setdefault(prompt, [])
            tries.append(time.monotonic())
            if media is not None:
                Server.media[prompt] = media
        if prompt == "1" and len(tries) == 1:
            self._answer(429, {"error": {"code": "queue_full"}}, {"Retry-After": str(RETRY_AFTER_S)})
            return
        self._answer(202, {"id": prompt, "status": "queued"})

    def do_GET(self) -> None:
        path = urlsplit(self.path)
        if path.path == "/v1/stats":
            self._answer(200, {"queues": {}, "device": {"busy_s": 0.0}, "cpu_s": {}})
            return
        assert float(parse_qs(path.query)["wait"][0]) > 0  # a long-poll
        job_id = path.path.rsplit("/", 1)[-1]
        with self.lock:
            Server.connections.add(id(self.connection))
            Server.polls[job_id] = Server.polls.get(job_id, 0) + 1
            status = "queued" if Server.polls[job_id] == 1 else "succeeded"
        self._answer(200, {"id": job_id, "status": status})

    def _answer(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # the base class names it so
        return


def _form(kind: str, body: bytes) -> tuple[str, bytes | None]:
    """The prompt, and the uploaded file's bytes if any, of a urlencoded or multipart form."""
    if kind.startswith("application/x-www-form-urlencoded"):
        return parse_qs(body.decode())["prompt"][0], None
    boundary = b"--" + kind.split("boundary=")[1].encode()
    fields: dict[str, bytes] = {}
    for part in body.split(boundary)[1:-1]:
        head, _, value = part.partition(b"\r\n\r\n")
        name = head.split(b'name="')[1].split(b'"')[0].decode()
        fields[name] = value[: -len(b"\r\n")]
    media = next((value for name, value in fields.items() if name != "prompt"), None)
    return fields["prompt"].decode(), media


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(driving, "CPU_SETTLE_S", 0.0)  # no workers here to settle
    Server.posts, Server.media, Server.polls, Server.connections = {}, {}, {}, set()
    with serve_handler("127.0.0.1", Server) as port:
        yield f"http://127.0.0.1:{port}"


def _requests(count: int) -> list[Request]:
    picture = Media("image", bytes(range(256)) * 4, "test image")
    return [
        Request(n, 0.05 * n, "image" if n % 2 else "text", str(n), picture if n % 2 else None) for n in range(count)
    ]


def test_every_request_is_sent_once_accepted_and_polled_until_it_ended(server: str) -> None:
    requests = _requests(8)
    run = driving.drive(server, requests, give_up_s=10)

    assert [o.request.n for o in run.outcomes] == list(range(8))
    assert all(o.error is None for o in run.outcomes)
    assert [o.job["status"] for o in run.outcomes if o.job] == ["succeeded"] * 8
    assert all(o.latency_s is not None and o.latency_s > 0 for o in run.outcomes)
    assert Server.polls == {str(n): 2 for n in range(8)}  # queued, then succeeded
    # The media went as the form's file, byte for byte; a text request is a plain form.
    assert Server.media == {str(n): r.media.data for n, r in enumerate(requests) if r.media}


def test_a_refused_request_waits_its_retry_after_and_is_counted(server: str) -> None:
    run = driving.drive(server, _requests(3), give_up_s=10)

    refused = run.outcomes[1]
    assert [o.refusals for o in run.outcomes] == [0, 1, 0]
    first, second = Server.posts["1"]
    assert second - first >= RETRY_AFTER_S
    assert refused.job is not None
    assert refused.job["status"] == "succeeded"
    assert refused.latency_s is not None
    assert refused.latency_s >= RETRY_AFTER_S  # from the first try


def test_requests_share_kept_alive_connections(server: str) -> None:
    run = driving.drive(server, _requests(12), give_up_s=10)

    assert all(o.job is not None for o in run.outcomes)
    # 12 jobs, 24 polls and 13 posts: the exchanges that do not overlap go over the same connections.
    assert len(Server.connections) < 12
