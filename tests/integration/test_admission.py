"""Bad requests get a structured 4xx and nothing is written or enqueued; a dead broker gets 503."""

from __future__ import annotations

import base64
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.adapters.store.keys import ACTIVE_KEY
from stoker.settings import ApiSettings
from tasks.pipeline import CelerySubmitter
from tests.conftest import queued
from tests.integration.conftest import SpySubmitter
from tests.media import text_image
from tests.serving import answers
from workers.broker import free_port
from workers.procs import spawn, stop, wait_for

LIMIT = 256 * 1024
QUEUES = ("decode", "ocr", "tokenize", "infer")


@pytest.fixture
def idle_spy() -> SpySubmitter:
    """Records submissions without forwarding them."""
    return SpySubmitter(forward=False)


@pytest.fixture
def api(idle_spy: SpySubmitter, store_redis: redis.Redis[bytes]) -> Iterator[TestClient]:
    """The API with a small body limit, its submitter a spy (the jobs it accepts are never run)."""
    with TestClient(create_app(ApiSettings(max_body_bytes=LIMIT), submitter=idle_spy)) as test_client:
        yield test_client
    if idle_spy.calls:  # not enqueued: take them from the reaper's watch, or it would send them on at their budget
        store_redis.zrem(ACTIVE_KEY, *(job_id for job_id, _ in idle_spy.calls))


def _job_keys(store: redis.Redis[bytes]) -> int:
    return sum(1 for _ in store.scan_iter("stoker:job:*"))


def _queued(broker_url: str) -> int:
    with redis.Redis.from_url(broker_url) as broker:
        return sum(queued(broker, q) for q in QUEUES)


