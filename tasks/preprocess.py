"""CPU stages: decode → OCR per image, in parallel across a job's images, then tokenize the whole prompt."""

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
from stoker.errors import InputExpired, StokerError
from stoker.jobs import ErrorInfo, InputRecord
from tasks import resources
from tasks.app import app
from tasks.stage import input_stage

log = logging.getLogger(__name__)

OCR_IMAGE = "ocr_image"
MODEL_INPUT = "model_input"

# Tokenizers parallelise internally; after a fork that deadlocks, so prefork children stay single-threaded.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _decode_fingerprint() -> str:
    p = resources.decode_params()
    return f"{p.max_pixels}-{p.image_size}-{p.ocr_max_side}"


def _record(job_id: str, index: int) -> InputRecord:
    record = resources.store().get_input(job_id, index)
    if record is None:
        raise InputExpired(f"job {job_id} has no input {index}")
    return record


@app.task(name="stoker.decode")
def decode(job_id: str, index: int) -> dict[str, Any]:
    """Decode one image: model-ready array and OCR image into the store, features into the record."""
    store = resources.store()
    store.mark_started(job_id)
    record = _record(job_id, index)
    with input_stage(record, "decode"):
        data = store.get_blob(ContentHash(record.content_hash))
        if data is None:
            raise InputExpired("input bytes expired before decode", stage="decode")
        decoded = decode_image(data, resources.decode_params())
        digest, fingerprint = ContentHash(record.content_hash), _decode_fingerprint()
        store.put_artifact(OCR_IMAGE, digest, fingerprint, array_to_bytes(decoded.ocr_image))
        store.put_artifact(MODEL_INPUT, digest, fingerprint, array_to_bytes(decoded.model_input))
        record.features = decoded.features.to_dict()
    store.put_input(job_id, record)
    return {"job_id": job_id, "index": index, "status": record.status}


@app.task(name="stoker.ocr")
def ocr(previous: dict[str, Any]) -> dict[str, Any]:
    """Read the text of one decoded image; an input that already failed passes straight through."""
    job_id, index = previous["job_id"], previous["index"]
    record = _record(job_id, index)
    if record.status == "failed":
        return previous
    s = resources.settings()
    with input_stage(record, "ocr"):
        raw = resources.store().get_artifact(OCR_IMAGE, ContentHash(record.content_hash), _decode_fingerprint())
        if raw is None:
            raise InputExpired("decoded image expired before OCR", stage="ocr")
        record.text = read_text(array_from_bytes(raw), s.ocr_langs, s.ocr_timeout_s)  # type: ignore[arg-type]
        record.status = "ok"
    resources.store().put_input(job_id, record)
    return {"job_id": job_id, "index": index, "status": record.status}


@app.task(name="stoker.tokenize")
def tokenize(_results: list[dict[str, Any]] | None, job_id: str) -> dict[str, Any]:
    """Assemble the chat prompt from the user's prompt and every input, tokenize it, hand it to inference."""
    store = resources.store()
    store.mark_started(job_id)
    job = store.load_job(job_id)
    if job is None or job.terminal:
        return {"job_id": job_id, "skipped": True}
    try:
        ids = _prompt_ids(job.prompt, job.inputs)
    except StokerError as exc:
        store.finish(job_id, "failed", error=ErrorInfo(**exc.to_dict()))
        return {"job_id": job_id, "failed": exc.code}
    store.put_tokens(job_id, ids)
    store.stamp(job_id, "preprocessed", status="inferring")
    app.signature("stoker.infer", kwargs={"job_id": job_id}).apply_async()
    return {"job_id": job_id, "prompt_tokens": len(ids)}


def _prompt_ids(prompt: str, inputs: list[InputRecord]) -> list[int]:
    s = resources.settings()
    tok = resources.tokenizer()
    context = min(s.max_context_tokens, int(getattr(tok, "model_max_length", s.max_context_tokens)))
    attachments = [
        Attachment(
            kind=r.kind,
            index=r.index,
            text=r.text or "",
            features=_prompt_features(r.features or {}),
            error_code=r.error.code if r.error else None,
        )
        for r in inputs
    ]
    return build_prompt_ids(tok, prompt, attachments, budget=context - s.max_new_tokens)


def _prompt_features(features: dict[str, Any]) -> dict[str, Any]:
    keep = ("format", "width", "height")
    return {k: features[k] for k in keep if k in features}


@celeryd_after_setup.connect
def _preload(sender: str, instance: Any, **_: Any) -> None:
    """Load the tokenizer in the parent before the pool forks, so no task pays for it under its time limit."""
    queues = set(instance.app.amqp.queues.consume_from or {})
    if "tokenize" in queues:
        started = time.perf_counter()
        resources.tokenizer()
        log.info("tokenizer preloaded in %.1fs", time.perf_counter() - started)
