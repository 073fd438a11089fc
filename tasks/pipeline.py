"""The canvas of a job: per image decode → OCR (images in parallel), then tokenize, which hands off to infer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from celery import Celery, chain, chord, group
from celery.canvas import Signature

from stoker.jobs import InputRecord
from tasks.app import app as default_app


class Submitter(Protocol):
    """Starts the processing of an accepted job. The API depends on this seam, not on Celery."""

    def submit(self, job_id: str, inputs: Sequence[InputRecord]) -> None:
        """Enqueue the job's work; raises if the broker cannot take it."""


def job_canvas(job_id: str, inputs: Sequence[InputRecord], app: Celery = default_app) -> Signature:
    """The Celery canvas for one job."""
    tokenize = app.signature("stoker.tokenize", kwargs={"job_id": job_id})
    if not inputs:
        return tokenize.clone(args=(None,))
    per_image = [
        chain(
            app.signature("stoker.decode", args=(job_id, r.index), immutable=True),
            app.signature("stoker.ocr"),
        )
        for r in inputs
    ]
    return chord(group(per_image), tokenize)


class CelerySubmitter:
    """Submits jobs to the broker as Celery canvases."""

    def __init__(self, app: Celery = default_app) -> None:
        self.app = app

    def submit(self, job_id: str, inputs: Sequence[InputRecord]) -> None:
        """Publish the job's canvas."""
        job_canvas(job_id, inputs, self.app).apply_async()
