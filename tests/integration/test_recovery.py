"""Whole processes die under load, and Redis itself: every accepted job still reaches its end.

A stack of its own (own Valkey with AOF, short visibility timeout, prompt re-drive) so processes can be killed
without disturbing the other tests. What dies here is processes, not a model: the device is simulated, and a batch
holds it for a second and a half, so a kill lands while one is on it.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stoker.adapters.broker import queue_depths
from stoker.adapters.store.keys import PROGRESS_FIELD, input_ref, job_key
from stoker.settings import ApiSettings, WorkerSettings
from tasks.app import make_app
from tests.fleet import SIM_RECOVERY, Fleet, own_fleet
from tests.integration.conftest import SpySubmitter
from tests.integration.test_pipeline import _wait
from tests.media import text_image
from workers.broker import start_embedded
from workers.procs import tail


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Messages of a dead worker come back after 10 s, lost inference messages are re-sent after 10."""
    # Every job does its own work: nothing rides on a cache hit.
    device = {"STOKER_BACKEND": "sim", "STOKER_SIM_BASE_MS": "1500"}
    settings = {**SIM_RECOVERY, **device, "STOKER_CACHE_ENABLED": "false"}
    # The API in this process reads the stack's settings as its workers do: it plans each job's first look by the
    # reaper (`redrive_after_s`), so a message lost with a crash is sent again after 10 s, not the default 120.
    names = {key: key.removeprefix("STOKER_").lower() for key in settings}
    api = {names[key]: value for key, value in settings.items() if names[key] in ApiSettings.model_fields}
    with own_fleet(settings, api=api) as crew:
        yield crew


def _submit(fleet: Fleet, count: int, image: bool = True) -> list[str]:
    ids = []
    for n in range(count):
        files = (
            [("image", (f"{n}.png", text_image(f"ORDER {n}{time.time_ns() % 10000}"), "image/png"))] if image else []
        )
        data = {"prompt": f"Job {n}: what is the order number?", "deadline_ms": "240000"}
        response = fleet.client.post("/v1/jobs", data=data, files=files)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    return ids


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _statuses(fleet: Fleet, ids: list[str]) -> list[str]:
    return [fleet.client.get(f"/v1/jobs/{i}").json()["status"] for i in ids]


def _all_answered(fleet: Fleet, ids: list[str]) -> list[dict[str, Any]]:
    jobs = [_wait(fleet.client, i) for i in ids]
    for job in jobs:
        assert job["status"] in ("succeeded", "degraded"), (job["status"], job.get("error"), fleet.logs())
        assert job["result"]["text"].strip()
    return jobs


def test_killing_the_whole_inference_worker_mid_batch_loses_no_job(fleet: Fleet) -> None:
    ids = _submit(fleet, 6, image=False)
    _until(lambda: "inferring" in _statuses(fleet, ids) and _any_on_device(fleet, ids), 120, "a batch on the device")
    fleet.kill("infer")
    fleet.start("infer")
    fleet.wait_workers(("infer",))
    jobs = _all_answered(fleet, ids)
    assert all(j["status"] == "succeeded" for j in jobs)


def _any_on_device(fleet: Fleet, ids: list[str]) -> bool:
    with fleet.store() as store:
        return any(store.hexists(f"stoker:job:{i}", "ts:infer_start") for i in ids)


def test_killing_the_whole_cpu_worker_mid_preprocessing_loses_no_job(fleet: Fleet) -> None:
    ids = _submit(fleet, 4)
    _until(lambda: "preprocessing" in _statuses(fleet, ids), 60, "preprocessing to start")
    fleet.kill("cpu")
    fleet.start("cpu")
    fleet.wait_workers(("cpu",))
    _all_answered(fleet, ids)


def test_a_redis_crash_and_restart_mid_run_loses_no_job(fleet: Fleet) -> None:
    ids = _submit(fleet, 5)
    _until(lambda: "preprocessing" in _statuses(fleet, ids), 60, "preprocessing to start")
    fleet.valkey.kill()  # SIGKILL: a crash, not a clean shutdown
    fleet.valkey.wait(10)
    refused = fleet.client.post("/v1/jobs", data={"prompt": "anyone there?"})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "broker_unavailable"
    time.sleep(2)  # an outage that lasts: workers retry against a Redis that is not there (not a wait for anything)
    fleet.valkey, _ = start_embedded(port=fleet.port, data_dir=fleet.root)
    jobs = _all_answered(fleet, ids)
    errors = [[(i["index"], i["status"], i.get("error")) for i in j["inputs"]] for j in jobs]
    assert [j["status"] for j in jobs] == ["succeeded"] * len(ids), errors
    assert all(p.poll() is None for p in fleet.procs.values()), fleet.logs()  # everyone reconnected, no one died


def test_a_job_whose_first_message_never_reached_the_broker_is_sent_again(fleet: Fleet) -> None:
    """An API that wrote the record and died before publishing (or a worker SIGKILLed as it took the message off
    the queue): no stage ever starts the job; once the CPU queues are empty, the reaper sends it again."""
    silent = SpySubmitter(forward=False)  # the record is written, its first message goes nowhere
    files = [("image", ("lost.png", text_image(f"ORDER {time.time_ns() % 10000}"), "image/png"))]
    fleet.kill("reaper", signal.SIGTERM)
    fleet.start("reaper", STOKER_REDRIVE_AFTER_S="3")  # a patient reaper would take the fleet's 10 s
    try:
        with fleet.api(silent, redrive_after_s=3) as api:
            accepted = api.post("/v1/jobs", data={"prompt": "What is the order number?"}, files=files)
        assert accepted.status_code == 202, accepted.text
        (job,) = _all_answered(fleet, [accepted.json()["id"]])
        assert job["status"] == "succeeded", job  # preprocessed and answered after the re-send, nothing failed
        assert [j for j, _ in silent.calls] == [job["id"]]  # the API sent it once (nowhere); the reaper the rest
        assert "sending it again" in tail(fleet.root / "reaper.log")
    finally:
        fleet.kill("reaper", signal.SIGTERM)
        fleet.start("reaper")


