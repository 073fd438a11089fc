"""Faults the stages cannot simply catch, on a separate stack with tight limits: a hung tesseract, a killed stage."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.settings import ApiSettings, CommonSettings
from tasks.app import make_app
from tasks.pipeline import CelerySubmitter
from tests.integration.test_pipeline import _wait
from tests.media import long_speech_wav, text_image
from workers.procs import running, spawn, tail, terminate, wait_for

DBS = (8, 9)


@pytest.fixture(scope="module")
def harsh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    """Workers whose tesseract hangs (OCR soft limit 3 s) and whose transcription is killed at 2 s."""
    base = os.environ["STOKER_TEST_REDIS"]
    urls = {"STOKER_BROKER_URL": f"{base}/{DBS[0]}", "STOKER_RESULT_URL": f"{base}/{DBS[1]}"}
    for url in urls.values():
        with redis.Redis.from_url(url) as flushed:
            flushed.flushdb()
    root = tmp_path_factory.mktemp("harsh")
    pids = root / "pids"
    pids.mkdir()
    stub = root / "tesseract"
    # Hangs; or, while a "poison" marker exists, kills the pool child that ran it (its parent). It tells its version
    # at once (a worker asks it before it takes any message: a hung answer held every start-up for 10 s).
    stub.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "tesseract 5.3.0 (a stub that hangs)"; exit 0; }\n'
        f"echo $$ > {pids}/$$\n[ -e {root}/poison ] && {{ kill -9 $PPID; exit 1; }}\nexec sleep 600\n"
    )
    stub.chmod(0o755)
    env = {
        **os.environ,
        **urls,
        "STOKER_CACHE_ENABLED": "false",
        "STOKER_METRICS_PORT": "0",
        "STOKER_TESSERACT_CMD": str(stub),
        "STOKER_OCR_TIMEOUT_S": "60",
        "STOKER_OCR_SOFT_S": "3",
        # Well past the prefork pool's 5 s maintenance tick: its parent noticed a child killed by the stub after
        # 0.03 s in some deliveries and only at that tick (up to 4.7 s) in others. A hard limit sooner than that
        # fires first and fails the poisoned page as stage_killed, before it can count as worker_lost.
        "STOKER_OCR_HARD_S": "15",
        "STOKER_TRANSCRIBE_SOFT_S": "60",
        "STOKER_TRANSCRIBE_HARD_S": "2",
        # What fails here is preprocessing: the device is simulated, a batch taking 300 ms as the model's would.
        "STOKER_BACKEND": "sim",
        "STOKER_SIM_BASE_MS": "300",
    }
    procs = {kind: spawn(["worker", kind], env, root / f"{kind}.log") for kind in ("cpu", "infer")}
    reaper = spawn(["reaper"], env, root / "reaper.log")
    app = make_app(CommonSettings(broker_url=urls["STOKER_BROKER_URL"], result_url=urls["STOKER_RESULT_URL"]))

    def all_answer() -> bool:
        replies = app.control.ping(timeout=0.5, limit=len(procs))  # back as soon as both answered
        return set(procs) <= {name.split("@")[0] for reply in replies for name in reply}

    try:
        wait_for(all_answer, 180, "harsh workers", [*procs.values(), reaper])
        settings = ApiSettings(broker_url=urls["STOKER_BROKER_URL"], result_url=urls["STOKER_RESULT_URL"])
        with TestClient(create_app(settings, submitter=CelerySubmitter(app))) as client:
            yield client, pids
    except Exception as exc:
        raise RuntimeError("\n".join(f"--- {k}\n{tail(root / f'{k}.log')}" for k in [*procs, "reaper"])) from exc
    finally:
        terminate([*procs.values(), reaper], grace_s=20)  # every process told at once, each finishing meanwhile


def test_a_hung_tesseract_times_out_and_leaves_nothing_behind(harsh: tuple[TestClient, Path]) -> None:
    client, pids = harsh
    files = [("image", ("hung.png", text_image("HUNG"), "image/png"))]
    response = client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files)
    assert response.status_code == 202
    job = _wait(client, response.json()["id"])
    assert job["status"] == "degraded", job
    item = job["inputs"][0]
    assert item["error"]["code"] == "ocr_timeout"
    assert item["features"]["width"] == 800  # decode still succeeded
    assert job["result"]["text"].strip()  # answered from the prompt alone
    started = [int(p.name) for p in pids.iterdir()]
    assert started, "the stub tesseract never ran"
    wait_for(lambda: not any(running(pid) for pid in started), 10, "the stub tesseracts to be gone", [])
    assert [pid for pid in started if running(pid)] == []


def test_a_stage_killed_at_its_hard_limit_still_ends_the_job(harsh: tuple[TestClient, Path]) -> None:
    client, _ = harsh
    files = [("audio", ("long.wav", long_speech_wav(4), "audio/wav"))]
    response = client.post("/v1/jobs", data={"prompt": "Summarise."}, files=files)
    assert response.status_code == 202
    job = _wait(client, response.json()["id"])
    assert job["status"] == "degraded", job
    item = job["inputs"][0]
    assert item["status"] == "failed"
    assert item["error"]["code"] == "stage_killed"
    assert job["result"]["text"].strip()


def test_a_stage_that_kills_its_worker_every_time_is_given_up(harsh: tuple[TestClient, Path]) -> None:
    client, pids = harsh
    marker = pids.parent / "poison"
    marker.touch()
    try:
        files = [("image", ("poison.png", text_image("POISON"), "image/png"))]
        poisoned = client.post("/v1/jobs", data={"prompt": "Read it."}, files=files).json()["id"]
        bystander = client.post("/v1/jobs", data={"prompt": "Say hello."}).json()["id"]
        job = _wait(client, poisoned)
    finally:
        marker.unlink()
    assert job["status"] == "degraded", job
    item = job["inputs"][0]
    assert item["error"]["code"] == "worker_lost"
    assert item["error"]["stage"] == "ocr"
    assert _wait(client, bystander)["status"] == "succeeded"


def test_a_short_deadline_answers_from_the_text_before_the_slow_stage_ends(harsh: tuple[TestClient, Path]) -> None:
    client, pids = harsh
    before = set(pids.iterdir())
    files = [("image", ("slow.png", text_image("SLOW"), "image/png"))]
    response = client.post("/v1/jobs", data={"prompt": "Say hello.", "deadline_ms": "1000"}, files=files)
    assert response.status_code == 202
    assert response.json()["deadline_ms"] == 1000
    job = _wait(client, response.json()["id"])
    assert job["status"] == "degraded", job
    item = job["inputs"][0]
    # Handed to the model at the preprocessing budget (0.5 s) with its OCR still running: the input says the
    # deadline cut it off, not that OCR timed out (its soft limit is 3 s).
    assert item["error"]["code"] == "deadline_exceeded"
    assert job["result"]["text"].strip()
    ocr = set(pids.iterdir()) - before
    assert ocr, "its OCR never started"
    # OCR's soft limit fires later and ends the hung tesseract; its late record must not rewrite what the job used.
    wait_for(lambda: not any(running(int(p.name)) for p in ocr), 20, "the slow OCR to be given up", [])
    assert client.get(f"/v1/jobs/{job['id']}").json()["inputs"][0]["error"]["code"] == "deadline_exceeded"


def test_a_job_whose_deadline_passes_in_the_inference_queue_is_never_computed(
    harsh: tuple[TestClient, Path],
) -> None:
    client, _ = harsh
    filler = client.post("/v1/jobs", data={"prompt": "Count from one to twenty."}).json()["id"]
    for _ in range(200):  # until the filler's batch is on the device
        if "infer_wait" in client.get(f"/v1/jobs/{filler}").json()["timings_ms"]:
            break
        time.sleep(0.05)
    # The filler's batch takes 300 ms on the device: a 100 ms deadline passes while the late job waits behind it.
    late = client.post("/v1/jobs", data={"prompt": "Say hello.", "deadline_ms": "100"}).json()["id"]
    job = _wait(client, late)
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "deadline_exceeded"
    assert job["result"] is None
    assert job["batch"] is None  # dropped before the model
    assert _wait(client, filler)["status"] == "succeeded"
