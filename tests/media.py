"""Test media made on the spot: images of rendered text and deliberately broken files."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image, ImageDraw, ImageFont


def text_image(text: str, size: tuple[int, int] = (800, 200), fmt: str = "PNG", font_size: int = 64) -> bytes:
    """An image of black text on white, encoded as fmt."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text(
        (40, size[1] // 2 - font_size // 2), text, fill="black", font=ImageFont.load_default(size=font_size)
    )
    return encode(image, fmt)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    """Encode a Pillow image to bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def truncated(data: bytes, keep: float = 0.5) -> bytes:
    """The first part of a file, as an interrupted upload leaves it."""
    return data[: int(len(data) * keep)]


def png_bomb(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width×height pixels (a decompression bomb)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    body = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
