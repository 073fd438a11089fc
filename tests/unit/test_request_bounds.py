"""What one request may cost the API before any route runs: the server's config (one, from settings, whichever way
the API is started) and the JSON body read counting its values as it streams in."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI
from sse_starlette.sse import AppStatus
from starlette.requests import Request
from starlette.types import Message
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.limits import read_json
from api.server import ApiServer, HeadBoundedProtocol, server_config
from stoker.core.errors import PayloadTooLarge
from stoker.settings import ApiSettings, StackSettings
from tests.serving import serve_with
from workers.broker import free_port
from workers.stack import api_argv

ROOT = Path(__file__).resolve().parents[2]


def test_the_server_bounds_a_request_head_in_bytes_and_time() -> None:
    settings = ApiSettings(max_header_bytes=4096, header_timeout_s=2.5, keep_alive_s=7)
    config = server_config(settings, app=FastAPI())
    assert config.http is HeadBoundedProtocol
    assert issubclass(HeadBoundedProtocol, HttpToolsProtocol)  # httptools, with the bounds it lacks added
    assert config.max_head_bytes == 4096
    assert config.header_timeout_s == 2.5
    assert config.timeout_keep_alive == 7
    assert config.ws == "none"


def test_every_way_the_api_is_started_runs_stoker_api() -> None:
    """`stoker api` builds the server from `server_config`: the stack, the image, Compose and Kubernetes run it."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    k8s = [doc for doc in yaml.safe_load_all((ROOT / "deploy/k8s/stoker.yaml").read_text()) if doc]
    deployment = next(doc for doc in k8s if doc["metadata"]["name"] == "stoker-api" and doc["kind"] == "Deployment")
    cmd = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("CMD "))
    commands = [
        compose["services"]["api"]["command"],
        deployment["spec"]["template"]["spec"]["containers"][0]["command"],
        json.loads(cmd.removeprefix("CMD ")),
    ]
    assert all(command[:2] == ["stoker", "api"] for command in commands), commands
    assert api_argv(StackSettings(port=8123))[1:6] == ["-m", "stoker.cli", "api", "--host", "127.0.0.1"]


def _request(chunks: list[bytes], received: list[int]) -> Request:
    async def receive() -> Message:
        received.append(1)
        more = len(received) < len(chunks)
        return {"type": "http.request", "body": chunks[len(received) - 1], "more_body": more}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def test_a_json_body_of_too_many_values_is_refused_before_the_rest_is_read() -> None:
    chunks = [b"[" + b"0," * 1000] * 100  # about 100 000 values, in 100 chunks
    received: list[int] = []
    with pytest.raises(PayloadTooLarge) as refused:
        asyncio.run(read_json(_request(chunks, received), max_values=16_384))
    assert len(received) == 17  # the chunk that passed the limit was the last one read
    assert refused.value.envelope()["error"]["code"] == "payload_too_large"


def test_a_json_body_within_its_values_is_read_whole_whatever_its_bytes() -> None:
    """Base64 has no value openers: a big inline medium costs no values."""
    chunks = [b'{"prompt":"hi","inputs":[{"kind":"image","data":"', *[b"QUJD" * 16_384] * 64, b'"}]}']
    received: list[int] = []
    body = asyncio.run(read_json(_request(chunks, received), max_values=256))
    assert body == b"".join(chunks)
    assert len(received) == len(chunks)


def test_the_access_log_is_off_unless_asked_for() -> None:
    assert server_config(ApiSettings(), app=FastAPI()).access_log is False
    assert server_config(ApiSettings(access_log=True), app=FastAPI()).access_log is True


def test_the_servers_loop_renews_the_date_every_round_and_a_stop_signal_ends_it_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn's loop wakes ten times a second; the API's once (`tick_s`), and the signal that stops it wakes it: with
    rounds an hour apart, the loop still ends as soon as it is told to."""
    # sse-starlette wraps uvicorn's exit handler and sets a flag of the whole process that ends every SSE stream at
    # once: restored after the test, so streams of apps this process serves later are not cut short.
    monkeypatch.setattr(AppStatus, "should_exit", AppStatus.should_exit)
    server = ApiServer(server_config(ApiSettings(), app=FastAPI()))
    server.config.load()
    server.tick_s = 3600.0
    rounds: list[int] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        rounds.append(counter)
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]

    async def run() -> None:
        loop = asyncio.create_task(server.main_loop())
        while not rounds:  # the first round ran: the loop now waits for its next one
            await asyncio.sleep(0)
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(loop, timeout=30)  # an hour without the wake

    asyncio.run(run())
    assert rounds == [0, 10]  # every round renews the Date header (uvicorn does it on multiples of 10)
    assert server.server_state.default_headers[0][0] == b"date"


def test_an_answer_slower_than_the_header_timeout_still_comes() -> None:
    """The head's deadline ends with the head: a request whose answer takes longer (a long-poll) is answered, and
    the connection then carries the next request."""
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        await asyncio.sleep(0.6)
        return {"status": "late"}

    settings = ApiSettings(header_timeout_s=0.2, port=free_port(), host="127.0.0.1")
    with serve_with(ApiServer(server_config(settings, app=app))) as base, httpx.Client(base_url=base, timeout=10) as c:
        answers = [c.get("/slow") for _ in range(2)]  # one connection, kept alive between them
    assert [(a.status_code, a.json()) for a in answers] == [(200, {"status": "late"})] * 2
