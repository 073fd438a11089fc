"""Completion callbacks on real workers: a receiver on loopback gets each job's end, signed; retries on 5xx; the
address rules of URL inputs hold; the job never waits for its receiver."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from stoker.adapters.store import Store
from stoker.core.callbacks import sign, verify
from stoker.core.tenancy import DEFAULT_TENANT
from tests.integration.conftest import URL_TEST_HOST
from tests.integration.test_pipeline import _wait
from tests.serving import serve_handler
from workers.procs import ROOT, wait_for


@dataclass
class Delivery:
    """One POST the receiver got."""

    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A webhook receiver: every delivery, and how many failures each path answers before a 200."""

    host: str
    port: int = 0
    got: list[Delivery] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def for_job(self, job_id: str) -> list[Delivery]:
        return [d for d in self.got if json.loads(d.body).get("id") == job_id]


@contextlib.contextmanager
def _receiver(host: str) -> Iterator[Receiver]:
    receiver = Receiver(host)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with lock:
                receiver.got.append(Delivery(self.path, dict(self.headers.items()), body))
                left = receiver.failures.get(self.path, 0)
                receiver.failures[self.path] = left - 1
            status = 404 if self.path == "/gone" else 503 if left > 0 else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with serve_handler(host, Handler) as port:
        receiver.port = port
        yield receiver


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """The allowlisted receiver (the workers may reach URL_TEST_HOST)."""
    with _receiver(URL_TEST_HOST) as served:
        yield served


def _submit(client: TestClient, callback_url: str, prompt: str = "Say hello.") -> str:
    response = client.post("/v1/jobs", data={"prompt": prompt, "callback_url": callback_url})
    assert response.status_code == 202, response.text
    assert response.json()["callback"] == {"url": callback_url, "status": "pending", "attempts": 0, "last_error": None}
    return str(response.json()["id"])


def _settled(client: TestClient, job_id: str) -> dict[str, Any]:
    """The job once its callback is delivered or given up."""
    wait_for(
        lambda: client.get(f"/v1/jobs/{job_id}").json()["callback"]["status"] != "pending",
        60,
        f"the callback of {job_id}",
        [],
    )
    job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
    return job


def _secret(store_redis: redis.Redis[bytes]) -> str:
    return Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600).callbacks.secret(DEFAULT_TENANT)


def test_a_receiver_gets_one_signed_post_per_job(
    client: TestClient, receiver: Receiver, store_redis: redis.Redis[bytes]
) -> None:
    job_id = _submit(client, receiver.url("/hook"))
    ended = _wait(client, job_id)
    assert ended["status"] == "succeeded"
    job = _settled(client, job_id)
    assert job["callback"] == {"url": receiver.url("/hook"), "status": "delivered", "attempts": 1, "last_error": None}
    (delivery,) = receiver.for_job(job_id)
    sent = json.loads(delivery.body)
    assert (sent["status"], sent["result"]["text"]) == ("succeeded", ended["result"]["text"])
    assert "tenant" not in sent
    timestamp, signature = delivery.headers["X-Stoker-Timestamp"], delivery.headers["X-Stoker-Signature"]
    secret = _secret(store_redis)
    assert verify(secret, timestamp, delivery.body, signature, time.time())
    assert not verify(secret, timestamp, delivery.body.replace(b"succeeded", b"failed"), signature, time.time())
    assert not verify("whsec_someone-else", timestamp, delivery.body, signature, time.time())
    # The receiver's own check, as docs/api.md shows it.
    argv = [sys.executable, "-m", "stoker.cli", "verify-callback", "--secret", secret, "--timestamp", timestamp]
    good = subprocess.run([*argv, "--signature", signature], input=delivery.body, capture_output=True, cwd=ROOT)
    bad = subprocess.run([*argv, "--signature", "v1=00"], input=delivery.body, capture_output=True, cwd=ROOT)
    assert (good.returncode, good.stdout.strip()) == (0, b"valid")
    assert bad.returncode == 1


def test_a_receiver_answering_503_twice_gets_three_attempts(client: TestClient, receiver: Receiver) -> None:
    receiver.failures["/flaky"] = 2
    job_id = _submit(client, receiver.url("/flaky"))
    job = _settled(client, job_id)
    assert job["status"] == "succeeded"
    assert (job["callback"]["status"], job["callback"]["attempts"]) == ("delivered", 3)
    assert len(receiver.for_job(job_id)) == 3


