"""The benchmark's workload: a deterministic (by seed) stream of multimodal requests with Poisson arrivals.

A request is text only, or a prompt with one image (640×480 up to 4000×3000, some pages of dense rendered text,
some photo-like scenes with a caption) or one audio clip (speech by espeak-ng, or tones where it is missing).
A `bad` share carries a corrupt image or a decompression bomb; a `repeat` share of media are byte-identical
repeats of earlier media, so the content-hash cache sees the hit rate real traffic has.
"""

from __future__ import annotations

import io
import math
import random
import shutil
import struct
import subprocess
import wave
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from stoker.core.costs import audio_seconds

Kind = Literal["text", "image", "audio"]

#: Image sizes and how often each is drawn: most traffic is small, a tenth is a 12-megapixel photo.
SIZES: tuple[tuple[tuple[int, int], float], ...] = (
    ((640, 480), 0.30),
    ((1024, 768), 0.25),
    ((1600, 1200), 0.20),
    ((2592, 1944), 0.15),
    ((4000, 3000), 0.10),
)
WORDS = [
    "invoice", "total", "amount", "due", "date", "order", "customer", "account", "number", "payment", "reference",
    "tax", "net", "gross", "shipping", "quarterly", "report", "finance", "team", "friday", "meeting", "schedule",
    "budget", "review", "project", "status", "update",
]  # fmt: skip


@dataclass(frozen=True)
class Media:
    """One media file of the workload."""

    kind: Literal["image", "audio"]
    data: bytes
    label: str  # what it is: "1600x1200 text", "speech 4.1s", "corrupt", "bomb"
    bad: bool = False


@dataclass(frozen=True)
class Request:
    """One request: when it arrives (seconds after the start), its prompt, and its media if any."""

    n: int
    at: float
    kind: Kind
    prompt: str
    media: Media | None = None
    repeat: bool = False

    @property
    def bad(self) -> bool:
        """Whether the request carries a bad input (the job must still answer, text only, degraded)."""
        return self.media is not None and self.media.bad


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Shares are of all requests; `repeat` is of media requests."""

    jobs: int = 120
    rate: float = 1.0
    seed: int = 7
    text: float = 0.3
    image: float = 0.5
    audio: float = 0.2
    repeat: float = 0.4
    bad: float = 0.01
    dense_text: float = 0.5
    sizes: tuple[tuple[tuple[int, int], float], ...] = SIZES


#: The two regimes `stoker bench` compares the designs in. `cpu-bound`: today's mix, where preprocessing on two
#: cores is the limit both designs meet. `device-bound`: mostly text and repeated small media, so preprocessing is
#: light and the (simulated) device is the bottleneck: there, batching across the whole fleet is what counts.
WORKLOADS: dict[str, dict[str, object]] = {
    "cpu-bound": {},
    "device-bound": {"text": 0.7, "image": 0.25, "audio": 0.05, "repeat": 0.9, "dense_text": 0.2, "sizes": SIZES[:2]},
}


@dataclass
class _Pool:
    """Media generated so far, per kind, for repeats."""

    seen: dict[str, list[Media]] = field(default_factory=lambda: {"image": [], "audio": []})


def generate(spec: WorkloadSpec) -> list[Request]:
    """The requests, identical for the same spec (and espeak-ng version)."""
    rng = random.Random(spec.seed)
    pool = _Pool()
    requests, at = [], 0.0
    for n in range(spec.jobs):
        at += rng.expovariate(spec.rate)
        requests.append(_request(n, at, rng, spec, pool))
    return requests


def _request(n: int, at: float, rng: random.Random, spec: WorkloadSpec, pool: _Pool) -> Request:
    kind: Kind = rng.choices(("text", "image", "audio"), (spec.text, spec.image, spec.audio))[0]
    if rng.random() < spec.bad:
        return Request(n, at, "image", _prompt(rng, "image"), _bad_image(rng))
    if kind == "text":
        return Request(n, at, kind, _prompt(rng, kind))
    earlier = pool.seen[kind]
    if earlier and rng.random() < spec.repeat:
        return Request(n, at, kind, _prompt(rng, kind), rng.choice(earlier), repeat=True)
    media = _image(rng, spec) if kind == "image" else _audio(rng)
    earlier.append(media)
    return Request(n, at, kind, _prompt(rng, kind), media)


def _prompt(rng: random.Random, kind: Kind) -> str:
    topic = " ".join(rng.choice(WORDS) for _ in range(3))
    if kind == "image":
        return f"What does this document say about {topic}?"
    if kind == "audio":
        return f"Summarise the recording; does it mention {topic}?"
    return f"Write one sentence about {topic}."


def _image(rng: random.Random, spec: WorkloadSpec) -> Media:
    (width, height) = rng.choices([s for s, _ in spec.sizes], [w for _, w in spec.sizes])[0]
    dense = rng.random() < spec.dense_text
    image = _page(rng, width, height) if dense else _scene(rng, width, height)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=88)
    return Media("image", out.getvalue(), f"{width}x{height} {'text' if dense else 'scene'}")


def _page(rng: random.Random, width: int, height: int) -> Image.Image:
    """A scanned page: lines of words across the whole image, at a size OCR reads."""
    image = Image.new("RGB", (width, height), (248, 246, 240))
    draw = ImageDraw.Draw(image)
    size = max(height // 40, 14)
    font = ImageFont.load_default(size=size)
    for top in range(size, height - size, int(size * 1.6)):
        line = " ".join(rng.choice(WORDS) for _ in range(max(width // (size * 6), 2)))
        draw.text((size, top), f"{line} {rng.randint(10, 99999)}", fill=(20, 20, 20), font=font)
    return image


def scene_jpeg(rng: random.Random, width: int, height: int, quality: int = 88) -> bytes:
    """A photo-like scene (gradient, shapes, noise, a caption) as a JPEG of the size a camera's would be."""
    out = io.BytesIO()
    _scene(rng, width, height).save(out, "JPEG", quality=quality)
    return out.getvalue()


