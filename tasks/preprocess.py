"""CPU stages of the image branch (decode → OCR), and tokenize, which joins every branch of a job."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from stoker.adapters.tracing import mark_failed, stage_span
from stoker.core.arrays import array_from_bytes, array_to_bytes
from stoker.core.cachekeys import OCR_IMAGE, PICTURE, CacheAddress
from stoker.core.errors import StageKilled
from stoker.core.imaging import DecodedImage, decode_image, served_picture
from stoker.core.jobs import InputRecord
from stoker.core.ocr import read_text
from stoker.runtime.context import WorkerContext
from stoker.runtime.handoff import fail_unfinished, tokenize_job
from stoker.runtime.stage import RETRY, cache_scope, follower_wait, input_bytes, run_input_stage, through_cache
from tasks.lifecycle import context
from tasks.worker import app

log = logging.getLogger(__name__)


def _decode_and_cache(
    ctx: WorkerContext, record: InputRecord, address: CacheAddress
) -> tuple[dict[str, Any], DecodedImage]:
    """Decode what this configuration needs and cache each part: the OCR image, the model's image tensors (their
    layout goes into the record), the picture for a server that sees."""
    decoded = decode_image(input_bytes(ctx, record, "decode"), ctx.decode_params, ctx.decode_needs)
    value: dict[str, Any] = {"features": decoded.features.to_dict()}
    if decoded.ocr_image is not None:
        ctx.cache.put_bytes(address, array_to_bytes(decoded.ocr_image), part=OCR_IMAGE)
    if decoded.picture is not None and ctx.image_preparer is not None:
        prepared = ctx.image_preparer.prepare(decoded.picture)
        ctx.put_prepared(ctx.vision_address(record.content_hash, address.scope), prepared)
        value["prepared"] = {"processor": ctx.image_preparer.identity, "layout": ctx.image_preparer.layout(prepared)}
    if decoded.picture is not None and ctx.picture_bounds is not None:
        ctx.cache.put_bytes(address, served_picture(decoded.picture, *ctx.picture_bounds), part=PICTURE)
    return value, decoded


@app.task(name="stoker.decode", **RETRY)
def decode(job_id: str, ref: str) -> dict[str, Any]:
    """Decode one image: its parts into the cache, its features (and its picture's layout) into the record."""
    return run_input_stage(context(), job_id, ref, "decode", _decode, opens_job=True)


def _decode(ctx: WorkerContext, job_id: str, record: InputRecord) -> None:
    address = ctx.decode_address(record.content_hash, cache_scope(ctx, job_id))
    wait = follower_wait(ctx.settings.decode_soft_s)
    value = through_cache(ctx, record, address, lambda: _decode_and_cache(ctx, record, address)[0], wait)
    record.features = value["features"]
    record.prepared = value.get("prepared")
    if not ctx.ocr_runs:
        record.status = "ok"  # nothing more to read from it: the OCR stage passes it through


def _ocr_pixels(ctx: WorkerContext, record: InputRecord, scope: str) -> npt.NDArray[np.uint8]:
    """The decoded grayscale image: from the cache, or decoded again if the cache lost it."""
    address = ctx.decode_address(record.content_hash, scope)
    raw = ctx.cache.get_bytes(address, part=OCR_IMAGE)
    if raw is not None:
        return array_from_bytes(raw)  # type: ignore[return-value]
    pixels = _decode_and_cache(ctx, record, address)[1].ocr_image
    assert pixels is not None  # OCR runs: decode made its image
    return pixels


@app.task(name="stoker.ocr", **RETRY)
def ocr(previous: dict[str, Any]) -> dict[str, Any]:
    """Read the text of one decoded image; a record that failed or was skipped passes straight through, and so does
    every record when OCR does not run for this model (`STOKER_OCR`)."""
    ctx = context()
    return run_input_stage(ctx, previous["job_id"], previous["ref"], "ocr", _ocr, done=lambda _: not ctx.ocr_runs)


def _ocr(ctx: WorkerContext, job_id: str, record: InputRecord) -> None:
    s = ctx.settings
    scope = cache_scope(ctx, job_id)

    def compute() -> dict[str, Any]:
        pixels = _ocr_pixels(ctx, record, scope)
        return {"text": read_text(pixels, s.ocr_langs, s.ocr_timeout_s, s.tesseract_cmd, cancelled=ended)}

    def ended() -> bool:  # asked while tesseract runs: a cancelled job's OCR stops at once
        return ctx.store.watch.ended(job_id)

    address = ctx.ocr_address(record.content_hash, scope)
    value = through_cache(ctx, record, address, compute, follower_wait(s.ocr_soft_s))
    record.text = value["text"]
    record.status = "ok"


@app.task(name="stoker.tokenize", **RETRY)
def tokenize(_results: list[dict[str, Any]] | None, job_id: str) -> dict[str, Any]:
    """Assemble the chat prompt from the user's prompt and every input, tokenize it, hand it to inference."""
    with stage_span("tokenize", {"stoker.job_id": job_id}) as span:
        outcome = tokenize_job(context(), job_id)
        span.set_attribute("stoker.prompt_tokens", int(outcome.get("prompt_tokens", 0)))
        if "failed" in outcome:
            mark_failed(span, str(outcome["failed"]))
        return outcome


@app.task(name="stoker.rescue")
def rescue(failed_task_id: str, *, job_id: str) -> dict[str, Any]:
    """Errback of a job's chord: a stage died beyond what it could catch (hard time limit, lost worker).

    Inputs still unfinished are marked failed, and the job goes on to tokenize with what it has.
    """
    ctx = context()
    killed = StageKilled(f"task {failed_task_id} was killed")
    if not fail_unfinished(ctx, job_id, killed):
        return {"job_id": job_id, "skipped": True}
    log.warning("job %s rescued after task %s was killed", job_id, failed_task_id)
    return tokenize_job(ctx, job_id)