def test_a_started_job_whose_next_message_was_lost_is_sent_again(fleet: Fleet) -> None:
    """A worker SIGKILLed as it took a job's OCR message off the queue (kombu pops it before it records it as
    unacknowledged): the job's decode ran, nothing else will. Once nothing moved it for the visibility timeout and
    the redrive delay, with the CPU queues empty, the reaper sends it to preprocessing again and it is answered."""
    silent = SpySubmitter(forward=False)  # the record is written, its canvas goes nowhere
    files = [("image", ("stalled.png", text_image(f"ORDER {time.time_ns() % 10000}"), "image/png"))]
    fleet.kill("reaper", signal.SIGTERM)  # the job is made stalled before any reaper sees it
    try:
        with fleet.api(silent, redrive_after_s=3) as api:
            accepted = api.post("/v1/jobs", data={"prompt": "What is the order number?"}, files=files)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        # Its first stage alone, as a real worker runs it: the job starts, the decoded image is written; the OCR
        # message that would follow it never exists.
        fleet.app.signature("stoker.decode", args=(job_id, input_ref(0)), immutable=True).apply_async()
        with fleet.store() as store:
            _until(lambda: store.hexists(job_key(job_id), PROGRESS_FIELD), 60, "the decoded image to be written")
            assert store.hget(job_key(job_id), "status") == b"preprocessing"
            # A patient reaper would wait the fleet's 10 s redrive delay on top of its visibility timeout; this one
            # looks 3 s after it (no message of this job exists to come back, whatever the broker's timeout).
            fleet.start("reaper", STOKER_REDRIVE_AFTER_S="3")
            (job,) = _all_answered(fleet, [job_id])
            assert job["status"] == "succeeded", job  # preprocessed and answered after the re-send, nothing failed
            assert job["inputs"][0]["status"] == "ok", job["inputs"]
            assert store.hget(job_key(job_id), "redrives") == b"1"  # sent again once
        assert [j for j, _ in silent.calls] == [job_id]  # the API sent it once (nowhere); the reaper the rest
        assert "preprocessing stalled" in tail(fleet.root / "reaper.log")
    finally:
        if fleet.procs["reaper"].poll() is None:
            fleet.kill("reaper", signal.SIGTERM)
        fleet.start("reaper")


def test_a_wedged_batch_fails_its_jobs_and_the_worker_is_replaced(fleet: Fleet) -> None:
    fleet.kill("infer")
    # A device that hangs: every batch sleeps 30 s, far past the 0.5 s budget and the 1 s grace after it.
    wedged = {"STOKER_BACKEND": "sim", "STOKER_SIM_BASE_MS": "30000"}
    fleet.start("infer", STOKER_INFER_BATCH_TIMEOUT_S="0.5", STOKER_INFER_WEDGE_GRACE_S="1", **wedged)
    fleet.wait_workers(("infer",))
    (job_id,) = _submit(fleet, 1, image=False)
    job = _wait(fleet.client, job_id)
    # Failed by the watchdog (the device would have answered it after 30 s, and succeeded).
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "inference_failed"
    assert fleet.procs["infer"].wait(30) == 75  # WEDGED_EXIT: replace me
    fleet.start("infer")
    fleet.wait_workers(("infer",))
    _all_answered(fleet, _submit(fleet, 1, image=False))


#: How long the broker is away in the test below: longer than Celery's own publish retries last (about a second).
OUTAGE_S = 3.0


def test_a_worker_s_publish_rides_out_a_broker_restart(tmp_path: Path) -> None:
    """A stage that ends while the broker restarts still sends the next stage: a worker's publish retries through
    an outage of seconds, as its result backend does, where Celery's default gave up after about one and the input
    failed `stage_killed`. Real Valkey, killed and started again on its own files; a worker's Celery app."""
    valkey, port = start_embedded(data_dir=tmp_path)
    base = f"redis://127.0.0.1:{port}"
    app = make_app(WorkerSettings(broker_url=f"{base}/0", result_url=f"{base}/1"))
    restarted: list[subprocess.Popen[bytes]] = []
    try:
        app.signature("stoker.decode", args=("before", "input:0"), immutable=True).apply_async()
        valkey.kill()  # SIGKILL: a crash
        valkey.wait(10)
        restart = threading.Timer(OUTAGE_S, lambda: restarted.append(start_embedded(port=port, data_dir=tmp_path)[0]))
        restart.start()
        sent_at = time.monotonic()
        app.signature("stoker.decode", args=("during", "input:0"), immutable=True).apply_async()  # raised before
        assert time.monotonic() - sent_at >= OUTAGE_S  # it waited the outage out
        restart.join()
        with app.connection_for_read() as connection:
            assert queue_depths(connection, ["decode"]) == {"decode": 2}  # both there, nothing lost or doubled
    finally:
        for server in [valkey, *restarted]:
            server.kill()
            server.wait(10)
