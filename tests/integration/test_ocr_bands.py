"""Chunked OCR on real workers and the real tesseract: a dense page read as bands on any CPU child, joined into the
text whole-page OCR reads; a band that fails fails its page alone; bands cached for a retry or a repeat."""

from __future__ import annotations

import os
import secrets
import signal
from contextlib import suppress
from typing import Any

import redis
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw, ImageFont

from stoker.adapters.store.keys import job_key
from stoker.adapters.tesseract import read_text
from stoker.core.imaging import DecodeParams, decode_image
from stoker.core.jobs import TERMINAL
from stoker.settings import ApiSettings
from tests.conftest import pids_named, queued
from tests.integration.conftest import SessionWorkers, SpySubmitter
from tests.media import SENTENCE, encode, speech_wav, text_image
from workers.procs import wait_for

#: A tag's letters: none tesseract mistakes for another or splits off (a run of "1"s at a line's start can be read
#: as a column of its own, before the rest of the page).
_TAG_LETTERS = "ACEFHKMNPRTWXY345789"
#: Samples in a row (taken 0.3 s apart) that one CPU child must be idle in, with OCR work waiting, to sit idle.
SITTING = 3


def _tag() -> str:
    """A fresh six-letter tag, so no page is a cache hit of another test's."""
    return "".join(secrets.choice(_TAG_LETTERS) for _ in range(6))


def _dense_page(tag: str = "DENSE") -> bytes:
    """A page of 14 lines across its width whose OCR image (2048 × 1433) is well over the band threshold: three
    bands (short words: the model reads a short prompt)."""
    return _lined_page(tag, (2400, 1680), lines=14, words=6, font_size=34, spacing=100)


def _lined_page(tag: str, size: tuple[int, int], lines: int, words: int, font_size: int, spacing: int) -> bytes:
    """A page of `lines` lines of `words` short words, new each time whatever its tag, so no page is a cache hit of
    another test's: 32 random bits in the top row of its margin, as white and near-white pixels that OCR's
    thresholding reads as white alike (a random tag would do it too, but some tags' letters are read differently on
    the whole page, where tesseract splits a line's start off as a column of its own)."""
    image = Image.new("L", size, 255)
    for x in range(32):
        image.putpixel((x, 0), 255 - secrets.randbelow(2))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    margin = spacing * 6 // 10
    for row in range(lines):
        line = f"{tag} ROW{row} " + " ".join(f"W{row}X{n}" for n in range(words))
        draw.text((margin, margin + row * spacing), line, fill=0, font=font)
    return encode(image, "PNG")


def _submit(client: TestClient, *images: bytes) -> str:
    files = [("image", (f"page{n}.png", data, "image/png")) for n, data in enumerate(images)]
    response = client.post("/v1/jobs", data={"prompt": "Read it."}, files=files)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _wait(client: TestClient, job_id: str) -> dict[str, Any]:
    for _ in range(10):
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        if job["status"] in ("succeeded", "degraded", "failed", "cancelled"):
            return job
    raise AssertionError(f"job {job_id} not terminal: {job}")


def test_a_dense_page_is_read_in_bands_that_join_into_the_whole_page_text(client: TestClient) -> None:
    page = _dense_page()  # its text read the same whole or in bands
    first = _wait(client, _submit(client, page))
    assert first["status"] == "succeeded", first
    read = first["inputs"][0]
    assert read["bands"] == 3  # three band tasks, not one OCR of the whole page
    assert read["cache_hit"]["ocr_band"] is False
    assert read["timings_ms"]["ocr_band"] > 0
    ocr_image = decode_image(page, DecodeParams()).ocr_image
    assert ocr_image is not None
    whole = read_text(ocr_image, "eng", timeout_s=60)
    assert read["text"].split() == whole.split()

    again = _wait(client, _submit(client, page))["inputs"][0]  # a repeat: the input comes whole from the cache
    assert (again["timings_ms"], again["cache_hit"]["ocr"], again["text"]) == ({}, True, read["text"])

    cache: redis.Redis[bytes] = redis.Redis.from_url(os.environ["STOKER_CACHE_URL"])
    digest = read["content_hash"]
    lost = [*cache.keys(f"stoker:cache:ocr:*:{digest}:*"), *cache.keys(f"stoker:cache:input:*:{digest}:*")]
    assert len(lost) == 2
    cache.delete(*lost)  # the page's text is gone (evicted): its bands are still there
    retried = _wait(client, _submit(client, page))["inputs"][0]
    assert (retried["bands"], retried["cache_hit"]["ocr_band"], retried["text"]) == (3, True, read["text"])