PNG = text_image("OK")
BAD_REQUESTS = {
    "missing prompt (form)": ({"files": [("image", ("a.png", PNG, "image/png"))]}, 422, "invalid_request"),
    "blank prompt (form)": ({"data": {"prompt": "  "}}, 422, "invalid_request"),
    "missing prompt (json)": ({"json": {"inputs": []}}, 422, "invalid_request"),
    "not base64 (json)": (
        {"json": {"prompt": "x", "inputs": [{"kind": "image", "data": "%%%"}]}},
        422,
        "invalid_request",
    ),
    "unknown kind (json)": (
        {"json": {"prompt": "x", "inputs": [{"kind": "hologram", "data": "AAAA"}]}},
        422,
        "invalid_request",
    ),
    "text posing as png": (
        {"data": {"prompt": "x"}, "files": [("image", ("cat.png", b"just some text, honest", "image/png"))]},
        415,
        "unsupported_media_type",
    ),
    "pdf posing as jpeg (json)": (
        {"json": {"prompt": "x", "inputs": [{"kind": "image", "data": base64.b64encode(b"%PDF-1.7 ...").decode()}]}},
        415,
        "unsupported_media_type",
    ),
    "too many images": (
        {"data": {"prompt": "x"}, "files": [("image", (f"{i}.png", PNG, "image/png")) for i in range(5)]},
        422,
        "too_many_inputs",
    ),
    "body over the limit": (
        {"data": {"prompt": "x"}, "files": [("image", ("big.png", PNG + b"\0" * LIMIT, "image/png"))]},
        413,
        "payload_too_large",
    ),
    "unknown field": ({"data": {"prompt": "x", "colour": "red"}}, 422, "invalid_request"),
    # The multipart parser's own limits, before any part is kept: files, fields, and one field's size.
    "too many file parts": (
        {"data": {"prompt": "x"}, "files": [("image", (f"{i}.png", PNG, "image/png")) for i in range(8)]},
        400,
        "bad_request",
    ),
    "too many fields": ({"data": {"prompt": "x", **{f"f{i}": "1" for i in range(12)}}}, 400, "bad_request"),
    "a field over its part size": ({"data": {"prompt": "x" * (32_000 * 4 + 1)}}, 400, "bad_request"),
    "plain text body": (
        {"content": b"prompt=hi", "headers": {"content-type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
}


@pytest.mark.parametrize(("kwargs", "status", "code"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_refused_and_nothing_is_enqueued(
    api: TestClient,
    idle_spy: SpySubmitter,
    store_redis: redis.Redis[bytes],
    kwargs: dict[str, Any],
    status: int,
    code: str,
) -> None:
    before = _job_keys(store_redis)
    queued_before = _queued(os.environ["STOKER_BROKER_URL"])
    response = api.post("/v1/jobs", **kwargs)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["message"]
    assert idle_spy.calls == []
    assert _job_keys(store_redis) == before
    assert _queued(os.environ["STOKER_BROKER_URL"]) == queued_before


def test_chunked_body_over_the_limit_is_cut_off(api: TestClient, idle_spy: SpySubmitter) -> None:
    def chunks() -> Iterator[bytes]:
        boundary = b"--xyz\r\n"
        yield boundary + b'Content-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n'
        yield boundary + b'Content-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
        for _ in range(2 * LIMIT // 4096):
            yield b"\0" * 4096

    response = api.post("/v1/jobs", content=chunks(), headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert idle_spy.calls == []


def test_a_50_mib_chunked_upload_is_cut_off_at_its_10_mib_limit_in_bounded_memory(tmp_path: Path) -> None:
    """A real API process (uvicorn) and a raw socket, so nothing in between buffers the body."""
    mib, chunk = 1024 * 1024, b"\0" * (64 * 1024)
    port = free_port()
    api = spawn(
        ["api", "--port", str(port)], {**os.environ, "STOKER_MAX_BODY_BYTES": str(10 * mib)}, tmp_path / "api.log"
    )
    try:
        wait_for(lambda: answers(port), 60, "the API", [api])
        # the tokenizer loads in the background after start: measure from when it is in (or known absent)
        log = tmp_path / "api.log"
        wait_for(lambda: "tokenizer" in log.read_text(errors="replace"), 60, "the API's tokenizer", [api])
        Path(f"/proc/{api.pid}/clear_refs").write_text("5")  # the peak (VmHWM) restarts from what is resident now
        before = _memory_kib(api.pid, "VmRSS")
        status, sent = _stream_chunked(port, chunk, total=50 * mib)
        growth_mib = (_memory_kib(api.pid, "VmHWM") - before) / 1024
    finally:
        stop(api)
    assert status.startswith(b"HTTP/1.1 413"), status
    assert sent < 50 * mib  # cut off: the rest was never read
    assert growth_mib < 8, growth_mib  # nothing near the 10 MiB that was read was held in memory


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _stream_chunked(port: int, chunk: bytes, total: int) -> tuple[bytes, int]:
    """Send a chunked multipart body of `total` bytes with no Content-Length; returns the status line and how much
    was sent before the server answered (or dropped the connection)."""
    head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: multipart/form-data; boundary=xyz\r\n\r\n"
    )
    part = b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="big.png"\r\n\r\n'
    answer: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = threading.Thread(target=lambda: answer.append(_read_some(sock)), daemon=True)
        reader.start()
        sent = 0
        try:
            sock.sendall(head + b"%x\r\n%s\r\n" % (len(part), part))
            while sent < total and not answer:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:  # the server answered and closed: what it said is in `answer`
            pass
        reader.join(30)
    return (answer[0].split(b"\r\n", 1)[0] if answer else b""), sent


def _read_some(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except OSError:
        return b""


def test_accepted_job_is_stored_before_the_answer(
    api: TestClient, idle_spy: SpySubmitter, store_redis: redis.Redis[bytes]
) -> None:
    response = api.post("/v1/jobs", data={"prompt": "x"}, files=[("image", ("a.png", PNG, "image/png"))])
    assert response.status_code == 202
    job_id = response.json()["id"]
    assert [c[0] for c in idle_spy.calls] == [job_id]
    assert store_redis.exists(f"stoker:job:{job_id}")
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"


def test_unreachable_broker_gets_503_and_no_job(store_redis: redis.Redis[bytes]) -> None:
    dead = Celery("dead", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    dead.conf.broker_connection_timeout = 0.5
    dead.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1}
    before = _job_keys(store_redis)
    app = create_app(ApiSettings(), submitter=CelerySubmitter(dead))
    with TestClient(app) as test_client:
        response = test_client.post("/v1/jobs", data={"prompt": "anyone there?"})
        ready = test_client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "broker_unavailable"
    assert "retry-after" in response.headers
    assert _job_keys(store_redis) == before
    assert ready.status_code == 200  # the API's own broker is fine; only this submitter's is dead


def test_readyz_is_503_when_the_broker_is_unreachable(store_redis: redis.Redis[bytes]) -> None:
    settings = ApiSettings(broker_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings, submitter=SpySubmitter(forward=False))) as test_client:
        response = test_client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["broker"] == "unreachable"
