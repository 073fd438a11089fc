"""`/v1/audio/transcriptions` (and the endpoints refused with their reason) with the official `openai` client, over
HTTP, against the real workers and speech model."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from api.app import create_app
from stoker.settings import ApiSettings
from tests.media import speech_wav, wav_header
from tests.serving import serve

MODEL = ApiSettings().public_model_name
SRT_CUE = re.compile(r"^1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n\S")


@pytest.fixture(scope="module")
def base_url(workers: dict[str, Path]) -> Iterator[str]:
    """The API (auth off, as `stoker up` runs locally), served over HTTP."""
    with serve(create_app(ApiSettings())) as base:
        yield base


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The official client, pointed at stoker; no retries, so a refusal surfaces as raised."""
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as official:
        yield official


@pytest.fixture(scope="module")
def spoken() -> bytes:
    return speech_wav("please send the quarterly report to the finance team")


def test_a_spoken_wav_is_transcribed_as_text_json_verbose_json_and_srt(
    client: openai.OpenAI, base_url: str, spoken: bytes
) -> None:
    plain = client.audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("speech.wav", spoken), response_format="text"
    )
    text = plain.parse()
    assert "quarterly report" in text.lower()
    job = httpx.get(f"{base_url}/v1/jobs/{plain.headers['x-stoker-job-id']}").json()
    assert job["status"] == "succeeded"
    assert job["result"] is None  # the transcript is the answer: no model ran

    as_json = client.audio.transcriptions.create(model=MODEL, file=("speech.wav", spoken))
    assert as_json.text.strip() == text.strip()

    verbose = client.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", spoken), response_format="verbose_json"
    )
    assert verbose.text.strip() == text.strip()
    assert verbose.language == "english"  # by name, as OpenAI answers
    assert verbose.duration > 1.0
    segments = verbose.segments or []
    assert segments
    assert [s.id for s in segments] == list(range(len(segments)))
    assert all(0.0 <= s.start < s.end <= verbose.duration + 0.5 for s in segments)
    assert " ".join(s.text for s in segments).strip() == verbose.text.strip()

    subtitles = client.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", spoken), response_format="srt"
    )
    assert SRT_CUE.match(subtitles)
    assert "quarterly report" in subtitles.lower()


def test_language_prompt_and_temperature_reach_the_speech_model_and_its_cache_address(
    client: openai.OpenAI, base_url: str
) -> None:
    recording = speech_wav("the invoices for march are overdue")

    def transcribe(**asked: Any) -> tuple[str, dict[str, Any]]:
        raw = client.audio.transcriptions.with_raw_response.create(
            model="whisper-1", file=("speech.wav", recording), response_format="verbose_json", **asked
        )
        job = httpx.get(f"{base_url}/v1/jobs/{raw.headers['x-stoker-job-id']}").json()
        verbose = raw.parse()
        assert verbose.language == "english"
        return verbose.text, job["inputs"][0]

    text, plain = transcribe()
    assert "invoices" in text.lower()
    assert "speech" not in plain  # a recording sent with no options has the record it always had
    _, asked = transcribe(language="en", prompt="Invoices, March, overdue.", temperature=0.2)
    assert asked["speech"] == {"language": "en", "prompt": "Invoices, March, overdue.", "temperature": 0.2}
    assert asked["cache_hit"]["transcribe"] is False  # not the transcript made without them
    _, again = transcribe(language="en", prompt="Invoices, March, overdue.", temperature=0.2)
    assert again["cache_hit"]["transcribe"] is True
    _, other = transcribe(language="en", prompt="A different glossary.", temperature=0.2)
    assert other["cache_hit"]["transcribe"] is False  # another prompt, another transcript


def test_a_language_that_is_no_whisper_code_is_refused(client: openai.OpenAI, spoken: bytes) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.transcriptions.create(model="whisper-1", file=("speech.wav", spoken), language="klingon")
    assert raised.value.param == "language"
    assert "klingon" in raised.value.message


def test_an_unreadable_recording_is_refused_with_its_code(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.audio.transcriptions.create(model="whisper-1", file=("empty.wav", wav_header(0)))
    assert raised.value.code == "media_empty"
    assert raised.value.param == "file"


def test_word_timestamps_and_other_models_are_refused(client: openai.OpenAI, spoken: bytes) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.transcriptions.create(
            model="whisper-1",
            file=("speech.wav", spoken),
            response_format="verbose_json",
            timestamp_granularities=["word"],
        )
    assert raised.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError) as missing:
        client.audio.transcriptions.create(model="no-such-model", file=("speech.wav", spoken))
    assert missing.value.code == "model_not_found"


def test_translations_and_embeddings_are_refused_with_their_reason(
    client: openai.OpenAI, base_url: str, spoken: bytes
) -> None:
    # by hand: the openai client marks its translations call deprecated
    files = {"file": ("speech.wav", spoken)}
    translation = httpx.post(f"{base_url}/v1/audio/translations", data={"model": "whisper-1"}, files=files)
    assert translation.status_code == 404
    error = translation.json()["error"]
    assert error["code"] == "endpoint_not_served"
    assert "does not translate" in error["message"]
    with pytest.raises(openai.NotFoundError) as embedding:
        client.embeddings.create(model=MODEL, input="a sentence")
    assert embedding.value.code == "endpoint_not_served"
    assert "not an embedding model" in embedding.value.message
