"""Audio and video stages: probe the container, transcribe the sound (queue asr), sample keyframes for OCR; each
stage's body is its module under `stoker.runtime.stages` (audio, keyframes)."""

from __future__ import annotations

from typing import Any

from stoker.runtime.stages.audio import run_probe, run_transcribe
from stoker.runtime.stages.keyframes import run_keyframe
from tasks.lifecycle import context
from tasks.retry import RETRY
from tasks.worker import app


@app.task(name="stoker.probe", **RETRY)
def probe(job_id: str, ref: str) -> dict[str, Any]:
    """Read duration and streams from the header; over-long, empty or unreadable media fail here, undecoded."""
    return run_probe(context(), job_id, ref)


@app.task(name="stoker.transcribe", **RETRY)
def transcribe(previous: dict[str, Any]) -> dict[str, Any]:
    """Transcribe the audio track with faster-whisper; a video without sound gets an empty transcript."""
    return run_transcribe(context(), previous["job_id"], previous["ref"])


@app.task(name="stoker.keyframe", **RETRY)
def keyframe(job_id: str, index: int, slot: int, count: int) -> dict[str, Any]:
    """Take keyframe `slot` of `count` from a video by seeking, and enter it into the image branch as an image."""
    return run_keyframe(context(), job_id, index, slot, count)