def test_a_band_whose_tesseract_is_killed_fails_its_page_alone(
    client: TestClient, session_workers: SessionWorkers
) -> None:
    cpu_pid = session_workers.procs["cpu"].pid
    small = text_image(f"KEPT {_tag()}")
    # Read once on its own first: in the job below it comes whole from the cache, so every tesseract running then is
    # one of the page's bands. (Waiting for it to be read while a band still ran was a race the page could win.)
    assert _wait(client, _submit(client, small))["status"] == "succeeded"
    job_id = _submit(client, _dense_page(_tag()), small)
    wait_for(lambda: bool(pids_named("tesseract", cpu_pid)), 60, "a band of the page to be read", [])
    for pid in pids_named("tesseract", cpu_pid):  # only the page's bands read now
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job = _wait(client, job_id)
    assert job["status"] == "degraded", job
    page, kept = job["inputs"]
    assert (page["status"], page["error"]["code"], page["bands"]) == ("failed", "ocr_failed", 3)
    assert kept["status"] == "ok"
    assert kept["cache_hit"]["ocr"] is True
    assert "KEPT" in kept["text"]
    assert job["result"]["text"].strip()  # the model still answered, with what could be read


def test_no_cpu_child_idles_while_ocr_work_waits_behind_a_transcription(client: TestClient) -> None:
    from tasks.worker import app

    cpu = next(name for reply in app.control.ping(timeout=1) for name in reply if name.startswith("cpu@"))
    inspect = app.control.inspect(destination=[cpu], timeout=2)

    def transcribing() -> bool:
        return any(t["name"] == "stoker.transcribe" for t in inspect.active()[cpu])

    dense = [_dense_page(_tag()) for _ in range(3)]  # drawn beforehand: they arrive right after the speech
    # Half a minute of speech no other test sends (so no cached transcript): its transcription still runs while the
    # pages wait and are read.
    talk = speech_wav(". ".join([SENTENCE] * 6 + [f"Talk number {secrets.randbelow(10**6)}"]))
    speech = client.post("/v1/jobs", data={"prompt": "Summarise."}, files=[("audio", ("talk.wav", talk, "audio/wav"))])
    assert speech.status_code == 202, speech.text
    wait_for(transcribing, 60, "the transcription to start", [])  # the pages arrive behind a running transcription
    pages = [_submit(client, page) for page in dense]
    samples: list[tuple[frozenset[int], int, bool]] = []  # (idle children's pids, OCR waiting, speech running)

    broker: redis.Redis[bytes] = redis.Redis.from_url(os.environ["STOKER_BROKER_URL"])

    def sample() -> bool:
        pool = inspect.stats()[cpu]["pool"]["processes"]  # read each time: a recycled child has a new pid
        running, reserved = inspect.active()[cpu], inspect.reserved()[cpu]
        waiting = sum(queued(broker, queue) for queue in ("ocr", "ocr_bands")) + sum(
            1 for t in reserved if t["name"].startswith("stoker.ocr")
        )
        idle = frozenset(pool) - {t["worker_pid"] for t in running}
        samples.append((idle, waiting, any(t["name"] == "stoker.transcribe" for t in running)))
        read = {"inferring", *TERMINAL}  # a page still `queued` has not been read either
        return all(client.get(f"/v1/jobs/{j}").json()["status"] in read for j in pages)

    wait_for(sample, 120, "the pages to be read", [])
    busy = [s for s in samples if s[1] > 0]  # while OCR work waited in the worker
    assert any(s[2] for s in busy), samples  # the transcription ran in the same pool meanwhile
    # No child sat idle. A child handing over to its next task is idle for a moment (10-70 ms seen under a full
    # test run): a sample may catch it, and now and then the next one too, 0.3 s later. A child that sits idle
    # while a transcription holds another stays idle for the whole transcription (seconds): the same child idle
    # in SITTING samples in a row (a second or more) while OCR work waited in each is one.
    for window in zip(*(samples[i:] for i in range(SITTING)), strict=False):
        if all(waiting > 0 for _, waiting, _ in window):
            assert not frozenset.intersection(*(idle for idle, _, _ in window)), samples
    _wait(client, speech.json()["id"])  # over before the next test


