"""An input's size class, read from its header at the door: it orders the CPU queues, small inputs first."""

from __future__ import annotations

import io
import wave

import pytest
from PIL import Image

from stoker.core.costs import LARGE, MEDIUM, SMALL, SizeBounds, audio_seconds, image_pixels, size_class
from tests.media import encode, text_image

BOUNDS = SizeBounds(small_pixels=1_000_000, large_pixels=4_000_000, small_audio_s=10.0, large_audio_s=60.0)


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * int(seconds * rate))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("size", "expected"),
    [((1000, 1000), SMALL), ((1001, 1000), MEDIUM), ((2000, 2000), MEDIUM), ((2001, 2000), LARGE)],
)
def test_a_pictures_class_follows_its_pixels(size: tuple[int, int], expected: int) -> None:
    data = encode(Image.new("L", size, 255), "PNG")
    assert image_pixels(data) == size[0] * size[1]
    assert size_class("image", data, "PNG", BOUNDS) == expected


def test_a_picture_whose_header_cannot_be_read_is_medium() -> None:
    data = text_image("CUT")[:40]  # the PNG signature and a cut header
    assert image_pixels(data) is None
    assert size_class("image", data, "PNG", BOUNDS) == MEDIUM


@pytest.mark.parametrize(("seconds", "expected"), [(4.0, SMALL), (30.0, MEDIUM), (61.0, LARGE)])
def test_a_wav_is_classed_by_the_seconds_its_header_gives(seconds: float, expected: int) -> None:
    data = _wav(seconds)
    assert audio_seconds(data, "WAV") == pytest.approx(seconds)
    assert size_class("audio", data, "WAV", BOUNDS) == expected


def test_a_wav_written_to_a_pipe_is_measured_by_its_bytes_not_its_placeholder_sizes() -> None:
    """espeak-ng and ffmpeg writing to a pipe leave placeholder sizes in the header (here espeak-ng's): read as
    given, 4 s of speech would be 18 hours, and large."""
    data = bytearray(_wav(4.0))
    placeholder = (0x7FFFF000).to_bytes(4, "little")
    data[4:8] = (0x7FFFF024).to_bytes(4, "little")  # the RIFF size
    data[40:44] = placeholder  # the data chunk's size
    assert audio_seconds(bytes(data), "WAV") == pytest.approx(4.0, abs=0.01)
    assert size_class("audio", bytes(data), "WAV", BOUNDS) == SMALL


def test_compressed_speech_is_estimated_from_its_size() -> None:
    assert audio_seconds(b"\xff" * 32_000, "MP3") == 2.0
    assert size_class("audio", b"\xff" * 16_000 * 100, "MP3", BOUNDS) == LARGE


def test_a_video_is_large_and_a_url_not_fetched_yet_is_medium() -> None:
    assert size_class("video", b"\0" * 10, "MP4", BOUNDS) == LARGE
    assert size_class("image", b"", "", BOUNDS) == MEDIUM
    assert size_class("audio", b"", "", BOUNDS) == MEDIUM
