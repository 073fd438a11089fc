"""The decode stage of an image: its parts into the stage cache (the OCR image, the model's image tensors, the picture
a server that sees gets, its rendering for vLLM's generate endpoint), its features into the record; a render job's
picture rendered instead."""

from __future__ import annotations

import time
from typing import Any

from stoker.adapters.render import ITEM
from stoker.core.arrays import array_to_bytes
from stoker.core.cachekeys import OCR_IMAGE, PICTURE, CacheAddress
from stoker.core.imaging import DecodedImage, decode_image, decode_rgb
from stoker.core.jobs import InputRecord
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import cache_scope, follower_wait, input_bytes, run_input_stage, through_cache


def run_decode(ctx: WorkerContext, job_id: str, ref: str) -> dict[str, Any]:
    """Decode one image: its parts into the cache, its features (and its picture's layout) into the record."""
    return run_input_stage(ctx, job_id, ref, "decode", _decode, opens_job=True)


def decode_and_cache(
    ctx: WorkerContext, record: InputRecord, address: CacheAddress
) -> tuple[dict[str, Any], DecodedImage]:
    """Decode what this configuration needs and cache each part: the OCR image, the model's image tensors (their
    layout goes into the record), the picture for a server that sees, its rendering for vLLM's generate endpoint."""
    decoded = decode_image(input_bytes(ctx, record, "decode"), ctx.decode_params, ctx.decode_needs)
    value: dict[str, Any] = {"features": decoded.features.to_dict()}
    pictures = ctx.pictures
    if decoded.ocr_image is not None:
        ctx.cache.put_bytes(address, array_to_bytes(decoded.ocr_image), part=OCR_IMAGE)
    if decoded.picture is not None and ctx.image_preparer is not None:
        prepared = ctx.image_preparer.prepare(decoded.picture)
        pictures.put_prepared(pictures.vision_address(record.content_hash, address.scope), prepared)
        value["prepared"] = {"processor": ctx.image_preparer.identity, "layout": ctx.image_preparer.layout(prepared)}
    if decoded.picture is not None and ctx.picture_bounds is not None:
        ctx.cache.put_bytes(address, pictures.served(decoded.picture), part=PICTURE)
    if decoded.picture is not None and ctx.request_renderer is not None:
        pictures.put_rendered(record.content_hash, address.scope, decoded.picture)  # for the generate endpoint
    return value, decoded


def _decode(ctx: WorkerContext, job_id: str, record: InputRecord) -> None:
    chat = ctx.store.jobs.conversation(job_id)
    if chat is not None and chat.render:
        _render(ctx, record, cache_scope(ctx, job_id))
        return
    address = ctx.decode_address(record.content_hash, cache_scope(ctx, job_id))
    wait = follower_wait(ctx.settings.decode_soft_s)
    value = through_cache(ctx, record, address, lambda: decode_and_cache(ctx, record, address)[0], wait)
    record.features = value["features"]
    record.prepared = value.get("prepared")
    if not ctx.ocr_runs:
        record.status = "ok"  # nothing more to read from it: the OCR stage passes it through


def _render(ctx: WorkerContext, record: InputRecord, scope: str) -> None:
    """A render job's picture: its rendering found in the stage cache (the tenant's scope), or decoded and rendered
    here and cached there (the rendering the generate backend reads too). The record says where (`prepared`), the
    API reads the tensors from there; nothing is left for OCR."""
    pictures = ctx.pictures
    address = pictures.rendering_address(record.content_hash, scope)
    hit = ctx.cache.has(address, part=ITEM)
    started = time.perf_counter()
    if not hit:
        picture = decode_rgb(input_bytes(ctx, record, "decode"), ctx.decode_params)
        pictures.render_picture(record.content_hash, scope, picture)
    ctx.cache.record(address.stage, hit=hit, cost_s=time.perf_counter() - started)
    record.cache_hit[address.stage] = hit
    record.prepared = {"render": ctx.renderer.identity, "decode": pictures.rendering_decode}
    record.status = "ok"
