"""Audio and video stages: probe the container, transcribe the sound (queue asr), sample keyframes for OCR."""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict
from typing import Any

from stoker.adapters.store.keys import frame_ref, input_ref
from stoker.core.asr import transcribe as transcribe_samples
from stoker.core.avmedia import decode_audio, extract_frame, keyframe_times
from stoker.core.avmedia import probe as probe_media
from stoker.core.cachekeys import CacheAddress
from stoker.core.errors import StokerError
from stoker.core.jobs import InputRecord, Segment
from stoker.core.media import ContentHash, content_hash
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import (
    RETRY,
    cache_scope,
    follower_wait,
    handoff,
    input_bytes,
    run_input_stage,
    through_cache,
    time_limit,
)
from stoker.settings import WorkerSettings
from tasks.lifecycle import context
from tasks.worker import app

log = logging.getLogger(__name__)


@app.task(name="stoker.probe", **RETRY)
def probe(job_id: str, ref: str) -> dict[str, Any]:
    """Read duration and streams from the header; over-long, empty or unreadable media fail here, undecoded."""
    return run_input_stage(context(), job_id, ref, "probe", _probe, opens_job=True)


def _probe(ctx: WorkerContext, _: str, record: InputRecord) -> None:
    info = probe_media(input_bytes(ctx, record, "probe"), ctx.settings.max_media_seconds)
    record.features = info.to_dict()


@app.task(name="stoker.transcribe", **RETRY)
def transcribe(previous: dict[str, Any]) -> dict[str, Any]:
    """Transcribe the audio track with faster-whisper; a video without sound gets an empty transcript."""
    return run_input_stage(context(), previous["job_id"], previous["ref"], "transcribe", _transcribe)


def _transcribe(ctx: WorkerContext, job_id: str, record: InputRecord) -> None:
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
            transcript = transcribe_samples(model, samples, s.asr_beam_size)
        segments = [asdict(x) for x in transcript.segments]
        return {"text": transcript.text, "segments": segments, "language": transcript.language}

    address = ctx.transcribe_address(record.content_hash, cache_scope(ctx, job_id))
    value = through_cache(ctx, record, address, compute, follower_wait(s.transcribe_soft_s))
    record.text = value["text"]
    record.segments = [Segment(**x) for x in value["segments"]]
    if value.get("language"):  # the language the speech model heard (an entry cached before it was kept has none)
        record.features = {**(record.features or {}), "language": value["language"]}
    record.status = "ok"


def transcribe_limit_s(s: WorkerSettings, record: InputRecord) -> float:
    """Transcription's own limit: a base plus a share of the media's length, under the task's soft limit."""
    duration = float((record.features or {}).get("duration_s", 0.0))
    return min(s.transcribe_base_s + s.transcribe_per_media_s * duration, s.transcribe_soft_s)


@app.task(name="stoker.keyframe", **RETRY)
def keyframe(job_id: str, index: int, slot: int, count: int) -> dict[str, Any]:
    """Take keyframe `slot` of `count` from a video by seeking, and enter it into the image branch as an image."""
    ctx = context()
    store = ctx.store
    store.jobs.mark_started(job_id)
    target = frame_ref(index, slot)
    video = store.jobs.get_input(job_id, input_ref(index))
    if video is None or not video.content_hash or store.watch.stage_gate(job_id) != "open":  # no bytes: fetch failed
        return handoff(job_id, target, None)
    frame = InputRecord(index=slot, kind="image", content_hash="", size_bytes=0, status="skipped")
    address = ctx.keyframe_address(video.content_hash, slot, count, cache_scope(ctx, job_id))
    take = functools.partial(_take_keyframe, ctx, job_id, video, address, slot, count)
    try:
        chosen = through_cache(ctx, frame, address, take, wait_s=5.0)
        if chosen.get("digest") and not _restore_frame(ctx, job_id, address, ContentHash(chosen["digest"])):
            chosen = take()  # the cache lost the picture: take it again
    except StokerError as exc:
        log.info("job %s input %d: no keyframe %d (%s)", job_id, index, slot, exc.code)
        chosen = {}
    if chosen.get("digest"):
        update = {
            "content_hash": chosen["digest"],
            "size_bytes": chosen["size"],
            "status": "pending",
            "time_s": chosen["time_s"],
        }
        frame = frame.model_copy(update=update)
    store.jobs.put_input(job_id, target, frame)
    return handoff(job_id, target, frame)


def _take_keyframe(
    ctx: WorkerContext, job_id: str, video: InputRecord, address: CacheAddress, slot: int, count: int
) -> dict[str, Any]:
    """Seek to keyframe `slot` of `count`; store its PNG as an input blob (and in the cache)."""
    data = input_bytes(ctx, video, "keyframes")
    info = probe_media(data, ctx.settings.max_media_seconds)
    times = keyframe_times(info.duration_s, count) if info.video_streams else []
    limit = ctx.settings.max_image_pixels
    taken = extract_frame(data, times[slot], limit) if slot < len(times) else None
    if taken is None:
        return {}
    at, png = taken
    digest = content_hash(png)
    ctx.store.blobs.put_blob(digest, png, job_id)
    ctx.cache.put_bytes(address, png, part="png")
    return {"digest": digest, "size": len(png), "time_s": round(at, 3)}


def _restore_frame(ctx: WorkerContext, job_id: str, address: CacheAddress, digest: ContentHash) -> bool:
    """Make sure a cached keyframe's picture is in the job store; False if neither store has it."""
    store = ctx.store
    if store.blobs.hold(digest, job_id):
        return True
    png = ctx.cache.get_bytes(address, part="png")
    if png is None:
        return False
    store.blobs.put_blob(digest, png, job_id)
    return True
