"""Content addressing and media sniffing: what an input is, judged by its bytes alone."""

from __future__ import annotations

from typing import NewType

import blake3

ContentHash = NewType("ContentHash", str)

#: Image formats accepted at the door, by magic bytes. Names match Pillow's format identifiers.
IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "HEIF")
AUDIO_FORMATS: tuple[str, ...] = ("WAV", "MP3", "FLAC", "OGG", "MP4")
VIDEO_FORMATS: tuple[str, ...] = ("MP4", "MOV", "MATROSKA")
#: What each input kind may be, judged by content.
KIND_FORMATS: dict[str, tuple[str, ...]] = {"image": IMAGE_FORMATS, "audio": AUDIO_FORMATS, "video": VIDEO_FORMATS}


def content_hash(data: bytes) -> ContentHash:
    """BLAKE3 of the bytes, hex: the identity of an input wherever it goes."""
    return ContentHash(blake3.blake3(data).hexdigest())


def guess_kind(data: bytes, filename: str = "") -> str | None:
    """The input kind a file most likely is, from its content (the name only splits MP4/Matroska audio from video)."""
    if sniff_image_format(data):
        return "image"
    fmt = sniff_av_format(data)
    if fmt in VIDEO_FORMATS:
        return "audio" if filename.lower().endswith((".m4a", ".mka", ".weba", ".opus")) else "video"
    return "audio" if fmt else None


def sniff_format(kind: str, data: bytes) -> str | None:
    """The format of data if it is one that inputs of this kind may have, else None."""
    fmt = sniff_image_format(data) if kind == "image" else sniff_av_format(data)
    return fmt if fmt in KIND_FORMATS.get(kind, ()) else None


def sniff_av_format(data: bytes) -> str | None:
    """The audio/video container named by the leading bytes, or None."""
    head = data[:16]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "WAV"
    if head[:4] == b"fLaC":
        return "FLAC"
    if head[:4] == b"OggS":
        return "OGG"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "MATROSKA"  # also WebM
    if head[4:8] == b"ftyp":
        if _heif_family(data):  # the same box family holds still pictures
            return None
        return "MOV" if head[8:12] == b"qt  " else "MP4"
    if head[4:8] in (b"moov", b"mdat", b"wide", b"free"):
        return "MOV"
    if head[:3] == b"ID3" or _mpeg_audio_sync(head):
        return "MP3"
    return None


def _mpeg_audio_sync(head: bytes) -> bool:
    """An MPEG audio frame header: 11 sync bits, and a layer that is not the reserved 00 (ADTS AAC)."""
    return len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xE0) == 0xE0 and (head[1] & 0x06) != 0


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
    return _heif_family(data)


#: ISO-BMFF brands (`ftyp` box) of still pictures: AVIF (AV1) and HEIF/HEIC (HEVC), as phones and browsers send.
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
_HEIC_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx"})


def _heif_family(data: bytes) -> str | None:
    """AVIF or HEIF, by the brands of the leading `ftyp` box (the major brand, then the compatible ones: a
    generic `mif1` major brand names the codec among the compatible brands)."""
    if data[4:8] != b"ftyp":
        return None
    size = int.from_bytes(data[:4], "big")
    if not 16 <= size <= 256 or len(data) < size:
        return None
    brands = [data[8:12], *(data[i : i + 4] for i in range(16, size - 3, 4))]
    for brand in brands:
        if brand in _AVIF_BRANDS:
            return "AVIF"
        if brand in _HEIC_BRANDS:
            return "HEIF"
    return None
