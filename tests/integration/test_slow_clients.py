"""One client cannot stall the API: a huge request head, a huge request target, trickled headers or a JSON body of
countless values is refused (or closed) while `/healthz` keeps answering as fast, measured against its own idle
latency on the same server. A real `stoker api` process on loopback and raw sockets, so nothing in between
buffers or bounds what is sent."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serving import answers
from workers.broker import free_port
from workers.procs import spawn, stop, tail, wait_for

MiB = 1024 * 1024
#: The server's deadline on a request's head, short so that the trickle test takes seconds.
HEADER_TIMEOUT_S = 1.0
#: How long each attack is repeated while `/healthz` is probed (an attack that takes longer runs to its end).
ATTACK_WINDOW_S = 1.0
#: How often `/healthz` is probed: the probes must not be the load.
PROBE_EVERY_S = 0.01
#: What a refused attack may get: a structured 4xx, or a connection the server closed.
REFUSED = {400, 408, 413, 431, "closed"}


@dataclass(frozen=True)
class Server:
    """The API process under attack."""

    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`stoker api` as every deployment starts it, with a short header timeout."""
    port, log = free_port(), tmp_path_factory.mktemp("slow-clients") / "api.log"
    env = {**os.environ, "STOKER_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "STOKER_API_TOKENIZE": "false"}
    proc = spawn(["api", "--port", str(port)], env, log)
    try:
        wait_for(lambda: answers(port), 60, f"the API\n{tail(log)}", [proc])
        yield Server(port, log)
    finally:
        stop(proc)


def _probe(client: httpx.Client) -> float:
    """Seconds one `/healthz` took."""
    started = time.perf_counter()
    response = client.get("/healthz", timeout=60)
    assert response.status_code == 200
    return time.perf_counter() - started


def _median_over_time(latencies: list[float]) -> float:
    """The latency that probes at most this slow spent half of the probing time in: a stall counts for as long as
    it lasted (a probe sent at any moment of it would have waited), not as one probe among many fast ones."""
    half, spent = sum(latencies) / 2, 0.0
    for latency in sorted(latencies):
        spent += latency
        if spent >= half:
            return latency
    raise ValueError("no probes")


def _idle_p50(server: Server) -> float:
    with httpx.Client(base_url=server.base) as client:
        _probe(client)  # the connection is open before anything is measured
        return _median_over_time([_probe(client) for _ in range(20)])


def _p50_during(server: Server, attack: Callable[[], object]) -> tuple[float, list[object]]:
    """The median over time of `/healthz` latency while `attack` runs again and again for ATTACK_WINDOW_S (or once,
    to its end, when one attack takes longer), and what each attack got."""
    outcomes: list[object] = []
    failed: list[BaseException] = []

    def repeat() -> None:
        until = time.monotonic() + ATTACK_WINDOW_S
        try:
            outcomes.append(attack())
            while time.monotonic() < until:
                outcomes.append(attack())
        except BaseException as exc:  # raised again in the test's thread, below
            failed.append(exc)

    latencies: list[float] = []
    attacker = threading.Thread(target=repeat, daemon=True)
    with httpx.Client(base_url=server.base) as client:
        _probe(client)
        attacker.start()
        while attacker.is_alive():
            latencies.append(_probe(client))
            attacker.join(PROBE_EVERY_S)  # the probes' pace: they must not be the load
    if failed:
        raise failed[0]
    return _median_over_time(latencies), outcomes


def _assert_unstalled(idle: float, attacked: float) -> None:
    """The ratio the API must hold under attack: 20 × its idle median, or 100 ms where that is less (medians over
    time, both)."""
    assert attacked < max(20 * idle, 0.1), f"/healthz p50 {attacked * 1e3:.1f} ms under attack, {idle * 1e3:.1f} idle"


def _send(port: int, payload: bytes) -> object:
    """Send payload on a fresh connection; the status the server answered, or "closed" if it closed the connection
    before answering (it may stop reading and reset the connection as soon as it has seen enough)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(payload)
            answer = sock.recv(64)
        except OSError:  # reset while sending or reading: the server refused to read the rest
            return "closed"
    if not answer:
        return "closed"
    return int(answer.split(b" ", 2)[1])


def _big_value() -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 * MiB) + b"\r\n\r\n"


def _big_target() -> bytes:
    return b"GET /healthz?" + b"a" * (32 * MiB) + b" HTTP/1.1\r\nHost: x\r\n\r\n"


def _many_lines() -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200_000)) + b"\r\n"


@pytest.mark.parametrize("make", [_big_value, _big_target, _many_lines], ids=["header-value", "target", "header-lines"])
def test_a_huge_request_head_is_refused_without_stalling_healthz(server: Server, make: Callable[[], bytes]) -> None:
    head = make()  # built here, not at collection: 32 MiB each
    idle = _idle_p50(server)
    attacked, outcomes = _p50_during(server, lambda: _send(server.port, head))
    _assert_unstalled(idle, attacked)
    assert set(outcomes) <= REFUSED, outcomes


def _json_job(inputs: int) -> bytes:
    body = b'{"prompt":"hi","inputs":[' + b",".join([b'{"kind":"image","url":"https://example.com/a.png"}'] * inputs)
    body += b"]}"
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % len(body) + body


def test_a_json_body_of_countless_values_is_refused_before_it_is_parsed(server: Server) -> None:
    attack = _json_job(350_000)
    assert len(attack) < 20 * MiB  # under the body limit: only the count of its values can refuse it
    idle = _idle_p50(server)
    attacked, outcomes = _p50_during(server, lambda: _send(server.port, attack))
    _assert_unstalled(idle, attacked)
    assert set(outcomes) <= REFUSED, outcomes


def test_trickled_headers_are_cut_off_at_the_header_timeout(server: Server) -> None:
    """150 connections each sending a header line every few hundred ms, never the end of the head: each is answered
    408 and closed once its head is HEADER_TIMEOUT_S late, and `/healthz` answers as fast meanwhile."""
    idle = _idle_p50(server)
    conns = [_Trickle.open(server.port) for _ in range(150)]

    def trickle() -> bool:
        for conn in conns:
            conn.step()
        return all(conn.closed_after is not None for conn in conns)

    try:
        attacked, _ = _p50_during(server, lambda: wait_for(trickle, 5 * HEADER_TIMEOUT_S, "closed trickles", []))
    finally:
        for conn in conns:
            conn.sock.close()
    _assert_unstalled(idle, attacked)
    assert min(conn.closed_after or 0 for conn in conns) >= HEADER_TIMEOUT_S
    heads, bodies = zip(*(conn.received.split(b"\r\n\r\n", 1) for conn in conns), strict=True)
    assert {head.split(b"\r\n", 1)[0] for head in heads} == {b"HTTP/1.1 408 Request Timeout"}
    assert {json.loads(body)["error"]["code"] for body in bodies} == {"request_timeout"}


def test_a_kept_alive_connection_s_next_head_has_the_same_deadline(server: Server) -> None:
    """After a first request answered, the next head on the same connection trickles: it is cut off as well."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    sent = time.monotonic()  # the next head's deadline starts after this: once the first request has arrived
    assert _response(sock).startswith(b"HTTP/1.1 200")
    conn = _Trickle(sock, sent)

    def cut_off() -> bool:
        conn.step()
        return conn.closed_after is not None

    try:
        wait_for(cut_off, 5 * HEADER_TIMEOUT_S, "the trickle cut off", [])
    finally:
        sock.close()
    assert conn.received.startswith(b"HTTP/1.1 408 Request Timeout")
    assert (conn.closed_after or 0) >= HEADER_TIMEOUT_S


#: How long the clients stoker serves keep an idle connection before they retire it (httpx's and the openai
#: client's `keepalive_expiry`).
CLIENT_KEEP_ALIVE_S = 5.0


def test_a_kept_alive_connection_outlives_the_clients_own_keep_alive(server: Server) -> None:
    """A client that comes back on its connection just before its own pool would retire it (after a Retry-After of
    5 s, say) finds it open: the server does not close it first, so the request cannot cross the server's close."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(CLIENT_KEEP_ALIVE_S + 0.5)  # the idle time under test, not a wait for something to happen
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200")


def _response(sock: socket.socket) -> bytes:
    """One /healthz answer off the socket (b"" if the server closed it first)."""
    received = b""
    while not received.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    return received


def test_the_api_raises_its_open_files_limit_to_the_hard_limit(tmp_path: Path) -> None:
    """Started at a soft limit under its hard one (many systems start a service at 1024), `stoker api` serves with
    its soft limit at the hard one: each kept-alive connection holds a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Low, yet above what this test process holds open now, so that starting the API here still works.
    lowered = max(1024, len(os.listdir("/proc/self/fd")) + 256)
    if hard == resource.RLIM_INFINITY or hard <= lowered:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    port, log = free_port(), tmp_path / "api.log"
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))  # the child inherits it
    try:
        proc = spawn(["api", "--port", str(port)], {**os.environ, "STOKER_API_TOKENIZE": "false"}, log)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        wait_for(lambda: answers(port), 60, f"the API\n{tail(log)}", [proc])
        limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
        (open_files,) = [line.split()[3:5] for line in limits if line.startswith("Max open files")]
        assert open_files == [str(hard), str(hard)]
    finally:
        stop(proc)


