"""The inference consumer keeps the device busy: work-conserving batches, arrival wakes it, a broken batch fails
its jobs at once, and a batch lost with its worker is run again (on the simulated device, a stack of its own)."""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.fleet import Fleet, own_fleet
from tests.integration.test_pipeline import _wait
from workers.procs import wait_for

BATCH = 8
#: The simulated device: a batch takes 300 ms + 20 ms per item, long enough to submit behind it.
DEVICE = {
    "STOKER_BACKEND": "sim",
    "STOKER_SIM_BASE_MS": "300",
    "STOKER_SIM_PER_ITEM_MS": "20",
    "STOKER_MAX_BATCH_SIZE": str(BATCH),
    "STOKER_CACHE_ENABLED": "false",
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """CPU and inference workers on the simulated device; default visibility timeout (300 s): a lost batch must
    come back through the consumer's heartbeat, not through the broker's redelivery."""
    with own_fleet(DEVICE) as crew:
        yield crew


def _submit(fleet: Fleet, prompt: str, **data: str) -> str:
    response = fleet.client.post("/v1/jobs", data={"prompt": prompt, "deadline_ms": "120000", **data})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _on_device(fleet: Fleet, job_id: str, timeout_s: float = 30.0) -> None:
    """Until the job's batch has started (its infer_start stamp is written)."""
    store = fleet.store()
    deadline = time.monotonic() + timeout_s
    while store.hget(f"stoker:job:{job_id}", "ts:infer_start") is None:
        assert time.monotonic() < deadline, f"job {job_id} never reached the device\n{fleet.logs()}"
        time.sleep(0.01)


def _device(fleet: Fleet) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in fleet.store().hgetall("stoker:device").items()}


def test_what_arrives_while_the_device_is_busy_forms_full_batches(fleet: Fleet) -> None:
    # Read before the filler: its batch is counted once it ends, which on a slow host can be before the twenty
    # are even sent.
    before = _device(fleet)
    filler = _submit(fleet, "Hold the device.")
    _on_device(fleet, filler)
    ids = [_submit(fleet, f"Job {n} of twenty.") for n in range(20)]
    jobs = [_wait(fleet.client, i) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs), jobs
    assert _wait(fleet.client, filler)["status"] == "succeeded"
    batches = {j["batch"]["id"] for j in jobs}
    assert len(batches) <= math.ceil(20 / BATCH) + 1, sorted(j["batch"]["size"] for j in jobs)
    # A real batch is one backend call: the one-by-one fallback would have made twenty. The consumer counts a batch
    # just after it writes the batch's answers, so the last count may land a moment after the last answer.
    expected = len(batches) + 1  # the filler's batch, then ours
    wait_for(lambda: _device(fleet)["calls"] - before.get("calls", 0) >= expected, 10, "the batches' counts", [])
    after = _device(fleet)
    calls = after["calls"] - before.get("calls", 0)
    assert calls == expected, (calls, batches)
    assert after["items"] - before.get("items", 0) == 21
    # Work waited between those batches: the idle gaps were measured and reach /v1/stats.
    gap = fleet.client.get("/v1/stats").json()["device_idle_gap"]
    assert gap["samples"] >= 1
    assert gap["p99_ms"] >= gap["p50_ms"] >= 0


def test_a_lone_job_on_an_idle_device_starts_at_once(fleet: Fleet) -> None:
    _wait(fleet.client, _submit(fleet, "Warm up."))  # the device is idle after this
    waits = []
    for n in range(5):  # one after another: each is alone on an idle device
        job = _wait(fleet.client, _submit(fleet, f"Alone on an idle device, {n}."))
        assert job["status"] == "succeeded", job
        assert job["batch"]["size"] == 1
        # From reaching the inference queue (its hand-over stamp) to its batch starting, read from its own stamps.
        waits.append(job["batch"]["wait_ms"])
    # The median, so one scheduling hiccup of a busy host does not decide; a consumer that looked for work on a
    # timer (celery-batches' flush interval: 10 s here) would wait half its period on average. 100 ms leaves room
    # for a host whose two cores another test suite shares (22-23 ms seen there; a few ms on a quiet one).
    assert sorted(waits)[2] <= 100, waits


#: What the inference worker may hold at once: STOKER_PREFETCH_BATCHES (3: running, prepared, being written) batches.
HOLD = BATCH * 3


def _held_for_inference(broker: redis.Redis[bytes]) -> int:
    """Messages the broker delivered to the inference worker and it has not acked yet (kombu's `unacked` hash: each
    entry is [message, exchange, routing key]); the ground truth of what the worker holds, reserved or running."""
    return sum(json.loads(raw)[2] == "infer" for raw in broker.hvals("unacked"))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 / 2**20