def test_a_small_page_after_three_large_ones_is_read_before_them(
    client: TestClient, store_redis: redis.Redis[bytes]
) -> None:
    # Drawn beforehand, so they arrive back to back: drawing and encoding a page between two submissions gave the
    # pool time to start the second large page's bands before the small one came.
    pages, small_page = [_dense_page(_tag()) for _ in range(3)], text_image(f"SMALL {_tag()}")
    large = [_submit(client, page) for page in pages]
    small = _submit(client, small_page)
    for job_id in [*large, small]:
        assert _wait(client, job_id)["status"] == "succeeded"
    read_at = {j: float(store_redis.hget(job_key(j), "ts:preprocessed") or 0) for j in [*large, small]}
    order = sorted(read_at, key=read_at.__getitem__)
    # The small page's OCR took its turn beside the bands, not after the nine of them: at most the first large
    # page (whose bands the pool had taken before the small one arrived) is read before it.
    assert order.index(small) <= 1, order


def test_small_pages_waiting_with_large_ones_are_taken_first(
    session_workers: SessionWorkers, store_redis: redis.Redis[bytes]
) -> None:
    from api.app import create_app
    from tasks.worker import app

    # Pages above a megapixel are large for this API (a picture's size class is read from its header at the door).
    settings = ApiSettings(small_pixels=200_000, large_pixels=1_000_000)
    cpu = [name for reply in app.control.ping(timeout=1) for name in reply if name.startswith("cpu@")]

    def large_page() -> bytes:  # a page no other job sends (no cache hit), mostly blank: quick to read
        page = Image.new("L", (1400, 1000), 255)
        ImageDraw.Draw(page).text((60, 60), f"LARGE {_tag()}", fill=0, font=ImageFont.load_default(size=40))
        return encode(page, "PNG")

    with TestClient(create_app(settings, submitter=SpySubmitter())) as client:
        # Every page waits in the decode queue before any is taken (Celery's remote control holds the consumer).
        assert app.control.cancel_consumer("decode", destination=cpu, reply=True)
        try:
            large = [_submit(client, large_page()) for _ in range(5)]
            small = [_submit(client, text_image(f"SMALL {_tag()}")) for _ in range(2)]
        finally:
            app.control.add_consumer("decode", destination=cpu, reply=True)
        for job_id in [*large, small[-1]]:
            assert _wait(client, job_id)["status"] == "succeeded"
    started = {j: float(store_redis.hget(job_key(j), "ts:started") or 0) for j in [*large, *small]}
    # The three children took both small pages' decodes first (they were sent last); one large page may start on
    # the third child at the same moment as the second small one. First come, first served would start three
    # large pages before either small one.
    before = [j for j in large if started[j] < max(started[s] for s in small)]
    assert len(before) <= 1, started


def _text_page(tag: str) -> bytes:
    """A page of eight lines under the band size threshold (1100 × 800: 880,000 pixels)."""
    return _lined_page(tag, (1100, 800), lines=8, words=4, font_size=30, spacing=90)


def test_a_page_under_the_size_threshold_is_cut_only_while_no_cpu_work_waits(client: TestClient) -> None:
    from tasks.worker import app

    page = _text_page(_tag())
    idle = _wait(client, _submit(client, page))
    assert idle["status"] == "succeeded", idle
    read = idle["inputs"][0]
    assert read["bands"] == 2  # on an idle stack: two bands, on two children
    ocr_image = decode_image(page, DecodeParams()).ocr_image
    assert ocr_image is not None
    whole = read_text(ocr_image, "eng", timeout_s=60)
    assert read["text"].split() == whole.split()

    # A transcription waits in the ASR queue (its consumer held): the next such page is read whole.
    cpu = [name for reply in app.control.ping(timeout=1) for name in reply if name.startswith("cpu@")]
    broker: redis.Redis[bytes] = redis.Redis.from_url(os.environ["STOKER_BROKER_URL"])
    assert app.control.cancel_consumer("asr", destination=cpu, reply=True)
    try:
        talk = speech_wav(f"{SENTENCE} Number {secrets.randbelow(10**6)}.")  # no cached transcript
        speech = client.post("/v1/jobs", data={"prompt": "Hi."}, files=[("audio", ("t.wav", talk, "audio/wav"))])
        assert speech.status_code == 202, speech.text
        wait_for(lambda: queued(broker, "asr") > 0, 60, "the transcription to wait in its queue", [])
        busy = _wait(client, _submit(client, _text_page(_tag())))
    finally:
        app.control.add_consumer("asr", destination=cpu, reply=True)
    assert busy["status"] == "succeeded", busy
    assert busy["inputs"][0]["bands"] is None  # read whole: no child would have been free for a band
    assert busy["inputs"][0]["cache_hit"]["ocr"] is False
    assert _wait(client, speech.json()["id"])["status"] == "succeeded"
