"""Hostile and heavy traffic at the API's door: huge input lists, many concurrent long-polls."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from api import intake
from api.app import create_app
from api.context import context_of
from stoker.adapters.store import Store
from stoker.core.jobs import ErrorInfo, InputRecord
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.fleet import Fleet
from tests.integration.conftest import SpySubmitter
from tests.media import text_image
from tests.serving import serve
from workers.broker import start_embedded
from workers.procs import stop, wait_for


def test_a_list_of_a_thousand_inputs_is_refused_before_any_is_decoded(client: TestClient) -> None:
    body = {"prompt": "hi", "inputs": [{"kind": "image", "data": "AAAA"}] * 1_000}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "too_many_inputs"
    assert response.json()["error"]["param"] == "inputs"


def test_five_images_in_json_are_counted_before_decoding(client: TestClient) -> None:
    body = {"prompt": "hi", "inputs": [{"kind": "image", "data": "not base64 at all!"}] * 5}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "too_many_inputs"  # not a base64 error: nothing was decoded


def test_healthz_answers_while_a_maximum_size_json_body_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed, answered = threading.Event(), threading.Event()
    real = intake._read_json

    def held(body: bytes, settings: ApiSettings) -> Any:
        """The real parse and base64 decode of the whole body, then held until /healthz has answered: were it run
        on the event loop, the API could answer nothing meanwhile and the probe below would time out."""
        fields = real(body, settings)
        parsed.set()
        answered.wait(30)
        return fields

    monkeypatch.setattr(intake, "_read_json", held)
    settings = ApiSettings(auth=False)
    chunk = (settings.max_body_bytes - 4096) // 4 // 4 * 3  # four inputs whose base64 fills the body limit
    body = {"prompt": "hi", "inputs": [{"kind": "image", "data": base64.b64encode(b"\0" * chunk).decode()}] * 4}
    content = json.dumps(body).encode()
    assert settings.max_body_bytes - 8192 < len(content) <= settings.max_body_bytes
    outcome: list[httpx.Response] = []
    with serve(create_app(settings, submitter=SpySubmitter(forward=False))) as base:
        headers = {"content-type": "application/json"}
        post = threading.Thread(
            target=lambda: outcome.append(httpx.post(f"{base}/v1/jobs", content=content, headers=headers, timeout=60))
        )
        post.start()
        assert parsed.wait(30), "the body was never parsed"
        probe = httpx.get(f"{base}/healthz", timeout=5)  # while the parse is still held
        answered.set()
        post.join(60)
    assert probe.status_code == 200
    assert outcome[0].status_code == 415  # parsed in full, then refused by its content (zeros are no image)
    assert outcome[0].json()["error"]["code"] == "unsupported_media_type"


class HoldingSubmitter(SpySubmitter):
    """Forwards jobs with inputs to the workers; holds text-only ones forever (they never end)."""

    def submit(self, job_id: str, inputs: Sequence[InputRecord], *args: Any, **kwargs: Any) -> None:
        """Forward only jobs that carry inputs."""
        if inputs:
            super().submit(job_id, inputs, *args, **kwargs)


def test_many_concurrent_long_polls_all_hear_the_end(workers: dict[str, Path], store_redis: Any) -> None:
    store = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)
    keys = {}
    for name in ("poller", "other"):
        issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
        store.tenants.put_api_key(issued.record)
        keys[name] = {"Authorization": f"Bearer {issued.token}"}
    app = create_app(ApiSettings(auth=True, rate_limit_per_s=1000.0, rate_limit_burst=1000), submitter=Holding())
    with serve(app) as base:
        held = httpx.post(f"{base}/v1/jobs", data={"prompt": "never runs"}, headers=keys["poller"]).json()["id"]
        files = [("image", ("scan.png", text_image("POLLS 150"), "image/png"))]
        other = httpx.post(f"{base}/v1/jobs", data={"prompt": "Read it."}, files=files, headers=keys["other"])
        statuses, ended = asyncio.run(_poll(base, app, store, held, keys, other.json()["id"]))
    assert statuses == {"failed": 150}  # every one of 150 concurrent waits was woken by the job's end
    assert ended["status"] == "succeeded"  # and another tenant's wait, meanwhile, got its own job's end


class Holding(SpySubmitter):
    """Forwards jobs with inputs to the workers; holds text-only ones forever (they never end by themselves)."""

    def submit(self, job_id: str, inputs: Sequence[InputRecord], *args: Any, **kwargs: Any) -> None:
        """Forward only jobs that carry inputs."""
        if inputs:
            super().submit(job_id, inputs, *args, **kwargs)


async def _poll(
    base: str, app: Any, store: Store, held: str, keys: dict[str, dict[str, str]], other: str
) -> tuple[dict[str, int], Any]:
    """150 waits on the held job, and the other tenant's wait; the held job is ended once all 150 wait."""
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=200)) as http:
        waits = [
            asyncio.ensure_future(http.get(f"/v1/jobs/{held}", params={"wait": 25}, headers=keys["poller"]))
            for _ in range(150)
        ]
        theirs = asyncio.ensure_future(_wait_end(http, other, keys["other"]))
        for _ in range(400):  # until every wait is registered (bounded)
            if context_of(app).announcements.waiting >= 150:
                break
            await asyncio.sleep(0.05)
        error = ErrorInfo(code="test_end", message="ended by the test")
        await asyncio.to_thread(store.jobs.finish, held, "failed", error=error)
        answers = await asyncio.gather(*waits)
        ended = await theirs
    statuses: dict[str, int] = {}
    for response in answers:
        assert response.status_code == 200, response.text
        status = response.json()["status"]
        statuses[status] = statuses.get(status, 0) + 1
    return statuses, ended