def test_the_worker_holds_no_more_than_its_prefetch_while_the_queue_is_deep(fleet: Fleet) -> None:
    fleet.kill("infer", signal.SIGTERM)  # the queue fills up to its high watermark (160) first, the rest waits
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda n: _submit(fleet, f"Deep queue {n}."), range(120)))
    held, rss = [], []
    with redis.Redis.from_url(fleet.env["STOKER_BROKER_URL"]) as broker:
        wait_for(lambda: int(broker.llen("infer")) >= 60, 60, "a deep inference queue", [])
        fleet.start("infer")
        fleet.wait_workers(("infer",))
        worker = fleet.procs["infer"].pid
        rss_before = _rss_mb(worker)
        while int(broker.llen("infer")) + int(broker.llen("tokenize")) > HOLD:  # more waits than it may hold
            held.append(_held_for_inference(broker))
            rss.append(_rss_mb(worker))
            time.sleep(0.05)  # a sampling interval, not a wait for anything
    jobs = [_wait(fleet.client, i) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs)
    assert held, "the queue was never deep"
    assert max(held) <= HOLD, held
    assert len(held) >= 10, held  # the queue stayed deep for a while: the samples mean something
    assert max(held) > BATCH, held  # it does hold the next batch while one runs (double buffering)
    assert max(rss) - rss_before < 150, (rss_before, max(rss))  # bounded by the prefetch, not the queue


def test_a_batch_lost_with_its_worker_is_run_again_when_a_worker_is_back(fleet: Fleet) -> None:
    filler = _submit(fleet, "Hold the device while the next batch forms.")
    _on_device(fleet, filler)
    ids = [_submit(fleet, f"Lost batch {n}.") for n in range(6)]
    _on_device(fleet, ids[-1])  # the batch of six is on the device
    fleet.kill("infer")  # SIGKILL mid-batch: no goodbye, no ack
    store = fleet.store()
    stamps = [store.hmget(f"stoker:job:{i}", ["ts:infer_start", "ts:done"]) for i in ids]
    lost = [i for i, (start, done) in zip(ids, stamps, strict=True) if start is not None and done is None]
    assert lost, "the batch ended before its worker died"

    def resent() -> bool:  # the reaper saw the heartbeat lapse and sent the lost batch's jobs again
        return all(store.hget(f"stoker:job:{i}", "losses") == b"1" for i in lost)

    deadline = time.monotonic() + 30
    while not resent():
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.1)
    fleet.start("infer")
    back = time.time()
    fleet.wait_workers(("infer",))
    jobs: list[dict[str, Any]] = [_wait(fleet.client, i) for i in lost]
    for job in jobs:
        assert job["status"] == "succeeded", (job, fleet.logs())  # run again, not failed by the reaper
    done = [float(store.hget(f"stoker:job:{i}", "ts:done") or 0) for i in lost]
    assert max(done) - back <= 30, (done, back)


def test_a_batch_whose_backend_raises_fails_its_jobs_at_once(fleet: Fleet) -> None:
    fleet.kill("infer", signal.SIGTERM)
    fleet.start("infer", STOKER_SIM_FAULT="raise")  # a backend that raises on every call
    try:
        fleet.wait_workers(("infer",))
        jobs = [_wait(fleet.client, i) for i in [_submit(fleet, f"Doomed {n}.") for n in range(3)]]
    finally:
        fleet.kill("infer", signal.SIGTERM)
        fleet.start("infer")  # the fleet's own device again, for whoever comes next
    store = fleet.store()
    for job in jobs:
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "inference_failed"
        assert job["batch"] is not None  # it reached the device: its own batch's error, not a reaper's verdict
        assert store.zscore("stoker:active", job["id"]) is None  # nothing left for the reaper


def test_a_worker_stopped_mid_batch_hands_back_what_it_held_to_the_next_at_once(fleet: Fleet) -> None:
    """A rolling restart: SIGTERM while a batch runs and more jobs wait in the worker's prefetch. The running batch
    ends or comes back, and what it held comes back for the next worker at once (not after the reaper's redrive);
    the stopped worker leaves no metric files behind."""
    filler = _submit(fleet, "Hold the device while the next jobs arrive.")
    _on_device(fleet, filler)
    ids = [_submit(fleet, f"Rolling restart {n}.") for n in range(2 * BATCH)]
    _on_device(fleet, ids[0])
    with redis.Redis.from_url(fleet.env["STOKER_BROKER_URL"]) as broker:  # a batch runs, the rest wait in its hands
        wait_for(lambda: _held_for_inference(broker) > BATCH, 10, "jobs held behind the running batch", [])
    metrics = Path(_environ(fleet.procs["infer"].pid)["PROMETHEUS_MULTIPROC_DIR"])
    assert metrics.is_dir()
    fleet.kill("infer", signal.SIGTERM)
    assert not metrics.exists()  # `stoker worker` made its metric files' directory, and took it with it
    store = fleet.store()
    fleet.start("infer")
    back = time.time()
    fleet.wait_workers(("infer",))
    jobs = [_wait(fleet.client, i) for i in [filler, *ids]]
    for job in jobs:
        assert job["status"] == "succeeded", (job, fleet.logs())
    done = [float(store.hget(f"stoker:job:{i}", "ts:done") or 0) for i in [filler, *ids]]
    assert max(done) - back <= 20, (sorted(d - back for d in done), fleet.logs())
    assert all(store.hget(f"stoker:job:{i}", "redrives") in (None, b"0") for i in ids)
