"""What the Files and Batch APIs let one tenant cost the others: a body read only once its key is checked, a deadline
on every body, bounded metadata, batch records that expire, a cap on running batches, listings read by range, files
that cost their quota however small, names any client can be given, and a quota that parallel uploads hold as they
stream. Real Redis; a real `stoker api` process on loopback where the server's own bounds are under test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.context import context_of
from api.openai_batch_feeder import OpenAIBatchFeeder
from stoker.adapters.files import FileStorage, FileWriter
from stoker.adapters.store import Store
from stoker.adapters.store.keys import batch_key, tenant_batches_key, tenant_live_batches_key
from stoker.core.openai_batches import OpenAIBatch
from stoker.core.pressure import StoreMemory
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.fleet import client_context
from tests.integration.test_slow_clients import (
    Server,
    _assert_unstalled,
    _exchange,
    _idle_p50,
    _p50_during,
    _send,
)
from tests.serving import answers, serve
from workers.broker import free_port
from workers.procs import spawn, stop, tail, wait_for

MiB = 1024 * 1024
#: The served API's deadline on a request's body, short so that a trickle takes a second.
BODY_TIMEOUT_S = 1.0
MODEL = ApiSettings().public_model_name


@dataclass(frozen=True)
class Tenant:
    """A tenant of this test, with a key of its own (names are fresh per test)."""

    name: str
    token: str

    @property
    def auth(self) -> dict[str, str]:
        """The request header carrying its key."""
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
def store(store_redis: redis.Redis[bytes]) -> Store:
    """The test store, as the API sees it."""
    return Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)


@pytest.fixture
def tenants(store: Store) -> tuple[Tenant, Tenant]:
    """Two tenants, each with a key of its own."""
    made = []
    for name in ("alpha", "beta"):
        issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
        store.tenants.put_api_key(issued.record)
        made.append(Tenant(issued.record.tenant, issued.token))
    return made[0], made[1]


@pytest.fixture
def make_api(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """Makes APIs in this process with keys required and generous rates (and `settings` on top), feeding nothing."""
    opened: list[TestClient] = []

    def make(**settings: Any) -> TestClient:
        chosen = {
            "auth": True,
            "rate_limit_per_s": 1000.0,
            "rate_limit_burst": 1000,
            "batch_feeder": False,
            "api_tokenize": False,
            "files_dir": tmp_path / "files",
            **settings,
        }
        api = TestClient(create_app(ApiSettings(**chosen)))
        opened.append(api.__enter__())
        return api

    yield make
    for api in opened:
        api.__exit__(None, None, None)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def a_line(custom_id: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(api: TestClient, tenant: Tenant, content: bytes, filename: str = "input.jsonl") -> httpx2.Response:
    files = {"file": (filename, content, "application/jsonl")}
    return api.post("/v1/files", data={"purpose": "batch"}, files=files, headers=tenant.auth)


def create_batch(api: TestClient, tenant: Tenant, file_id: str, **extra: Any) -> httpx2.Response:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    return api.post("/v1/batches", json=body, headers=tenant.auth)


def an_input_file(api: TestClient, tenant: Tenant) -> str:
    made = upload(api, tenant, jsonl([a_line("a"), a_line("b")]))
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def error_of(response: httpx.Response | httpx2.Response, status: int) -> dict[str, Any]:
    """The error body of a response from a served API (httpx) or from a TestClient (httpx2, as Starlette's is)."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


# -- the served API: a body read only after the key, and a deadline on every body -------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`stoker api` with keys required and a short deadline on request bodies."""
    root = tmp_path_factory.mktemp("batch-limits")
    port, log = free_port(), root / "api.log"
    env = {
        **os.environ,
        "STOKER_AUTH": "true",
        "STOKER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "STOKER_API_TOKENIZE": "false",
        "STOKER_BATCH_FEEDER": "false",
        "STOKER_FILES_DIR": str(root / "files"),
    }
    proc = spawn(["api", "--port", str(port)], env, log)
    try:
        wait_for(lambda: answers(port), 60, f"the API\n{tail(log)}", [proc])
        yield Server(port, log)
    finally:
        stop(proc)


def _head(path: str, length: int, headers: dict[str, str] | None = None, kind: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Type: {kind}", f"Content-Length: {length}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _metadata_flood(size: int) -> bytes:
    """A batch body of `size` bytes or so whose metadata holds hundreds of thousands of pairs."""
    pairs = b",".join(b'"k%d":"v"' % n for n in range(size // 15))  # up to 14 bytes each, and a comma
    return b'{"input_file_id":"file-x","endpoint":"/v1/chat/completions","completion_window":"24h","metadata":{' + (
        pairs + b"}}"
    )


def test_an_unauthenticated_batch_body_is_refused_401_before_it_is_read(server: Server) -> None:
    """With no key, `POST /v1/batches` answers 401 to the head alone (its 19 MiB body never sent), and a body of
    countless values sent whole stalls `/healthz` no more than any other refused request."""
    body = _metadata_flood(19 * MiB)
    assert len(body) < ApiSettings().max_body_bytes  # within the body limit: only the key can refuse it first
    head = _head("/v1/batches", len(body))
    ((status, answer),) = _exchange(server.port, head)  # and not a byte of the body: the answer cannot wait for it
    assert status == 401, answer
    assert json.loads(answer)["error"]["code"] == "unauthorized"
    idle = _idle_p50(server)
    attacked, outcomes = _p50_during(server, lambda: _send(server.port, head + body))
    _assert_unstalled(idle, attacked)
    assert set(outcomes) == {401}, outcomes


class _Trickle:
    """A request whose head is sent whole and whose body then comes a few bytes at a time, never to its end."""

    def __init__(self, port: int, head: bytes, body: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(head)
        self.sent_at = time.monotonic()
        self.body, self.received = body, b""
        self.closed_after: float | None = None
        self.sock.setblocking(False)

    def step(self) -> bool:
        """Read what came, send a few more bytes of the body; whether the server closed the connection."""
        if self.closed_after is not None:
            return True
        while True:
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed_after = time.monotonic() - self.sent_at
                return True
            self.received += chunk
        piece, self.body = self.body[:4], self.body[4:]
        with contextlib.suppress(OSError):
            self.sock.send(piece)
        return False


def _trickled(server: Server, head: bytes, body: bytes) -> _Trickle:
    trickle = _Trickle(server.port, head, body)
    try:
        wait_for(trickle.step, 10 * BODY_TIMEOUT_S, "the trickled request closed", [])
    finally:
        trickle.sock.close()
    return trickle


def _multipart(content: bytes) -> tuple[bytes, str]:
    head = b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b'--bb\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    return head + content + b"\r\n--bb--\r\n", "multipart/form-data; boundary=bb"


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/files", "/v1/chat/completions"])
def test_a_body_trickled_past_its_deadline_is_answered_408_and_closed(
    server: Server, tenants: tuple[Tenant, Tenant], path: str
) -> None:
    alpha, _ = tenants
    body, kind = (
        _multipart(jsonl([a_line("a")] * 50)) if path == "/v1/files" else (json.dumps(a_line("a")).encode() * 20, "")
    )
    head = _head(path, len(body), alpha.auth, kind or "application/json")
    trickle = _trickled(server, head, body)
    assert trickle.body, "the whole body was sent: nothing was late"
    assert (trickle.closed_after or 0) >= BODY_TIMEOUT_S
    status, rest = trickle.received.split(b"\r\n", 1)
    assert status == b"HTTP/1.1 408 Request Timeout", trickle.received[:300]
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_body_still_trickling_after_its_answer_is_cut_off_at_its_deadline(server: Server) -> None:
    """Answered 401 at once, a request that goes on sending its body a few bytes at a time is closed at the body's
    deadline instead of holding its connection for as long as it likes."""
    body = _metadata_flood(4096)
    trickle = _trickled(server, _head("/v1/batches", len(body)), body)
    assert trickle.received.startswith(b"HTTP/1.1 401 ")
    assert trickle.body, "the whole body was sent: nothing was late"
    assert (trickle.closed_after or 0) >= BODY_TIMEOUT_S


# -- batches: metadata, expiry, a cap on running ones, listings by range -------------------------------------------
def test_batch_metadata_is_held_to_openai_s_limits(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant]
) -> None:
    api = make_api()
    alpha, _ = tenants
    file_id = an_input_file(api, alpha)
    widest = {f"{n:02d}" + "k" * 62: "v" * 512 for n in range(16)}
    made = create_batch(api, alpha, file_id, metadata=widest)
    assert made.status_code == 200, made.text
    assert made.json()["metadata"] == widest
    too_many = {f"k{n}": "v" for n in range(17)}
    refused = [
        error_of(create_batch(api, alpha, file_id, metadata=meta), 422)
        for meta in (too_many, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": {"nested": "v"}})
    ]
    assert {error["code"] for error in refused} == {"invalid_request"}
    assert [error["param"].split(".")[0] for error in refused] == ["metadata"] * 4
    assert refused[2]["param"] == "metadata.k"
    assert error_of(api.post("/v1/batches", content=b"{not json", headers=alpha.auth), 422)["code"] == "invalid_request"


def test_an_ended_batch_s_record_expires(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], store_redis: redis.Redis[bytes]
) -> None:
    """Cancelled, and ended by the feeder: its record lives `batch_ttl_s` more, and it no longer counts as running."""
    api = make_api(batch_ttl_s=300)
    alpha, _ = tenants
    batch_id = create_batch(api, alpha, an_input_file(api, alpha)).json()["id"]
    assert store_redis.ttl(batch_key(batch_id)) == -1  # running: kept for as long as it runs
    assert api.post(f"/v1/batches/{batch_id}/cancel", headers=alpha.auth).status_code == 200
    feeder = OpenAIBatchFeeder(client_context(api))

    def ended() -> bool:
        portal = api.portal  # the portal of the entered client
        assert portal is not None
        portal.call(feeder.tick)
        return bool(api.get(f"/v1/batches/{batch_id}", headers=alpha.auth).json()["status"] == "cancelled")

    wait_for(ended, 30, "the batch cancelled", [])
    assert 0 < store_redis.ttl(batch_key(batch_id)) <= 300
    assert not store_redis.sismember(tenant_live_batches_key(alpha.name), batch_id)
    assert store_redis.ttl(tenant_batches_key(alpha.name)) > 0  # the listing itself lapses once all it names have


def test_a_tenant_s_running_batches_are_capped(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant]
) -> None:
    api = make_api(batch_tenant_max_live=2)
    alpha, beta = tenants
    file_id = an_input_file(api, alpha)
    first, second = (create_batch(api, alpha, file_id).json()["id"] for _ in range(2))
    refused = create_batch(api, alpha, file_id)
    assert error_of(refused, 429)["code"] == "too_many_batches"
    assert int(refused.headers["retry-after"]) > 0
    assert create_batch(api, beta, an_input_file(api, beta)).status_code == 200  # another tenant's cap is its own
    batches = client_context(api).store.openai_batches
    assert batches.move(first, "cancelled", int(time.time()), only_from=("validating",))
    batches.retire(first)  # as the feeder ends a batch
    assert create_batch(api, alpha, file_id).status_code == 200
    assert second in {b["id"] for b in api.get("/v1/batches", headers=alpha.auth).json()["data"]}


def test_new_batches_are_refused_while_the_store_is_full(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant]
) -> None:
    api = make_api()
    alpha, _ = tenants
    file_id = an_input_file(api, alpha)
    monitor = client_context(api).monitor
    monitor.memory = StoreMemory(time.time() + 3600, 100 * MiB, 100 * MiB)  # as the monitor sees a full store
    try:
        refused = create_batch(api, alpha, file_id)
    finally:
        monitor.memory = None
    assert error_of(refused, 503)["code"] == "store_full"


def test_batches_are_listed_by_range_and_gone_ones_taken_off(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], store_redis: redis.Redis[bytes]
) -> None:
    api = make_api()
    alpha, _ = tenants
    now = int(time.time())
    made = [f"batch_{uuid.uuid4().hex}" for _ in range(5)]
    for age, batch_id in enumerate(reversed(made)):  # a second apart: the listing orders by creation time
        record = OpenAIBatch(
            id=batch_id,
            endpoint="/v1/chat/completions",
            input_file_id="file-unused",
            completion_window="24h",
            status="validating",
            created_at=now - age,
            expires_at=now - age + 3600,
            tenant=alpha.name,
        )
        client_context(api).store.openai_batches.create(record)
    newest = made[::-1]
    first = api.get("/v1/batches", params={"limit": 2}, headers=alpha.auth).json()
    assert [b["id"] for b in first["data"]] == newest[:2]
    assert first["has_more"]
    store_redis.delete(batch_key(newest[2]))  # its record lapsed
    second = api.get("/v1/batches", params={"limit": 2, "after": first["last_id"]}, headers=alpha.auth).json()
    assert [b["id"] for b in second["data"]] == newest[3:5]
    assert not second["has_more"]
    listed = {raw.decode() for raw in store_redis.zrange(tenant_batches_key(alpha.name), 0, -1)}
    assert listed == set(made) - {newest[2]}


# -- files: a cost however small, names of any characters, a quota held as uploads stream ---------------------------
def test_empty_files_count_against_the_quota_and_a_tenant_s_files_are_capped(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant]
) -> None:
    api = make_api(files_tenant_max_bytes=4 * 1024, files_tenant_max_count=6)
    alpha, beta = tenants
    kept = [upload(api, alpha, b"") for _ in range(4)]
    assert [r.status_code for r in kept] == [200] * 4
    assert error_of(upload(api, alpha, b""), 429)["code"] == "tenant_storage_full"  # 4 × 1 KiB is the quota
    assert api.delete(f"/v1/files/{kept[0].json()['id']}", headers=alpha.auth).status_code == 200
    assert upload(api, alpha, b"").status_code == 200  # deleting one gave its KiB back
    count_capped = make_api(files_tenant_max_bytes=0, files_tenant_max_count=3)
    assert [upload(count_capped, beta, b"{}\n").status_code for _ in range(3)] == [200] * 3
    assert error_of(upload(count_capped, beta, b"{}\n"), 429)["code"] == "tenant_storage_full"
    page = count_capped.get("/v1/files", params={"limit": 2}, headers=beta.auth).json()
    rest = count_capped.get("/v1/files", params={"after": page["last_id"]}, headers=beta.auth).json()
    assert len(page["data"]) == 2
    assert page["has_more"]
    assert len(rest["data"]) == 1
    assert not {f["id"] for f in page["data"]} & {f["id"] for f in rest["data"]}


