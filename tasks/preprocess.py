"""CPU stages of the image branch (decode → OCR), and tokenize, which joins every branch of a job; decode's body is
`stoker.runtime.stages.decode`."""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt
from celery import Task

from stoker.adapters.tesseract import read_text
from stoker.adapters.tracing import mark_failed, stage_span
from stoker.core.arrays import array_from_bytes
from stoker.core.cachekeys import OCR_IMAGE
from stoker.core.errors import StageKilled
from stoker.core.jobs import InputRecord
from stoker.core.ocr import Band
from stoker.runtime.bands import bands_for, run_band
from stoker.runtime.context import WorkerContext
from stoker.runtime.handoff import fail_unfinished, tokenize_job
from stoker.runtime.stage import RETRY, cache_scope, follower_wait, run_input_stage, through_cache
from stoker.runtime.stages.decode import decode_and_cache, run_decode
from tasks.lifecycle import context
from tasks.worker import app

log = logging.getLogger(__name__)


@app.task(name="stoker.decode", **RETRY)
def decode(job_id: str, ref: str) -> dict[str, Any]:
    """Decode one image: its parts into the cache, its features (and its picture's layout) into the record."""
    return run_decode(context(), job_id, ref)


def _ocr_pixels(ctx: WorkerContext, record: InputRecord, scope: str) -> npt.NDArray[np.uint8]:
    """The decoded grayscale image: from the cache, or decoded again if the cache lost it."""
    address = ctx.decode_address(record.content_hash, scope)
    raw = ctx.cache.get_bytes(address, part=OCR_IMAGE)
    if raw is not None:
        return array_from_bytes(raw)  # type: ignore[return-value]
    pixels = decode_and_cache(ctx, record, address)[1].ocr_image
    assert pixels is not None  # OCR runs: decode made its image
    return pixels


@app.task(name="stoker.ocr", bind=True, **RETRY)
def ocr(self: Task, previous: dict[str, Any]) -> dict[str, Any]:
    """Read the text of one decoded image; a record that failed or was skipped passes straight through, and so does
    every record when OCR does not run for this model (`STOKER_OCR`). A dense page is cut into bands instead, each
    its own `stoker.ocr_band` task in the job's chord."""
    ctx, job_id, ref = context(), previous["job_id"], previous["ref"]
    # Bands join the job's chord; called in-line (the synchronous baseline) there is none: the page is read whole.
    spread: list[Band] | None = [] if self.request.chord else None
    work = functools.partial(_ocr, spread=spread)
    # done: OCR does not run here, or the record was finished before it (a render's picture, a redelivery)
    outcome = run_input_stage(ctx, job_id, ref, "ocr", work, done=lambda r: not ctx.ocr_runs or r.status == "ok")
    deadline = ctx.store.watch.clock(job_id).deadline or None if spread else None
    bands = spread or []
    for index, band in enumerate(bands):  # sent once the page's record says it waits for them
        args = (job_id, ref, index, band.top, band.bottom, band.overlapped, len(bands))
        band_task = app.signature("stoker.ocr_band", args=args, immutable=True)
        if deadline is not None:
            band_task.set(expires=datetime.fromtimestamp(deadline, UTC))
        self.add_to_chord(band_task)
    return outcome


def _ocr(ctx: WorkerContext, job_id: str, record: InputRecord, spread: list[Band] | None) -> None:
    s = ctx.settings
    scope = cache_scope(ctx, job_id)
    address = ctx.ocr_address(record.content_hash, scope)
    found = ctx.cache.get_json(address)
    pixels = None if found is not None else _ocr_pixels(ctx, record, scope)
    bands = [] if pixels is None or spread is None else bands_for(ctx, pixels)
    if spread is not None and len(bands) > 1:  # the bands read it; the record waits for them
        record.bands = len(bands)
        spread.extend(bands)
        return

    def compute() -> dict[str, Any]:
        page = pixels if pixels is not None else _ocr_pixels(ctx, record, scope)
        return {"text": read_text(page, s.ocr_langs, s.ocr_timeout_s, s.tesseract_cmd, cancelled=ended)}

    def ended() -> bool:  # asked while tesseract runs: a cancelled job's OCR stops at once
        return ctx.store.watch.ended(job_id)

    value = through_cache(ctx, record, address, compute, follower_wait(s.ocr_soft_s))
    record.text = value["text"]
    record.status = "ok"


@app.task(name="stoker.ocr_band", **RETRY)
def ocr_band(job_id: str, ref: str, index: int, top: int, bottom: int, overlapped: bool, count: int) -> dict[str, Any]:
    """OCR one band of a dense page; the last band of the page joins their texts into its record."""
    ctx = context()
    record = ctx.store.jobs.get_input(job_id, ref)
    scope = cache_scope(ctx, job_id)
    page_at = ctx.ocr_address(record.content_hash if record else "", scope)
    pixels = functools.partial(_ocr_pixels, ctx, record, scope) if record else _no_pixels
    return run_band(ctx, job_id, ref, index, Band(top, bottom, overlapped), count, page_at, pixels)


def _no_pixels() -> npt.NDArray[np.uint8]:
    raise AssertionError("a band of a page that is gone reads no pixels")  # run_band returns before asking


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
