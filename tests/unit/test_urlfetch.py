"""The fetch loop over a fake resolver and httpx's MockTransport: pinning, redirects, caps and error mapping."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator
from ipaddress import ip_address

import httpx
import pytest

from stoker.adapters import urlfetch
from stoker.adapters.urlfetch import FetchPolicy, fetch, resolve
from stoker.core.errors import FetchFailed, FetchTimeout, FetchTooLarge, FetchUnavailable, UrlRejected
from stoker.core.urls import Allowlist, IPAddress
from stoker.runtime import stage
from stoker.runtime.stages import fetch as fetch_stage

PUBLIC = ip_address("93.184.216.34")
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 24
POLICY = FetchPolicy(max_bytes=1000, timeout_s=5.0)


class Chunks(httpx.SyncByteStream):
    """A response body sent in pieces, counting how many were taken."""

    def __init__(self, *parts: bytes, pause_s: float = 0.0) -> None:
        self.parts = parts
        self.pause_s = pause_s
        self.taken = 0

    def __iter__(self) -> Iterator[bytes]:
        for part in self.parts:
            self.taken += 1
            yield part
            time.sleep(self.pause_s)


class Server:
    """A MockTransport handler that records every request it got."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answer(request)

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def _dns(table: dict[str, list[str]]) -> Callable[[str, int], list[IPAddress]]:
    def resolver(host: str, port: int) -> list[IPAddress]:
        return [ip_address(a) for a in table.get(host, [host])]

    return resolver


def _ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=Chunks(PNG))


def test_the_request_goes_to_the_vetted_address_with_the_name_in_host_and_sni() -> None:
    server = Server(_ok)
    body = fetch("https://files.example/a.png?x=1", POLICY, _dns({"files.example": [str(PUBLIC)]}), server.transport)
    assert body == PNG
    (request,) = server.requests
    assert request.url.host == str(PUBLIC)
    assert request.url.raw_path == b"/a.png?x=1"
    assert request.headers["host"] == "files.example"
    assert request.extensions["sni_hostname"] == "files.example"
    assert request.headers["accept-encoding"] == "identity"


def test_a_name_is_resolved_once_per_hop_so_rebinding_changes_nothing() -> None:
    answers = iter([[PUBLIC], [ip_address("127.0.0.1")]])
    calls: list[str] = []

    def rebinding(host: str, port: int) -> list[IPAddress]:
        calls.append(host)
        return next(answers)

    server = Server(_ok)
    assert fetch("http://rebind.example/a.png", POLICY, rebinding, server.transport) == PNG
    assert calls == ["rebind.example"]
    assert [r.url.host for r in server.requests] == [str(PUBLIC)]


@pytest.mark.parametrize(
    "location",
    [
        "http://127.0.0.1:8080/secret",
        "http://[::1]/secret",
        "http://169.254.169.254/latest/meta-data/",
        "http://internal.example/",
        "file:///etc/passwd",
    ],
)
def test_every_redirect_is_checked_before_it_is_followed(location: str) -> None:
    server = Server(lambda r: httpx.Response(302, headers={"location": location}))
    dns = _dns({"files.example": [str(PUBLIC)], "internal.example": ["10.0.0.5"]})
    with pytest.raises(UrlRejected):
        fetch("http://files.example/a.png", POLICY, dns, server.transport)
    assert len(server.requests) == 1  # nothing was sent to where the redirect pointed


def test_redirects_are_followed_up_to_the_limit_and_no_further() -> None:
    server = Server(lambda r: httpx.Response(301, headers={"location": f"/hop{len(server.requests)}"}))
    dns = _dns({"files.example": [str(PUBLIC)]})
    with pytest.raises(UrlRejected, match="more than 3 redirects"):
        fetch("http://files.example/a.png", POLICY, dns, server.transport)
    assert [r.url.path for r in server.requests] == ["/a.png", "/hop1", "/hop2", "/hop3"]

    hops = Server(lambda r: httpx.Response(302, headers={"location": "/end"}) if r.url.path != "/end" else _ok(r))
    assert fetch("http://files.example/a.png", POLICY, dns, hops.transport) == PNG
    assert [r.url.path for r in hops.requests] == ["/a.png", "/end"]


def test_an_allowlisted_private_host_is_fetched() -> None:
    policy = FetchPolicy(max_bytes=1000, timeout_s=5.0, allowlist=Allowlist.parse("127.0.0.2"))
    server = Server(_ok)
    assert fetch("http://127.0.0.2:8080/a.png", policy, _dns({}), server.transport) == PNG
    assert server.requests[0].headers["host"] == "127.0.0.2:8080"
    with pytest.raises(UrlRejected, match="loopback"):
        fetch("http://127.0.0.1:8080/a.png", policy, _dns({}), server.transport)


