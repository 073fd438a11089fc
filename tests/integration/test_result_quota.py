"""What a tenant's stored results hold counts against its quota (`STOKER_TENANT_MAX_RESULT_BYTES`) for as long as
they are kept: charged when its jobs end, refused new jobs at the cap while other tenants are admitted, let go of
when the records expire or their job is deleted. Real Redis, the real workers, the API with keys on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.adapters.store import Store
from stoker.adapters.store.jobs import NewJob
from stoker.adapters.store.keys import job_key, tenant_result_bytes_key, tenant_results_key
from stoker.core.deadlines import deadline_for
from stoker.core.jobs import ResultInfo
from stoker.core.tenancy import DEFAULT_TENANT, issue_key
from stoker.settings import ApiSettings
from workers.procs import wait_for

#: A record's lifetime short enough for a test to see its result expire: below the setting's floor of 60 s (which
#: keeps a production record past its job's deadline), so set past validation; a job here ends within a few seconds.
SHORT_TTL_S = 12


@dataclass(frozen=True)
class Tenant:
    """A tenant of one test (a fresh name: its quota starts empty), with its key."""

    name: str
    auth: dict[str, str]


@pytest.fixture
def job_store(store_redis: redis.Redis[bytes]) -> Store:
    return Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)


@pytest.fixture
def tenants(job_store: Store) -> tuple[Tenant, Tenant]:
    made = []
    for name in ("acme", "globex"):
        issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
        job_store.tenants.put_api_key(issued.record)
        made.append(Tenant(issued.record.tenant, {"Authorization": f"Bearer {issued.token}"}))
    return made[0], made[1]


@pytest.fixture
def keyed(workers: dict[str, Path]) -> Iterator[Callable[..., TestClient]]:
    """Makes APIs with keys on, submitting to the real workers; `job_ttl_s` may be set below its floor."""
    opened: list[TestClient] = []

    def make(job_ttl_s: int = 3600, **overrides: Any) -> TestClient:
        settings = ApiSettings(auth=True, rate_limit_per_s=1000.0, rate_limit_burst=1000, **overrides)
        api = TestClient(create_app(settings.model_copy(update={"job_ttl_s": job_ttl_s})))
        opened.append(api.__enter__())
        return api

    yield make
    for api in opened:
        api.__exit__(None, None, None)


def _ended(api: TestClient, tenant: Tenant | None, prompt: str) -> str:
    """A job of the tenant's (None: keys off), once it succeeded: its id."""
    headers = tenant.auth if tenant else {}
    response = api.post("/v1/jobs", params={"wait": 30}, data={"prompt": prompt}, headers=headers)
    assert response.status_code in (200, 202), response.text
    job: dict[str, Any] = response.json()
    for _ in range(4):
        if job["status"] not in ("queued", "preprocessing", "inferring"):
            break
        job = api.get(f"/v1/jobs/{job['id']}", params={"wait": 30}, headers=headers).json()
    assert job["status"] == "succeeded", job
    return str(job["id"])


def _stored(store_redis: redis.Redis[bytes], job_id: str) -> int:
    """The bytes of the result a job's record keeps."""
    result = store_redis.hget(job_key(job_id), "result")
    assert result is not None
    return len(result)


def _refused(response: Any) -> int:
    """The Retry-After of a 429 `tenant_storage_full`."""
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "tenant_storage_full"
    assert "stored results" in response.json()["error"]["message"]
    assert response.headers["x-should-retry"] == "true"
    return int(response.headers["retry-after"])