#: What the header must be: an ASCII fallback in a quoted string nothing can end early, then the name itself.
ATTACHMENT = re.compile(r"attachment; filename=\"([^\"\\;\r\n]*)\"; filename\*=utf-8''([A-Za-z0-9%._~-]*)", re.I)


def test_a_file_named_outside_latin_1_downloads_with_its_name_intact(
    make_api: Callable[..., TestClient], tenants: tuple[Tenant, Tenant]
) -> None:
    api = make_api()
    alpha, _ = tenants
    name = 'отчёт "q"; filename=evil.sh.jsonl'
    escaped = name.replace('"', '\\"').encode()
    body = b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    body += (
        b'--bb\r\nContent-Disposition: form-data; name="file"; filename="' + escaped + b'"\r\n\r\n{}\n\r\n--bb--\r\n'
    )
    headers = {**alpha.auth, "Content-Type": "multipart/form-data; boundary=bb"}
    made = api.post("/v1/files", content=body, headers=headers)
    assert made.status_code == 200, made.text
    assert made.json()["filename"] == name
    download = api.get(f"/v1/files/{made.json()['id']}/content", headers=alpha.auth)
    assert download.status_code == 200
    assert download.content == b"{}\n"
    shape = ATTACHMENT.fullmatch(download.headers["content-disposition"])
    assert shape is not None, download.headers["content-disposition"]
    assert urllib.parse.unquote(shape.group(2)) == name
    assert shape.group(1).isascii()


