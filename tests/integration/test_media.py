"""Audio and video through the API, on real workers: transcripts, keyframe OCR, and every bad input."""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.test_pipeline import _wait
from tests.media import KEY_WORDS, flac_claiming, speech_wav, text_video, to_mp3, truncated, wav_header
from workers.procs import wait_for


@functools.cache
def mp3() -> bytes:
    return to_mp3(speech_wav())


def _submit(client: TestClient, field: str, name: str, data: bytes, prompt: str = "Summarise.") -> dict[str, Any]:
    response = client.post(
        "/v1/jobs", data={"prompt": prompt}, files=[(field, (name, data, "application/octet-stream"))]
    )
    assert response.status_code == 202, response.text
    return _wait(client, response.json()["id"])


def _ran(record: dict[str, Any]) -> set[str]:
    """The stages that ran on a record (its run times, not its queue waits)."""
    return {k for k in record["timings_ms"] if not k.endswith("_queue")}


def _heard(text: str) -> list[str]:
    return [w for w in KEY_WORDS if w in text.lower()]


def test_every_cpu_child_loads_the_speech_model_as_it_starts(workers: dict[str, Path]) -> None:
    """The session's CPU worker runs three children that may each transcribe: each loads the speech model at start
    (`STOKER_ASR_PRELOAD`), whether or not a recording has come, so none pays the load on a job."""

    def loaded() -> bool:
        return workers["cpu"].read_text(errors="replace").count("speech model preloaded in") >= 3

    wait_for(loaded, 60, "three CPU children to preload the speech model", [])
    # Three children on two cores: one thread each, so the second replica for fallback tries ahead fits.
    assert workers["cpu"].read_text(errors="replace").count("lookahead=True") >= 3


def test_speech_is_transcribed_and_answered(client: TestClient) -> None:
    job = _submit(client, "audio", "speech.mp3", mp3(), "What should be sent, and to whom?")
    assert job["status"] == "succeeded", job
    item = job["inputs"][0]
    assert item["kind"] == "audio"
    assert len(_heard(item["text"])) >= 4, item["text"]
    assert item["segments"]
    assert item["segments"][0]["end"] > item["segments"][0]["start"]
    assert item["features"]["duration_s"] > 3
    assert _ran(item) == {"probe", "transcribe"}
    assert job["result"]["text"].strip()


def test_video_gets_a_transcript_and_keyframe_text(client: TestClient) -> None:
    job = _submit(client, "video", "talk.mp4", text_video("SLIDE 7", speech_wav()))
    assert job["status"] == "succeeded", job
    item = job["inputs"][0]
    assert len(_heard(item["text"])) >= 4, item["text"]
    frames = item["frames"]
    assert len(frames) == 3
    assert [f["time_s"] for f in frames] == sorted(f["time_s"] for f in frames)
    assert any("SLIDE" in (f["text"] or "") for f in frames), frames
    assert all(_ran(f) == {"decode", "ocr"} for f in frames)


def test_video_without_sound_is_read_from_its_frames(client: TestClient) -> None:
    job = _submit(client, "video", "mute.webm", text_video("MUTE 3", None, fmt="matroska"))
    assert job["status"] == "succeeded", job
    item = job["inputs"][0]
    assert item["status"] == "ok"
    assert item["text"] == ""
    assert any("MUTE" in (f["text"] or "") for f in item["frames"])


def test_json_audio_input(client: TestClient) -> None:
    body = {"prompt": "Transcribe.", "inputs": [{"kind": "audio", "data": base64.b64encode(mp3()).decode()}]}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = _wait(client, response.json()["id"])
    assert len(_heard(job["inputs"][0]["text"])) >= 4


BAD_MEDIA = {
    "header-only wav": ("audio", lambda: wav_header(0), {"media_empty"}),
    "ten silent hours (flac)": ("audio", lambda: flac_claiming(10 * 3600), {"media_too_long"}),
    "ten hours by a wav header": ("audio", lambda: wav_header(10 * 3600), {"media_too_long"}),
    "corrupt flac": ("audio", lambda: b"fLaC" + b"\x00" * 200, {"media_corrupt", "media_empty"}),
}


@pytest.mark.parametrize(("field", "make", "codes"), BAD_MEDIA.values(), ids=BAD_MEDIA.keys())
def test_bad_media_fails_alone_and_the_job_degrades(client: TestClient, field: str, make: Any, codes: set[str]) -> None:
    job = _submit(client, field, "bad.bin", make())
    assert job["status"] == "degraded", job
    item = job["inputs"][0]
    assert item["status"] == "failed"
    assert item["error"]["code"] in codes
    assert "transcribe" not in item["timings_ms"]  # refused by the probe: nothing was decoded
    assert job["result"]["text"].strip()


def test_half_an_mp3_gives_a_structured_result(client: TestClient) -> None:
    job = _submit(client, "audio", "half.mp3", truncated(mp3(), 0.5))
    assert job["status"] in ("succeeded", "degraded"), job
    item = job["inputs"][0]
    if item["status"] == "ok":
        assert item["text"]
    else:
        assert item["error"]["code"] in {"media_corrupt", "media_empty"}


@pytest.mark.parametrize(
    ("field", "data"),
    [("audio", b"\x13\x37" * 512), ("audio", b""), ("video", b"ID3\x04 an mp3 posing as video")],
    ids=["random-bytes-as-mp3", "zero-bytes", "mp3-as-video"],
)
def test_unrecognised_media_is_415(client: TestClient, field: str, data: bytes) -> None:
    response = client.post("/v1/jobs", data={"prompt": "x"}, files=[(field, ("clip.mp3", data, "audio/mpeg"))])
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_one_audio_per_job(client: TestClient) -> None:
    files = [("audio", ("a.mp3", mp3(), "audio/mpeg")), ("audio", ("b.mp3", mp3(), "audio/mpeg"))]
    response = client.post("/v1/jobs", data={"prompt": "x"}, files=files)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "too_many_inputs"