class _Trickle:
    """A connection that sends its request head a line at a time and never ends it."""

    def __init__(self, sock: socket.socket, opened: float) -> None:
        self.sock = sock
        #: A monotonic time no later than the server's start of this head's deadline.
        self.opened = opened
        self.received = b""
        #: Seconds from `opened` to the server's close; None while open.
        self.closed_after: float | None = None
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        sock.setblocking(False)

    @classmethod
    def open(cls, port: int) -> _Trickle:
        """A new connection, timed from before it was made (so before the server saw it)."""
        opened = time.monotonic()
        return cls(socket.create_connection(("127.0.0.1", port), timeout=5), opened)

    def step(self) -> None:
        """Read what the server sent (noting when it closed), then send one more header line."""
        if self.closed_after is not None:
            return
        while (chunk := self._read()) is not None:
            if not chunk:
                self.closed_after = time.monotonic() - self.opened
                return
            self.received += chunk
        with contextlib.suppress(OSError):  # closed under us: the next step reads the end
            self.sock.send(b"X-Trickle: 1\r\n")

    def _read(self) -> bytes | None:
        """The next bytes, b"" at the end, None when nothing is there yet."""
        try:
            return self.sock.recv(4096)
        except BlockingIOError:
            return None
        except OSError:
            return b""


