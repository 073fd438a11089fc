"""Metrics and per-job timings after real jobs through real workers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from stoker.settings import ApiSettings
from tests.integration.conftest import SpySubmitter
from tests.integration.test_pipeline import _wait
from tests.media import text_image
from workers.broker import free_port
from workers.procs import wait_for


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def _worker_metrics(kind: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    ports = dict(item.split("=") for item in os.environ["STOKER_TEST_METRICS"].split(","))
    return _samples(httpx.get(f"http://127.0.0.1:{ports[kind]}/metrics", timeout=5).text)


@pytest.fixture
def metered(workers: dict[str, Path], spy: SpySubmitter) -> Iterator[tuple[TestClient, str]]:
    """The API submitting to the real workers, and the URL of its metrics listener (a port of its own)."""
    port = free_port()
    with TestClient(create_app(ApiSettings(api_metrics_port=port), submitter=spy)) as api:
        yield api, f"http://127.0.0.1:{port}/metrics"


def test_stages_batches_cache_and_jobs_are_measured(metered: tuple[TestClient, str]) -> None:
    client, metrics_url = metered
    assert client.get("/metrics").status_code == 404  # not on the API's own port
    api_before = _samples(httpx.get(metrics_url, timeout=5).text)
    image = text_image(f"METRIC {time.time_ns() % 100000}")
    files = [("image", ("m.png", image, "image/png"))]
    first = _wait(client, client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files).json()["id"])
    second = _wait(client, client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files).json()["id"])
    assert (first["status"], second["status"]) == ("succeeded", "succeeded")

    # The job: queue wait and run time per stage, preprocessing's share.
    timings = first["inputs"][0]["timings_ms"]
    assert {"decode_queue", "decode", "ocr_queue", "ocr"} <= set(timings)
    assert 0 < first["preprocess_share"] < 1

    api = _samples(httpx.get(metrics_url, timeout=5).text)
    assert _value(api, "stoker_api_admissions_total", outcome="accepted") >= 2
    assert (
        _value(api, "stoker_jobs_total", status="succeeded")
        >= _value(api_before, "stoker_jobs_total", status="succeeded") + 2
    )
    # The repeat was served from the cache at the door: its tokenized prompt was a hit.
    assert _value(api, "stoker_cache_lookups_total", stage="tokenize", result="hit") >= 1 + _value(
        api_before, "stoker_cache_lookups_total", stage="tokenize", result="hit"
    )
    assert _value(api, "stoker_api_request_duration_seconds_count", route="/v1/jobs", method="POST") >= 2

    cpu = _worker_metrics("cpu")
    assert _value(cpu, "stoker_stage_duration_seconds_count", stage="decode", cache="miss") >= 1
    assert _value(cpu, "stoker_stage_duration_seconds_count", stage="ocr") >= 1
    assert _value(cpu, "stoker_stage_queue_wait_seconds_count", stage="ocr") >= 1
    assert _value(cpu, "stoker_cache_lookups_total", stage="ocr", result="miss") >= 1

    sampled = ("stoker_queue_depth", frozenset({("queue", "infer")}))
    wait_for(lambda: sampled in _worker_metrics("infer"), 15, "the inference worker's first device sample", [])
    infer = _worker_metrics("infer")
    assert _value(infer, "stoker_batch_size_count") >= 2
    assert _value(infer, "stoker_batch_size_sum") >= 2
    assert _value(infer, "stoker_device_busy_seconds_total") > 0
    assert ("stoker_queue_depth", frozenset({("queue", "infer")})) in infer
    assert any(name == "stoker_device_starved_seconds_total" for name, _ in infer)
    assert 0 <= _value(infer, "stoker_device_busy_ratio") <= 1


def test_the_device_counts_as_starved_while_work_waits_upstream(client: TestClient, workers: dict[str, Path]) -> None:
    from tasks.worker import app

    def starved() -> float:
        return _value(_worker_metrics("infer"), "stoker_device_starved_seconds_total")

    cpu = [name for reply in app.control.ping(timeout=1) for name in reply if name.startswith("cpu@")]
    assert cpu
    before = starved()
    # The CPU worker stops taking decode messages (Celery's own remote control): the pages wait in the decode queue
    # while the device has nothing to run. Each second of that is a second of starvation.
    assert app.control.cancel_consumer("decode", destination=cpu, reply=True)
    try:
        ids = []
        for n in range(3):
            files = [("image", ("page.png", text_image(f"STARVED {n}"), "image/png"))]
            response = client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        wait_for(lambda: starved() >= before + 2.0, 30, "two seconds of starvation counted", [])
    finally:
        app.control.add_consumer("decode", destination=cpu, reply=True)
    for job_id in ids:
        assert _wait(client, job_id)["status"] == "succeeded"
