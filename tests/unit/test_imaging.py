"""Image decode: safe opening, fast downscale, orientation, the two outputs."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from stoker.core.errors import ImageCorrupt, ImageTooLarge
from stoker.core.imaging import (
    DecodeNeeds,
    DecodeParams,
    decode_image,
    decode_rgb,
    error_text,
    served_picture,
    within,
)
from tests.media import encode, photo, png_bomb, text_image, truncated

PARAMS = DecodeParams(max_pixels=90_000_000, ocr_max_side=2048)


def test_decode_yields_features_and_the_ocr_image() -> None:
    decoded = decode_image(text_image("HELLO", size=(800, 200)), PARAMS)
    assert decoded.features.format == "PNG"
    assert (decoded.features.width, decoded.features.height) == (800, 200)
    assert decoded.ocr_image is not None
    assert decoded.ocr_image.shape == (200, 800)
    assert decoded.ocr_image.dtype == np.uint8
    assert decoded.picture is None  # no model asked for the picture
    assert decoded.ocr_image.min() < 50 < 200 < decoded.ocr_image.max()  # black text on white survived


def test_decode_makes_only_what_is_needed() -> None:
    data = text_image("HELLO", size=(800, 200))
    neither = decode_image(data, PARAMS, DecodeNeeds(ocr=False, picture=False))
    assert (neither.ocr_image, neither.picture) == (None, None)
    both = decode_image(data, PARAMS, DecodeNeeds(ocr=True, picture=True))
    assert both.ocr_image is not None
    assert both.picture is not None
    assert both.picture.size == (800, 200)


def test_the_full_picture_is_not_shrunk_for_ocr() -> None:
    """A JPEG bigger than OCR's side: OCR gets it shrunk, the full picture keeps every pixel (no draft scale)."""
    big = Image.new("RGB", (3000, 1000), "white")
    decoded = decode_image(encode(big, "JPEG", quality=90), PARAMS, DecodeNeeds(ocr=True, picture=True))
    assert decoded.picture is not None
    assert decoded.picture.size == (3000, 1000)
    assert decoded.ocr_image is not None
    assert max(decoded.ocr_image.shape) <= 2048


def test_the_served_picture_fits_the_bounds_losslessly_and_is_never_enlarged() -> None:
    picture = decode_rgb(text_image("PAGE", size=(1600, 400)), PARAMS)
    served = Image.open(io.BytesIO(served_picture(picture, 1024)))
    assert (served.format, served.size) == ("PNG", (1024, 256))
    small = Image.open(io.BytesIO(served_picture(picture, 4096)))
    assert np.array_equal(np.asarray(small), np.asarray(picture))  # lossless, at the upload's own size
    assert within((4000, 3000), 10_000, max_pixels=3_000_000) == (2000, 1500)
    assert within((1, 1), 64) == (1, 1)


def test_a_served_photo_over_the_cache_limit_as_png_goes_as_the_best_jpeg_that_fits() -> None:
    limit = 8 * 1024**2  # STOKER_CACHE_MAX_VALUE_BYTES's default
    picture = photo(4096, 3072, seed=5)
    assert len(served_picture(picture, 4096)) > limit  # lossless, a camera's noise and all
    data = served_picture(picture, 4096, max_bytes=limit)
    served = Image.open(io.BytesIO(data))
    assert (served.format, served.size) == ("JPEG", (4096, 3072))  # at the served size: only the encoding gives
    assert len(data) <= limit
    # a limit no quality meets: the best quality at a smaller size, within it
    tight = served_picture(photo(800, 600, seed=5), 4096, max_bytes=40_000)
    shrunk = Image.open(io.BytesIO(tight))
    assert len(tight) <= 40_000
    assert shrunk.format == "JPEG"
    assert max(shrunk.size) < 800
    assert shrunk.size[0] * 3 == pytest.approx(shrunk.size[1] * 4, abs=4)  # the same shape
    # a picture whose PNG fits stays lossless
    page = decode_rgb(text_image("PAGE", size=(1600, 400)), PARAMS)
    assert Image.open(io.BytesIO(served_picture(page, 4096, max_bytes=limit))).format == "PNG"


def test_big_jpeg_is_downscaled_while_decoding() -> None:
    big = Image.new("RGB", (8000, 6000), "white")
    decoded = decode_image(encode(big, "JPEG", quality=70), PARAMS)
    assert (decoded.features.width, decoded.features.height) == (8000, 6000)
    assert decoded.ocr_image is not None
    assert max(decoded.ocr_image.shape) <= 2048
    assert decoded.features.megapixels == 48.0


