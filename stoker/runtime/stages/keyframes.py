"""The keyframe stage of a video: one keyframe slot taken by seeking, and entered into the image branch as an image
(its PNG stored as an input blob, and cached), which decode and OCR then read like an upload."""

from __future__ import annotations

import functools
import logging
from typing import Any

from stoker.adapters.store.keys import frame_ref, input_ref
from stoker.core.avmedia import extract_frame, keyframe_times
from stoker.core.avmedia import probe as probe_media
from stoker.core.cachekeys import CacheAddress
from stoker.core.errors import StokerError
from stoker.core.jobs import InputRecord
from stoker.core.media import ContentHash, content_hash
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import cache_scope, handoff, input_bytes, through_cache

log = logging.getLogger(__name__)


def run_keyframe(ctx: WorkerContext, job_id: str, index: int, slot: int, count: int) -> dict[str, Any]:
    """Take keyframe `slot` of `count` from a video by seeking, and enter it into the image branch as an image."""
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
