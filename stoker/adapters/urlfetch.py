"""Fetching a URL input without SSRF: each hop resolved, every address vetted, the connection pinned to one of them.

The host name of a hop is resolved once, here. Every address it resolves to must be public (or allowlisted), and
the request then goes to one of those addresses by number, carrying the name only in the Host header and as the
TLS server name (so certificates are still checked against it). Nothing resolves the name again between the check
and the connection, so a DNS answer that changes in between (rebinding) gains nothing. Redirects are followed
here, never by httpx, and each one is a new hop, checked the same way.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from ipaddress import ip_address

import httpx

from stoker.core.errors import FetchFailed, FetchTimeout, FetchTooLarge, FetchUnavailable, UrlRejected
from stoker.core.urls import Allowlist, IPAddress, Target, parse_url, redirect_location, vet_addresses

#: Host name and port in, every address it resolves to out.
Resolver = Callable[[str, int], list[IPAddress]]

#: Answers worth fetching again later; any other error status fails the input at once.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
USER_AGENT = "stoker-fetch/1"


@dataclass(frozen=True)
class FetchPolicy:
    """What a fetch may cost, and which private hosts it may reach anyway."""

    max_bytes: int
    timeout_s: float
    max_redirects: int = 3
    allowlist: Allowlist = field(default_factory=Allowlist)


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address (A and AAAA) host resolves to, in the resolver's order, each once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            raise FetchUnavailable(f"{host} cannot be resolved now") from exc
        raise FetchFailed(f"{host} cannot be resolved") from exc
    return list(dict.fromkeys(ip_address(info[4][0]) for info in infos))


def fetch(
    url: str, policy: FetchPolicy, resolver: Resolver = resolve, transport: httpx.BaseTransport | None = None
) -> bytes:
    """The body at url, after at most policy.max_redirects redirects, within the policy's byte and time caps.

    Raises UrlRejected, FetchFailed, FetchTooLarge, FetchTimeout, or FetchUnavailable (worth another try).
    """
    deadline = time.monotonic() + policy.timeout_s
    target = parse_url(url)
    with httpx.Client(trust_env=False, follow_redirects=False, transport=transport) as client:
        for _ in range(policy.max_redirects + 1):
            outcome = _hop(client, target, policy, resolver, deadline)
            if isinstance(outcome, bytes):
                return outcome
            target = outcome
    raise UrlRejected(f"more than {policy.max_redirects} redirects")


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    policy: FetchPolicy,
    resolver: Resolver = resolve,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """POST body to url, its addresses vetted and the connection pinned like a fetch; the 2xx status it answered.

    No redirect is followed (a receiver that moved is an error). Raises UrlRejected, FetchFailed (a 4xx, a
    redirect, a bad certificate), FetchTimeout, or FetchUnavailable (5xx, 408, 429, the network: worth a retry).
    """
    deadline = time.monotonic() + policy.timeout_s
    target = parse_url(url)
    sending = Sending("POST", body, headers)
    with httpx.Client(trust_env=False, follow_redirects=False, transport=transport) as client:
        addresses = vet_addresses(target, resolver(target.host, target.port), policy.allowlist)
        with _network_errors(target, deadline), _send_pinned(client, target, addresses, deadline, sending) as answer:
            if 300 <= answer.status_code < 400:
                raise FetchFailed(f"{target.host} answered a redirect (HTTP {answer.status_code}), not followed")
            _check_status(target, answer.status_code)
            return answer.status_code


@dataclass(frozen=True)
class Sending:
    """What a pinned request sends: a GET of nothing, or a POST of a body."""

    method: str = "GET"
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _hop(
    client: httpx.Client, target: Target, policy: FetchPolicy, resolver: Resolver, deadline: float
) -> bytes | Target:
    """One request: the body, or where a redirect leads next (checked for syntax; its addresses at its own hop)."""
    _remaining(deadline)
    addresses = vet_addresses(target, resolver(target.host, target.port), policy.allowlist)
    with _network_errors(target, deadline), _send_pinned(client, target, addresses, deadline) as response:
        location = redirect_location(target, response.status_code, response.headers.get("location"))
        if location is not None:
            return parse_url(location)
        _check_status(target, response.status_code)
        return _read_body(target, response, policy.max_bytes, deadline)


@contextlib.contextmanager
def _send_pinned(
    client: httpx.Client, target: Target, addresses: list[IPAddress], deadline: float, sending: Sending = Sending()
) -> Iterator[httpx.Response]:
    """A streamed request to the first vetted address that takes the connection; closed on the way out."""
    response = None
    for address in addresses[:-1]:
        with contextlib.suppress(httpx.ConnectError):
            response = client.send(_pinned_request(client, target, address, deadline, sending), stream=True)
            break
    if response is None:
        response = client.send(_pinned_request(client, target, addresses[-1], deadline, sending), stream=True)
    try:
        yield response
    finally:
        response.close()


def _pinned_request(
    client: httpx.Client, target: Target, address: IPAddress, deadline: float, sending: Sending
) -> httpx.Request:
    """A request to address by number; the name travels in the Host header and as the TLS server name."""
    url = httpx.URL(scheme=target.scheme, host=str(address), port=target.port, raw_path=target.path.encode("ascii"))
    headers = {**sending.headers, "Host": target.host_header, "Accept-Encoding": "identity", "User-Agent": USER_AGENT}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    return client.build_request(
        sending.method,
        url,
        headers=headers,
        content=sending.body,
        timeout=_remaining(deadline),
        extensions=extensions,
    )


def _remaining(deadline: float) -> float:
    """Seconds left of the fetch's time cap; FetchTimeout when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchTimeout("fetching the URL took longer than its time limit")
    return left


def _check_status(target: Target, status: int) -> None:
    if 200 <= status < 300:
        return
    if status in RETRY_STATUSES:
        raise FetchUnavailable(f"{target.host} answered HTTP {status}")
    raise FetchFailed(f"{target.host} answered HTTP {status}")


def _read_body(target: Target, response: httpx.Response, max_bytes: int, deadline: float) -> bytes:
    """The body as sent (never decompressed), abandoned as soon as it would pass max_bytes or the time cap."""
    too_large = FetchTooLarge(f"the content at {target.host} is larger than {max_bytes} bytes")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise FetchFailed(f"{target.host} sent {encoding}-encoded content")
    body = bytearray()
    for chunk in response.iter_raw():  # as read from the socket (at most 64 KiB each), never re-buffered
        if len(body) + len(chunk) > max_bytes:
            raise too_large
        body += chunk
        _remaining(deadline)
    return bytes(body)


@contextlib.contextmanager
def _network_errors(target: Target, deadline: float) -> Iterator[None]:
    """httpx's errors as stoker's: a bad certificate is permanent, a lost or slow connection worth a retry."""
    try:
        yield
    except httpx.TimeoutException as exc:
        if time.monotonic() >= deadline:
            raise FetchTimeout("fetching the URL took longer than its time limit") from exc
        raise FetchUnavailable(f"{target.host} timed out") from exc
    except httpx.HTTPError as exc:
        if _bad_certificate(exc):
            raise FetchFailed(f"{target.host} has no valid TLS certificate for its name") from exc
        raise FetchUnavailable(f"fetching from {target.host} failed: {type(exc).__name__}") from exc


def _bad_certificate(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
