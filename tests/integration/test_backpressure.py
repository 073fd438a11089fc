"""The inference consumer under load, on the simulated device: batches fill up, queues stay bounded, overload
is pushed back to clients as 429, and nothing accepted is lost."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from tests.fakeopenai import fake_openai_server
from tests.fleet import Fleet, client_context, own_fleet
from tests.integration.test_pipeline import _wait
from tests.media import text_image
from workers.procs import wait_for

BATCH = 8


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """CPU and inference workers, the device simulated: a batch takes 300 ms + 20 ms per item."""
    settings = {
        "STOKER_BACKEND": "sim",
        "STOKER_SIM_BASE_MS": "300",
        "STOKER_SIM_PER_ITEM_MS": "20",
        "STOKER_MAX_BATCH_SIZE": str(BATCH),
        "STOKER_INFER_HIGH_WATERMARK": "4",
        "STOKER_INFER_LOW_WATERMARK": "2",
        "STOKER_HANDOFF_MAX_WAIT_S": "30",
        "STOKER_VISIBILITY_TIMEOUT_S": "200",
    }
    with own_fleet(settings) as crew:
        yield crew


def _text_job(client: TestClient, n: int, deadline_ms: int = 300_000) -> tuple[int, dict[str, str], str]:
    response = client.post(
        "/v1/jobs", data={"prompt": f"Question {n}: {time.time_ns()}", "deadline_ms": str(deadline_ms)}
    )
    body = response.json()
    return response.status_code, dict(response.headers), body.get("id", "")


def _backend_calls(fleet: Fleet) -> int:
    """Calls the device's backend answered, as the consumer counts them (one per batch; one per job after a
    batch fell back to one-by-one)."""
    with fleet.store() as store:
        return int(store.hget("stoker:device", "calls") or 0)


def test_jobs_submitted_together_ride_in_full_batches(fleet: Fleet) -> None:
    calls_before = _backend_calls(fleet)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: _text_job(fleet.client, n), range(50)))
    assert all(status == 202 for status, _, _ in answers)
    jobs = [_wait(fleet.client, job_id) for _, _, job_id in answers]
    assert all(j["status"] == "succeeded" for j in jobs), [j for j in jobs if j["status"] != "succeeded"][:2]
    assert all(j["result"]["model"] == "sim" for j in jobs)
    sizes = {j["batch"]["id"]: j["batch"]["size"] for j in jobs}
    assert max(sizes.values()) <= BATCH
    assert sum(sizes.values()) == 50
    mean = sum(sizes.values()) / len(sizes)
    assert mean >= BATCH / 2, sizes
    # The device counts a call after it writes the call's answers: let the last one's count land.
    wait_for(lambda: _backend_calls(fleet) - calls_before >= len(sizes), 10, "the last batch's count", [])
    assert _backend_calls(fleet) - calls_before == len(sizes) < 50  # one call per batch: real batches


def _rss_mb(pgid: int) -> float:
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) == pgid:
                total += int((proc / "statm").read_text().split()[1]) * 4096
        except (OSError, IndexError, ValueError):
            continue
    return total / 2**20


def _job_records(fleet: Fleet) -> int:
    with fleet.store() as store:
        return sum(1 for key in store.scan_iter("stoker:job:*") if key.count(b":") == 2)


#: Tokenize children of the fleet's CPU worker (its default pool): each may pass the watermark check at once.
CPU_CHILDREN = 2
HIGH_WATERMARK = 4


def test_overload_is_refused_with_retry_after_and_nothing_accepted_is_lost(fleet: Fleet) -> None:
    fleet.kill("infer", signal.SIGTERM)  # a clean stop: the device is gone, work piles up
    cpu_before = _rss_mb(fleet.procs["cpu"].pid)
    accepted: list[str] = []
    refused: dict[str, str] | None = None
    deepest = 0
    # Every text job through tokenize (no API shortcut): the watermarks alone stand between it and the device.
    with (
        fleet.api(cpu_queue_limit=6, infer_queue_limit=10, api_tokenize=False) as client,
        redis.Redis.from_url(fleet.env["STOKER_BROKER_URL"]) as broker,
    ):
        monitor = client_context(client).monitor
        wait_for(lambda: monitor.fresh() is not None, 15, "the admission monitor's first sample", [])
        for n in range(80):
            records = _job_records(fleet)
            status, headers, job_id = _text_job(client, n)
            deepest = max(deepest, int(broker.llen("infer")))
            if status == 429:
                refused = headers
                assert _job_records(fleet) == records  # a refusal writes nothing
                break
            assert status == 202
            accepted.append(job_id)
            time.sleep(0.15)  # arrivals paced, not a wait for anything
        stats = client.get("/v1/stats").json()
    assert refused is not None, f"never refused after {len(accepted)} jobs: {stats}"
    assert 1 <= int(refused["retry-after"]) <= 120
    # Tokenize held: the inference queue never passed its high watermark plus what tokenize had in hand…
    assert deepest <= HIGH_WATERMARK + CPU_CHILDREN, (deepest, stats["queues"])
    assert stats["queues"]["infer"]["depth"] >= HIGH_WATERMARK
    # …and the backlog grew upstream instead, in the tokenize queue, whose limit refused the job.
    assert stats["refused"].get("tokenize", 0) >= 1, stats["refused"]
    assert stats["refused"].get("infer", 0) == 0, stats["refused"]
    assert _rss_mb(fleet.procs["cpu"].pid) - cpu_before < 100  # CPU workers held the line, not their memory
    fleet.start("infer")
    fleet.wait_workers(("infer",))
    finished = [_wait(fleet.client, job_id) for job_id in accepted]
    assert [j["status"] for j in finished] == ["succeeded"] * len(accepted)


def test_the_openai_backend_gets_the_preprocessed_picture_through_the_pipeline(fleet: Fleet) -> None:
    with fake_openai_server() as server:
        fleet.kill("infer", signal.SIGTERM)
        fleet.start("infer", STOKER_BACKEND="openai", STOKER_OPENAI_BASE_URL=server.url, STOKER_OPENAI_MODEL="vlm")
        fleet.wait_workers(("infer",))
        try:
            files = [("image", ("note.png", text_image("PICTURE 12"), "image/png"))]
            response = fleet.client.post("/v1/jobs", data={"prompt": "What is in the picture?"}, files=files)
            job = _wait(fleet.client, response.json()["id"])
        finally:
            fleet.kill("infer", signal.SIGTERM)
            fleet.start("infer")
    assert job["status"] == "succeeded", job
    assert job["result"]["text"] == "fake saw 1 image(s)"
    assert job["result"]["model"] == "openai:vlm"
    # The decode workers here are not the openai backend's: the inference worker made the picture from the held
    # upload, at its own size (800×200, under the bound), losslessly, named by its content hash.
    (picture,) = server.pictures
    assert (picture.format, picture.size, picture.uuid) == ("PNG", (800, 200), job["inputs"][0]["content_hash"])
    text = server.bodies[-1]["messages"][-1]["content"][0]["text"]
    assert "PICTURE 12" in text
    assert "What is in the picture?" in text


def test_retry_after_predicts_how_long_the_queue_takes_to_drain(fleet: Fleet) -> None:
    # A device that drains a steady 5 jobs/s (batches of 2 every 400 ms) and jobs arriving at ~20/s: the inference
    # queue reaches its limit (60) in seconds, and the 429 says when it will be back at its resume level (30). The
    # API tokenizes these text jobs itself (up to its own watermark, 1000): they go straight to the inference queue.
    fleet.kill("infer", signal.SIGTERM)
    steady = {"STOKER_SIM_BASE_MS": "400", "STOKER_SIM_PER_ITEM_MS": "0", "STOKER_MAX_BATCH_SIZE": "2"}
    fleet.start("infer", STOKER_BACKEND="sim", **steady)
    try:
        fleet.wait_workers(("infer",))
        # A fresh API: its drain meter has seen none of the earlier tests' traffic.
        api = fleet.api(infer_queue_limit=60, admission_resume_ratio=0.5, infer_high_watermark=1000)
        with api as client, redis.Redis.from_url(fleet.env["STOKER_BROKER_URL"]) as broker:
            assert int(broker.llen("infer")) == 0
            monitor = client_context(client).monitor
            wait_for(lambda: monitor.fresh() is not None, 15, "the admission monitor's first sample", [])
            retry_after = None
            for n in range(400):
                status, headers, _ = _text_job(client, n, deadline_ms=120_000)
                if status == 429:
                    retry_after, refused_at = int(headers["retry-after"]), time.monotonic()
                    break
                assert status == 202
                time.sleep(0.05)  # arrivals paced at ~20/s, not a wait for anything
            assert retry_after is not None, "never refused"
            wait_for(lambda: int(broker.llen("infer")) <= 30, 120, "the inference queue back at its resume level", [])
            took = time.monotonic() - refused_at
    finally:
        fleet.kill("infer", signal.SIGTERM)
        fleet.start("infer")
    assert 0.5 * took <= retry_after <= 1.5 * took, (retry_after, took)