def test_a_tenant_whose_results_hold_its_quota_is_refused_while_another_is_admitted(
    keyed: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    acme, globex = tenants
    first = keyed(tenant_max_result_bytes=1)  # any result fills it
    held = _stored(store_redis, _ended(first, acme, "Say hello."))
    usage = job_store.tenants.usage(acme.name)
    assert (usage.result_bytes, usage.results, usage.stored_bytes, usage.messages) == (held, 1, 0, 0)
    stats = first.get("/v1/stats", headers=acme.auth).json()["tenant"]
    assert stats == {
        "name": acme.name,
        "queue_messages": 0,
        "stored_bytes": 0,
        "max_stored_bytes": ApiSettings().tenant_max_stored_bytes,
        "results": 1,
        "result_bytes": held,
        "max_result_bytes": 1,
    }
    retry_after = _refused(first.post("/v1/jobs", data={"prompt": "Say hello again."}, headers=acme.auth))
    assert 3000 < retry_after <= 3600  # when its result expires, an hour from its job's acceptance
    theirs = _stored(store_redis, _ended(first, globex, "Say hello."))  # another tenant's results are its own
    # Results add up: a quota that one result fits in refuses once a second one is kept.
    roomy = keyed(tenant_max_result_bytes=theirs + 1)
    more = _stored(store_redis, _ended(roomy, globex, "Say goodbye."))
    assert job_store.tenants.usage(globex.name).result_bytes == theirs + more
    _refused(roomy.post("/v1/jobs", data={"prompt": "A third?"}, headers=globex.auth))
    unlimited = keyed(tenant_max_result_bytes=0)
    assert _stored(store_redis, _ended(unlimited, acme, "Say it anyway.")) > 0  # 0: no cap


def test_results_are_let_go_of_when_their_records_expire(
    keyed: Callable[..., TestClient], tenants: tuple[Tenant, Tenant], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    acme, _ = tenants
    api = keyed(job_ttl_s=SHORT_TTL_S, tenant_max_result_bytes=1)
    job_id = _ended(api, acme, "Say hello.")
    assert job_store.tenants.usage(acme.name).result_bytes == _stored(store_redis, job_id)
    assert 1 <= _refused(api.post("/v1/jobs", data={"prompt": "Again?"}, headers=acme.auth)) <= SHORT_TTL_S
    wait_for(lambda: not store_redis.exists(job_key(job_id)), 2 * SHORT_TTL_S, "the record's expiry", [])
    usage = job_store.tenants.usage(acme.name)
    assert (usage.result_bytes, usage.results) == (0, 0)
    again = _ended(api, acme, "Say hello again.")  # admitted once its result was let go of
    assert job_store.tenants.usage(acme.name).results == 1
    # Its bookkeeping expires with its last result: a tenant that stops leaves nothing behind.
    keys = (tenant_results_key(acme.name), tenant_result_bytes_key(acme.name))
    wait_for(lambda: not store_redis.exists(*keys), 2 * SHORT_TTL_S + 2, "the quota's keys to expire", [])
    assert not store_redis.exists(job_key(again))


def test_a_deleted_job_gives_its_result_back_once(store_redis: redis.Redis[bytes]) -> None:
    store = Store.over(store_redis, blob_ttl_s=60, job_ttl_s=60)
    tenant = f"acme-{uuid.uuid4().hex[:8]}"
    now = time.time()
    ids = [uuid.uuid4().hex for _ in range(2)]
    for job_id in ids:
        store.jobs.create(job_id, NewJob("Hi.", [], now, deadline_for(now, 60_000, 5_000), 60_000, tenant=tenant))
    answer = ResultInfo(text="hello", model="m", prompt_tokens=2, completion_tokens=1)
    assert store.jobs.finish(ids[0], "succeeded", result=answer)
    assert not store.jobs.finish(ids[0], "succeeded", result=answer)  # ended once: charged once
    assert store.jobs.finish(ids[1], "succeeded", result=answer)
    size = len(answer.model_dump_json())
    assert store.tenants.usage(tenant).result_bytes == 2 * size
    store.jobs.delete_job(ids[0])
    store.jobs.delete_job(ids[0])  # already gone: nothing more given back
    usage = store.tenants.usage(tenant)
    assert (usage.result_bytes, usage.results) == (size, 1)
    ttl = store_redis.ttl(tenant_results_key(tenant))
    assert 58 <= ttl <= 61  # the quota's keys live as long as the last result they count
    assert store_redis.ttl(tenant_result_bytes_key(tenant)) == ttl


def test_without_keys_no_result_is_charged(client: TestClient, store_redis: redis.Redis[bytes]) -> None:
    assert _stored(store_redis, _ended(client, None, "Say hello.")) > 0
    assert not store_redis.exists(tenant_results_key(DEFAULT_TENANT), tenant_result_bytes_key(DEFAULT_TENANT))
    assert "tenant" not in client.get("/v1/stats").json()