def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_read() -> None:
    body = Chunks(b"x" * 10)
    server = Server(lambda r: httpx.Response(200, headers={"content-length": "5000"}, stream=body))
    with pytest.raises(FetchTooLarge):
        fetch("http://files.example/a", POLICY, _dns({"files.example": [str(PUBLIC)]}), server.transport)
    assert body.taken == 0


def test_a_body_over_the_cap_is_abandoned_at_the_first_chunk_past_it() -> None:
    body = Chunks(*[b"x" * 400] * 10)
    server = Server(lambda r: httpx.Response(200, stream=body))
    with pytest.raises(FetchTooLarge):
        fetch("http://files.example/a", POLICY, _dns({"files.example": [str(PUBLIC)]}), server.transport)
    assert body.taken == 3
    exact = Server(lambda r: httpx.Response(200, stream=Chunks(b"x" * 600, b"y" * 400)))
    assert len(fetch("http://files.example/a", POLICY, _dns({"files.example": [str(PUBLIC)]}), exact.transport)) == 1000


def test_a_slow_body_fails_at_the_time_cap() -> None:
    server = Server(lambda r: httpx.Response(200, stream=Chunks(b"a", b"b", b"c", pause_s=0.15)))
    dns = _dns({"files.example": [str(PUBLIC)]})
    with pytest.raises(FetchTimeout):
        fetch("http://files.example/a", FetchPolicy(1000, 0.2), dns, server.transport)


@pytest.mark.parametrize(
    ("status", "error"),
    [(404, FetchFailed), (403, FetchFailed), (304, FetchFailed), (503, FetchUnavailable), (429, FetchUnavailable)],
)
def test_error_statuses_fail_permanently_or_for_now(status: int, error: type[Exception]) -> None:
    server = Server(lambda r: httpx.Response(status))
    with pytest.raises(error, match=str(status)):
        fetch("http://files.example/a", POLICY, _dns({"files.example": [str(PUBLIC)]}), server.transport)


def test_compressed_content_is_refused() -> None:
    server = Server(lambda r: httpx.Response(200, headers={"content-encoding": "gzip"}, stream=Chunks(b"\x1f\x8b")))
    with pytest.raises(FetchFailed, match="gzip"):
        fetch("http://files.example/a", POLICY, _dns({"files.example": [str(PUBLIC)]}), server.transport)


def test_network_errors_map_to_retry_or_fail() -> None:
    dns = _dns({"files.example": [str(PUBLIC)]})

    def raises(exc: Exception) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            raise exc

        return httpx.MockTransport(handler)

    with pytest.raises(FetchUnavailable, match="timed out"):
        fetch("http://files.example/a", POLICY, dns, raises(httpx.ReadTimeout("slow")))
    with pytest.raises(FetchUnavailable):
        fetch("http://files.example/a", POLICY, dns, raises(httpx.RemoteProtocolError("bad")))
    bad_cert = httpx.ConnectError("tls")
    bad_cert.__cause__ = ssl.SSLCertVerificationError("certificate verify failed")
    with pytest.raises(FetchFailed, match="certificate"):
        fetch("https://files.example/a", POLICY, dns, raises(bad_cert))


def test_the_next_vetted_address_is_tried_when_one_refuses_the_connection() -> None:
    second = ip_address("93.184.216.35")

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == str(PUBLIC):
            raise httpx.ConnectError("refused")
        return _ok(request)

    server = Server(answer)
    dns = _dns({"files.example": [str(PUBLIC), str(second)]})
    assert fetch("http://files.example/a", POLICY, dns, server.transport) == PNG
    assert [r.url.host for r in server.requests] == [str(PUBLIC), str(second)]


def test_address_literals_resolve_to_themselves() -> None:
    assert resolve("127.0.0.1", 80) == [ip_address("127.0.0.1")]
    assert resolve("::1", 80) == [ip_address("::1")]


def test_a_last_temporary_failure_fails_the_input_as_fetch_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(url: str, policy: FetchPolicy) -> bytes:
        raise FetchUnavailable("files.example answered HTTP 503")

    monkeypatch.setattr(urlfetch, "fetch", unavailable)
    from stoker.core.jobs import InputRecord

    record = InputRecord(index=0, kind="image", content_hash="", size_bytes=0, url="http://files.example/a")
    assert stage.last_try()  # called in-process: there is no retry to wait for
    with pytest.raises(FetchFailed, match="503"):
        fetch_stage.download(record, POLICY)
