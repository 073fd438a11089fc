"""Speech to text with a faster-whisper model: samples in, a transcript with timed segments out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

#: Bump when transcription's output changes for the same audio and parameters.
VERSION = "1"


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


def speech_threads(configured: int, cores: int, children: int, sleeping_waits: bool) -> int:
    """The speech model's threads in one process: as configured; else, where its OpenMP threads sleep while they
    wait (`sleeping_waits`), twice its pool child's share of the host's cores, rounded up, and never more than the
    host has; else its share, at least one.

    A recording transcribed while the other children idle then has the cores they leave: on 2 cores, 2 threads
    took 0.80x the time of one at 1.09x the CPU, and with every child busy they cost no more than one. That holds
    only where a thread that reaches a barrier first sleeps: GNU OpenMP (CTranslate2's) spins there by default,
    and in a pool whose other children run tesseract the spinning doubled the CPU per job at 4 jobs/s (0.26 ->
    0.38-0.52 CPU s). CTranslate2's own count (4) spent 1.5x the CPU of one thread per recording on 2 cores.
    """
    if configured:
        return configured
    share = max(children, 1)
    return max(1, min(cores, -(-2 * cores // share))) if sleeping_waits else max(1, cores // share)


def transcribe(model: SpeechModel, audio: npt.NDArray[np.float32], beam_size: int, vad: bool = True) -> Transcript:
    """Transcribe, consuming the lazy segment generator here, so the caller's time limit covers all the work."""
    generator, info = model.transcribe(audio, beam_size=beam_size, vad_filter=vad, condition_on_previous_text=False)
    segments = [Segment(round(s.start, 2), round(s.end, 2), s.text.strip()) for s in generator]
    text = " ".join(s.text for s in segments if s.text)
    return Transcript(text=text, segments=segments, language=getattr(info, "language", None))
