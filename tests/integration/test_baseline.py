"""The synchronous baseline (`STOKER_PIPELINE_MODE=sync`, the benchmark's "before"): one `stoker worker sync`
runs every stage of a job inline, in its one thread, then the model; the results match the pipeline's."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kombu.asynchronous import Hub
from kombu.connection import Connection
from kombu.entity import Queue
from kombu.messaging import Consumer

from stoker.adapters.broker import queue_depths, transport_options
from stoker.adapters.kombu_redis import REDIS_TRANSPORT
from stoker.core.queues import SYNC_QUEUE
from tests.conftest import queued
from tests.fleet import Fleet, own_fleet
from tests.integration.test_pipeline import _wait
from tests.media import text_image, truncated
from workers.broker import start_embedded

SYNC = {"STOKER_PIPELINE_MODE": "sync", "STOKER_BACKEND": "sim", "STOKER_SIM_BASE_MS": "50"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with own_fleet(SYNC, kinds=("sync",), api={"pipeline_mode": "sync"}) as crew:
        yield crew


def test_one_worker_reads_the_image_and_answers(fleet: Fleet) -> None:
    files = [("image", ("page.png", text_image("BASELINE"), "image/png"))]
    response = fleet.client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files)
    assert response.status_code == 202, response.text
    job = _wait(fleet.client, response.json()["id"])
    assert job["status"] == "succeeded", job
    assert "BASELINE" in job["inputs"][0]["text"].upper()
    assert {"decode", "ocr"} <= set(job["inputs"][0]["timings_ms"])
    assert not any(k.endswith("_queue") for k in job["inputs"][0]["timings_ms"])  # no stage went through a queue
    assert job["batch"]["size"] >= 1
    assert queued(fleet.store(), "decode") == queued(fleet.store(), "infer") == 0


def test_a_corrupt_image_degrades_the_job_and_the_next_job_is_served(fleet: Fleet) -> None:
    bad = [("image", ("scan.jpg", truncated(text_image("LOST", fmt="JPEG")), "image/jpeg"))]
    first = fleet.client.post("/v1/jobs", data={"prompt": "Read it"}, files=bad).json()["id"]
    second = fleet.client.post("/v1/jobs", data={"prompt": "Say hello"}).json()["id"]
    job = _wait(fleet.client, first)
    assert job["status"] == "degraded", job
    assert job["inputs"][0]["error"]["code"] == "image_corrupt"
    assert job["result"]["text"]
    assert _wait(fleet.client, second)["status"] == "succeeded"


def test_the_api_watches_the_sync_queue(fleet: Fleet) -> None:
    stats = fleet.client.get("/v1/stats").json()
    assert "sync" in stats["queues"]
    assert stats["drained"].get("sync", 0) >= 1


def test_a_backlog_is_taken_in_full_batches() -> None:
    """Jobs that queued while the worker's one thread ran a batch reach its receiver a few per tick of the
    consumer's loop; the next batch waits for those the broker still holds, up to a full batch."""
    # A fill bound far above what 32 messages take to arrive, so a busy host cannot cut the batch short.
    settings = {
        **SYNC,
        "STOKER_SIM_BASE_MS": "1500",
        "STOKER_MAX_BATCH_SIZE": "32",
        "STOKER_SYNC_BACKLOG_FILL_MS": "2000",
    }
    with own_fleet(settings, kinds=("sync",), api={"pipeline_mode": "sync"}) as crew:
        first = crew.client.post("/v1/jobs", data={"prompt": "First."}).json()["id"]
        _until_inferring(crew.client, first)  # its batch holds the worker's thread for 1.5 s
        backlog = [crew.client.post("/v1/jobs", data={"prompt": f"Job {n}."}).json()["id"] for n in range(48)]
        assert crew.client.get(f"/v1/jobs/{first}").json()["status"] == "inferring"  # all 48 queued behind it
        sizes = Counter(_wait(crew.client, job_id)["batch"]["size"] for job_id in backlog)
    assert sizes == {32: 32, 16: 16}


def test_a_message_the_consumer_took_and_has_not_read_is_seen() -> None:
    """The receiver waits for a backlog while the queue's depth counts it; kombu's BRPOP takes each message off the
    queue before the consumer's event loop reads it, so the last one is counted by neither the depth nor the
    receiver: `unread_brpop` and `reply_waits` see it (kombu's Redis transport, as the baseline mirrors it)."""
    from stoker.adapters.kombu_redis import reply_waits, unread_brpop

    server, port = start_embedded(persist=False)
    url = f"redis://127.0.0.1:{port}/0"
    options = transport_options(url, 3600)
    try:
        # kombu is unannotated: its calls here are marked as untyped ones.
        with (
            Connection(url, transport=REDIS_TRANSPORT, transport_options=options) as consuming,  # type: ignore[no-untyped-call]
            Connection(url, transport=REDIS_TRANSPORT, transport_options=options) as looking,  # type: ignore[no-untyped-call]
            closing(Hub()) as hub,  # type: ignore[no-untyped-call]
        ):
            consuming.transport.register_with_event_loop(consuming.connection, hub)
            consumer, delivered = SimpleNamespace(connection=consuming), []

            def deliver(body: Any, message: Any) -> None:
                delivered.append(body)
                message.ack()

            with Consumer(consuming.default_channel, [Queue(SYNC_QUEUE)], callbacks=[deliver]):  # type: ignore[no-untyped-call]
                assert unread_brpop(consumer, SYNC_QUEUE) is None  # the loop has not run: no BRPOP sent
                for tick in list(hub.on_tick):  # the start of the loop's round: it sends the BRPOP
                    tick()
                sock = unread_brpop(consumer, SYNC_QUEUE)
                assert sock is not None
                assert not reply_waits(sock)  # blocked on the empty queue
                looking.Producer().publish({"n": 1}, routing_key=SYNC_QUEUE)
                _until(lambda: queue_depths(looking, [SYNC_QUEUE])[SYNC_QUEUE] == 0, "the BRPOP never took it")
                assert reply_waits(sock)  # off the queue, not yet read: in flight
                assert not delivered
                _until(lambda: hub.run_once() or delivered, "the event loop never read it")  # type: ignore[no-untyped-call]
                assert delivered == [{"n": 1}]
                assert unread_brpop(consumer, SYNC_QUEUE) is None  # read: nothing in flight
    finally:
        server.kill()
        server.wait(10)


def _until(condition: Any, failure: str, timeout_s: float = 10.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, failure
        time.sleep(0.01)


def _until_inferring(client: TestClient, job_id: str, timeout_s: float = 30.0) -> None:
    give_up = time.monotonic() + timeout_s
    while client.get(f"/v1/jobs/{job_id}").json()["status"] != "inferring":
        assert time.monotonic() < give_up, "the first job never reached the device"
        time.sleep(0.01)
