"""The image path with a model that sees (the tiny VLM), through real CPU workers: decode stores the model's own
processor tensors, tokenize builds the processor's own prompt, OCR stays off by default, bad pictures fail alone.

The fleet is `vlm_fleet`'s (the `openai` backend in front of the fake server): what these tests read is what the
CPU side left in the cache (tensors, the built prompt) and what the server was sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from PIL import Image

from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.adapters.cache import StageCache
from stoker.adapters.store.keys import cache_key
from stoker.core.cachekeys import VISION_TENSORS, prompt_address, vision_address
from stoker.core.imaging import DecodeParams
from stoker.core.jobs import InputRecord
from stoker.core.media import ContentHash
from stoker.core.prompting import attachment_for
from stoker.core.tenancy import DEFAULT_TENANT, cache_scope
from stoker.settings import CommonSettings, WorkerSettings
from tests.fakeopenai import FakeServer
from tests.fakes.outbox import NoOutbox
from tests.fleet import Fleet
from tests.media import PICTURES, encode, photo, png_bomb, text_image, text_video, truncated

PROMPT = "What colour is it?"


@pytest.fixture(scope="module")
def fleet(vlm_fleet: tuple[FakeServer, Fleet]) -> Fleet:
    return vlm_fleet[1]


@pytest.fixture(scope="module")
def processor(tiny_vlm: Path) -> Any:
    """The tiny VLM's processor, as a user would run it in-process."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm)


def _run(fleet: Fleet, files: list[tuple[str, bytes]], prompt: str = PROMPT) -> dict[str, Any]:
    """Submit a job of these pictures and wait for its end."""
    parts = [("image", (name, data, "image/png")) for name, data in files]
    response = fleet.client.post("/v1/jobs", data={"prompt": prompt}, files=parts)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job: dict[str, Any] = fleet.client.get(f"/v1/jobs/{job_id}", params={"wait": 5}).json()
        if job["status"] in ("succeeded", "degraded", "failed"):
            return job
    raise AssertionError(f"job {job_id} did not end:\n{fleet.logs()}")


def _built(fleet: Fleet, job: dict[str, Any]) -> dict[str, Any]:
    """The prompt the tokenize stage built for the job (ids, messages, pictures), from the cache."""
    cache = StageCache.connect(CommonSettings(cache_url=fleet.env["STOKER_CACHE_URL"]))
    context = cache.context()
    assert context is not None
    attachments = [attachment_for(InputRecord.model_validate(r)) for r in job["inputs"]]
    built = cache.get_json(
        prompt_address(context, job["prompt"], attachments, cache_scope(DEFAULT_TENANT, shared=False))
    )
    assert built is not None
    return built


def _tensors(fleet: Fleet, digest: str, identity: str) -> PreparedImage:
    """A picture's tensors as the decode stage cached them."""
    s = WorkerSettings()
    params = DecodeParams(max_pixels=s.max_image_pixels, ocr_max_side=s.ocr_max_side)
    address = vision_address(digest, cache_scope(DEFAULT_TENANT, shared=False), params, identity)
    with redis.Redis.from_url(fleet.env["STOKER_CACHE_URL"]) as cache:
        raw = cache.get(cache_key(address, VISION_TENSORS))
    assert raw is not None, f"no tensors cached for {digest[:12]}"
    return PreparedImage.from_bytes(raw)


def _processor_ids(processor: Any, pictures: list[Image.Image], prompt: str = PROMPT) -> list[int]:
    chat = [{"role": "user", "content": [*({"type": "image"} for _ in pictures), {"type": "text", "text": prompt}]}]
    ids = processor(text=processor.apply_chat_template(chat, add_generation_prompt=True), images=pictures)
    return [int(i) for i in ids["input_ids"][0]]


@pytest.mark.parametrize("names", [list(PICTURES)[:4], list(PICTURES)[4:]], ids=["photos", "odd-ones"])
def test_cpu_stage_tensors_and_prompt_are_the_processors_own(
    fleet: Fleet, processor: Any, tiny_vlm: Path, names: list[str]
) -> None:
    """Landscape, portrait, EXIF-rotated JPEG, PNG with alpha; CMYK JPEG, 1×1, a page over the processor's maximum
    (and over OCR's side): the tensors the CPU stage cached are those of the processor run in-process on the
    picture, and the prompt ids those of the processor for the same chat."""
    preparer = ImagePreparer.load(tiny_vlm)
    assert preparer is not None
    made = {name: PICTURES[name][0]() for name in names}
    job = _run(fleet, [(f"{name}.img", data) for name, (data, _) in made.items()])
    assert job["status"] == "succeeded", job
    for record, (name, (_, picture)) in zip(job["inputs"], made.items(), strict=True):
        assert record["text"] is None, name  # OCR `auto` does not read pictures for a model that sees
        assert "ocr" not in record["timings_ms"]
        direct = processor.image_processor(images=picture, return_row_col_info=True)
        prepared = _tensors(fleet, record["content_hash"], preparer.identity)
        np.testing.assert_array_equal(
            prepared.tensors["pixel_values"], np.asarray(direct["pixel_values"]).astype(np.float16)
        )
        np.testing.assert_array_equal(prepared.tensors["pixel_attention_mask"], direct["pixel_attention_mask"] != 0)
        assert record["prepared"] == {
            "processor": preparer.identity,
            "layout": {"rows": direct["rows"], "cols": direct["cols"]},
        }, name
    built = _built(fleet, job)
    # Every picture in the prompt, in order, each placeholder expanded exactly as the processor expands it.
    assert built["images"] == [r["content_hash"] for r in job["inputs"]]
    assert built["ids"] == _processor_ids(processor, [picture for _, picture in made.values()])
    assert built["messages"] == [{"role": "user", "content": PROMPT, "images": built["images"]}]