def _exchange(port: int, payload: bytes, answers: int = 1) -> list[tuple[int, bytes]]:
    """Send payload on a fresh connection and read `answers` responses (status, body) off it, or fewer where the
    server closes it first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        received = b""
        parsed: list[tuple[int, bytes]] = []
        while len(parsed) < answers and (chunk := sock.recv(65536)):
            received += chunk
            while b"\r\n\r\n" in received:
                head, rest = received.split(b"\r\n\r\n", 1)
                fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
                length = int(fields[b"content-length"])
                if len(rest) < length:
                    break
                parsed.append((int(head.split(b" ", 2)[1]), rest[:length]))
                received = rest[length:]
    return parsed


DEFAULT_MAX_HEAD = 16 * 1024  # the `max_header_bytes` default the fixture's server runs with


def _head_of(size: int) -> bytes:
    """A GET /healthz head of exactly `size` bytes."""
    start, end = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def test_a_head_over_its_bound_is_refused_431_in_the_error_shape_and_one_within_it_served(server: Server) -> None:
    within = _exchange(server.port, _head_of(DEFAULT_MAX_HEAD - 512))
    assert [status for status, _ in within] == [200]
    ((status, body),) = _exchange(server.port, _head_of(DEFAULT_MAX_HEAD + 4096))
    assert status == 431
    assert json.loads(body)["error"]["code"] == "headers_too_large"


def test_a_malformed_request_is_refused_400_in_the_error_shape(server: Server) -> None:
    ((status, body),) = _exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost x\r\nBad\x01Header: v\r\n\r\n")
    assert status == 400
    assert json.loads(body)["error"]["code"] == "malformed_request"


def test_pipelined_requests_are_all_answered_and_a_body_is_not_counted_against_the_next_head(server: Server) -> None:
    """Three requests in one send, the first with a body larger than a head may be: the bound counts heads only."""
    body = b'{"prompt":"' + b"a" * (2 * DEFAULT_MAX_HEAD) + b'"}'  # over the prompt's length: 422, nothing queued
    post = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = _exchange(server.port, post % len(body) + body + get + get, answers=3)
    assert [status for status, _ in answers] == [422, 200, 200], answers[0]
