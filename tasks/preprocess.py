"""CPU stages of the image branch (decode → OCR), and tokenize, which joins every branch of a job."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery.signals import celeryd_after_setup

from stoker.core.arrays import array_from_bytes, array_to_bytes
from stoker.core.imaging import decode_image
from stoker.core.media import ContentHash
from stoker.core.ocr import read_text
from stoker.core.prompting import Attachment, build_prompt_ids
from stoker.errors import InputExpired, MediaEmpty, StokerError
from stoker.jobs import ErrorInfo, InputRecord
from stoker.store import input_ref
from tasks import resources
from tasks.app import app
from tasks.stage import handoff, input_stage, runnable

log = logging.getLogger(__name__)

OCR_IMAGE = "ocr_image"
MODEL_INPUT = "model_input"

# Tokenizers parallelise internally; after a fork that deadlocks, so prefork children stay single-threaded.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _decode_fingerprint() -> str:
    p = resources.decode_params()
    return f"{p.max_pixels}-{p.image_size}-{p.ocr_max_side}"


@app.task(name="stoker.decode")
def decode(job_id: str, ref: str) -> dict[str, Any]:
    """Decode one image: model-ready array and OCR image into the store, features into the record."""
    store = resources.store()
    store.mark_started(job_id)
    record = store.get_input(job_id, ref)
    if record is None or not runnable(record):
        return handoff(job_id, ref, record)
    with input_stage(record, "decode"):
        data = store.get_blob(ContentHash(record.content_hash))
        if data is None:
            raise InputExpired("input bytes expired before decode", stage="decode")
        decoded = decode_image(data, resources.decode_params())
        digest, fingerprint = ContentHash(record.content_hash), _decode_fingerprint()
        store.put_artifact(OCR_IMAGE, digest, fingerprint, array_to_bytes(decoded.ocr_image))
        store.put_artifact(MODEL_INPUT, digest, fingerprint, array_to_bytes(decoded.model_input))
        record.features = decoded.features.to_dict()
    store.put_input(job_id, ref, record)
    return handoff(job_id, ref, record)


@app.task(name="stoker.ocr")
def ocr(previous: dict[str, Any]) -> dict[str, Any]:
    """Read the text of one decoded image; a record that failed or was skipped passes straight through."""
    job_id, ref = previous["job_id"], previous["ref"]
    store = resources.store()
    record = store.get_input(job_id, ref)
    if record is None or not runnable(record):
        return handoff(job_id, ref, record)
    s = resources.settings()
    with input_stage(record, "ocr"):
        raw = store.get_artifact(OCR_IMAGE, ContentHash(record.content_hash), _decode_fingerprint())
        if raw is None:
            raise InputExpired("decoded image expired before OCR", stage="ocr")
        record.text = read_text(array_from_bytes(raw), s.ocr_langs, s.ocr_timeout_s)  # type: ignore[arg-type]
        record.status = "ok"
    store.put_input(job_id, ref, record)
    return handoff(job_id, ref, record)


@app.task(name="stoker.tokenize")
def tokenize(_results: list[dict[str, Any]] | None, job_id: str) -> dict[str, Any]:
    """Assemble the chat prompt from the user's prompt and every input, tokenize it, hand it to inference."""
    store = resources.store()
    store.mark_started(job_id)
    job = store.load_job(job_id)
    if job is None or job.terminal:
        return {"job_id": job_id, "skipped": True}
    for record in job.inputs:
        if settle_video(record):
            store.put_input(job_id, input_ref(record.index), record.model_copy(update={"frames": None}))
    try:
        ids = _prompt_ids(job.prompt, job.inputs)
    except StokerError as exc:
        store.finish(job_id, "failed", error=ErrorInfo(**exc.to_dict()))
        return {"job_id": job_id, "failed": exc.code}
    store.put_tokens(job_id, ids)
    store.stamp(job_id, "preprocessed", status="inferring")
    app.signature("stoker.infer", kwargs={"job_id": job_id}).apply_async()
    return {"job_id": job_id, "prompt_tokens": len(ids)}


def settle_video(record: InputRecord) -> bool:
    """A video with no audio stream is usable only through its keyframes; with none either, it failed."""
    no_sound = (record.features or {}).get("audio_streams") == 0
    frames_ok = any(f.status == "ok" for f in record.frames or [])
    if record.kind != "video" or record.status != "ok" or not no_sound or frames_ok:
        return False
    record.status = "failed"
    record.error = ErrorInfo(**MediaEmpty("no audio track and no decodable frame", stage="keyframes").to_dict())
    return True


def _prompt_ids(prompt: str, inputs: list[InputRecord]) -> list[int]:
    s = resources.settings()
    tok = resources.tokenizer()
    context = min(s.max_context_tokens, int(getattr(tok, "model_max_length", s.max_context_tokens)))
    attachments = [_attachment(r) for r in inputs]
    return build_prompt_ids(tok, prompt, attachments, budget=context - s.max_new_tokens)


def _attachment(record: InputRecord) -> Attachment:
    texts = [record.text or ""] + [
        f"On screen at {f.time_s:.1f}s: {f.text}" for f in record.frames or [] if f.status == "ok" and f.text
    ]
    keep = ("format", "width", "height", "duration_s")
    return Attachment(
        kind=record.kind,
        index=record.index,
        text="\n".join(t for t in texts if t),
        features={k: v for k, v in (record.features or {}).items() if k in keep},
        error_code=record.error.code if record.error else None,
    )


@celeryd_after_setup.connect
def _preload(sender: str, instance: Any, **_: Any) -> None:
    """Load the tokenizer in the parent before the pool forks, so no task pays for it under its time limit."""
    queues = set(instance.app.amqp.queues.consume_from or {})
    if "tokenize" in queues:
        started = time.perf_counter()
        resources.tokenizer()
        log.info("tokenizer preloaded in %.1fs", time.perf_counter() - started)
