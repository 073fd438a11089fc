"""Content hashing and sniffing by magic bytes."""

from __future__ import annotations

import pytest
from PIL import Image

from stoker.core.media import IMAGE_FORMATS, content_hash, guess_kind, sniff_image_format
from tests.media import encode


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_every_allowed_format_is_recognised_by_its_bytes(fmt: str) -> None:
    data = encode(Image.new("RGB", (8, 8), "red"), fmt)
    assert sniff_image_format(data) == fmt


@pytest.mark.parametrize(
    "data",
    [b"", b"hello world", b"%PDF-1.7\n", b"\x00" * 64, b"RIFF\x00\x00\x00\x00WAVEfmt ", b"BM"],
    ids=["empty", "text", "pdf", "zeros", "wav", "bmp-stub"],
)
def test_other_bytes_are_not_images(data: bytes) -> None:
    assert sniff_image_format(data) is None


def test_hash_depends_on_content_only() -> None:
    assert content_hash(b"abc") == content_hash(b"abc")
    assert content_hash(b"abc") != content_hash(b"abd")
    assert len(content_hash(b"")) == 64


def test_kind_is_guessed_from_content_not_name() -> None:
    png = encode(Image.new("RGB", (8, 8)), "PNG")
    assert guess_kind(png, "song.mp3") == "image"
    assert guess_kind(b"ID3\x04rest", "photo.png") == "audio"
    assert guess_kind(b"\x00\x00\x00\x18ftypisom", "clip.mp4") == "video"
    assert guess_kind(b"\x00\x00\x00\x18ftypM4A ", "voice.m4a") == "audio"
    assert guess_kind(b"plain text", "a.txt") is None