class _MeteredStorage:
    """The API's file storage, metered: the bytes written by files being written or kept, and their peak."""

    def __init__(self, storage: FileStorage) -> None:
        self.storage = storage
        self.lock = threading.Lock()
        self.written: dict[str, int] = {}
        self.peak = 0

    def _add(self, file_id: str, size: int) -> None:
        with self.lock:
            self.written[file_id] = self.written.get(file_id, 0) + size
            self.peak = max(self.peak, sum(self.written.values()))

    @contextlib.contextmanager
    def create(self, file_id: str) -> Iterator[FileWriter]:
        meter = self

        class Writer:
            def write(self, data: bytes, /) -> int:
                meter._add(file_id, len(data))
                return inner.write(data)

        try:
            with self.storage.create(file_id) as inner:
                yield Writer()
        except BaseException:
            self._forget(file_id)
            raise

    def read(self, file_id: str, offset: int = 0) -> Iterator[bytes]:
        return self.storage.read(file_id, offset)

    def delete(self, file_id: str) -> None:
        self._forget(file_id)
        self.storage.delete(file_id)

    def _forget(self, file_id: str) -> None:
        with self.lock:  # uploads write on other threads meanwhile
            self.written.pop(file_id, None)

    def exists(self, file_id: str) -> bool:
        return self.storage.exists(file_id)


