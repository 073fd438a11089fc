"""One trace per job, across the API and every worker process, read back from the spans they exported."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tests.integration.test_pipeline import _wait
from tests.media import text_image, truncated


def _spans(trace_id: str) -> list[dict[str, Any]]:
    """The job's spans, from the file every process appends to (waiting for the last ones to land)."""
    path = Path(os.environ["STOKER_TRACE_FILE"])
    found: list[dict[str, Any]] = []
    for _ in range(50):
        lines = path.read_text().splitlines() if path.exists() else []
        found = [s for s in map(json.loads, lines) if s["context"]["trace_id"] == f"0x{trace_id}"]
        if any(s["name"] == "stage infer" for s in found):
            break
        time.sleep(0.1)
    return found


def _chain_to_root(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[str]:
    names = []
    while span is not None:
        names.append(span["name"])
        span = by_id.get(span["parent_id"]) if span["parent_id"] else None  # type: ignore[assignment]
    return names


def _root(name: str, spans: list[dict[str, Any]]) -> bool:
    return any(s["name"] == name and not s["parent_id"] for s in spans)


def test_a_job_is_one_trace_with_a_span_per_stage_in_order(client: TestClient, workers: dict[str, Path]) -> None:
    files = [("image", ("t.png", text_image(f"TRACE {time.time_ns() % 100000}"), "image/png"))]
    job = _wait(client, client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files).json()["id"])
    assert job["status"] == "succeeded"
    assert job["trace_id"]
    assert len(job["trace_id"]) == 32
    spans = _spans(job["trace_id"])
    by_id = {s["context"]["span_id"]: s for s in spans}
    stages = sorted((s for s in spans if s["name"].startswith("stage ")), key=lambda s: s["start_time"])
    assert [s["name"] for s in stages] == ["stage decode", "stage ocr", "stage tokenize", "stage infer"]
    for span in stages:  # every stage hangs, through its task's spans, off the API's job span
        chain = _chain_to_root(span, by_id)
        assert "job" in chain, chain
        assert _root(chain[-1], spans), chain  # …and ends at the API request, the trace's root
    decode, _ocr, _, infer = stages
    assert decode["attributes"]["stoker.pixels"] == 800 * 200
    assert decode["attributes"]["stoker.content_hash"] == job["inputs"][0]["content_hash"][:16]
    assert decode["attributes"]["stoker.cache_hit"] is False
    assert infer["attributes"]["stoker.batch_size"] >= 1
    assert infer["attributes"]["stoker.batch_id"] == job["batch"]["id"]
    assert {s["resource"]["attributes"]["service.name"] for s in stages} >= {"stoker-cpu", "stoker-infer"}


def test_a_degraded_jobs_failing_span_carries_the_error_code(client: TestClient, workers: dict[str, Path]) -> None:
    broken = truncated(text_image(f"BROKEN {time.time_ns() % 100000}"))
    files = [("image", ("b.png", broken, "image/png"))]
    job = _wait(client, client.post("/v1/jobs", data={"prompt": "Say hello."}, files=files).json()["id"])
    assert job["status"] == "degraded"
    (decode,) = [s for s in _spans(job["trace_id"]) if s["name"] == "stage decode"]
    assert decode["status"]["status_code"] == "ERROR"
    assert decode["attributes"]["stoker.error_code"] == job["inputs"][0]["error"]["code"] == "image_corrupt"
