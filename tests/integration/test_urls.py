"""URL inputs end to end: real HTTP servers on loopback, real workers fetching, every SSRF route refused.

The workers allowlist URL_TEST_HOST (127.0.0.2) alone; 127.0.0.1, [::1] and the metadata address stay forbidden.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import ssl
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.adapters.store import Store
from stoker.adapters.urlfetch import FetchPolicy, fetch
from stoker.core.errors import FetchFailed
from stoker.core.media import content_hash
from stoker.core.tenancy import issue_key
from stoker.core.urls import Allowlist, IPAddress
from stoker.settings import ApiSettings, WorkerSettings
from tests.conftest import missing
from tests.integration.conftest import URL_TEST_HOST, SpySubmitter
from tests.integration.test_pipeline import _wait
from tests.media import speech_wav, text_image, text_video
from tests.serving import serve_handler

PNG = text_image("URL 4242")
Route = Callable[[BaseHTTPRequestHandler], None]


@dataclass
class Served:
    """A running server: its address, and every (path, Host header) it was asked for."""

    host: str
    port: int
    hits: list[tuple[str, str]] = field(default_factory=list)

    def url(self, path: str, scheme: str = "http") -> str:
        return f"{scheme}://{self.host}:{self.port}{path}"


def _send(handler: BaseHTTPRequestHandler, body: bytes, content_type: str = "image/png", status: int = 200) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _redirect(location: str) -> Route:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


def _endless(declare: int | None) -> Route:
    """A PNG that never ends (declared with a length, or delimited by the connection closing)."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        if declare is not None:
            handler.send_header("Content-Length", str(declare))
        handler.close_connection = True
        handler.end_headers()
        handler.wfile.write(PNG[:16])
        for _ in range(4096):  # 256 MiB at most: far past any cap, never reached
            handler.wfile.write(b"\0" * 65536)

    return answer


def _flaky(failures: int) -> Route:
    """Answers 503 the first `failures` times, then the PNG."""
    asked = [0]

    def answer(handler: BaseHTTPRequestHandler) -> None:
        asked[0] += 1
        if asked[0] <= failures:
            _send(handler, b"try again", "text/plain", 503)
        else:
            _send(handler, PNG)

    return answer


@contextlib.contextmanager
def _serve(host: str, routes: dict[str, Route], tls: ssl.SSLContext | None = None) -> Iterator[Served]:
    """A real HTTP(S) server on its own thread, answering from routes."""
    served = Served(host, 0)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            served.hits.append((self.path, self.headers.get("Host", "")))
            route = routes.get(self.path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if route is None:
                    _send(self, b"no such thing", "text/plain", 404)
                else:
                    route(self)

        def log_message(self, *args: Any) -> None:
            pass

    with serve_handler(host, Handler, tls) as port:
        served.port = port
        yield served


@pytest.fixture(scope="module")
def loopback() -> Iterator[Served]:
    """A server on 127.0.0.1, which the workers must never reach."""
    with _serve("127.0.0.1", {"/text.png": lambda h: _send(h, PNG)}) as served:
        yield served


@pytest.fixture(scope="module")
def media(loopback: Served) -> Iterator[Served]:
    """The allowlisted server on URL_TEST_HOST."""
    cap = WorkerSettings().fetch_max_bytes
    routes: dict[str, Route] = {
        "/text.png": lambda h: _send(h, PNG),
        "/page.html": lambda h: _send(h, b"<!doctype html><title>not an image</title>", "text/html"),
        "/talk.mp4": lambda h: _send(h, text_video("CLIP 77", speech_wav()), "video/mp4"),
        "/to-loopback": _redirect(loopback.url("/text.png")),
        "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data/"),
        "/declared-big.png": _endless(cap + 1),
        "/streamed-big.png": _endless(None),
        "/flaky.png": _flaky(2),
        "/unavailable.png": _flaky(1000),
    }
    with _serve(URL_TEST_HOST, routes) as served:
        yield served


def _submit(client: TestClient, url: str, kind: str = "image") -> dict[str, Any]:
    body = {"prompt": "What does it say?", "inputs": [{"kind": kind, "url": url}]}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    accepted: dict[str, Any] = response.json()
    return accepted


