"""What stoker reports about a job, without services: its log line, its waterfall, its preprocessing share, and
the device's busy and starved time."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from api.app import RequestTimer
from stoker.adapters.client import waterfall
from stoker.adapters.metrics import DeviceClock, JobCounts, serve_api_metrics, serve_worker_metrics
from stoker.core.jobs import ErrorInfo, InputRecord, Job, preprocess_share
from stoker.runtime.monitoring import job_line, starved_seconds
from workers.broker import free_port

TIMINGS = {"queued": 100.0, "preprocess": 300.0, "infer_wait": 50.0, "infer": 650.0, "total": 1000.0}


def _job(**update: object) -> Job:
    image = InputRecord(
        index=0, kind="image", content_hash="h", size_bytes=1, status="ok", cache_hit={"decode": True, "ocr": True}
    )
    job = Job(id="j1", status="succeeded", prompt="p", inputs=[image], timings_ms=TIMINGS, preprocess_share=0.3)
    return job.model_copy(update=update)


def test_a_finished_job_logs_one_line_with_its_shares() -> None:
    assert job_line(_job()) == (
        "job=j1 status=succeeded kinds=image+text preprocess=300ms(cache hit) infer=650ms total=1000ms "
        "preprocess_share=30%"
    )


def test_a_degraded_job_line_names_its_failed_inputs() -> None:
    broken = InputRecord(
        index=0, kind="audio", content_hash="a", size_bytes=1, status="failed",
        error=ErrorInfo(code="asr_timeout", message="slow"), cache_hit={"transcribe": False},
    )  # fmt: skip
    line = job_line(_job(status="degraded", inputs=[broken]))
    assert "kinds=audio+text" in line
    assert "preprocess=300ms " in line  # not served by the cache
    assert line.endswith("failed_inputs=0:asr_timeout")


def test_preprocess_share_appears_once_the_job_ended() -> None:
    assert preprocess_share(TIMINGS) == 0.3
    assert preprocess_share({"preprocess": 300.0}) is None


def test_the_waterfall_lays_phases_end_to_end_and_stages_inside_preprocessing() -> None:
    job = {
        "timings_ms": TIMINGS,
        "inputs": [{"index": 0, "timings_ms": {"decode_queue": 5.0, "decode": 40.0, "ocr": 150.0}}],
    }
    rows = waterfall(job)
    assert rows[:4] == [("queued", 0.0, 100.0), ("preprocess", 100.0, 200.0), ("infer_wait", 300.0, 50.0),
                        ("infer", 350.0, 650.0)]  # fmt: skip
    assert rows[4:] == [
        ("  input 0 decode (queue)", 100.0, 5.0),
        ("  input 0 decode", 105.0, 40.0),
        ("  input 0 ocr", 145.0, 150.0),
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_device_busy_time_counts_running_batches_up_to_now() -> None:
    clock = Clock()
    device = DeviceClock(clock)
    device.begin()
    clock.now = 2.0
    device.end()
    clock.now = 3.0
    device.begin()
    clock.now = 3.5
    assert device.take() == 2.5  # a finished batch and half a second of the running one
    clock.now = 4.0
    device.end()
    assert device.take() == 0.5


def test_the_device_is_starved_only_while_work_waits_upstream() -> None:
    assert starved_seconds(1.0, 0.25, cpu_backlog=3) == 0.75
    assert starved_seconds(1.0, 0.25, cpu_backlog=0) == 0.0
    assert starved_seconds(1.0, 1.0, cpu_backlog=9) == 0.0


def test_the_api_metrics_listener_serves_its_collectors_on_its_own_address_only() -> None:
    port = free_port()
    counts = JobCounts(lambda: {"succeeded": 3})
    stop = serve_api_metrics(port, "127.0.0.2", counts)  # a loopback address other than 127.0.0.1
    assert stop is not None
    try:
        text = httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=5).text
        assert 'stoker_jobs_total{status="succeeded"} 3.0' in text  # the collector it was given
        assert "stoker_api_request_duration_seconds" in text  # and this process's own registry
        with pytest.raises(httpx.ConnectError):  # bound to that address, not to every interface
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert serve_api_metrics(port, "127.0.0.2") is None  # taken: logged, and the API goes on without
    finally:
        stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=5)
    assert serve_api_metrics(0, "127.0.0.1") is None


def test_a_workers_metrics_listener_binds_to_the_metrics_host_only(tmp_path: Path) -> None:
    port = free_port()
    stop = serve_worker_metrics(port, tmp_path, "127.0.0.2")
    assert stop is not None
    try:
        assert httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=5).status_code == 200
        with pytest.raises(httpx.ConnectError):  # not on every interface
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        stop()
    assert serve_worker_metrics(0, tmp_path, "127.0.0.1") is None  # turned off


def test_request_latency_is_observed_by_route_template_and_status() -> None:
    app = FastAPI()
    app.add_middleware(RequestTimer)

    @app.get("/things/{thing}")
    async def thing(thing: str) -> dict[str, str]:
        if thing == "missing":
            raise HTTPException(404)
        return {"thing": thing}

    def count(status: str) -> float:
        labels = {"method": "GET", "route": "/things/{thing}", "status": status}
        return REGISTRY.get_sample_value("stoker_api_request_duration_seconds_count", labels) or 0.0

    before = count("200"), count("404")
    with TestClient(app) as client:
        assert [client.get(f"/things/{n}").status_code for n in ("a", "b", "missing")] == [200, 200, 404]
    assert (count("200") - before[0], count("404") - before[1]) == (2.0, 1.0)
