"""CPU stages of the image branch (decode → OCR, a dense page's OCR in bands), and tokenize, which joins every branch
of a job; a render of one picture as one task; each stage's body is its module under `stoker.runtime.stages`."""

from __future__ import annotations

from typing import Any

from celery import Task

from stoker.core.ocr import Band
from stoker.runtime.stages.decode import run_decode
from stoker.runtime.stages.ocr import bands_for, run_ocr, run_ocr_band, whole_page
from stoker.runtime.stages.tokenization import run_rescue, run_tokenize
from tasks.lifecycle import context
from tasks.pipeline import band_signatures
from tasks.retry import RETRY
from tasks.worker import app


@app.task(name="stoker.decode", **RETRY)
def decode(job_id: str, ref: str) -> dict[str, Any]:
    """Decode one image: its parts into the cache, its features (and its picture's layout) into the record."""
    return run_decode(context(), job_id, ref)


@app.task(name="stoker.render", **RETRY)
def render(job_id: str, ref: str) -> dict[str, Any]:
    """A render of one picture, whole: the picture rendered into the stage cache (decode's render), then the job
    ended at its hand-off (tokenize's), in one task (`tasks.pipeline.render_branches`)."""
    ctx = context()
    run_decode(ctx, job_id, ref)
    return run_tokenize(ctx, job_id)


@app.task(name="stoker.ocr", bind=True, **RETRY)
def ocr(self: Task, previous: dict[str, Any]) -> dict[str, Any]:
    """Read the text of one decoded image; a dense page's bands join the job's chord, one task each (called outside
    a chord, there is none to join: the page is read whole)."""
    cut = bands_for if self.request.chord else whole_page
    outcome, spread = run_ocr(context(), previous["job_id"], previous["ref"], cut)
    for band in band_signatures(app, spread.band_args(), spread.deadline):  # the page's record waits for them
        self.add_to_chord(band)
    return outcome


@app.task(name="stoker.ocr_band", **RETRY)
def ocr_band(job_id: str, ref: str, index: int, top: int, bottom: int, overlapped: bool, count: int) -> dict[str, Any]:
    """OCR one band of a dense page; the last band of the page joins their texts into its record."""
    return run_ocr_band(context(), job_id, ref, index, Band(top, bottom, overlapped), count)


@app.task(name="stoker.tokenize", **RETRY)
def tokenize(_results: list[dict[str, Any]] | None, job_id: str) -> dict[str, Any]:
    """Assemble the chat prompt from the user's prompt and every input, tokenize it, hand it to inference."""
    return run_tokenize(context(), job_id)


@app.task(name="stoker.rescue")
def rescue(failed_task_id: str, *, job_id: str) -> dict[str, Any]:
    """Errback of a job's chord: a stage died beyond what it could catch (hard time limit, lost worker); the job
    goes on to tokenize with what it has."""
    return run_rescue(context(), job_id, failed_task_id)
