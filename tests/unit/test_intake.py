"""Request validation at the door, without any service."""

from __future__ import annotations

import pytest

from api.intake import validate
from stoker.core.media import content_hash
from stoker.errors import InvalidRequest, TooManyInputs, UnsupportedMediaType
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
def test_invalid_requests_raise_their_error(prompt: str | None, raw: list[tuple[str, bytes]], error: type) -> None:
    with pytest.raises(error):
        validate(prompt, raw, SETTINGS)
