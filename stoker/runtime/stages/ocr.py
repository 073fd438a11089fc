"""The OCR stage of an image: its text, read whole, or cut into bands when the page is dense (or the pool idle).

Chunked OCR: a dense page is cut into horizontal bands (`stoker.core.ocr.plan_bands`), each OCR'd as a task of its
own on any CPU child, and the band that comes in last joins their texts into the page's record.

The LLM servers' answer to one long prompt holding a server while short ones queue (chunked prefill), for
preprocessing: a page that takes seconds of tesseract no longer holds one child while small pages wait behind it;
its bands spread over every child that is free. The bands join the job's chord (the task sends what `run_ocr`
returns as a `Spread`), so tokenize runs only once every band is in, and a band killed outright is the chord's
failure, as for any stage (`rescue`). Each band is cached under the page's OCR address and its rows: a retry or a
repeat reuses what was read.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stoker.adapters.cache import COST_FIELD
from stoker.adapters.tesseract import read_text
from stoker.core.arrays import array_from_bytes
from stoker.core.cachekeys import OCR_IMAGE, CacheAddress, ocr_band_address
from stoker.core.errors import StokerError
from stoker.core.jobs import ErrorInfo, InputRecord
from stoker.core.ocr import Band, band_limit, join_bands, lines_of_text, plan_bands
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import (
    cache_scope,
    follower_wait,
    handoff,
    input_stage,
    run_input_stage,
    through_cache,
    why_no_work,
    write_no_work,
)
from stoker.runtime.stages.decode import decode_and_cache

log = logging.getLogger(__name__)

#: The stage name of one band (its timings, metrics and cache entries).
STAGE = "ocr_band"

Pixels = Callable[[], npt.NDArray[np.uint8]]

#: How a page is cut into bands (`bands_for`, or `whole_page`): more than one, and its bands read it.
Cut = Callable[[WorkerContext, npt.NDArray[np.uint8]], list[Band]]


@dataclass(frozen=True)
class Spread:
    """The bands a page was cut into, each for a `stoker.ocr_band` task of the job's chord (none: it was read whole),
    and the job's deadline, which their messages expire at."""

    job_id: str
    ref: str
    bands: list[Band]
    deadline: float | None = None

    def band_args(self) -> list[tuple[str, str, int, int, int, bool, int]]:
        """Each band's task arguments (`run_ocr_band`'s, after the context)."""
        count = len(self.bands)
        return [
            (self.job_id, self.ref, index, band.top, band.bottom, band.overlapped, count)
            for index, band in enumerate(self.bands)
        ]


def run_ocr(ctx: WorkerContext, job_id: str, ref: str, cut: Cut) -> tuple[dict[str, Any], Spread]:
    """Read the text of one decoded image; a record that failed or was skipped passes straight through, and so does
    every record when OCR does not run for this model (`STOKER_OCR`). A page that `cut` cuts into more than one band
    is not read here: the `Spread` says which bands, for the task to send once the page's record says it waits for
    them."""
    spread: list[Band] = []
    work = functools.partial(_ocr, cut=cut, spread=spread)
    # done: OCR does not run here, or the record was finished before it (a render's picture, a redelivery)
    outcome = run_input_stage(ctx, job_id, ref, "ocr", work, done=lambda r: not ctx.ocr_runs or r.status == "ok")
    deadline = (ctx.store.watch.clock(job_id).deadline or None) if spread else None
    return outcome, Spread(job_id, ref, spread, deadline)


def _ocr(ctx: WorkerContext, job_id: str, record: InputRecord, cut: Cut, spread: list[Band]) -> None:
    s = ctx.settings
    scope = cache_scope(ctx, job_id)
    address = ctx.ocr_address(record.content_hash, scope)
    found = ctx.cache.get_json(address)
    pixels = None if found is not None else ocr_pixels(ctx, record, scope)
    bands = [] if pixels is None else cut(ctx, pixels)
    if len(bands) > 1:  # the bands read it; the record waits for them
        record.bands = len(bands)
        spread.extend(bands)
        return

    def compute() -> dict[str, Any]:
        page = pixels if pixels is not None else ocr_pixels(ctx, record, scope)
        return {"text": read_text(page, s.ocr_langs, s.ocr_timeout_s, s.tesseract_cmd, cancelled=ended)}

    def ended() -> bool:  # asked while tesseract runs: a cancelled job's OCR stops at once
        return ctx.store.watch.ended(job_id)

    value = through_cache(ctx, record, address, compute, follower_wait(s.ocr_soft_s))
    record.text = value["text"]
    record.status = "ok"


def ocr_pixels(ctx: WorkerContext, record: InputRecord, scope: str) -> npt.NDArray[np.uint8]:
    """The decoded grayscale image: from the cache, or decoded again if the cache lost it."""
    address = ctx.decode_address(record.content_hash, scope)
    raw = ctx.cache.get_bytes(address, part=OCR_IMAGE)
    if raw is not None:
        return array_from_bytes(raw)  # type: ignore[return-value]
    pixels = decode_and_cache(ctx, record, address)[1].ocr_image
    assert pixels is not None  # OCR runs: decode made its image
    return pixels


