"""The job API a client can rely on: cancel a job, list a tenant's jobs (real workers, real tesseract), retry a
submission with its Idempotency-Key and get its one job back."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from kombu.connection import Connection

from api.app import create_app
from api.context import context_of
from api.intake import AcceptedRequest
from api.submission import submit_job
from stoker.adapters.broker import queue_depths
from stoker.adapters.store import Store
from stoker.adapters.store.jobs import LoopJobs, NewJob
from stoker.adapters.store.keys import ACTIVE_KEY, api_key_key, idempotency_key, tokens_key
from stoker.core.errors import Cancelled
from stoker.core.idempotency import Remembered, key_digest
from stoker.core.jobs import ErrorInfo, Job, new_job_id
from stoker.core.media import ContentHash
from stoker.core.tenancy import DEFAULT_TENANT, issue_key
from stoker.settings import ApiSettings
from tests.conftest import pids_named
from tests.fleet import Fleet, client_context
from tests.integration.conftest import SessionWorkers, SpySubmitter
from tests.media import text_image
from tests.serving import serve
from workers.broker import start_embedded
from workers.procs import stop, wait_for

TERMINAL = ("succeeded", "degraded", "failed", "cancelled")


@pytest.fixture
def job_store(store_redis: redis.Redis[bytes]) -> Store:
    """The test store, as the API and the workers see it."""
    return Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)


def _tenant(store: Store, name: str) -> dict[str, str]:
    """A fresh tenant's auth header."""
    issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
    store.tenants.put_api_key(issued.record)
    return {"Authorization": f"Bearer {issued.token}"}


@pytest.fixture
def api(workers: dict[str, Path], job_store: Store) -> Iterator[Callable[..., TestClient]]:
    """Makes APIs with auth on and generous limits, submitting to the real workers (or to `submitter`)."""
    opened: list[TestClient] = []

    def make(submitter: Any = None, **settings: Any) -> TestClient:
        limits = {"rate_limit_per_s": 1000.0, "rate_limit_burst": 1000, **settings}
        client = TestClient(create_app(ApiSettings(auth=True, **limits), submitter=submitter or SpySubmitter()))
        opened.append(client.__enter__())
        return client

    yield make
    for client in opened:
        client.__exit__(None, None, None)


def _wait(client: TestClient, job_id: str, auth: dict[str, str]) -> dict[str, Any]:
    for _ in range(10):
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=auth).json()
        if job["status"] in TERMINAL:
            return job
    raise AssertionError(f"job {job_id} not terminal: {job}")


#: A dense page: tesseract needs seconds for it, long enough to cancel while it reads.
SLOW_PAGE = text_image(
    "\n".join(" ".join(f"LINE{row}W{n}" for n in range(14)) for row in range(20)), size=(3000, 2200), font_size=40
)  # 20 dense lines: about 2 s of tesseract (one line of 60 words read in 0.6 s, shorter than a cancel's round trip)


def test_cancelling_a_job_while_its_ocr_runs(
    api: Callable[..., TestClient], job_store: Store, session_workers: SessionWorkers
) -> None:
    cpu_pid = session_workers.procs["cpu"].pid
    client = api(max_jobs_in_flight=1)
    auth = _tenant(job_store, "canceller")
    files = [("image", ("page.png", SLOW_PAGE, "image/png"))]
    job_id = client.post("/v1/jobs", data={"prompt": "Read it."}, files=files, headers=auth).json()["id"]
    wait_for(lambda: bool(pids_named("tesseract", cpu_pid)), 60, "its OCR to start", [])
    response = client.delete(f"/v1/jobs/{job_id}", headers=auth)
    assert response.status_code == 200, response.text
    cancelled = response.json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["error"]["code"] == "cancelled"
    # stopped, not left to finish
    wait_for(lambda: not pids_named("tesseract", cpu_pid), 10, "its tesseract to stop", [])
    second = client.post("/v1/jobs", data={"prompt": "Say hi."}, headers=auth)
    assert second.status_code == 202, second.text  # the one in-flight slot was given back
    assert _wait(client, second.json()["id"], auth)["status"] == "succeeded"
    job = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
    assert job["status"] == "cancelled"
    assert (job["result"], job["batch"]) == (None, None)  # never reached the model
    assert job["inputs"][0]["status"] == "pending"  # nothing half-written after the cancel
    assert job["inputs"][0]["bands"] == 3  # a dense page: OCR'd in bands, and none of them wrote after the cancel
    assert "infer_wait" not in job["timings_ms"]
    assert not job_store.client.exists(tokens_key(job_id))


