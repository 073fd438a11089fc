"""Audio and video stages: probe the container, transcribe the sound (queue asr), sample keyframes for OCR."""

from __future__ import annotations

import logging
from typing import Any

from stoker.core.asr import transcribe as transcribe_samples
from stoker.core.avmedia import decode_audio, extract_frame, keyframe_times
from stoker.core.avmedia import probe as probe_media
from stoker.core.media import ContentHash, content_hash
from stoker.errors import InputExpired, StokerError
from stoker.jobs import InputRecord, Segment
from stoker.store import frame_ref, input_ref
from tasks import resources
from tasks.app import app
from tasks.stage import handoff, input_stage, runnable

log = logging.getLogger(__name__)


def _blob(record: InputRecord, stage: str) -> bytes:
    data = resources.store().get_blob(ContentHash(record.content_hash))
    if data is None:
        raise InputExpired(f"input bytes expired before {stage}", stage=stage)
    return data


@app.task(name="stoker.probe")
def probe(job_id: str, ref: str) -> dict[str, Any]:
    """Read duration and streams from the header; over-long, empty or unreadable media fail here, undecoded."""
    store = resources.store()
    store.mark_started(job_id)
    record = store.get_input(job_id, ref)
    if record is None or not runnable(record):
        return handoff(job_id, ref, record)
    with input_stage(record, "probe"):
        info = probe_media(_blob(record, "probe"), resources.settings().max_media_seconds)
        record.features = info.to_dict()
    store.put_input(job_id, ref, record)
    return handoff(job_id, ref, record)


@app.task(name="stoker.transcribe")
def transcribe(previous: dict[str, Any]) -> dict[str, Any]:
    """Transcribe the audio track with faster-whisper; a video without sound gets an empty transcript."""
    job_id, ref = previous["job_id"], previous["ref"]
    store = resources.store()
    record = store.get_input(job_id, ref)
    if record is None or not runnable(record):
        return handoff(job_id, ref, record)
    s = resources.settings()
    with input_stage(record, "transcribe"):
        if (record.features or {}).get("audio_streams", 1) > 0:
            samples = decode_audio(_blob(record, "transcribe"))
            transcript = transcribe_samples(resources.speech_model(), samples, s.asr_beam_size)
            record.text = transcript.text
            record.segments = [Segment(start=x.start, end=x.end, text=x.text) for x in transcript.segments]
        else:
            record.text, record.segments = "", []
        record.status = "ok"
    store.put_input(job_id, ref, record)
    return handoff(job_id, ref, record)


@app.task(name="stoker.keyframe")
def keyframe(job_id: str, index: int, slot: int, count: int) -> dict[str, Any]:
    """Take keyframe `slot` of `count` from a video by seeking, and enter it into the image branch as an image."""
    store = resources.store()
    store.mark_started(job_id)
    target = frame_ref(index, slot)
    video = store.get_input(job_id, input_ref(index))
    if video is None:
        return handoff(job_id, target, None)
    frame = InputRecord(index=slot, kind="image", content_hash="", size_bytes=0, status="skipped")
    try:
        data = _blob(video, "keyframes")
        info = probe_media(data, resources.settings().max_media_seconds)
        times = keyframe_times(info.duration_s, count) if info.video_streams else []
        taken = extract_frame(data, times[slot]) if slot < len(times) else None
    except StokerError as exc:
        log.info("job %s input %d: no keyframe %d (%s)", job_id, index, slot, exc.code)
        taken = None
    if taken is not None:
        at, png = taken
        digest = content_hash(png)
        store.put_blob(digest, png)
        update = {"content_hash": digest, "size_bytes": len(png), "status": "pending", "time_s": round(at, 3)}
        frame = frame.model_copy(update=update)
    store.put_input(job_id, target, frame)
    return handoff(job_id, target, frame)