def bands_for(ctx: WorkerContext, pixels: npt.NDArray[np.uint8]) -> list[Band]:
    """How this worker cuts a page, into no more bands than its pool reads at once (`band_limit`): always when it
    is past the size threshold; when smaller (down to `STOKER_OCR_BAND_IDLE_MIN_PIXELS`), only when it is lines of
    text and the pool has room (`WorkerContext.pool_has_room`); else it is one band.

    What tesseract costs follows the lines of text more than the pixels: on the benchmark's pages (one thread, an
    idle host) a dense 1024×768 page took 0.57 s whole, a photo of the same size 0.15, a dense 2048×1536 page 0.78.
    A dense page under the size threshold was among the slowest jobs on an idle pool; in two bands on two free
    children it takes 0.34 (0.32 + 0.34 CPU s; docs/bench/log/2026-12-05-pages-of-text-in-bands-while-idle.md).
    Under load the children are busy anyway, and it is read whole, at the least CPU.

    Bands read the decoded page from the stage cache, so with the cache off a page is read whole: each band would
    otherwise decode the whole page again (a 4000×3000 JPEG: 0.1 to 0.3 CPU s a band)."""
    s = ctx.settings
    height, width = pixels.shape[:2]
    whole = [Band(0, height)]
    area = height * width
    if s.ocr_band_min_pixels == 0 or not ctx.cache.enabled:
        return whole
    dense = area > s.ocr_band_min_pixels
    if not dense and (s.ocr_band_idle_min_pixels == 0 or area <= s.ocr_band_idle_min_pixels):
        return whole
    most = band_limit(s.ocr_bands, ctx.cores, ctx.pool_children)
    bands = plan_bands(pixels, s.ocr_band_rows, s.ocr_band_search_rows, s.ocr_band_overlap_rows, most)
    if dense or len(bands) == 1:
        return bands
    # With room in the pool, a band sent now is taken at once: by this child, whose OCR task ends as it sends
    # them, and by any child that is free.
    return bands if lines_of_text(bands) and ctx.pool_has_room() else whole


def whole_page(_ctx: WorkerContext, pixels: npt.NDArray[np.uint8]) -> list[Band]:
    """The page as one band: it is read whole, by the task that decoded it."""
    return [Band(0, pixels.shape[0])]


def run_ocr_band(ctx: WorkerContext, job_id: str, ref: str, index: int, band: Band, count: int) -> dict[str, Any]:
    """OCR one band of a dense page; the last band of the page joins their texts into its record."""
    record = ctx.store.jobs.get_input(job_id, ref)
    scope = cache_scope(ctx, job_id)
    page_at = ctx.ocr_address(record.content_hash if record else "", scope)
    pixels = functools.partial(ocr_pixels, ctx, record, scope) if record else _no_pixels
    return run_band(ctx, job_id, ref, index, band, count, page_at, pixels)


def _no_pixels() -> npt.NDArray[np.uint8]:
    raise AssertionError("a band of a page that is gone reads no pixels")  # run_band returns before asking


def run_band(
    ctx: WorkerContext, job_id: str, ref: str, index: int, band: Band, count: int, page_at: CacheAddress, pixels: Pixels
) -> dict[str, Any]:
    """OCR one band of the page at `ref`, keep its outcome beside the page, and join the page if it was the last."""
    page = ctx.store.jobs.get_input(job_id, ref)
    if page is None:
        return handoff(job_id, ref, page)
    skipped = why_no_work(ctx, job_id, page, "ocr")
    if skipped is not None:
        write_no_work(ctx, job_id, ref, page, skipped)
        return handoff(job_id, ref, page)
    part = InputRecord(index=index, kind="image", content_hash=page.content_hash, size_bytes=0)
    part.features = {"top": band.top, "bottom": band.bottom, "overlapped": band.overlapped}
    with input_stage(part, STAGE):
        part.text = _band_text(ctx, job_id, part, band, page_at, pixels)
        part.status = "ok"
    arrived = ctx.store.jobs.put_band(job_id, ref, index, part)
    if arrived == count:
        join_page(ctx, job_id, ref, count, page_at)
    return handoff(job_id, ref, part)


def _band_text(
    ctx: WorkerContext, job_id: str, part: InputRecord, band: Band, page_at: CacheAddress, pixels: Pixels
) -> str:
    s = ctx.settings

    def compute() -> dict[str, Any]:
        rows = pixels()[band.top : band.bottom]
        return {"text": read_text(rows, s.ocr_langs, s.ocr_timeout_s, s.tesseract_cmd, cancelled=ended)}

    def ended() -> bool:  # asked while tesseract runs: a cancelled job's bands stop at once
        return ctx.store.watch.ended(job_id)

    address = ocr_band_address(page_at, band.top, band.bottom)
    return str(through_cache(ctx, part, address, compute, follower_wait(s.ocr_soft_s))["text"])


def join_page(ctx: WorkerContext, job_id: str, ref: str, count: int, page_at: CacheAddress) -> None:
    """Every band of the page is in: its record gets their joined text (or the first band's error), and the page's
    own OCR entry is cached, so a repeat of the page needs no band at all."""
    jobs = ctx.store.jobs
    page = jobs.get_input(job_id, ref)
    parts = jobs.bands(job_id, ref, count)
    if page is None or page.status != "pending" or any(p is None for p in parts):
        return
    done = [p for p in parts if p is not None]
    failed = next((p for p in done if p.status == "failed"), None)
    page.timings_ms[STAGE] = round(sum(p.timings_ms.get(STAGE, 0.0) for p in done), 2)
    page.cache_hit[STAGE] = all(p.cache_hit.get(STAGE, False) for p in done)
    if failed is not None:
        page.status, page.error = "failed", failed.error or ErrorInfo(**StokerError("a band failed").to_dict())
    else:
        page.text = join_bands([p.text or "" for p in done], [_band(p) for p in done])
        page.status = "ok"
        ctx.cache.put_json(page_at, {"text": page.text, COST_FIELD: page.timings_ms[STAGE] / 1000})
    if jobs.put_input(job_id, ref, page):
        jobs.clear_bands(job_id, ref, count)
    log.info("job %s %s: %d bands joined (%s)", job_id, ref, count, page.status)


def _band(part: InputRecord) -> Band:
    features = part.features or {}
    return Band(int(features["top"]), int(features["bottom"]), bool(features.get("overlapped")))
