"""What an input is expected to cost its stages, read from its header at the door: pixels for a picture (OCR and
decode grow with them), seconds for speech (transcription grows with them). Its size class orders the CPU queues:
small inputs are taken before large ones (broker priorities), and the reaper's age bound lifts a large input that
waited too long to the front (`stoker.adapters.kombu_redis.promote_aged`), so it is never starved.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import Literal

from PIL import Image

SizeClass = Literal[0, 1, 2]
SMALL: SizeClass = 0
MEDIUM: SizeClass = 1
LARGE: SizeClass = 2

#: Bytes per second assumed for compressed speech whose header is not read (128 kbit/s, a common MP3/AAC rate).
NOMINAL_AUDIO_BYTES_PER_S = 16_000


@dataclass(frozen=True)
class SizeBounds:
    """Where small ends and large begins, per kind (`STOKER_SMALL_*` / `STOKER_LARGE_*`: the defaults live there)."""

    small_pixels: int
    large_pixels: int
    small_audio_s: float
    large_audio_s: float


def image_pixels(data: bytes) -> int | None:
    """A picture's pixel count from its header (Pillow reads no pixel data for this); None when it cannot say."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception:  # a broken or unknown header: decode gives the structured error, this only ranks the input
        return None
    return width * height


def audio_seconds(data: bytes, fmt: str) -> float:
    """A recording's length: exact from a WAV header, else estimated from its size at a nominal bit rate.

    A WAV written to a pipe (espeak-ng's or ffmpeg's `--stdout`/`pipe:`) cannot go back to fill in its sizes and
    leaves a placeholder (0x7FFFF000 bytes: over 13 hours at 22 kHz); its frames are then counted from the bytes
    that came, which bound any WAV's."""
    if fmt == "WAV":
        try:
            with wave.open(io.BytesIO(data), "rb") as recording:
                frame_bytes = max(recording.getsampwidth() * recording.getnchannels(), 1)
                frames = min(recording.getnframes(), len(data) // frame_bytes)
                return frames / max(recording.getframerate(), 1)
        except Exception:  # not a plain PCM WAV (or broken): fall back on its size like any other format
            pass
    return len(data) / NOMINAL_AUDIO_BYTES_PER_S


def size_class(kind: str, data: bytes, fmt: str, bounds: SizeBounds) -> SizeClass:
    """The input's size class: a video is always large (keyframes and a soundtrack); an input whose size cannot be
    read (a URL not fetched yet, a broken header) is medium."""
    if kind == "video":
        return LARGE
    if kind == "image":
        pixels = image_pixels(data)
        return MEDIUM if pixels is None else _classify(pixels, bounds.small_pixels, bounds.large_pixels)
    if kind == "audio" and data:
        return _classify(audio_seconds(data, fmt), bounds.small_audio_s, bounds.large_audio_s)
    return MEDIUM


def _classify(amount: float, small: float, large: float) -> SizeClass:
    if amount <= small:
        return SMALL
    return LARGE if amount > large else MEDIUM
