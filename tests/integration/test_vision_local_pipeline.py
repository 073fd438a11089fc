"""An image job through the real workers with the tiny VLM as the local backend: the answer is the model's own on
the raw picture, and a restarted inference worker still finds the picture's vision embeddings in the shared store.

The fleet is `vlm_fleet`'s, its inference worker replaced for these tests by one of the `transformers` backend
(and put back after)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from stoker.adapters.store import Store
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.core.tenancy import issue_key
from tests.fakeopenai import FakeServer
from tests.fleet import Fleet
from tests.media import text_image

#: The model runs in this process: these tests run beside no other that does (tests/conftest.py).
pytestmark = pytest.mark.real_model

TOKENS = 6


@pytest.fixture(scope="module")
def fleet(vlm_fleet: tuple[FakeServer, Fleet]) -> Iterator[Fleet]:
    crew = vlm_fleet[1]
    _local_inference(crew)
    yield crew
    crew.kill("infer")
    crew.start("infer")  # the fleet's own, the openai backend, for the tests after these
    crew.wait_workers(("infer",))


def _local_inference(crew: Fleet) -> None:
    """(Re)start the inference worker as the `transformers` backend serving the tiny VLM."""
    if "infer" in crew.procs:
        crew.kill("infer")
    crew.start("infer", STOKER_BACKEND="transformers", STOKER_MAX_NEW_TOKENS=str(TOKENS))
    crew.wait_workers(("infer",))


@pytest.fixture(scope="module")
def in_process(tiny_vlm: Path) -> tuple[Any, Any]:
    """The tiny VLM and its processor, loaded as a user loads them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval(), AutoProcessor.from_pretrained(tiny_vlm)


def _answer(in_process: tuple[Any, Any], data: bytes, prompt: str) -> str:
    """What a user writing the processor and the model in one process gets (greedy)."""
    model, processor = in_process
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=text, images=[decode_rgb(data, DecodeParams())], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    # Whitespace and all: stoker's answer keeps the model's, as vLLM's does.
    answer: str = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return answer


def _run(
    fleet: Fleet, data: bytes, prompt: str, client: TestClient | None = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    api = client or fleet.client
    files = [("image", ("p.png", data, "image/png"))]
    response = api.post("/v1/jobs", data={"prompt": prompt}, files=files, headers=headers)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(f"/v1/jobs/{job_id}", params={"wait": 5}, headers=headers).json()
        if job["status"] in ("succeeded", "degraded", "failed"):
            return job
    raise AssertionError(f"job {job_id} did not end:\n{fleet.logs()}")


def test_an_image_job_answers_as_the_model_in_process_and_a_restarted_worker_skips_the_encoder(
    fleet: Fleet, in_process: tuple[Any, Any]
) -> None:
    data = text_image("PIPELINE 7", size=(800, 200))
    first = _run(fleet, data, "What does it say?")
    assert first["status"] == "succeeded", first
    assert first["inputs"][0]["encoder"] == "miss"
    assert first["result"]["text"] == _answer(in_process, data, "What does it say?")

    _local_inference(fleet)  # a restarted worker: its memory is empty, the shared store is not
    second = _run(fleet, data, "Describe it.")
    assert second["status"] == "succeeded", second
    assert second["inputs"][0]["encoder"] == "hit"
    assert second["result"]["text"] == _answer(in_process, data, "Describe it.")


def test_a_tenant_sees_no_sign_of_a_picture_another_tenant_sent(fleet: Fleet) -> None:
    store = Store.over(fleet.store(), blob_ttl_s=3600, job_ttl_s=3600)
    headers = {}
    for name in ("alpha", "beta"):
        issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
        store.tenants.put_api_key(issued.record)
        headers[name] = {"Authorization": f"Bearer {issued.token}"}
    data = text_image(f"ONLY ALPHA {uuid.uuid4().hex[:6]}", size=(400, 200))
    with fleet.api(auth=True, rate_limit_per_s=1000.0, rate_limit_burst=1000) as api:
        first = _run(fleet, data, "What does it say?", api, headers["alpha"])
        second = _run(fleet, data, "What does it say?", api, headers["beta"])
    assert first["status"] == second["status"] == "succeeded", (first, second)
    assert first["inputs"][0]["encoder"] == "miss"
    # the same picture, sent by beta after alpha: computed again, as if alpha had never sent it
    assert second["inputs"][0]["encoder"] == "miss"
    assert second["inputs"][0]["cache_hit"] == {"decode": False}
