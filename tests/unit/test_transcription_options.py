"""A transcription request's `language`, `prompt` and `temperature`: how they reach faster-whisper, how they shape
the transcript's cache address, and the language table they are checked against."""

from __future__ import annotations

import pytest
from transformers.models.whisper.tokenization_whisper import LANGUAGES as WHISPER_LANGUAGES

from stoker.core import asr
from stoker.core.cachekeys import fingerprint, transcribe_address
from stoker.core.jobs import InputRecord, SpeechOptions
from stoker.core.speech_languages import LANGUAGES, language_name
from stoker.core.tenancy import cache_scope

SCOPE = cache_scope("acme", shared=False)


def _address(speech: SpeechOptions | None) -> str:
    return transcribe_address("abc", SCOPE, model="tiny.en", weights="1:2", beam=1, speech=speech).fingerprint


@pytest.mark.parametrize("speech", [None, SpeechOptions(), SpeechOptions(temperature=0.0, prompt="")])
def test_a_request_that_asks_nothing_keeps_the_address_transcripts_had(speech: SpeechOptions | None) -> None:
    # the address as it was computed before requests could ask: existing cache entries stay valid
    assert _address(speech) == fingerprint(model="tiny.en", weights="1:2", beam=1, vad=True)


def test_each_option_asked_gives_a_transcript_an_address_of_its_own() -> None:
    addresses = {
        _address(None),
        _address(SpeechOptions(language="en")),
        _address(SpeechOptions(language="fr")),
        _address(SpeechOptions(prompt="Quarterly report, finance team.")),
        _address(SpeechOptions(prompt="Another glossary.")),
        _address(SpeechOptions(temperature=0.4)),
        _address(SpeechOptions(language="en", prompt="Quarterly report, finance team.")),
    }
    assert len(addresses) == 7


def test_options_become_faster_whispers_arguments() -> None:
    default = asr.decode_options(beam_size=1)
    assert "language" not in default
    assert "initial_prompt" not in default
    assert default["temperature"] == list(asr.TEMPERATURES)
    asked = asr.decode_options(beam_size=1, language="de", prompt="Glossar: Quartalsbericht.", temperature=0.3)
    assert asked["language"] == "de"
    assert asked["initial_prompt"] == "Glossar: Quartalsbericht."
    # the first try at the temperature asked, then the fallback above it, as the lookahead expects
    assert asked["temperature"] == [0.3, 0.4, 0.6, 0.8, 1.0]
    assert asr.next_temperature(0.3) == 0.4
    assert asr.decode_options(beam_size=1, temperature=1.0)["temperature"] == [1.0]


def test_a_record_keeps_its_options_only_when_asked() -> None:
    plain = InputRecord(index=0, kind="audio", content_hash="abc", size_bytes=3)
    assert "speech" not in plain.model_dump()
    asked = plain.model_copy(update={"speech": SpeechOptions(language="en")})
    again = InputRecord.model_validate_json(asked.model_dump_json())
    assert again.speech == SpeechOptions(language="en")


def test_the_language_table_is_whispers() -> None:
    assert LANGUAGES == WHISPER_LANGUAGES
    assert language_name("en") == "english"
    assert language_name("haw") == "hawaiian"
    assert language_name(None) is None
