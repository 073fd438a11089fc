"""What one request may cost the API before any route runs: the server's config (one, from settings, whichever way
the API is started) and the JSON body read counting its values as it streams in."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sse_starlette.sse import AppStatus
from starlette.requests import Request
from starlette.types import Message
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.app import error_response
from api.limits import JsonValueCounter, read_json
from api.server import server_config
from api.uvicorn_server import ApiServer, HeadBoundedProtocol
from stoker.core.errors import PayloadTooLarge, StokerError
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


def _chunked(body: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


def test_commas_inside_a_string_are_not_values_wherever_the_chunks_cut_it() -> None:
    """A CSV prompt of 100 000 commas (with escaped quotes and backslashes in it) is one value: read whole, whether
    a chunk ends inside it, on a backslash, or just after its closing quote."""
    csv = ",".join(f'{n},"x\\\\"' for n in range(50_000))
    body = json.dumps({"prompt": csv, "inputs": [1, 2, 3]}).encode()
    backslash = body.index(b"\\")
    for cuts in ([], [backslash + 1], [backslash, backslash + 1, backslash + 2], list(range(1, len(body), 65_536))):
        received: list[int] = []
        chunks = _chunked(body, cuts)
        assert asyncio.run(read_json(_request(chunks, received), max_values=16_384)) == body
        assert len(received) == len(chunks)


def test_values_after_a_string_cut_by_chunks_are_counted_and_refused() -> None:
    """Past a string cut mid-escape, 20 000 real values are counted still, and refused before the rest is read."""
    head = b'{"prompt":"a \\" quote, a backslash \\\\' + b'and commas,,,,", "inputs":['
    cut = head.index(b"\\") + 1  # the first chunk ends on the backslash that escapes the quote
    chunks = [head[:cut], head[cut:], *[b"0," * 1000] * 20, b"0]}"]
    received: list[int] = []
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_json(_request(chunks, received), max_values=16_384))
    assert len(received) == 2 + 17  # the chunk that passed the limit was the last one read


def _values_by_hand(text: bytes) -> tuple[int, int]:
    """Values and strings of a JSON text, a byte at a time (the reference the counter must agree with)."""
    values, strings, inside, escaped = 1, 0, False, False
    for byte in text:
        if inside:
            escaped, inside = (False, True) if escaped else (byte == ord("\\"), byte != ord('"'))
        elif byte == ord('"'):
            inside, strings = True, strings + 1
        else:
            values += byte in b",[{"
    return values, strings


def test_the_value_counter_agrees_with_a_byte_by_byte_count_on_any_text_in_any_chunks() -> None:
    picks = random.Random(7)
    pieces = [b'"', b"\\", b'\\"', b"\\\\", b",", b"[", b"{", b"}", b"]", b":", b"a", b" ", "é".encode()]
    for _ in range(3000):
        text = b"".join(picks.choice(pieces) for _ in range(picks.randint(0, 40)))
        cuts = sorted(picks.sample(range(len(text) + 1), min(len(text) + 1, picks.randint(0, 6))))
        counter = JsonValueCounter()
        for chunk in _chunked(text, cuts):
            counter.feed(chunk)
        assert (counter.values, counter.strings) == _values_by_hand(text), (text, cuts)


def test_a_text_of_nothing_but_strings_is_refused_as_its_values_would_be() -> None:
    """Empty strings back to back are no valid JSON of few values: past twice the values' bound they are refused."""
    received: list[int] = []
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_json(_request([b'""' * 20_000] * 4, received), max_values=16_384))
    assert len(received) == 2  # 40 000 strings: the second chunk passed 2 × 16 384


def test_the_server_bounds_a_request_body_in_time_with_an_allowance_for_its_size() -> None:
    settings = ApiSettings(body_timeout_s=4.5, body_min_bytes_per_s=1000)
    config = server_config(settings, app=FastAPI())
    assert (config.body_timeout_s, config.body_min_bytes_per_s) == (4.5, 1000)


def test_a_body_slower_than_its_timeout_within_its_pace_is_read_whole() -> None:
    """3000 bytes sent over about a second (3000 bytes a second) with a body timeout of 0.3 s: at a least pace of
    1000 bytes a second, each byte in earns a millisecond more, so they pass; with no allowance they are cut off
    408."""
    app = FastAPI()

    @app.exception_handler(StokerError)
    async def refused(_: Request, exc: StokerError) -> JSONResponse:
        return error_response(exc)  # as the API answers every error

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    def paced() -> Iterator[bytes]:
        for _ in range(10):
            yield b"x" * 300
            time.sleep(0.1)  # the client's pace under test, not a wait for something to happen

    outcomes = []
    for rate in (1000, 0):
        settings = ApiSettings(body_timeout_s=0.3, body_min_bytes_per_s=rate, port=free_port(), host="127.0.0.1")
        with serve_with(ApiServer(server_config(settings, app=app))) as base:
            answer = httpx.post(f"{base}/echo", content=paced(), timeout=10)
        outcomes.append((answer.status_code, answer.json()))
    assert outcomes[0] == (200, {"bytes": 3000})
    assert outcomes[1][0] == 408
    assert outcomes[1][1]["error"]["code"] == "request_timeout"