@pytest.mark.parametrize("mode", ["RGB", "CMYK", "L"])
def test_a_jpeg_read_for_ocr_alone_is_its_luma_as_the_full_picture_would_give_it(mode: str) -> None:
    """Decoded for OCR alone, a colour JPEG gives its luma channel (no colour conversion): the same grey levels, to
    the rounding, as its RGB picture converted; CMYK and grey JPEGs go the long way and agree as well."""
    rng = np.random.default_rng(7)
    colours = rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)
    image = Image.fromarray(colours).resize((2400, 1800), Image.Resampling.NEAREST).convert(mode)
    data = encode(image, "JPEG", quality=92)
    alone = decode_image(data, PARAMS, DecodeNeeds(ocr=True, picture=False)).ocr_image
    via_picture = decode_image(data, PARAMS, DecodeNeeds(ocr=True, picture=True)).ocr_image
    assert alone is not None
    assert via_picture is not None
    assert alone.shape == via_picture.shape == (1536, 2048)
    apart = np.abs(alone.astype(int) - via_picture.astype(int))
    assert apart.mean() < 0.5  # the same picture; they differ only where colours clamp at a block's edge
    assert (apart > 3).mean() < 0.005


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (300, 100), "white")
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to view
    decoded = decode_image(encode(image, "JPEG", exif=exif), PARAMS)
    assert (decoded.features.width, decoded.features.height) == (100, 300)
    assert decoded.ocr_image is not None
    assert decoded.ocr_image.shape == (300, 100)


def test_transparent_pixels_become_white() -> None:
    decoded = decode_image(encode(Image.new("RGBA", (20, 20), (0, 0, 0, 0)), "PNG"), PARAMS)
    assert decoded.ocr_image is not None
    assert decoded.ocr_image.min() == 255


def test_animated_gif_is_flagged_and_its_first_frame_used() -> None:
    frames = [Image.new("L", (32, 32), v) for v in (0, 255, 128)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    decoded = decode_image(data, PARAMS)
    assert decoded.features.animated is True
    assert decoded.ocr_image is not None
    assert decoded.ocr_image.max() == 0


def test_decompression_bomb_is_refused_before_decoding() -> None:
    with pytest.raises(ImageTooLarge) as info:
        decode_image(png_bomb(50_000, 50_000), PARAMS)
    assert info.value.code == "image_too_large"


def test_one_pixel_over_the_cap_is_refused() -> None:
    data = encode(Image.new("L", (101, 100)), "PNG")
    with pytest.raises(ImageTooLarge):
        decode_image(data, DecodeParams(max_pixels=100 * 100, ocr_max_side=64))
    decode_image(data, DecodeParams(max_pixels=101 * 100, ocr_max_side=64))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_is_corrupt(fmt: str) -> None:
    data = truncated(text_image("CUT", size=(1200, 900), fmt=fmt), keep=0.3)
    with pytest.raises(ImageCorrupt) as info:
        decode_image(data, PARAMS)
    assert info.value.stage == "decode"


def test_garbage_is_corrupt() -> None:
    with pytest.raises(ImageCorrupt):
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100, PARAMS)


@pytest.mark.parametrize(
    "data",
    [b"\x89PNG\r\n\x1a\n" + b"\x00" * 100, b"GIF89a" + b"\x00" * 30, b"\xff\xd8\xff" + b"\x00" * 50],
    ids=["png", "gif", "jpeg"],
)
def test_an_unidentified_image_is_told_without_the_decoders_object_or_its_address(data: bytes) -> None:
    with pytest.raises(ImageCorrupt) as info:
        decode_image(data, PARAMS)
    assert info.value.message == (
        "cannot identify image: not a picture in any format read here (JPEG, PNG, WEBP, GIF, BMP, TIFF, AVIF, HEIF)"
    )
    assert info.value.to_dict() == {"code": "image_corrupt", "message": info.value.message, "stage": "decode"}


def test_a_decoders_message_loses_the_address_of_any_object_it_names() -> None:
    said = OSError("cannot identify image file <_io.BytesIO object at 0x7fa31c2b9e40>")
    assert error_text(said) == "cannot identify image file"
    assert error_text(EOFError()) == "EOFError"  # an error without a message is named


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """A PNG's chunks as (type, payload), in file order."""
    chunks, position = [], 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        chunks.append((data[position + 4 : position + 8], data[position + 8 : position + 8 + length]))
        position += 12 + length
    return chunks


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    """A PNG of these chunks, each with its CRC made right (so only their order is wrong)."""
    body = b"".join(
        struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        for kind, payload in chunks
    )
    return b"\x89PNG\r\n\x1a\n" + body


def test_an_apng_whose_frame_controls_are_out_of_order_is_corrupt() -> None:
    frames = [Image.new("RGB", (32, 16), colour) for colour in ("red", "blue")]
    chunks = _png_chunks(encode(frames[0], "PNG", save_all=True, append_images=frames[1:]))
    kinds = [kind for kind, _ in chunks]
    assert kinds == [b"IHDR", b"acTL", b"fcTL", b"IDAT", b"fcTL", b"fdAT", b"IEND"]
    assert decode_image(_png(chunks), PARAMS).features.animated is True  # rebuilt as it was, it decodes
    second = kinds.index(b"fcTL", 3)
    chunks[second], chunks[second + 1] = chunks[second + 1], chunks[second]  # the frame's data before its control
    with pytest.raises(ImageCorrupt) as info:
        decode_image(_png(chunks), PARAMS)
    assert (info.value.code, info.value.stage) == ("image_corrupt", "decode")
    assert "frame sequence" in info.value.message