def test_an_allowlisted_url_image_is_fetched_by_a_worker_and_read(client: TestClient, media: Served) -> None:
    url = media.url("/text.png")
    accepted = _submit(client, url)
    assert accepted["inputs"][0]["url"] == url
    assert accepted["inputs"][0]["content_hash"] == ""  # the API fetched nothing
    job = _wait(client, accepted["id"])
    assert job["status"] == "succeeded", job
    item = job["inputs"][0]
    assert item["status"] == "ok"
    assert "4242" in item["text"]
    assert (item["content_hash"], item["size_bytes"]) == (content_hash(PNG), len(PNG))
    assert item["features"]["format"] == "PNG"
    assert {"fetch", "decode", "ocr"} <= set(item["timings_ms"])
    assert ("/text.png", f"{URL_TEST_HOST}:{media.port}") in media.hits
    assert job["result"]["text"].strip()


def test_a_url_video_is_fetched_once_for_its_sound_and_its_keyframes(client: TestClient, media: Served) -> None:
    before = len(media.hits)
    job = _wait(client, _submit(client, media.url("/talk.mp4"), "video")["id"])
    assert job["status"] == "succeeded", job
    item = job["inputs"][0]
    assert item["text"].strip()
    assert len(item["frames"]) == 3
    assert any("CLIP" in (f["text"] or "") for f in item["frames"]), item["frames"]
    assert [path for path, _ in media.hits[before:]] == ["/talk.mp4"]


#: Every form of a forbidden address, and what its error names: (how to make the URL, reason).
FORBIDDEN: dict[str, tuple[Callable[[Served, Served], str], str]] = {
    "127.0.0.1": (lambda media, loopback: loopback.url("/text.png"), "loopback"),
    "169.254.169.254": (lambda media, loopback: "http://169.254.169.254/latest/meta-data/", "metadata"),
    "[::1]": (lambda media, loopback: f"http://[::1]:{loopback.port}/text.png", "loopback"),
    "localhost": (lambda media, loopback: f"http://localhost:{loopback.port}/text.png", "loopback"),
    "redirect-to-loopback": (lambda media, loopback: media.url("/to-loopback"), "loopback"),
    "redirect-to-metadata": (lambda media, loopback: media.url("/to-metadata"), "metadata"),
}


def _submit_many(client: TestClient, urls: list[str]) -> dict[str, Any]:
    """One job with an image input per URL (a job may have four)."""
    body = {"prompt": "What does it say?", "inputs": [{"kind": "image", "url": url} for url in urls]}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    accepted: dict[str, Any] = response.json()
    return accepted


@pytest.mark.parametrize("forms", [list(FORBIDDEN)[:4], list(FORBIDDEN)[4:]], ids=["direct", "redirected"])
def test_forbidden_addresses_fail_the_input_and_the_job_degrades(
    client: TestClient, media: Served, loopback: Served, forms: list[str]
) -> None:
    # Four forms at a time, one input each: every input fails alone, with its own reason.
    job = _wait(client, _submit_many(client, [FORBIDDEN[form][0](media, loopback) for form in forms])["id"])
    assert job["status"] == "degraded", job
    for form, item in zip(forms, job["inputs"], strict=True):
        assert item["status"] == "failed", (form, item)
        assert (item["error"]["code"], item["error"]["stage"]) == ("url_rejected", "fetch"), form
        assert FORBIDDEN[form][1] in item["error"]["message"], (form, item["error"])
    assert loopback.hits == []  # not one request reached it
    assert job["result"]["text"].strip()  # answered from the prompt alone


#: What a URL may serve that cannot be used, and the code its input fails with.
UNUSABLE = {
    "/declared-big.png": "fetch_too_large",
    "/streamed-big.png": "fetch_too_large",
    "/page.html": "unsupported_media_type",
    "/missing.png": "fetch_failed",
}


def test_what_cannot_be_used_fails_the_input_with_its_code(client: TestClient, media: Served) -> None:
    job = _wait(client, _submit_many(client, [media.url(path) for path in UNUSABLE])["id"])
    assert job["status"] == "degraded", job
    for (path, code), item in zip(UNUSABLE.items(), job["inputs"], strict=True):
        assert item["status"] == "failed", (path, item)
        assert item["error"]["code"] == code, (path, item)
    assert job["result"]["text"].strip()


