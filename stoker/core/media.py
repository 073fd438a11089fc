"""Content addressing and media sniffing: what an input is, judged by its bytes alone."""

from __future__ import annotations

from typing import NewType

import blake3

ContentHash = NewType("ContentHash", str)

#: Image formats accepted at the door, by magic bytes. Names match Pillow's format identifiers.
IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def content_hash(data: bytes) -> ContentHash:
    """BLAKE3 of the bytes, hex: the identity of an input wherever it goes."""
    return ContentHash(blake3.blake3(data).hexdigest())


def sniff_image_format(data: bytes) -> str | None:
    """The image format named by the leading magic bytes, or None if it is not an allowed image."""
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:2] == b"BM" and len(data) >= 26:
        return "BMP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    return None