def test_a_callback_where_the_rules_forbid_is_refused_and_recorded_while_the_job_succeeds(
    client: TestClient, receiver: Receiver
) -> None:
    with _receiver("127.0.0.1") as loopback:  # not allowlisted: what SSRF would aim at, here by a name
        job_id = _submit(client, f"http://localhost:{loopback.port}/hook")
        job = _settled(client, job_id)
    assert job["status"] == "succeeded"  # the job never depended on its receiver
    assert (job["callback"]["status"], job["callback"]["attempts"]) == ("failed", 1)
    assert job["callback"]["last_error"].startswith("url_rejected")
    assert "127.0.0.1" not in job["callback"]["last_error"]  # the kind of address the name has, never which one
    assert loopback.got == []
    # A receiver that answers 404 is not tried again.
    gone = _settled(client, _submit(client, receiver.url("/gone")))
    assert (gone["callback"]["status"], gone["callback"]["attempts"]) == ("failed", 1)
    assert gone["callback"]["last_error"].startswith("fetch_failed")


def test_a_callback_url_is_checked_when_the_job_is_submitted(client: TestClient, workers: dict[str, Path]) -> None:
    response = client.post("/v1/jobs", data={"prompt": "hi", "callback_url": "ftp://example.com/hook"})
    assert response.status_code == 422
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("url_rejected", "callback_url")


def _keys_cli(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-m", "stoker.cli", "keys", *args]
    return subprocess.run(argv, capture_output=True, cwd=ROOT, env={**os.environ, **env}, timeout=60)


def test_each_tenant_gets_a_callback_secret_of_its_own_whatever_the_deployment_sets(
    store_redis: redis.Redis[bytes],
) -> None:
    callbacks = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600).callbacks
    printed = {}
    for name in ("acme", "globex"):
        tenant = f"{name}-{uuid.uuid4().hex[:8]}"
        created = _keys_cli("create", "--tenant", tenant, STOKER_CALLBACK_SECRET="whsec_deployment")
        assert created.returncode == 0, created.stderr
        found = re.search(rb"whsec_\S+", created.stdout)
        assert found is not None, created.stdout
        printed[tenant] = found.group().decode()
        assert callbacks.live_secrets(tenant) == [printed[tenant]]  # what its callbacks are signed with
    assert len(set(printed.values())) == 2  # no tenant can sign another's callbacks
    assert "whsec_deployment" not in printed.values()


def test_a_rotated_secret_signs_beside_the_new_one_until_its_grace_ends(store_redis: redis.Redis[bytes]) -> None:
    callbacks = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600).callbacks
    tenant = f"rotate-{uuid.uuid4().hex[:8]}"
    first = callbacks.secret(tenant)
    assert callbacks.live_secrets(tenant) == [first]
    second = callbacks.rotate(tenant, grace_s=1)
    assert callbacks.live_secrets(tenant) == [second, first]
    wait_for(lambda: callbacks.live_secrets(tenant) == [second], 10, "the grace period to end", [])
    third = callbacks.rotate(tenant, grace_s=0)
    assert callbacks.live_secrets(tenant) == [third]  # no grace: the replaced secret stops signing at once
    fourth, fifth = callbacks.rotate(tenant, grace_s=60), callbacks.rotate(tenant, grace_s=60)
    assert callbacks.live_secrets(tenant) == [fifth, fourth]  # a rotation within the grace drops the older one
    assert len({first, second, third, fourth, fifth}) == 5


def test_the_deprecated_deployment_secret_stands_in_until_a_rotation(store_redis: redis.Redis[bytes]) -> None:
    callbacks = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600).callbacks
    tenant = f"single-{uuid.uuid4().hex[:8]}"
    assert callbacks.live_secrets(tenant, "whsec_deployment") == ["whsec_deployment"]
    new = callbacks.rotate(tenant, grace_s=60, fallback="whsec_deployment")
    assert callbacks.live_secrets(tenant, "whsec_deployment") == [new, "whsec_deployment"]  # its own wins now


def test_after_a_rotation_deliveries_carry_both_signatures(
    client: TestClient, receiver: Receiver, store_redis: redis.Redis[bytes]
) -> None:
    old = _secret(store_redis)
    rotated = _keys_cli("rotate-callback-secret", "--tenant", DEFAULT_TENANT, "--grace", "3600")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.decode().strip().splitlines()[-1]
    assert new.startswith("whsec_")
    assert new != old
    job_id = _submit(client, receiver.url("/rotated"))
    assert _settled(client, job_id)["callback"]["status"] == "delivered"
    (delivery,) = receiver.for_job(job_id)
    timestamp, signature = delivery.headers["X-Stoker-Timestamp"], delivery.headers["X-Stoker-Signature"]
    assert len(signature.split(",")) == 2
    assert signature.startswith(sign(new, int(timestamp), delivery.body))  # the new one first
    for secret in (new, old):  # a receiver still on the old secret and one already on the new both accept it
        argv = [sys.executable, "-m", "stoker.cli", "verify-callback", "--secret", secret, "--timestamp", timestamp]
        checked = subprocess.run([*argv, "--signature", signature], input=delivery.body, capture_output=True, cwd=ROOT)
        assert (checked.returncode, checked.stdout.strip()) == (0, b"valid")
    assert not verify("whsec_someone-else", timestamp, delivery.body, signature, time.time())
