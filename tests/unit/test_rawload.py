"""The cost benchmark's load generator (`bench.rawload`) against a real HTTP/1.1 server: keep-alive exchanges,
what each client got, and every accepted job waited for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar
from urllib.parse import parse_qs

import pytest

from bench import rawload
from tests.serving import serve_handler


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
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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