def test_parallel_uploads_never_hold_more_than_the_quota_together(
    tmp_path: Path, tenants: tuple[Tenant, Tenant]
) -> None:
    """Six uploads of 5 MiB at once against a 20 MiB quota, each pausing once it has sent 4 MiB until all have:
    what they write (kept or not) never passes the quota at any moment, nor do the files kept, and whoever is refused
    hears `tenant_storage_full`."""
    quota, size, uploads = 20 * MiB, 5 * MiB, 6
    settings = ApiSettings(
        auth=True,
        rate_limit_per_s=1000.0,
        rate_limit_burst=1000,
        batch_feeder=False,
        api_tokenize=False,
        files_dir=tmp_path,
        files_tenant_max_bytes=quota,
    )
    app = create_app(settings)
    alpha, _ = tenants
    halfway = threading.Barrier(uploads, timeout=60)
    line = json.dumps(a_line("x" * 200)).encode() + b"\n"
    rows = size // len(line)

    def body() -> Iterator[bytes]:
        yield b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--bb\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        for row in range(rows):
            if row == rows * 4 // 5:
                halfway.wait()
            yield line
        yield b"\r\n--bb--\r\n"

    answers_: list[httpx.Response] = []
    with serve(app) as base:
        metered = _MeteredStorage(context_of(app).files)
        app.state.context = replace(context_of(app), files=metered)
        headers = {**alpha.auth, "Content-Type": "multipart/form-data; boundary=bb"}

        def send() -> None:
            answers_.append(httpx.post(f"{base}/v1/files", content=body(), headers=headers, timeout=60))

        threads = [threading.Thread(target=send) for _ in range(uploads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        kept = [a.json() for a in answers_ if a.status_code == 200]
        refused = [a for a in answers_ if a.status_code != 200]
        assert len(answers_) == uploads
        assert kept, [(a.status_code, a.text) for a in answers_]
        assert {error_of(a, 429)["code"] for a in refused} <= {"tenant_storage_full"}
        assert sum(f["bytes"] for f in kept) <= quota
        assert metered.peak <= quota, f"{metered.peak / MiB:.1f} MiB written at once"
        assert context_of(app).store.files.used(alpha.name) == sum(f["bytes"] for f in kept)
