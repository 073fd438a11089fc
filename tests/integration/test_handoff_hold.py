"""Jobs held for a full inference queue are not overtaken: while one is held, every later producer (another
tokenize, the API's own hand-off) waits for the low watermark too. Over a real Redis (store and broker), with the
inference queue's depth set by hand."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from typing import TypedDict

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.pressure import QueueMonitor
from stoker.adapters.store import Store
from stoker.adapters.store.keys import HANDOFF_HOLD_KEY
from stoker.core.jobs import Job
from stoker.runtime.context import WorkerContext
from stoker.runtime.handoff import wait_for_room
from stoker.settings import ApiSettings, WorkerSettings
from tests.fleet import client_context
from tests.integration.conftest import SpySubmitter
from workers.procs import wait_for

#: A database of the test Redis no worker of the suite reads: the broker's inference list is junk here.
SCRATCH_DB = 8
HIGH, LOW = 4, 2


class Watermarks(TypedDict):
    """The inference queue's watermarks, as settings of the API and the workers alike."""

    infer_high_watermark: int
    infer_low_watermark: int


class ListOutbox:
    """The inference queue's depth as the broker holds it (the list a test fills), and who looked at it."""

    def __init__(self, broker: redis.Redis[bytes]) -> None:
        self.broker = broker
        self.looks: dict[str, int] = {}
        self._lock = threading.Lock()

    def queue_depths(self, queues: Iterable[str], timeout_s: float | None = None) -> dict[str, int]:
        with self._lock:
            name = threading.current_thread().name
            self.looks[name] = self.looks.get(name, 0) + 1
        return {queue: int(self.broker.llen(queue)) for queue in queues}

    def enqueue_inference(self, job_id: str, prompt_tokens: int | None, deadline: float | None, *_: str) -> None:
        raise AssertionError("waiting for room sends nothing")

    def send_callback(self, job_id: str) -> None:
        raise AssertionError("no job ends here")

    def resubmit(self, job: Job, deadline: float | None) -> None:
        raise AssertionError("no job is sent again here")

    def promote_aged(self, queues: Iterable[str], max_age_s: float) -> int:
        raise AssertionError("nothing is promoted here")


def _scratch_url() -> str:
    return f"{os.environ['STOKER_TEST_REDIS']}/{SCRATCH_DB}"


@pytest.fixture
def scratch() -> Iterator[redis.Redis[bytes]]:
    client = redis.Redis.from_url(_scratch_url())
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _depth(broker: redis.Redis[bytes], depth: int) -> None:
    """Set the inference queue's depth: junk entries only the depth readers see."""
    with broker.pipeline() as pipe:
        pipe.delete("infer")
        if depth:
            pipe.rpush("infer", *[b"x"] * depth)
        pipe.execute()


