"""The synchronous baseline (`STOKER_PIPELINE_MODE=sync`, the benchmark's "before"): one `stoker worker sync`
runs every stage of a job inline, in its one thread, then the model; the results match the pipeline's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
