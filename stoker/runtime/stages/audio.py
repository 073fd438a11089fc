"""The sound branch of an audio or video input: probe the container, then transcribe its audio track (queue asr)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from stoker.core.asr import transcribe as transcribe_samples
from stoker.core.avmedia import decode_audio
from stoker.core.avmedia import probe as probe_media
from stoker.core.jobs import InputRecord, Segment
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import cache_scope, follower_wait, input_bytes, run_input_stage, through_cache, time_limit
from stoker.settings import WorkerSettings


def run_probe(ctx: WorkerContext, job_id: str, ref: str) -> dict[str, Any]:
    """Read duration and streams from the header; over-long, empty or unreadable media fail here, undecoded."""
    return run_input_stage(ctx, job_id, ref, "probe", _probe, opens_job=True)


def _probe(ctx: WorkerContext, _: str, record: InputRecord) -> None:
    info = probe_media(input_bytes(ctx, record, "probe"), ctx.settings.max_media_seconds)
    record.features = info.to_dict()


def run_transcribe(ctx: WorkerContext, job_id: str, ref: str) -> dict[str, Any]:
    """Transcribe the audio track with faster-whisper; a video without sound gets an empty transcript."""
    return run_input_stage(ctx, job_id, ref, "transcribe", transcribe)


def transcribe(ctx: WorkerContext, job_id: str, record: InputRecord) -> None:
    """The transcript of the record's audio track into the record: from the cache, or transcribed here within the
    recording's own limit (`transcribe_limit_s`)."""
    s = ctx.settings
    if (record.features or {}).get("audio_streams", 1) == 0:
        record.text, record.segments, record.status = "", [], "ok"  # a video without sound: an empty transcript
        return

    def compute() -> dict[str, Any]:
        # The model first, outside the recording's own limit: a pool child that just started may still be loading
        # it (`STOKER_ASR_PRELOAD`), which is no fault of this recording (the task's soft limit bounds the load).
        model = ctx.speech_model
        with time_limit(transcribe_limit_s(s, record), "transcribe"):
            samples = decode_audio(input_bytes(ctx, record, "transcribe"))
            transcript = transcribe_samples(model, samples, s.asr_beam_size, **_asked(record))
        segments = [asdict(x) for x in transcript.segments]
        return {"text": transcript.text, "segments": segments, "language": transcript.language}

    address = ctx.transcribe_address(record.content_hash, cache_scope(ctx, job_id), record.speech)
    value = through_cache(ctx, record, address, compute, follower_wait(s.transcribe_soft_s))
    record.text = value["text"]
    record.segments = [Segment(**x) for x in value["segments"]]
    if value.get("language"):  # the language the speech model heard (an entry cached before it was kept has none)
        record.features = {**(record.features or {}), "language": value["language"]}
    record.status = "ok"


def _asked(record: InputRecord) -> dict[str, Any]:
    """The language, prompt and temperature the recording's request asked for, as `stoker.core.asr.transcribe`
    takes them (none: the deployment's way)."""
    speech = record.speech
    if speech is None:
        return {}
    return {"language": speech.language, "prompt": speech.prompt, "temperature": speech.temperature}


def transcribe_limit_s(s: WorkerSettings, record: InputRecord) -> float:
    """Transcription's own limit: a base plus a share of the media's length, under the task's soft limit."""
    duration = float((record.features or {}).get("duration_s", 0.0))
    return min(s.transcribe_base_s + s.transcribe_per_media_s * duration, s.transcribe_soft_s)
