"""Test media made on the spot: images of rendered text and deliberately broken files."""

from __future__ import annotations

import io
import struct
import subprocess
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import av
import numpy as np
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


SENTENCE = "please send the quarterly report to the finance team by friday"
KEY_WORDS = ("please", "send", "quarterly", "report", "finance", "team", "friday")


def speech_wav(text: str = SENTENCE) -> bytes:
    """Spoken text as a WAV file, by espeak-ng."""
    out = subprocess.run(["espeak-ng", "-s", "120", "--stdout", text], capture_output=True, check=True, timeout=60)
    return out.stdout


def _audio_frames(wav: bytes, resampler: av.AudioResampler) -> Iterator[av.AudioFrame]:
    with av.open(io.BytesIO(wav)) as src:
        for frame in src.decode(audio=0):
            yield from resampler.resample(frame)
    yield from resampler.resample(None)


def _mux(dst: Any, stream: Any, frames: Iterable[Any]) -> None:
    for frame in frames:
        for packet in stream.encode(frame):
            dst.mux(packet)
    for packet in stream.encode(None):
        dst.mux(packet)


def to_mp3(wav: bytes) -> bytes:
    """Re-encode WAV as MP3 with PyAV."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as dst:
        stream = dst.add_stream("libmp3lame", rate=22050, layout="mono")
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=22050)
        _mux(dst, stream, _audio_frames(wav, resampler))
    return out.getvalue()


def text_video(text: str, wav: bytes | None, seconds: float = 4.0, fmt: str = "mp4") -> bytes:
    """A video of rendered text (H.264), with the speech as its AAC sound track when given."""
    out = io.BytesIO()
    fps = 10
    picture = Image.open(io.BytesIO(text_image(text, size=(640, 360), font_size=56))).convert("RGB")
    with av.open(out, "w", format=fmt) as dst:
        video = dst.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = 640, 360, "yuv420p"
        audio = dst.add_stream("aac", rate=22050, layout="mono") if wav else None
        frames = (av.VideoFrame.from_image(picture) for _ in range(int(seconds * fps)))
        _mux(dst, video, frames)
        if audio is not None and wav is not None:
            resampler = av.AudioResampler(format=audio.codec_context.format.name, layout="mono", rate=22050)
            _mux(dst, audio, _audio_frames(wav, resampler))
    return out.getvalue()


def wav_header(seconds: float, rate: int = 8000, payload: bytes = b"") -> bytes:
    """A PCM WAV whose header claims `seconds` of 8-bit mono sound, followed by only `payload`."""
    size = int(seconds * rate)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", size)
        + payload
    )


def flac_claiming(seconds: float, rate: int = 8000) -> bytes:
    """One second of silent FLAC whose STREAMINFO claims `seconds` of sound: long media in a tiny file."""
    out = io.BytesIO()
    with av.open(out, "w", format="flac") as dst:
        stream = dst.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame(format="s16", layout="mono", samples=rate)
        frame.planes[0].update(b"\0\0" * rate)
        frame.sample_rate = rate
        _mux(dst, stream, [frame])
    data = bytearray(out.getvalue())
    at = 18  # "fLaC", block header, then STREAMINFO's rate/channels/bits/total-samples word
    word = int.from_bytes(data[at : at + 8], "big")
    word = (word & ~((1 << 36) - 1)) | int(seconds * rate)
    data[at : at + 8] = word.to_bytes(8, "big")
    return bytes(data)


def long_speech_wav(repeats: int) -> bytes:
    """The sentence spoken `repeats` times in one WAV: long enough to catch a transcription in the act."""
    return speech_wav(". ".join([SENTENCE] * repeats))


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour gradients with noise: what a camera picture compresses like."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def reopened(data: bytes) -> Image.Image:
    """The file's stored pixels as Pillow reads them, with no orientation applied."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def landscape() -> tuple[bytes, Image.Image]:
    data = encode(photo(1000, 400), "JPEG", quality=90)
    return data, reopened(data)


def portrait() -> tuple[bytes, Image.Image]:
    data = encode(photo(400, 1000, seed=1), "PNG")
    return data, reopened(data)


def exif_rotated() -> tuple[bytes, Image.Image]:
    """Stored landscape, shown portrait: orientation 6 says turn it 90° clockwise."""
    stored = photo(1000, 400, seed=2)
    exif = stored.getexif()
    exif[0x0112] = 6
    data = encode(stored, "JPEG", quality=90, exif=exif.tobytes())
    return data, reopened(data).transpose(Image.Transpose.ROTATE_270)


def png_alpha() -> tuple[bytes, Image.Image]:
    """Left half transparent: the picture shows white there, as decode puts it on paper."""
    rgba = photo(600, 300, seed=3).convert("RGBA")
    alpha = np.full((300, 600), 255, dtype=np.uint8)
    alpha[:, :300] = 0
    rgba.putalpha(Image.fromarray(alpha, "L"))
    pixels = np.asarray(rgba.convert("RGB")).copy()
    pixels[:, :300] = 255
    return encode(rgba, "PNG"), Image.fromarray(pixels, "RGB")


def cmyk_jpeg() -> tuple[bytes, Image.Image]:
    data = encode(photo(640, 480, seed=4).convert("CMYK"), "JPEG", quality=90)
    return data, reopened(data).convert("RGB")


def one_pixel() -> tuple[bytes, Image.Image]:
    data = encode(Image.new("RGB", (1, 1), (200, 30, 90)), "PNG")
    return data, reopened(data)


def large_page() -> tuple[bytes, Image.Image]:
    """Bigger than the processor's longest edge (it is shrunk, then tiled) and than OCR's side (a JPEG that decode
    would draft-decode at half scale for OCR alone)."""
    data = encode(photo(2200, 1400, seed=5), "JPEG", quality=90)
    return data, reopened(data)


#: Pictures for the image path, each as (file bytes, the picture a user would hand the model's processor in-process:
#: EXIF-rotated RGB, transparency on white), and the tiles (rows, cols) SmolVLM's processor cuts it into at 1024 px
#: and 512-px tiles (the tiny VLM's).
PICTURES = {
    "landscape": (landscape, (1, 2)),
    "portrait": (portrait, (2, 1)),
    "exif_rotated": (exif_rotated, (2, 1)),
    "png_alpha": (png_alpha, (1, 2)),
    "cmyk_jpeg": (cmyk_jpeg, (2, 2)),
    "one_pixel": (one_pixel, (2, 2)),
    "large_page": (large_page, (2, 2)),
}
