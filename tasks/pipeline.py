"""The canvas of a job: every input's branch in parallel (a chord header), then tokenize, which hands off to infer.

image  decode → ocr
audio  probe → transcribe
video  probe → transcribe, and per keyframe slot: keyframe → decode → ocr
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from celery import Celery, chain, chord, group
from celery.canvas import Signature

from stoker.jobs import InputRecord
from stoker.store import frame_ref, input_ref
from tasks.app import app as default_app

#: Where a job enters the pipeline: from the start, at tokenize (inputs cached), at inference (prompt cached).
Start = Literal["preprocess", "tokenize", "infer"]


class Submitter(Protocol):
    """Starts the processing of an accepted job. The API depends on this seam, not on Celery."""

    def submit(self, job_id: str, inputs: Sequence[InputRecord], start: Start = "preprocess") -> None:
        """Enqueue the job's work from `start` on; raises if the broker cannot take it."""


def job_canvas(
    job_id: str,
    inputs: Sequence[InputRecord],
    app: Celery = default_app,
    keyframes: int = 3,
    start: Start = "preprocess",
) -> Signature:
    """The Celery canvas for one job, from where it enters the pipeline."""
    if start == "infer":
        return app.signature("stoker.infer", kwargs={"job_id": job_id})
    tokenize = app.signature("stoker.tokenize", kwargs={"job_id": job_id})
    todo = inputs if start == "preprocess" else []
    branches = [branch for record in todo for branch in _branches(app, job_id, record, keyframes)]
    if not branches:
        return tokenize.clone(args=(None,))
    # Stages catch their own errors; this errback covers what they cannot (a hard time limit, a killed child).
    tokenize.link_error(app.signature("stoker.rescue", kwargs={"job_id": job_id}))
    return chord(group(branches), tokenize)


def _branches(app: Celery, job_id: str, record: InputRecord, keyframes: int) -> list[Signature]:
    ref = input_ref(record.index)
    if record.kind == "image":
        return [_image_branch(app, job_id, ref)]
    sound = chain(app.signature("stoker.probe", args=(job_id, ref), immutable=True), app.signature("stoker.transcribe"))
    if record.kind == "audio":
        return [sound]
    frames = [
        chain(
            app.signature("stoker.keyframe", args=(job_id, record.index, slot, keyframes), immutable=True),
            _image_branch(app, job_id, frame_ref(record.index, slot)),
        )
        for slot in range(keyframes)
    ]
    return [sound, *frames]


def _image_branch(app: Celery, job_id: str, ref: str) -> Signature:
    return chain(app.signature("stoker.decode", args=(job_id, ref), immutable=True), app.signature("stoker.ocr"))


class CelerySubmitter:
    """Submits jobs to the broker as Celery canvases."""

    def __init__(self, app: Celery = default_app, keyframes: int = 3) -> None:
        self.app = app
        self.keyframes = keyframes

    def submit(self, job_id: str, inputs: Sequence[InputRecord], start: Start = "preprocess") -> None:
        """Publish the job's canvas."""
        job_canvas(job_id, inputs, self.app, self.keyframes, start).apply_async()
