"""Generation parameters: who can share a backend call, stop sequences, token limits, the stored request."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from stoker.adapters.tesseract import read_text
from stoker.core.errors import ImageTooLarge
from stoker.core.imaging import DecodeParams, decode_image
from stoker.core.media import guess_kind, sniff_format
from stoker.core.model import GenerationParams, ModelRequest, apply_stop, sampling_groups
from tests.media import text_image


def _request(**params: object) -> ModelRequest:
    return ModelRequest([1], params=GenerationParams(**params))


def test_greedy_requests_share_a_call_whatever_their_seed_and_samplers_group_by_their_parameters() -> None:
    requests = [
        _request(),
        _request(temperature=0.5),
        _request(seed=4),
        _request(temperature=0.5),
        _request(temperature=0.5, seed=1),
    ]
    assert sampling_groups(requests, mixes_sampling=False) == [[0, 2], [1, 3], [4]]
    assert sampling_groups(requests, mixes_sampling=True) == [[0, 1, 2, 3, 4]]
    assert sampling_groups([], mixes_sampling=True) == []


def test_the_earliest_stop_sequence_cuts_the_answer() -> None:
    assert apply_stop("one two. three END four", ("END", ".")) == ("one two", True)
    assert apply_stop("nothing to cut", ("END",)) == ("nothing to cut", False)
    assert apply_stop("empty stops", ("",)) == ("empty stops", False)


def test_token_limits_default_and_cap() -> None:
    assert GenerationParams().new_tokens(default=64, cap=512) == 64
    assert GenerationParams(max_tokens=1000).new_tokens(default=64, cap=512) == 512
    assert GenerationParams(max_tokens=5).new_tokens(default=64, cap=512) == 5
    assert GenerationParams(max_tokens=500).new_tokens(default=64, cap=512, room=40) == 40  # the context is full
    assert GenerationParams().new_tokens(default=64, cap=512, room=0) == 1


def test_a_request_round_trips_with_its_parameters_and_stream() -> None:
    request = ModelRequest(
        [1, 2],
        [{"role": "user", "content": "x", "images": ["h"]}],
        ["h"],
        "s",
        GenerationParams(temperature=1.0, stop=("x",)),
        "job1",
    )
    assert ModelRequest.from_json(request.to_json()) == request
    assert ModelRequest.from_json('{"ids": [3]}') == ModelRequest([3])


@pytest.mark.parametrize("fmt", ["AVIF", "HEIF"])
def test_avif_and_heif_pictures_are_images_by_their_bytes(fmt: str) -> None:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(text_image("PHONE"))).convert("RGB").save(buffer, format=fmt)
    data = buffer.getvalue()
    assert sniff_format("image", data) == fmt
    assert guess_kind(data) == "image"
    assert sniff_format("video", data) is None


def test_an_mp4_is_not_taken_for_a_picture() -> None:
    head = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    assert sniff_format("image", head + b"\x00" * 64) is None


@pytest.mark.parametrize("fmt", ["AVIF", "HEIF"])
def test_avif_and_heif_pictures_decode_under_the_same_pixel_limit(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # decode sets Pillow's global cap
    buffer = io.BytesIO()
    Image.open(io.BytesIO(text_image("PHONE 42"))).convert("RGB").save(buffer, format=fmt)
    decoded = decode_image(buffer.getvalue(), DecodeParams())
    assert (decoded.features.format, decoded.features.width, decoded.features.height) == (fmt, 800, 200)
    assert decoded.ocr_image is not None
    assert "PHONE" in read_text(decoded.ocr_image, "eng", timeout_s=10)
    with pytest.raises(ImageTooLarge):
        decode_image(buffer.getvalue(), DecodeParams(max_pixels=800 * 200 - 1))
