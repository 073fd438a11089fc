"""Speech to text with a faster-whisper model: samples in, a transcript with timed segments out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

#: Bump when transcription's output changes for the same audio and parameters.
VERSION = "1"

#: The temperatures a window is decoded at, each only when the text of the one before failed faster-whisper's
#: checks (too repetitive or too unlikely), and the candidates sampled at each above 0: faster-whisper's defaults,
#: named here so transcription and the fallback lookahead (`stoker.adapters.speech`) agree on them.
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
BEST_OF = 5


class SpeechModel(Protocol):
    """The slice of faster_whisper.WhisperModel that transcription needs."""

    def transcribe(self, audio: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Return (segment generator, info)."""


@dataclass(frozen=True)
class Segment:
    """A stretch of speech and its text."""

    start: float
    end: float
    text: str


@dataclass(frozen=True)
class Transcript:
    """The whole transcript and its segments."""

    text: str
    segments: list[Segment]
    language: str | None = None


def speech_threads(configured: int, cores: int, children: int) -> int:
    """The speech model's threads in one process: as configured, else the host's cores shared among the worker's
    pool children (at least one each).

    CTranslate2's own choice takes more threads than a small host's children can share: on 2 cores it spent 1.5x
    the CPU of one thread per recording, and took longer
    (docs/bench/log/2026-12-03-cpu-bound-speech-threads-and-size-classes.md).
    """
    return configured or max(1, cores // max(children, 1))


def next_temperature(temperature: float) -> float | None:
    """The temperature a window falls back to after `temperature`, or None after the last."""
    return next((t for t in TEMPERATURES if t > temperature + 1e-6), None)


def temperatures_from(temperature: float | None) -> list[float]:
    """The temperatures a window is decoded at when the first is `temperature` (None or 0: faster-whisper's own
    fallback from 0): that one, then the rest of the fallback above it, as Whisper's `--temperature` does."""
    if not temperature:
        return list(TEMPERATURES)
    return [temperature, *(t for t in TEMPERATURES if t > temperature + 1e-6)]


def decode_options(
    beam_size: int,
    vad: bool = True,
    *,
    language: str | None = None,
    prompt: str | None = None,
    temperature: float | None = None,
) -> dict[str, Any]:
    """How a recording is decoded (`faster_whisper.WhisperModel.transcribe`'s options): by the ASR stage, and as
    it does by the benchmarks and tests that time or check its fallbacks. `language` (a Whisper code; None:
    detected), `prompt` (read as the text before the recording) and `temperature` (the first try's) as a
    transcription request asks; an English-only model transcribes English whatever `language` says."""
    options: dict[str, Any] = {
        "beam_size": beam_size,
        "vad_filter": vad,
        "condition_on_previous_text": False,
        "temperature": temperatures_from(temperature),
        "best_of": BEST_OF,
    }
    if language is not None:
        options["language"] = language
    if prompt:
        options["initial_prompt"] = prompt
    return options


def transcribe(
    model: SpeechModel,
    audio: npt.NDArray[np.float32],
    beam_size: int,
    vad: bool = True,
    *,
    language: str | None = None,
    prompt: str | None = None,
    temperature: float | None = None,
) -> Transcript:
    """Transcribe, consuming the lazy segment generator here, so the caller's time limit covers all the work;
    `language`, `prompt` and `temperature` as a request asked (`decode_options`)."""
    asked = decode_options(beam_size, vad, language=language, prompt=prompt, temperature=temperature)
    generator, info = model.transcribe(audio, **asked)
    segments = [Segment(round(s.start, 2), round(s.end, 2), s.text.strip()) for s in generator]
    text = " ".join(s.text for s in segments if s.text)
    return Transcript(text=text, segments=segments, language=getattr(info, "language", None))