def test_jobs_cancelled_behind_a_busy_queue_stay_cancelled(
    api: Callable[..., TestClient], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    from tasks.worker import app

    client = api(max_jobs_in_flight=10)
    auth = _tenant(job_store, "early-canceller")
    cpu = [name for reply in app.control.ping(timeout=1) for name in reply if name.startswith("cpu@")]
    drained = job_store.stats.drained().get("tokenize", 0)
    counted = job_store.stats.job_counts().get("cancelled", 0)
    small = [("image", ("note.png", text_image(f"EARLY {uuid.uuid4().hex[:6]}"), "image/png"))]
    # The CPU worker stops taking decode messages (Celery's own remote control): the jobs wait in a busy queue.
    assert app.control.cancel_consumer("decode", destination=cpu, reply=True)
    try:
        early = [
            client.post("/v1/jobs", data={"prompt": "Read."}, files=small, headers=auth).json()["id"] for _ in "abc"
        ]
        for job_id in early:
            response = client.delete(f"/v1/jobs/{job_id}", headers=auth)
            assert response.json()["status"] == "cancelled", response.text
    finally:
        app.control.add_consumer("decode", destination=cpu, reply=True)
    # Every job's messages are still taken and let go: its chord ends in a tokenize message that finds it ended.
    wait_for(lambda: job_store.stats.drained().get("tokenize", 0) >= drained + 3, 60, "the jobs' messages", [])
    for job_id in early:
        job = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
        assert job["status"] == "cancelled"
        assert (job["inputs"][0]["status"], job["inputs"][0]["timings_ms"]) == ("pending", {})  # no stage ran
        assert not store_redis.hexists(f"stoker:job:{job_id}", "ts:started")
        again = client.delete(f"/v1/jobs/{job_id}", headers=auth)
        assert again.status_code == 409, again.text
        assert again.json()["job"] == {"id": job_id, "status": "cancelled"}
    assert job_store.stats.job_counts().get("cancelled", 0) == counted + 3  # each counted once
    assert job_store.tenants.jobs_in_flight(job_store.jobs.tenant(early[0]) or "") == []  # every slot given back
    assert not any(store_redis.zscore(ACTIVE_KEY, job_id) for job_id in early)  # nothing left for the reaper


def test_cancelling_twice_is_409_and_another_tenants_cancel_is_404(
    api: Callable[..., TestClient], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    idle = SpySubmitter(forward=False)  # never runs: it stays cancellable
    client = api(submitter=idle)
    mine, theirs = _tenant(job_store, "owner"), _tenant(job_store, "stranger")
    # A picture no job sent before: it must be preprocessed, so the job stays queued (a text-only job may be
    # tokenized in the API and handed straight to inference).
    files = [("image", ("wait.png", text_image(f"WAIT {uuid.uuid4().hex[:6]}"), "image/png"))]
    job_id = client.post("/v1/jobs", data={"prompt": "Wait for me."}, files=files, headers=mine).json()["id"]
    try:
        other = client.delete(f"/v1/jobs/{job_id}", headers=theirs)
        assert other.status_code == 404
        assert other.json()["error"]["code"] == "job_not_found"
        assert client.get(f"/v1/jobs/{job_id}", headers=mine).json()["status"] == "queued"  # untouched
        assert client.delete(f"/v1/jobs/{job_id}", headers=mine).status_code == 200
        again = client.delete(f"/v1/jobs/{job_id}", headers=mine)
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "job_already_ended"
        assert again.json()["job"] == {"id": job_id, "status": "cancelled"}
    finally:
        store_redis.zrem(ACTIVE_KEY, job_id)


def test_a_job_cancelled_while_it_waits_for_the_device_never_reaches_it(one_at_a_time: Fleet) -> None:
    # One job at a time on a device that takes 1 s: the second waits for the device while the first runs.
    crew = one_at_a_time
    client = crew.client
    with crew.store() as store:
        before = int(store.hget("stoker:device", "batches") or 0), int(store.hget("stoker:device", "items") or 0)
        filler = client.post("/v1/jobs", data={"prompt": "Hold the device."}).json()["id"]
        wait_for(lambda: store.hexists(f"stoker:job:{filler}", "ts:infer_start"), 30, "the filler's batch", [])
        waiting = client.post("/v1/jobs", data={"prompt": "Cancel me."}).json()["id"]
        assert client.delete(f"/v1/jobs/{waiting}").json()["status"] == "cancelled"
        after = client.post("/v1/jobs", data={"prompt": "After."}).json()["id"]
        for job_id in (filler, after):  # in order: had the cancelled one run, it would have run before `after`
            assert _wait(client, job_id, {})["status"] == "succeeded"

        # The consumer counts a batch just after it writes the batch's results: wait until `after`'s is counted
        # (no batch is marked running any more, and at least the two batches are in).
        def counted() -> bool:
            device = store.hgetall("stoker:device")
            return b"running_since" not in device and int(device.get(b"batches", 0)) >= before[0] + 2

        wait_for(counted, 30, "the device's counters", [])
        device_items = int(store.hget("stoker:device", "items") or 0) - before[1]
    assert device_items == 2  # the filler and the one after: never the cancelled one
    job = client.get(f"/v1/jobs/{waiting}").json()
    assert (job["status"], job["result"], job["batch"]) == ("cancelled", None, None)


def test_a_tenants_list_pages_through_every_job_once_newest_first(
    api: Callable[..., TestClient], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    client = api(submitter=SpySubmitter(forward=False))
    mine, theirs = _tenant(job_store, "lister"), _tenant(job_store, "neighbour")
    ids = [client.post("/v1/jobs", data={"prompt": f"Job {n}."}, headers=mine).json()["id"] for n in range(7)]
    ids_theirs = [client.post("/v1/jobs", data={"prompt": "Not yours."}, headers=theirs).json()["id"]]
    try:
        seen, cursor, pages = [], None, 0
        while True:
            params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
            page = client.get("/v1/jobs", params=params, headers=mine).json()
            seen += [job["id"] for job in page["data"]]
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids[::-1]  # every job once, newest first, nobody else's
        assert pages == 3
        for job_id in ids[:2]:
            client.delete(f"/v1/jobs/{job_id}", headers=mine)
        only = client.get("/v1/jobs", params={"status": "cancelled"}, headers=mine).json()
        assert [job["id"] for job in only["data"]] == ids[1::-1]
        assert only["next_cursor"] is None
        bad = client.get("/v1/jobs", params={"cursor": "not-a-cursor"}, headers=mine)
        assert bad.status_code == 422
        assert bad.json()["error"]["param"] == "cursor"
        assert client.get("/v1/jobs", params={"status": "lost"}, headers=mine).status_code == 422
    finally:
        for job_id in ids:
            client.delete(f"/v1/jobs/{job_id}", headers=mine)
        for job_id in ids_theirs:
            client.delete(f"/v1/jobs/{job_id}", headers=theirs)
        store_redis.zrem(ACTIVE_KEY, *ids, *ids_theirs)


def test_twenty_concurrent_posts_with_one_key_make_one_job(
    workers: dict[str, Path], job_store: Store, store_redis: redis.Redis[bytes]
) -> None:
    auth = _tenant(job_store, "retrier")
    spy = SpySubmitter(forward=False)  # what is enqueued is what counts: the job never runs
    settings = ApiSettings(auth=True, rate_limit_per_s=1000.0, rate_limit_burst=1000, max_jobs_in_flight=50)
    image = text_image(f"ONCE {uuid.uuid4().hex[:6]}")
    key = {**auth, "Idempotency-Key": str(uuid.uuid4())}
    with serve(create_app(settings, submitter=spy)) as base:

        def post(_: int) -> httpx.Response:
            files = [("image", ("scan.png", image, "image/png"))]
            return httpx.post(f"{base}/v1/jobs", data={"prompt": "Read it."}, files=files, headers=key, timeout=60)

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(post, range(20)))
        as_json = {"prompt": "Read it.", "inputs": [{"kind": "image", "data": base64.b64encode(image).decode()}]}
        same_in_json = httpx.post(f"{base}/v1/jobs", json=as_json, headers=key, timeout=60)
        other = httpx.post(f"{base}/v1/jobs", data={"prompt": "Something else."}, headers=key, timeout=60)
        bad_key = httpx.post(f"{base}/v1/jobs", data={"prompt": "x"}, headers={**auth, "Idempotency-Key": "a b"})
    try:
        assert sorted(a.status_code for a in answers) == [200] * 19 + [202], [a.text for a in answers]
        assert len({a.json()["id"] for a in answers}) == 1
        job_id = answers[0].json()["id"]
        replayed = [a for a in answers if a.headers.get("idempotent-replayed") == "true"]
        assert len(replayed) == 19
        assert [job for job, _ in spy.calls] == [job_id]  # one job enqueued
        assert job_store.tenants.jobs_in_flight(job_store.jobs.tenant(job_id) or "") == [job_id]  # one slot
        # The same request in another encoding is the same request; another request is refused.
        assert (same_in_json.status_code, same_in_json.json()["id"]) == (200, job_id)
        assert other.status_code == 422
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        assert bad_key.status_code == 422
        assert bad_key.json()["error"]["param"] == "Idempotency-Key"
    finally:
        for job_id in {a.json().get("id") for a in answers} - {None}:
            job_store.jobs.finish(job_id, "cancelled")  # never run: end it, giving its slot back
            store_redis.zrem(ACTIVE_KEY, job_id)


@dataclass
class OwnValkey:
    """A Valkey of a test's own, as broker (db 0), store (db 1) and cache (db 2) of the APIs it makes: what its
    server counts is those APIs' doing alone, and nothing they leave behind reaches the session's workers."""

    base: str
    store: Store

    def settings(self, **values: Any) -> ApiSettings:
        """API settings over this Valkey."""
        base = self.base
        return ApiSettings(broker_url=f"{base}/0", result_url=f"{base}/1", cache_url=f"{base}/2", **values)

    def calls(self) -> int:
        """Every command the server has run so far (`INFO commandstats`)."""
        stats = self.store.client.info("commandstats")
        return sum(int(entry["calls"]) for entry in stats.values())


@pytest.fixture
def own_valkey() -> Iterator[OwnValkey]:
    """A fresh Valkey for one test."""
    valkey, port = start_embedded()
    base = f"redis://127.0.0.1:{port}"
    client = redis.Redis.from_url(f"{base}/1")
    try:
        yield OwnValkey(base, Store.over(client, blob_ttl_s=3600, job_ttl_s=3600))
    finally:
        client.close()
        stop(valkey, grace_s=10)


def _slow_json(body: bytes, arrived: threading.Event) -> Iterator[bytes]:
    """A JSON body whose first bytes come at once and the rest once `arrived` is set: an upload still going on."""
    yield body[:5]
    arrived.wait(60)
    yield body[5:]


@contextlib.contextmanager
def _commands_naming(valkey: OwnValkey, needle: str) -> Iterator[list[str]]:
    """The commands clients send the server during the block that name `needle` (Redis's `MONITOR`; a script's
    own commands left out), in order, once the block ends."""
    seen: list[str] = []
    end = f"end-{uuid.uuid4().hex}"
    with valkey.store.client.monitor() as monitor:

        def watch() -> None:
            while end not in (entry := monitor.next_command())["command"]:
                if entry["client_type"] != "lua" and needle in entry["command"]:
                    seen.append(entry["command"].split()[0].upper())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            valkey.store.client.ping()  # a command sent once MONITOR is on: the watch sees what follows
            yield seen
        finally:
            valkey.store.client.echo(end)
            watcher.join(10)


def test_a_key_read_once_is_then_checked_and_counted_in_one_round_trip(own_valkey: OwnValkey) -> None:
    # Three requests at once, then one every 20 s: which requests were counted shows in which are refused.
    settings = own_valkey.settings(auth=True, rate_limit_per_s=0.05, rate_limit_burst=3)
    auth = _tenant(own_valkey.store, "known")
    key_id = auth["Authorization"].split("_")[1]
    wrong = {"Authorization": f"Bearer stk_{key_id}_{'x' * 43}"}
    with TestClient(create_app(settings, submitter=SpySubmitter(forward=False))) as client:
        with _commands_naming(own_valkey, key_id) as first:
            assert client.get("/v1/models", headers=auth).status_code == 200  # the key's record read, then counted
        with _commands_naming(own_valkey, key_id) as later:
            assert client.get("/v1/models", headers=wrong).status_code == 401  # another secret: nothing counted
            assert client.get("/v1/models", headers=auth).status_code == 200
            assert client.get("/v1/models", headers=auth).status_code == 200  # the third of the burst of three
            refused = client.get("/v1/models", headers=auth)
        assert refused.status_code == 429, refused.text
        assert first == ["HGETALL"]
        assert later == ["EVALSHA"] * 4  # the record checked by the script that counts: one round trip each
        own_valkey.store.tenants.revoke_api_key(key_id)
        assert client.get("/v1/models", headers=auth).status_code == 401  # a revoked key at its next request
        own_valkey.store.client.delete(api_key_key(key_id))
        assert client.get("/v1/models", headers=auth).status_code == 401  # and one whose record is gone


def test_replays_count_against_the_rate_but_take_no_slot_and_pass_queue_pressure(own_valkey: OwnValkey) -> None:
    spy = SpySubmitter(forward=False)
    # Three requests at once, then one every 20 s; one job in flight; a CPU queue of two messages is full.
    settings = own_valkey.settings(
        auth=True, rate_limit_per_s=0.05, rate_limit_burst=3, max_jobs_in_flight=1, cpu_queue_limit=2
    )
    auth = _tenant(own_valkey.store, "replayer")
    keyed = {**auth, "Idempotency-Key": str(uuid.uuid4())}
    with TestClient(create_app(settings, submitter=spy)) as client:
        first = client.post("/v1/jobs", data={"prompt": "Once."}, headers=keyed)
        assert first.status_code == 202, first.text
        with redis.Redis.from_url(settings.broker_url) as broker:
            broker.lpush("decode", "a", "b")  # the queue at its limit: new jobs are refused
        monitor = client_context(client).monitor
        wait_for(lambda: monitor.refusal() is not None, 10, "queue pressure", [])
        new = client.post("/v1/jobs", data={"prompt": "Another."}, headers=auth)
        assert (new.status_code, new.json()["error"]["code"]) == (429, "overloaded"), new.text
        replays = [client.post("/v1/jobs", data={"prompt": "Once."}, headers=keyed) for _ in range(3)]
    # The first request and two replays are the burst of three: neither the slot the job holds nor the full queue
    # turns a replay away, the tenant's rate does.
    assert [r.status_code for r in replays] == [200, 200, 429], [r.text for r in replays]
    assert {r.json()["id"] for r in replays[:2]} == {first.json()["id"]}
    assert replays[2].json()["error"]["code"] == "rate_limited"
    assert int(replays[2].headers["retry-after"]) >= 1
    assert [job for job, _ in spy.calls] == [first.json()["id"]]


def test_a_post_whose_wait_runs_out_answers_202_and_its_replay_waits_on_the_same_job(own_valkey: OwnValkey) -> None:
    spy = SpySubmitter(forward=False)  # nothing runs the job: the wait can only run out
    keyed = {"Idempotency-Key": str(uuid.uuid4())}
    with TestClient(create_app(own_valkey.settings(auth=False), submitter=spy)) as client:
        response = client.post("/v1/jobs", params={"wait": 0.3}, data={"prompt": "Nobody runs me."}, headers=keyed)
        # The same key again: the first request's job, waited on from a read of its own
        replay = client.post("/v1/jobs", params={"wait": 0.3}, data={"prompt": "Nobody runs me."}, headers=keyed)
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "queued"
    assert response.headers["location"] == f"/v1/jobs/{response.json()['id']}"
    assert [job_id for job_id, _ in spy.calls] == [response.json()["id"]]
    assert (replay.status_code, replay.headers["idempotent-replayed"]) == (200, "true"), replay.text
    assert (replay.json()["id"], replay.json()["status"]) == (response.json()["id"], "queued")


class _EndingSubmitter(SpySubmitter):
    """Ends each job as soon as it is enqueued: a device faster than the API's read of the job it just made."""

    def __init__(self, store: Store) -> None:
        super().__init__(forward=False)
        self.store = store

    def submit(self, job_id: str, inputs: Any, *args: Any, **kwargs: Any) -> None:
        super().submit(job_id, inputs, *args, **kwargs)
        ended = ErrorInfo(**Cancelled("ended at once", stage="api").to_dict())
        self.store.jobs.finish(job_id, "cancelled", error=ended)


def test_a_job_that_ends_before_its_post_is_answered_is_202_unless_the_post_waited(own_valkey: OwnValkey) -> None:
    # 200 is the answer to a POST that asked to wait for the job's end (?wait=S), not to a fast job. A POST that
    # did not wait answers the job as it was accepted (read back with its record); a read after shows its end.
    app = create_app(own_valkey.settings(auth=False), submitter=_EndingSubmitter(own_valkey.store))
    with TestClient(app) as client:
        unwaited = client.post("/v1/jobs", data={"prompt": "Over before it is answered."})
        waited = client.post("/v1/jobs", params={"wait": 5}, data={"prompt": "Over before it is answered."})
        later = client.get(unwaited.headers["location"])
    assert (unwaited.status_code, unwaited.json()["status"]) == (202, "queued"), unwaited.text
    assert later.json()["status"] == "cancelled", later.text
    assert (waited.status_code, waited.json()["status"]) == (200, "cancelled"), waited.text


def test_a_waiter_answers_from_the_announcement_of_its_jobs_end_without_reading_the_job(
    own_valkey: OwnValkey, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The end of a job someone waits on is announced with its ended record: the waiter answers from it, where it
    # used to read the job again (a thread hop and a round trip per waited job). A read after finds the same job.
    app = create_app(own_valkey.settings(auth=False), submitter=_EndingSubmitter(own_valkey.store))
    context = context_of(app)
    reads: list[str] = []
    load_job = LoopJobs.load_job

    async def counted(self: LoopJobs, job_id: str) -> Job | None:
        reads.append(job_id)
        return await load_job(self, job_id)

    monkeypatch.setattr(LoopJobs, "load_job", counted)
    with TestClient(app) as client:
        wait_for(lambda: context.announcements.listening, 10, "the announcement listener", [])
        waited = client.post("/v1/jobs", params={"wait": 30}, data={"prompt": "Over before it is answered."})
        assert reads == []
        assert (waited.status_code, waited.json()["status"]) == (200, "cancelled"), waited.text
        read = client.get(waited.headers["location"])
    assert reads == [waited.json()["id"]]  # the GET's, only
    assert read.json() == waited.json()


def test_publishing_a_job_subscribes_the_api_to_no_result_channel(own_valkey: OwnValkey) -> None:
    # The API never waits on a Celery result: Celery's Redis backend subscribed it to each published task's
    # result channel (and unsubscribed again), two commands per job for nothing; and once a job with media had
    # published a chord, it unsubscribed for every job after (a round trip per job).
    def subscribes() -> int:
        stats = own_valkey.store.client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{verb}", {}).get("calls", 0)) for verb in ("subscribe", "unsubscribe"))

    with TestClient(create_app(own_valkey.settings(auth=False))) as client:
        before = subscribes()
        image = {"image": ("page.png", text_image("a chord of stages"), "image/png")}
        posted = [client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=image)]
        posted += [client.post("/v1/jobs", data={"prompt": f"Question {n}."}) for n in range(5)]
        assert [p.status_code for p in posted] == [202] * 6, [p.text for p in posted]
        with Connection(f"{own_valkey.base}/0") as broker:  # type: ignore[no-untyped-call]  # kombu is unannotated
            assert sum(queue_depths(broker).values()) == 6  # published, to queues nobody here consumes
        assert subscribes() == before


def test_a_first_request_slower_than_its_claim_keeps_the_key_to_one_job(own_valkey: OwnValkey) -> None:
    spy = SpySubmitter(forward=False)
    app = create_app(own_valkey.settings(auth=False, idempotency_claim_s=1), submitter=spy)
    key = str(uuid.uuid4())
    claim = idempotency_key(key_digest(DEFAULT_TENANT, key))
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    body = json.dumps({"prompt": "Slow to arrive."}).encode()
    arrived = threading.Event()
    with serve(app) as base, ThreadPoolExecutor(2) as pool:
        url = f"{base}/v1/jobs"
        first = pool.submit(httpx.post, url, content=_slow_json(body, arrived), headers=headers, timeout=60)
        wait_for(lambda: bool(own_valkey.store.client.exists(claim)), 10, "the first request's claim", [])
        time.sleep(2.5)  # the first request's body is still arriving two and a half claim lifetimes later
        second = pool.submit(httpx.post, url, content=body, headers=headers, timeout=60)
        announcements = context_of(app).announcements
        wait_for(lambda: second.done() or announcements.waiting > 0, 10, "the second request to wait", [])
        arrived.set()
        answers = [first.result(), second.result()]
    assert [a.status_code for a in answers] == [202, 200], [a.text for a in answers]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert len(spy.calls) == 1  # one job for the key


def test_requests_waiting_behind_a_slow_first_barely_touch_redis(own_valkey: OwnValkey) -> None:
    spy = SpySubmitter(forward=False)
    app = create_app(own_valkey.settings(auth=False), submitter=spy)
    key, waiters, window_s = str(uuid.uuid4()), 10, 2.5
    claim = idempotency_key(key_digest(DEFAULT_TENANT, key))
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    body = json.dumps({"prompt": "Wait for me."}).encode()
    arrived = threading.Event()

    def calls_per_s() -> float:  # the API's Redis calls per second over the window
        before, started = own_valkey.calls(), time.monotonic()
        time.sleep(window_s)
        return (own_valkey.calls() - before) / (time.monotonic() - started)

    with serve(app) as base, ThreadPoolExecutor(waiters + 1) as pool:
        url = f"{base}/v1/jobs"
        first = pool.submit(httpx.post, url, content=_slow_json(body, arrived), headers=headers, timeout=60)
        wait_for(lambda: bool(own_valkey.store.client.exists(claim)), 10, "the first request's claim", [])
        alone = calls_per_s()  # the API's own background (queue monitor, the claim's renewal) with nobody waiting
        retries = [pool.submit(httpx.post, url, content=body, headers=headers, timeout=60) for _ in range(waiters)]
        busy = calls_per_s()
        arrived.set()
        answers = [first.result(), *(r.result() for r in retries)]
    assert [a.status_code for a in answers] == [202] + [200] * waiters, [a.text for a in answers]
    assert {a.json()["id"] for a in answers} == {answers[0].json()["id"]}
    per_waiter_s = (busy - alone) / waiters
    # Polling every 20 ms made about 80 calls per waiting second; announcements and a 1 s fallback look make 2.
    assert per_waiter_s < 8, f"{per_waiter_s:.1f} Redis calls per waiter per second ({alone:.0f}/s with none)"


def test_only_the_holder_of_a_claim_renews_it(job_store: Store) -> None:
    keys, digest = job_store.idempotency, key_digest(DEFAULT_TENANT, str(uuid.uuid4()))
    stored = idempotency_key(digest)
    assert keys.claim(digest, "first", ttl_s=5) is None
    assert keys.claim(digest, "second", ttl_s=5) == "first"  # held: what the second gets is the first's claim
    assert not keys.renew(digest, "second", ttl_s=100)
    assert job_store.client.ttl(stored) <= 5  # another request's renewal extends nothing
    assert keys.renew(digest, "first", ttl_s=100)
    assert job_store.client.ttl(stored) > 5
    assert keys.remember(digest, Remembered("first", "request"), ttl_s=200)
    assert not keys.renew(digest, "first", ttl_s=100)  # settled: nothing left to renew
    assert keys.claim(digest, "third", ttl_s=5) == Remembered("first", "request")
    job_store.client.delete(stored)


def test_the_store_lets_go_of_every_upload_once_its_jobs_end(api: Callable[..., TestClient], job_store: Store) -> None:
    client = api()
    auth = _tenant(job_store, "uploader")
    pictures = [text_image(f"KEEP {uuid.uuid4().hex[:6]}") for _ in "ab"]
    ids = []
    for picture in (pictures[0], pictures[0], pictures[1]):  # two jobs share one picture
        files = [("image", ("scan.png", picture, "image/png"))]
        ids.append(client.post("/v1/jobs", data={"prompt": "Read it."}, files=files, headers=auth).json()["id"])
    jobs = [_wait(client, job_id, auth) for job_id in ids]
    assert [job["status"] for job in jobs] == ["succeeded"] * 3, jobs
    digests = {job["inputs"][0]["content_hash"] for job in jobs}
    assert len(digests) == 2
    for digest in digests:
        assert job_store.blobs.get_blob(ContentHash(digest)) is None
        assert job_store.blobs.holders(ContentHash(digest)) == set()
    assert job_store.tenants.usage(job_store.jobs.tenant(ids[0]) or "").stored_bytes == 0


def test_a_submission_cancelled_while_its_job_is_written_still_sends_its_message(
    own_valkey: OwnValkey, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The API makes a job on its loop: a request cancelled meanwhile (its server stopping) must still make the job
    # whole, its record and its first message, never a record whose message was never sent.
    spy = SpySubmitter(forward=False)
    context = context_of(create_app(own_valkey.settings(auth=False), submitter=spy))
    create = LoopJobs.create

    async def scenario() -> str:
        writing, go_on = asyncio.Event(), asyncio.Event()

        async def slow_create(self: LoopJobs, job_id: str, new: NewJob) -> Job:
            writing.set()
            await go_on.wait()
            return await create(self, job_id, new)

        monkeypatch.setattr(LoopJobs, "create", slow_create)
        job_id = new_job_id()
        accepted = AcceptedRequest("Cancelled while written.", [], 60_000)

        async def read() -> AcceptedRequest:
            return accepted

        submission = asyncio.create_task(submit_job(context, DEFAULT_TENANT, None, read, job_id=job_id))
        await writing.wait()
        submission.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submission
        go_on.set()
        for _ in range(200):  # until the shielded write and send are through (bounded)
            if job_id in spy.starts:
                break
            await asyncio.sleep(0.01)
        await context.loop.aclose()
        return job_id

    job_id = asyncio.run(scenario())
    assert spy.starts == {job_id: "preprocess"}  # this app has not loaded the tokenizer: the tokenize stage's
    made = own_valkey.store.jobs.load_job(job_id)
    assert made is not None
    assert made.status == "queued"