def test_a_prompt_with_one_picture_is_the_processors_own(fleet: Fleet, processor: Any) -> None:
    picture = photo(640, 360, seed=10)
    job = _run(fleet, [("p.png", encode(picture, "PNG"))], prompt="Describe it.")
    built = _built(fleet, job)
    assert built["ids"] == _processor_ids(processor, [picture], "Describe it.")
    assert built["images"] == [job["inputs"][0]["content_hash"]]


def test_bad_pictures_fail_alone_and_the_prompt_says_which(vlm_fleet: tuple[FakeServer, Fleet], processor: Any) -> None:
    server, fleet = vlm_fleet
    good = photo(500, 300, seed=12)
    sliver = Image.new("RGB", (1, 20_000), (40, 90, 200))  # an aspect ratio no tiling expects: read all the same
    files = [
        ("good.png", encode(good, "PNG")),
        ("cut.jpg", truncated(text_image("CUT", size=(1600, 1200), fmt="JPEG"), 0.4)),
        ("bomb.png", png_bomb(50_000, 50_000)),
        ("sliver.png", encode(sliver, "PNG")),
    ]
    job = _run(fleet, files)
    assert job["status"] == "degraded", job
    statuses = [(r["status"], (r["error"] or {}).get("code")) for r in job["inputs"]]
    assert statuses == [("ok", None), ("failed", "image_corrupt"), ("failed", "image_too_large"), ("ok", None)]
    # No placeholder for a picture that could not be read; the text says which, and why.
    built = _built(fleet, job)
    hashes = [job["inputs"][0]["content_hash"], job["inputs"][3]["content_hash"]]
    assert built["images"] == hashes
    text = built["messages"][0]["content"]
    assert (
        text
        == f"[image 2 could not be read: image_corrupt]\n\n[image 3 could not be read: image_too_large]\n\n{PROMPT}"
    )
    assert built["ids"] == _processor_ids(processor, [good, sliver], text)
    # The server got the two pictures that were read, each at the served model's size, named by its hash.
    sent = [p for p in server.pictures if p.uuid in hashes]
    assert [(p.uuid, p.format) for p in sent] == [(h, "PNG") for h in hashes]
    assert [p.size for p in sent] == [(500, 300), (1, 1024)]  # under the 1024 edge as uploaded; the sliver shrunk


def test_the_inference_side_gets_tensors_from_the_cache_or_the_held_upload(
    fleet: Fleet, processor: Any, tiny_vlm: Path
) -> None:
    from stoker.runtime.context import WorkerContext

    picture = photo(400, 300, seed=13)
    upload = encode(picture, "PNG")
    job = _run(fleet, [("p.png", upload)])
    digest, scope = job["inputs"][0]["content_hash"], cache_scope(DEFAULT_TENANT, shared=False)
    env = fleet.env
    settings = WorkerSettings(
        broker_url=env["STOKER_BROKER_URL"],
        result_url=env["STOKER_RESULT_URL"],
        cache_url=env["STOKER_CACHE_URL"],
        model=str(tiny_vlm),
    )
    ctx = WorkerContext(settings, outbox=NoOutbox())
    direct = np.asarray(processor.image_processor(images=picture)["pixel_values"]).astype(np.float16)
    key = cache_key(ctx.pictures.vision_address(digest, scope), VISION_TENSORS)
    assert ctx.cache.redis is not None
    try:
        cached = ctx.pictures.prepared_image(digest, scope)
        assert cached is not None
        np.testing.assert_array_equal(cached.tensors["pixel_values"], direct)
        # The cache lost them while a job still holds the upload: prepared again from it, and cached again.
        ctx.store.blobs.put_blob(ContentHash(digest), upload, "a-job-still-running")
        ctx.cache.redis.delete(key)
        again = ctx.pictures.prepared_image(digest, scope)
        assert again is not None
        np.testing.assert_array_equal(again.tensors["pixel_values"], direct)
        assert ctx.cache.redis.exists(key)
        # Neither the cache nor the job store has them: None, for the inference side to fail that request alone.
        ctx.store.blobs.release("a-job-still-running")
        ctx.cache.redis.delete(key)
        assert ctx.store.blobs.get_blob(ContentHash(digest)) is None
        assert ctx.pictures.prepared_image(digest, scope) is None
    finally:
        ctx.close()


def test_video_keyframes_take_the_same_picture_path(fleet: Fleet, processor: Any) -> None:
    response = fleet.client.post(
        "/v1/jobs",
        data={"prompt": "What is shown?"},
        files=[("video", ("mute.webm", text_video("MUTE 3", None, fmt="matroska"), "video/webm"))],
    )
    assert response.status_code == 202, response.text
    job = fleet.client.get(f"/v1/jobs/{response.json()['id']}", params={"wait": 30}).json()
    deadline = time.monotonic() + 120
    while job["status"] not in ("succeeded", "degraded", "failed") and time.monotonic() < deadline:
        job = fleet.client.get(f"/v1/jobs/{job['id']}", params={"wait": 5}).json()
    assert job["status"] == "succeeded", job
    frames = job["inputs"][0]["frames"]
    assert len(frames) == 3
    assert all(f["prepared"] and f["text"] is None for f in frames)  # prepared for the model, not OCR'd
    built = _built(fleet, job)
    assert built["images"] == [f["content_hash"] for f in frames]  # in the order they were taken
    global_views = processor.tokenizer.convert_tokens_to_ids("<global-img>")
    assert built["ids"].count(global_views) == 3  # one picture's placeholder group per keyframe