async def _wait_end(http: httpx.AsyncClient, job_id: str, auth: dict[str, str]) -> Any:
    job = (await http.get(f"/v1/jobs/{job_id}", headers=auth)).json()
    for _ in range(60):
        if job["status"] in ("succeeded", "degraded", "failed"):
            break
        job = (await http.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=auth)).json()
    return job


def test_a_stopped_store_is_a_503_and_service_returns_when_it_continues(one_at_a_time: Fleet) -> None:
    crew = one_at_a_time
    with crew.api(store_timeout_s=1.0) as api:
        first = api.post("/v1/jobs", data={"prompt": "before"}).json()["id"]
        assert _ended(api, first)["status"] == "succeeded"
        os.kill(crew.valkey.pid, signal.SIGSTOP)  # what a partition looks like: connections open, no answers
        try:
            read = api.get(f"/v1/jobs/{first}")
            submitted = api.post("/v1/jobs", data={"prompt": "during"})
            ready = api.get("/readyz")
        finally:
            os.kill(crew.valkey.pid, signal.SIGCONT)
        for response in (read, submitted):
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "broker_unavailable"
            assert "retry-after" in response.headers
        assert ready.status_code == 503
        assert ready.json()["store"] == "unreachable"
        assert api.get(f"/v1/jobs/{first}").json()["status"] == "succeeded"
        after = api.post("/v1/jobs", data={"prompt": "after"})
        assert after.status_code == 202
        assert _ended(api, after.json()["id"])["status"] == "succeeded"


def _ended(api: TestClient, job_id: str) -> Any:
    job = api.get(f"/v1/jobs/{job_id}").json()
    for _ in range(30):
        if job["status"] in ("succeeded", "degraded", "failed"):
            break
        job = api.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()
    return job


def test_a_stopped_broker_is_a_503_and_the_api_keeps_answering(store_redis: Any) -> None:
    valkey, port = start_embedded()
    settings = ApiSettings(auth=False, broker_url=f"redis://127.0.0.1:{port}/0", store_timeout_s=1.0)
    try:
        with TestClient(create_app(settings)) as api:
            assert api.post("/v1/jobs", data={"prompt": "before"}).status_code == 202
            os.kill(valkey.pid, signal.SIGSTOP)  # the broker alone hangs; the store answers
            try:
                submitted = api.post("/v1/jobs", data={"prompt": "during"})
                health = api.get("/healthz")
            finally:
                os.kill(valkey.pid, signal.SIGCONT)
            assert submitted.status_code == 503, submitted.text
            assert submitted.json()["error"]["code"] == "broker_unavailable"
            assert health.status_code == 200
            assert api.post("/v1/jobs", data={"prompt": "after"}).status_code == 202
    finally:
        stop(valkey, grace_s=10)


def test_a_nearly_full_store_refuses_new_jobs_with_503_until_memory_is_freed() -> None:
    import redis as redis_client

    valkey, port = start_embedded(maxmemory_mb=64)
    base = f"redis://127.0.0.1:{port}"
    store = redis_client.Redis.from_url(f"{base}/1")
    try:
        settings = ApiSettings(auth=False, broker_url=f"{base}/0", result_url=f"{base}/1", cache_url=f"{base}/2")
        with TestClient(create_app(settings, submitter=SpySubmitter(forward=False))) as api:
            assert api.post("/v1/jobs", data={"prompt": "room"}).status_code == 202
            for n in range(60):  # ~60 MiB of someone's data: past 90% of the 64 MiB the server may hold
                store.set(f"filler:{n}", b"x" * (1 << 20))

            def refused() -> bool:
                return api.post("/v1/jobs", data={"prompt": "full?"}).status_code == 503

            wait_for(refused, 15, "the API to see the store nearly full", [])
            answer = api.post("/v1/jobs", data={"prompt": "full"})
            assert answer.json()["error"]["code"] == "store_full"
            assert int(answer.headers["retry-after"]) >= 1
            store.delete(*(f"filler:{n}" for n in range(60)))
            wait_for(lambda: not refused(), 15, "the API to see the memory freed", [])
    finally:
        store.close()
        stop(valkey, grace_s=10)