def test_a_temporary_failure_is_fetched_again(client: TestClient, media: Served) -> None:
    job = _wait(client, _submit(client, media.url("/flaky.png"))["id"])
    assert job["status"] == "succeeded", job
    assert "4242" in job["inputs"][0]["text"]
    assert [path for path, _ in media.hits].count("/flaky.png") == 3


def test_a_server_that_stays_unavailable_fails_the_input_after_the_retries(client: TestClient, media: Served) -> None:
    job = _wait(client, _submit(client, media.url("/unavailable.png"))["id"])
    assert job["status"] == "degraded", job
    item = job["inputs"][0]
    assert item["error"]["code"] == "fetch_failed", item
    assert "503" in item["error"]["message"]
    assert [path for path, _ in media.hits].count("/unavailable.png") == 4  # the first try and 3 retries


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.2/a.png", "http://user:pw@127.0.0.2/a.png"])
def test_the_api_refuses_non_http_urls_at_once(client: TestClient, spy: SpySubmitter, url: str) -> None:
    response = client.post("/v1/jobs", json={"prompt": "Read it.", "inputs": [{"kind": "image", "url": url}]})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "url_rejected"
    assert "inputs[0].url" in error["message"]
    assert spy.calls == []


def test_an_input_gives_data_or_url_not_both(client: TestClient) -> None:
    item = {"kind": "image", "url": "http://127.0.0.2/a.png", "data": "AAAA"}
    response = client.post("/v1/jobs", json={"prompt": "Read it.", "inputs": [item]})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for files.test, made with the openssl command."""
    if shutil.which("openssl") is None:
        missing("the openssl command is not installed")
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    names = ["-subj", "/CN=files.test", "-addext", "subjectAltName=DNS:files.test"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *names, *files],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_goes_to_the_vetted_address_and_checks_the_certificate_against_the_name(
    tls_files: tuple[Path, Path],
) -> None:
    cert, key = tls_files
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    trust = ssl.create_default_context(cafile=str(cert))
    policy = FetchPolicy(max_bytes=1 << 20, timeout_s=10, allowlist=Allowlist.parse(URL_TEST_HOST))

    def dns(host: str, port: int) -> list[IPAddress]:
        return [ip_address(URL_TEST_HOST)]

    with _serve(URL_TEST_HOST, {"/text.png": lambda h: _send(h, PNG)}, tls=server_tls) as served:
        url = f"https://files.test:{served.port}/text.png"
        assert fetch(url, policy, dns, httpx.HTTPTransport(verify=trust)) == PNG
        assert served.hits == [("/text.png", f"files.test:{served.port}")]
        with pytest.raises(FetchFailed, match="certificate"):
            fetch(f"https://other.test:{served.port}/text.png", policy, dns, httpx.HTTPTransport(verify=trust))


def test_a_download_that_would_pass_its_tenants_stored_bytes_fails_its_input(
    workers: dict[str, Path], media: Served, store_redis: redis.Redis[bytes]
) -> None:
    store = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)
    issued = issue_key(f"fetcher-{uuid.uuid4().hex[:8]}", time.time())
    store.tenants.put_api_key(issued.record)
    upload = text_image("UPLOADED 31")
    # The upload fits; the download would take the tenant one byte over: a 200-byte request cannot make a worker
    # store what its tenant may not.
    settings = ApiSettings(auth=True, tenant_max_stored_bytes=len(upload) + len(PNG) - 1)
    headers = {"Authorization": f"Bearer {issued.token}"}
    with TestClient(create_app(settings, submitter=SpySubmitter()), headers=headers) as api:
        inputs = [
            {"kind": "image", "data": base64.b64encode(upload).decode()},
            {"kind": "image", "url": media.url("/text.png")},
        ]
        response = api.post("/v1/jobs", json={"prompt": "What do they say?", "inputs": inputs})
        assert response.status_code == 202, response.text
        job = _wait(api, response.json()["id"])
    assert job["status"] == "degraded", job
    uploaded, fetched = job["inputs"]
    assert uploaded["status"] == "ok"
    assert "UPLOADED" in uploaded["text"]
    assert fetched["status"] == "failed"
    assert (fetched["error"]["code"], fetched["error"]["stage"]) == ("storage_quota_exceeded", "fetch")
    usage = store.tenants.usage(issued.record.tenant)
    assert (usage.messages, usage.stored_bytes) == (0, 0)  # all given back when the job ended
