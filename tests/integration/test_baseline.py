"""The synchronous baseline (`STOKER_PIPELINE_MODE=sync`, the benchmark's "before"): one `stoker worker sync`
runs every stage of a job inline, in its one thread, then the model; the results match the pipeline's."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.conftest import queued
from tests.fleet import Fleet, own_fleet
from tests.integration.test_pipeline import _wait
from tests.media import text_image, truncated

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


def _until_inferring(client: TestClient, job_id: str, timeout_s: float = 30.0) -> None:
    give_up = time.monotonic() + timeout_s
    while client.get(f"/v1/jobs/{job_id}").json()["status"] != "inferring":
        assert time.monotonic() < give_up, "the first job never reached the device"
        time.sleep(0.01)
