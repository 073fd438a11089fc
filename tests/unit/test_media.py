"""Content hashing and sniffing by magic bytes."""

from __future__ import annotations

import pytest
from PIL import Image

from stoker.core.media import IMAGE_FORMATS, content_hash, sniff_image_format
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