def _holder(ctx: WorkerContext, name: str, done: list[str]) -> threading.Thread:
    def run() -> None:
        wait_for_room(ctx, name, None)
        done.append(name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def test_a_held_job_is_not_overtaken_by_later_ones_that_find_the_queue_between_its_watermarks(
    scratch: redis.Redis[bytes],
) -> None:
    url = _scratch_url()
    store = Store.over(scratch, blob_ttl_s=60, job_ttl_s=60)
    marks: Watermarks = {"infer_high_watermark": HIGH, "infer_low_watermark": LOW}
    outbox = ListOutbox(scratch)
    ctx = WorkerContext(WorkerSettings(**marks, handoff_max_wait_s=60), outbox, store=store)
    monitor = QueueMonitor(ApiSettings(**marks, broker_url=url), store)
    done: list[str] = []
    try:
        _depth(scratch, HIGH + 1)
        first = _holder(ctx, "first", done)
        wait_for(store.handoff_hold.held, 10, "the first job's hold", [])
        _depth(scratch, LOW + 1)  # the device took some: under the high watermark, above the low
        monitor.sample()
        assert not monitor.room_for_inference()  # the API sends its next job behind the held one
        later = _holder(ctx, "later", done)
        wait_for(lambda: outbox.looks.get("later", 0) >= 3, 10, "the later job's looks", [])
        assert later.is_alive()
        assert first.is_alive()
        assert done == []
        _depth(scratch, LOW)
        first.join(10)
        later.join(10)
        assert sorted(done) == ["first", "later"]
        assert not store.handoff_hold.held()  # released at the low watermark
        _depth(scratch, LOW + 1)
        monitor.sample()
        assert monitor.room_for_inference()  # nobody held: between the watermarks is room again
        _depth(scratch, HIGH)
        monitor.sample()
        assert monitor.room_for_inference()  # at the high watermark, as tokenize's hand-off finds it
        _depth(scratch, HIGH + 1)
        monitor.sample()
        assert not monitor.room_for_inference()  # above it: through tokenize
    finally:
        monitor.close()


def test_the_first_held_job_to_go_in_leaves_the_hold_on_for_those_still_held(scratch: redis.Redis[bytes]) -> None:
    """Two jobs held: the first goes in (the device took one: the queue at its low watermark, then above it again
    with that job); the API still sends its next job behind the second until that one has gone in too."""
    url = _scratch_url()
    store = Store.over(scratch, blob_ttl_s=60, job_ttl_s=60)
    marks: Watermarks = {"infer_high_watermark": HIGH, "infer_low_watermark": LOW}
    monitor = QueueMonitor(ApiSettings(**marks, broker_url=url), store)
    hold = store.handoff_hold
    try:
        hold.hold("first", 30)
        hold.hold("second", 30)
        hold.release("first")
        _depth(scratch, LOW + 1)
        monitor.sample()
        assert not monitor.room_for_inference()
        hold.release("second")
        monitor.sample()
        assert monitor.room_for_inference()
    finally:
        monitor.close()


def test_the_hold_of_a_holder_that_died_lapses_on_its_own(scratch: redis.Redis[bytes]) -> None:
    hold = Store.over(scratch, blob_ttl_s=60, job_ttl_s=60).handoff_hold
    hold.hold("died", 0.3)
    hold.hold("alive", 30)
    hold.release("alive")
    assert hold.held()
    wait_for(lambda: not hold.held(), 5, "the hold to lapse", [])


def test_a_short_hold_after_a_long_one_leaves_the_long_one_standing(scratch: redis.Redis[bytes]) -> None:
    hold = Store.over(scratch, blob_ttl_s=60, job_ttl_s=60).handoff_hold
    hold.hold("long", 30)
    hold.hold("short", 0.3)

    def short_lapsed() -> bool:
        still_held = hold.held()  # a look drops the lapsed holders
        return still_held and scratch.zscore(HANDOFF_HOLD_KEY, "short") is None

    wait_for(short_lapsed, 5, "the short hold to lapse, the long one standing", [])
    assert scratch.zscore(HANDOFF_HOLD_KEY, "long") is not None


def test_a_batch_line_held_for_the_queue_holds_no_interactive_job_back(scratch: redis.Redis[bytes]) -> None:
    store = Store.over(scratch, blob_ttl_s=60, job_ttl_s=60)
    settings = WorkerSettings(infer_high_watermark=HIGH, infer_low_watermark=LOW, handoff_max_wait_s=60)
    outbox = ListOutbox(scratch)
    _depth(scratch, HIGH + 1)
    ctx = WorkerContext(settings, outbox, store=store)
    done: list[str] = []
    thread = threading.Thread(
        target=lambda: done.append(str(wait_for_room(ctx, "b", None, "batch"))), name="line", daemon=True
    )
    thread.start()
    wait_for(lambda: outbox.looks.get("line", 0) >= 3, 10, "the batch line's looks", [])
    assert thread.is_alive()
    assert not store.handoff_hold.held()
    _depth(scratch, LOW)
    thread.join(10)
    assert len(done) == 1


def test_stats_show_operators_when_jobs_are_held(scratch: redis.Redis[bytes]) -> None:
    url = _scratch_url()
    marks: Watermarks = {"infer_high_watermark": HIGH, "infer_low_watermark": LOW}
    settings = ApiSettings(**marks, broker_url=url, result_url=url, cache_url=url)
    hold = Store.over(scratch, blob_ttl_s=60, job_ttl_s=60).handoff_hold
    with TestClient(create_app(settings, submitter=SpySubmitter(forward=False))) as client:
        _depth(scratch, LOW + 1)
        free = client.get("/v1/stats").json()["infer_watermarks"]
        hold.hold("a-job", 30)
        client_context(client).monitor.sample()
        held = client.get("/v1/stats").json()["infer_watermarks"]
    assert free == {"high": HIGH, "low": LOW, "held": False}
    assert held == {"high": HIGH, "low": LOW, "held": True}
