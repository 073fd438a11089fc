"""The core pipeline through the API, on real Redis and real worker processes with the real model."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.media import encode, png_bomb, text_image, truncated


def _wait(client: TestClient, job_id: str) -> dict[str, Any]:
    for _ in range(10):
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        if job["status"] in ("succeeded", "degraded", "failed"):
            return job
    raise AssertionError(f"job {job_id} not terminal: {job}")


def test_image_job_reads_the_text_and_the_model_answers(client: TestClient) -> None:
    image = text_image("INVOICE 4711")
    response = client.post(
        "/v1/jobs",
        data={"prompt": "What is the invoice number?"},
        files=[("image", ("scan.png", image, "image/png"))],
    )
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert response.headers["location"] == f"/v1/jobs/{accepted['id']}"
    assert accepted["status"] in ("queued", "preprocessing")
    job = _wait(client, accepted["id"])
    assert job["status"] == "succeeded", job
    item = job["inputs"][0]
    assert item["status"] == "ok"
    assert "INVOICE" in item["text"]
    assert "4711" in item["text"]
    assert item["features"]["width"] == 800
    assert item["features"]["format"] == "PNG"
    assert {k for k in item["timings_ms"] if not k.endswith("_queue")} == {"decode", "ocr"}
    assert {"decode_queue", "ocr_queue"} <= set(item["timings_ms"])
    assert job["result"]["text"].strip()
    assert job["result"]["model"] == "smollm2-135m-instruct"
    assert job["result"]["completion_tokens"] > 0
    assert set(job["timings_ms"]) == {"queued", "preprocess", "infer_wait", "infer", "total"}
    assert job["timings_ms"]["total"] >= job["timings_ms"]["preprocess"]
    assert job["batch"]["size"] >= 1


def test_json_job_with_two_images_reads_both(client: TestClient) -> None:
    images = [text_image("ALPHA 12"), text_image("BRAVO 34", fmt="JPEG")]
    body = {
        "prompt": "List the words.",
        "inputs": [{"kind": "image", "data": base64.b64encode(i).decode()} for i in images],
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = _wait(client, response.json()["id"])
    assert job["status"] == "succeeded", job
    texts = [i["text"] for i in job["inputs"]]
    assert "ALPHA" in texts[0]
    assert "BRAVO" in texts[1]
    assert job["inputs"][1]["features"]["format"] == "JPEG"


def test_text_only_job_skips_image_stages(client: TestClient) -> None:
    response = client.post("/v1/jobs", data={"prompt": "Say hello."})
    assert response.status_code == 202, response.text
    job = _wait(client, response.json()["id"])
    assert job["status"] == "succeeded", job
    assert job["inputs"] == []
    assert job["result"]["text"].strip()


def test_a_job_posted_with_wait_comes_back_ended_in_one_request(client: TestClient) -> None:
    response = client.post("/v1/jobs", params={"wait": 30}, data={"prompt": "Say hello."})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "succeeded", job
    assert job["result"]["text"].strip()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert response.headers["x-stoker-job-id"] == job["id"]
    assert client.get(f"/v1/jobs/{job['id']}").json()["result"] == job["result"]


def test_corrupt_image_fails_alone_and_the_job_degrades(client: TestClient) -> None:
    broken = truncated(text_image("LOST", size=(1600, 1200)), keep=0.3)
    good = text_image("KEPT 99")
    response = client.post(
        "/v1/jobs",
        data={"prompt": "What can you read?"},
        files=[("image", ("a.png", broken, "image/png")), ("image", ("b.png", good, "image/png"))],
    )
    assert response.status_code == 202, response.text
    assert response.headers["x-stoker-job-id"] == response.json()["id"]
    job = _wait(client, response.json()["id"])
    assert job["status"] == "degraded", job
    read = client.get(f"/v1/jobs/{job['id']}")
    assert (read.headers["x-stoker-job-id"], read.headers["x-stoker-degraded"]) == (job["id"], "image_corrupt")
    failed, ok = job["inputs"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "image_corrupt"
    assert failed["error"]["stage"] == "decode"
    assert ok["status"] == "ok"
    assert "KEPT" in ok["text"]
    assert job["result"]["text"].strip()


def test_unknown_job_is_404(client: TestClient) -> None:
    response = client.get("/v1/jobs/does-not-exist")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "job_not_found"


def test_wait_over_the_limit_is_rejected(client: TestClient) -> None:
    response = client.get(
        f"/v1/jobs/{uuid.uuid4().hex}", params={"wait": 31}
    )  # a well-formed id: a malformed one is 404
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"
    posted = client.post("/v1/jobs", params={"wait": 31}, data={"prompt": "Never made."})
    assert (posted.status_code, posted.json()["error"]["code"]) == (422, "invalid_request")


def test_ready_when_broker_and_store_answer(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"broker": "ok", "store": "ok"}


def test_jobs_arriving_together_share_batches(client: TestClient) -> None:
    responses = [client.post("/v1/jobs", data={"prompt": f"Count to {n}."}) for n in range(12)]
    jobs = [_wait(client, r.json()["id"]) for r in responses]
    assert all(job["status"] == "succeeded" for job in jobs)
    members: dict[str, int] = {}
    for job in jobs:
        members[job["batch"]["id"]] = members.get(job["batch"]["id"], 0) + 1
    sizes = {job["batch"]["id"]: job["batch"]["size"] for job in jobs}
    assert sizes == members  # every job reports the batch it really rode in
    assert max(sizes.values()) > 1
    assert max(sizes.values()) <= 8  # STOKER_MAX_BATCH_SIZE


def _one_image(client: TestClient, data: bytes) -> dict[str, Any]:
    response = client.post("/v1/jobs", data={"prompt": "What is it?"}, files=[("image", ("x.img", data, "image/png"))])
    assert response.status_code == 202, response.text
    return _wait(client, response.json()["id"])


BAD_IMAGES = {
    "decompression bomb": (lambda: png_bomb(60_000, 60_000), "image_too_large"),
    "truncated jpeg": (lambda: truncated(text_image("CUT", size=(1600, 1200), fmt="JPEG"), 0.4), "image_corrupt"),
}


@pytest.mark.parametrize(("make", "code"), BAD_IMAGES.values(), ids=BAD_IMAGES.keys())
def test_bad_images_degrade_with_their_code(client: TestClient, make: Any, code: str) -> None:
    job = _one_image(client, make())
    assert job["status"] == "degraded", job
    assert job["inputs"][0]["error"]["code"] == code
    assert job["result"]["text"].strip()


def test_a_12_megapixel_class_jpeg_decodes_within_its_limit(client: TestClient) -> None:
    noise = Image.effect_noise((8000, 6000), 30).convert("RGB")
    data = encode(noise, "JPEG", quality=70)
    assert 8 * 1024 * 1024 < len(data) < 20 * 1024 * 1024
    job = _one_image(client, data)
    assert job["status"] == "succeeded", job  # over the decode soft limit it would be image_decode_timeout
    assert job["inputs"][0]["features"]["megapixels"] == 48.0


def test_an_animated_gif_with_thousands_of_frames_uses_its_first(client: TestClient) -> None:
    frames = [Image.new("L", (64, 64), n % 256) for n in range(3000)]
    job = _one_image(client, encode(frames[0], "GIF", save_all=True, append_images=frames[1:]))
    assert job["status"] == "succeeded", job
    assert job["inputs"][0]["features"]["animated"] is True
