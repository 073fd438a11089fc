"""Request validation at the door, without any service."""

from __future__ import annotations

import json

import pytest

from api.intake import UrlInput, _read_json, validate
from stoker.core.errors import InvalidRequest, PromptTooLong, TooManyInputs, UnsupportedMediaType
from stoker.core.jobs import InputKind
from stoker.core.media import content_hash
from stoker.settings import ApiSettings
from tests.media import text_image

SETTINGS = ApiSettings(max_images=2, max_prompt_chars=50)
PNG = text_image("X")


def test_valid_request_is_hashed_and_sniffed() -> None:
    accepted = validate("hi", [("image", PNG)], SETTINGS)
    assert accepted.inputs[0].digest == content_hash(PNG)
    assert accepted.inputs[0].format == "PNG"


@pytest.mark.parametrize(
    ("prompt", "raw", "error"),
    [
        (None, [], InvalidRequest),
        ("", [], InvalidRequest),
        ("x" * 51, [], InvalidRequest),
        ("hi", [("image", PNG)] * 3, TooManyInputs),
        ("hi", [("image", PNG), ("image", b"GIF00 not really")], UnsupportedMediaType),
    ],
    ids=["missing", "empty", "too-long", "too-many", "bad-magic"],
)
def test_invalid_requests_raise_their_error(
    prompt: str | None, raw: list[tuple[InputKind, bytes | UrlInput]], error: type
) -> None:
    with pytest.raises(error):
        validate(prompt, raw, SETTINGS)


def test_a_prompt_over_the_limit_is_prompt_too_long_as_a_chats_is() -> None:
    with pytest.raises(PromptTooLong) as refused:
        validate("x" * 51, [], SETTINGS)
    assert refused.value.envelope() == {
        "error": {
            "message": "the prompt is 51 characters, more than the 50 this server takes",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "prompt_too_long",
        }
    }
    assert refused.value.http_status == 422
    assert validate("x" * 50, [], SETTINGS).prompt == "x" * 50


def test_deadline_defaults_from_settings_and_accepts_form_text() -> None:
    assert validate("hi", [], SETTINGS).deadline_ms == SETTINGS.deadline_ms
    assert validate("hi", [], SETTINGS, "1500").deadline_ms == 1500
    assert validate("hi", [], SETTINGS, 2500).deadline_ms == 2500


@pytest.mark.parametrize("deadline", ["soon", "1.5", "99", str(SETTINGS.max_deadline_ms + 1), -5])
def test_bad_deadlines_are_refused(deadline: str | int) -> None:
    with pytest.raises(InvalidRequest, match="deadline_ms"):
        validate("hi", [], SETTINGS, deadline)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"prompt": "hi", "callbak_url": "https://a.example/h"}, "callbak_url"),  # a misspelt field
        (
            {"prompt": "hi", "inputs": [{"kind": "image", "url": "https://a.example/x.png", "detail": "high"}]},
            "inputs.0.detail",
        ),
    ],
    ids=["top-level", "in-an-input"],
)
def test_a_json_job_with_an_unknown_field_is_refused(body: dict[str, object], where: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        _read_json(json.dumps(body).encode(), SETTINGS)
    assert refused.value.envelope() == {
        "error": {
            "message": f"unknown field: {where}",
            "type": "invalid_request_error",
            "param": where,
            "code": "invalid_request",
        }
    }
    assert refused.value.http_status == 422