def _scene(rng: random.Random, width: int, height: int) -> Image.Image:
    """A photo-like scene: a colour gradient with shapes and noise, and a caption."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.array([rng.random() * 255 for _ in range(3)], dtype=np.float32)
    pixels = np.stack([base[c] * 0.5 + 60 * np.sin(x / (width / (c + 2))) + 60 * (y / height) for c in range(3)], -1)
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 6, pixels.shape)
    image = Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        box = (x0, y0, x0 + rng.randrange(width // 3 + 1), y0 + rng.randrange(height // 3 + 1))
        draw.ellipse(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    font = ImageFont.load_default(size=max(height // 25, 14))
    draw.text((20, 20), " ".join(rng.choice(WORDS) for _ in range(4)), fill="white", font=font)
    return image


def _audio(rng: random.Random) -> Media:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
    if shutil.which("espeak-ng"):
        wav = subprocess.run(
            ["espeak-ng", "-s", "150", "--stdout", words], capture_output=True, check=True, timeout=60
        ).stdout
        return Media("audio", wav, f"speech {audio_seconds(wav, 'WAV'):.1f}s")  # its header's sizes are placeholders
    return Media("audio", _tones(rng), "tones")


def _tones(rng: random.Random, rate: int = 16000) -> bytes:
    """A few seconds of tones: audio with nothing to transcribe."""
    t = np.arange(int(rate * rng.uniform(2, 5))) / rate
    signal = 0.3 * np.sin(2 * math.pi * rng.choice((220, 330, 440, 550)) * t)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((signal * 32767).astype("<i2").tobytes())
    return out.getvalue()


def _bad_image(rng: random.Random) -> Media:
    """A truncated JPEG, or a PNG whose header claims 40 000 × 40 000 pixels."""
    if rng.random() < 0.5:
        good = _image(rng, WorkloadSpec(sizes=(((1024, 768), 1.0),))).data
        return Media("image", good[: len(good) // 3], "corrupt", bad=True)
    return Media("image", png_bomb(40_000, 40_000), "bomb", bad=True)


def png_bomb(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` × `height` pixels over a few bytes of data: a decompression bomb."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 1024))
        + chunk(b"IEND", b"")
    )


def text_png(word: str, size: tuple[int, int] = (240, 80)) -> bytes:
    """A small PNG with one word on it: the overhead benchmark's input."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((10, 20), word, fill="black", font=ImageFont.load_default(size=36))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def describe(requests: list[Request]) -> dict[str, int]:
    """Counts by kind, repeats and bad inputs: what the report says the workload was."""
    counts: dict[str, int] = {}
    for r in requests:
        for key in (r.kind, *(["repeat"] if r.repeat else []), *(["bad"] if r.bad else [])):
            counts[key] = counts.get(key, 0) + 1
    return counts


def media_files(requests: list[Request]) -> Iterator[tuple[str, bytes]]:
    """Distinct media of the workload, by label and bytes (for looking at what was sent)."""
    seen: set[int] = set()
    for r in requests:
        if r.media is not None and id(r.media) not in seen:
            seen.add(id(r.media))
            yield r.media.label, r.media.data
