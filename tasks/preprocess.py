"""CPU stages of the image branch (decode → OCR), and tokenize, which joins every branch of a job."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from celery.signals import celeryd_after_setup, worker_process_init

from stoker.adapters.broker import queue_depths
from stoker.adapters.rlimits import cap_address_space
from stoker.adapters.store.keys import frame_ref, input_ref
from stoker.adapters.tracing import mark_failed, stage_span
from stoker.core import asr, imaging, tenancy
from stoker.core import ocr as ocr_core
from stoker.core.arrays import array_from_bytes, array_to_bytes
from stoker.core.cachekeys import MODEL_INPUT, OCR_IMAGE, CacheAddress, PipelineContext, fingerprint, prompt_address
from stoker.core.errors import DeadlineExceeded, MediaEmpty, StageKilled, StokerError
from stoker.core.imaging import DecodedImage, decode_image
from stoker.core.jobs import ErrorInfo, InputRecord, Job
from stoker.core.model import ModelRequest
from stoker.core.ocr import read_text
from stoker.core.pressure import room_to_enqueue
from stoker.core.prompting import attachment_for, build_prompt, model_request
from tasks import resources
from tasks.pipeline import enqueue_inference
from tasks.stage import (
    RETRY,
    cache_scope,
    input_bytes,
    run_input_stage,
    through_cache,
    time_limit,
)
from tasks.worker import app

log = logging.getLogger(__name__)


def _follower_wait(soft_s: float) -> float:
    """How long a stage may wait on a twin computing the same result: well inside its own soft limit."""
    return max(soft_s - 1.0, 0.5)


def _decode_and_cache(record: InputRecord, address: CacheAddress) -> tuple[dict[str, Any], DecodedImage]:
    decoded = decode_image(input_bytes(record, "decode"), resources.decode_params())
    cache = resources.cache()
    cache.put_bytes(address, array_to_bytes(decoded.ocr_image), part=OCR_IMAGE)
    cache.put_bytes(address, array_to_bytes(decoded.model_input), part=MODEL_INPUT)
    return {"features": decoded.features.to_dict()}, decoded


@app.task(name="stoker.decode", **RETRY)
def decode(job_id: str, ref: str) -> dict[str, Any]:
    """Decode one image: arrays into the cache, features into the record."""
    return run_input_stage(job_id, ref, "decode", _decode, opens_job=True)


def _decode(job_id: str, record: InputRecord) -> None:
    address = resources.decode_address(record.content_hash, cache_scope(job_id))
    wait = _follower_wait(resources.settings().decode_soft_s)
    value = through_cache(record, address, lambda: _decode_and_cache(record, address)[0], wait)
    record.features = value["features"]


def _ocr_pixels(record: InputRecord, scope: str) -> npt.NDArray[np.uint8]:
    """The decoded grayscale image: from the cache, or decoded again if the cache lost it."""
    address = resources.decode_address(record.content_hash, scope)
    raw = resources.cache().get_bytes(address, part=OCR_IMAGE)
    if raw is not None:
        return array_from_bytes(raw)  # type: ignore[return-value]
    return _decode_and_cache(record, address)[1].ocr_image


@app.task(name="stoker.ocr", **RETRY)
def ocr(previous: dict[str, Any]) -> dict[str, Any]:
    """Read the text of one decoded image; a record that failed or was skipped passes straight through."""
    return run_input_stage(previous["job_id"], previous["ref"], "ocr", _ocr)


def _ocr(job_id: str, record: InputRecord) -> None:
    s = resources.settings()
    scope = cache_scope(job_id)

    def compute() -> dict[str, Any]:
        pixels = _ocr_pixels(record, scope)
        return {"text": read_text(pixels, s.ocr_langs, s.ocr_timeout_s, s.tesseract_cmd, cancelled=ended)}

    def ended() -> bool:  # asked while tesseract runs: a cancelled job's OCR stops at once
        return resources.store().watch.ended(job_id)

    address = resources.ocr_address(record.content_hash, scope)
    value = through_cache(record, address, compute, _follower_wait(s.ocr_soft_s))
    record.text = value["text"]
    record.status = "ok"


@app.task(name="stoker.tokenize", **RETRY)
def tokenize(_results: list[dict[str, Any]] | None, job_id: str) -> dict[str, Any]:
    """Assemble the chat prompt from the user's prompt and every input, tokenize it, hand it to inference."""
    with stage_span("tokenize", {"stoker.job_id": job_id}) as span:
        outcome = tokenize_job(job_id)
        span.set_attribute("stoker.prompt_tokens", int(outcome.get("prompt_tokens", 0)))
        if "failed" in outcome:
            mark_failed(span, str(outcome["failed"]))
        return outcome


@app.task(name="stoker.rescue")
def rescue(failed_task_id: str, *, job_id: str) -> dict[str, Any]:
    """Errback of a job's chord: a stage died beyond what it could catch (hard time limit, lost worker).

    Inputs still unfinished are marked failed, and the job goes on to tokenize with what it has.
    """
    killed = StageKilled(f"task {failed_task_id} was killed")
    if not fail_unfinished(job_id, killed):
        return {"job_id": job_id, "skipped": True}
    log.warning("job %s rescued after task %s was killed", job_id, failed_task_id)
    return tokenize_job(job_id)


def cut_off(job_id: str) -> dict[str, Any]:
    """The job's preprocessing budget is spent: fail what is unfinished and go to inference with the rest."""
    with stage_span("cutoff", {"stoker.job_id": job_id}, parent=resources.store().jobs.trace_context(job_id)):
        fail_unfinished(job_id, DeadlineExceeded("the job's preprocessing budget ran out first"))
        return tokenize_job(job_id, backpressure=False)  # the reaper must not stall on one job


def fail_unfinished(job_id: str, error: StokerError) -> bool:
    """Mark every input (and keyframe) still pending as failed with error; False if the job is gone or over."""
    store = resources.store()
    job = store.jobs.load_job(job_id)
    if job is None or job.terminal:
        return False
    info = ErrorInfo(**error.to_dict())
    for record in job.inputs:
        items = [
            (input_ref(record.index), record),
            *((frame_ref(record.index, f.index), f) for f in record.frames or []),
        ]
        for ref, item in items:
            if item.status == "pending":
                store.jobs.put_input(
                    job_id, ref, item.model_copy(update={"status": "failed", "error": info, "frames": None})
                )
    return True


def tokenize_job(job_id: str, backpressure: bool = True, enqueue: bool = True) -> dict[str, Any]:
    """Build and tokenize the job's prompt from its records, and hand it to the inference queue, exactly once.

    The hand-over is checked against the records' revision: a stage that wrote a record meanwhile makes the
    prompt be built again, so the job's record always shows what the model was given. With `backpressure`, the
    job waits here while the inference queue is above its high watermark (bounded by its deadline). Without
    `enqueue` the job is handed over but no message sent: the caller serves it (the synchronous baseline).
    """
    store = resources.store()
    store.jobs.mark_started(job_id)
    for attempt in range(_HANDOFF_ATTEMPTS):
        job, rev = store.jobs.load_for_handoff(job_id)
        if job is None or job.terminal or job.status == "inferring":
            return {"job_id": job_id, "skipped": True}
        if _settle_videos(job_id, job.inputs):
            continue
        scope = tenancy.cache_scope(job.tenant or tenancy.DEFAULT_TENANT, resources.settings().cache_shared)
        try:
            context = pipeline_context()
            with time_limit(resources.settings().tokenize_soft_s, "tokenize"):
                request = _model_request(context, job, scope)
        except Exception as exc:  # the job must end, whatever went wrong
            return _tokenize_failed(job_id, exc)
        outcome = store.jobs.hand_off(job_id, request, None if attempt == _HANDOFF_ATTEMPTS - 1 else rev)
        if outcome == "stale":
            continue
        if outcome == "done":
            return {"job_id": job_id, "skipped": True}
        _remember_inputs(context, job.inputs, scope)
        deadline = store.watch.clock(job_id).deadline or None
        if backpressure:
            wait_for_room(job_id, deadline)
        if enqueue:
            enqueue_inference(job_id, len(request.prompt_ids), deadline, app)
        return {"job_id": job_id, "prompt_tokens": len(request.prompt_ids)}
    return {"job_id": job_id, "skipped": True}


def wait_for_room(job_id: str, deadline: float | None) -> float:
    """Hold the job while the inference queue is above its high watermark, until it drains to the low one, the
    wait limit passes or the job's deadline does; returns the seconds waited.

    Holding it here stalls this CPU worker: its prefetch bounds what it takes, and the CPU queues grow in the
    broker (where admission control sees them) instead of the inference queue or any worker's memory.
    """
    s = resources.settings()
    started = time.time()
    until = min(started + s.handoff_max_wait_s, deadline or float("inf"))
    waiting = False
    while True:
        with app.pool.acquire(block=True) as connection:
            depth = queue_depths(connection, ["infer"])["infer"]
        if room_to_enqueue(depth, s.infer_high_watermark, s.infer_low_watermark, waiting) or time.time() >= until:
            break
        if not waiting:
            log.info("inference queue at %d (> %d): holding job %s", depth, s.infer_high_watermark, job_id)
        waiting = True
        time.sleep(0.2)
    return time.time() - started


#: Tries at a hand-over whose records keep changing; the last one hands over regardless.
_HANDOFF_ATTEMPTS = 8


def _settle_videos(job_id: str, inputs: list[InputRecord]) -> bool:
    """Settle every video input; True if a record changed (and the job must be read again)."""
    changed = False
    for record in inputs:
        if settle_video(record):
            changed |= resources.store().jobs.put_input(
                job_id, input_ref(record.index), record.model_copy(update={"frames": None})
            )
    return changed


def _tokenize_failed(job_id: str, exc: Exception) -> dict[str, Any]:
    error = exc if isinstance(exc, StokerError) else StokerError(f"{type(exc).__name__}: {exc}", stage="tokenize")
    log.error("tokenize failed for job %s", job_id, exc_info=exc)
    resources.store().jobs.finish(job_id, "failed", error=ErrorInfo(**error.to_dict()))
    return {"job_id": job_id, "failed": error.code}


def _remember_inputs(context: PipelineContext, inputs: list[InputRecord], scope: str) -> None:
    """Cache the finished inputs whole, so a job of the same scope repeating them skips preprocessing."""
    cache = resources.cache()
    cache.publish_context(context)
    for record in inputs:
        # One job's URL is not content.
        cache.put_input(context.identity, record.model_copy(update={"url": None}), scope)


def pipeline_context() -> PipelineContext:
    """This worker's identity for whole cached inputs and prompts: every setting that shapes them."""
    s = resources.settings()
    tok = resources.tokenizer()
    window = min(s.max_context_tokens, int(getattr(tok, "model_max_length", s.max_context_tokens)))
    identity = fingerprint(
        ocr=resources.ocr_address("", tenancy.SHARED_SCOPE).fingerprint,
        decode=resources.decode_address("", tenancy.SHARED_SCOPE).fingerprint,
        asr=[s.asr_model, s.asr_beam_size, asr.VERSION, resources.asr_model_identity()],
        keyframes=[s.video_keyframes, s.max_media_seconds],
        versions=[imaging.VERSION, ocr_core.VERSION],
    )
    return PipelineContext(
        identity=identity, tokenizer=resources.tokenizer_identity(), budget=window - s.max_new_tokens
    )


def settle_video(record: InputRecord) -> bool:
    """A video with no audio stream is usable only through its keyframes; with none either, it failed."""
    no_sound = (record.features or {}).get("audio_streams") == 0
    frames_ok = any(f.status == "ok" for f in record.frames or [])
    if record.kind != "video" or record.status != "ok" or not no_sound or frames_ok:
        return False
    record.status = "failed"
    record.error = ErrorInfo(**MediaEmpty("no audio track and no decodable frame", stage="keyframes").to_dict())
    return True


def _model_request(context: PipelineContext, job: Job, scope: str) -> ModelRequest:
    """The model request for this job's prompt material (a chat's every turn): the prompt from the cache when it
    was built before."""
    attachments = [attachment_for(r) for r in job.inputs]
    turns = job.chat.turns if job.chat else None

    def compute() -> dict[str, Any]:
        built = build_prompt(resources.prompt_tokenizer(), job.prompt, attachments, context.budget, turns)
        return {"ids": built.ids, "messages": built.messages}

    address = prompt_address(context, job.prompt, attachments, scope, turns)
    value = through_cache(None, address, compute, _follower_wait(resources.settings().tokenize_soft_s))
    return model_request(value, job.inputs, scope, job.chat, job.id)


@worker_process_init.connect
def _cap_memory(**_: Any) -> None:
    """Each CPU and ASR pool child gets an address-space cap, so a decompression bomb (an image, or media whose
    decode balloons) fails alone instead of taking the host's memory."""
    s = resources.settings()
    cap = {"cpu": s.cpu_address_space_mb, "ocr": s.cpu_address_space_mb, "asr": s.asr_address_space_mb}
    if cap.get(s.worker_kind):
        cap_address_space(cap[s.worker_kind])


@celeryd_after_setup.connect
def _preload(sender: str, instance: Any, **_: Any) -> None:
    """Load the tokenizer and probe tesseract in the parent before the pool forks: no task pays for them."""
    queues = set(instance.app.amqp.queues.consume_from or {})
    started = time.perf_counter()
    if "tokenize" in queues:
        resources.cache().publish_context(pipeline_context())  # the API can tokenize cheap jobs from now on
    if "ocr" in queues:
        resources.tesseract()
    log.info("worker resources preloaded in %.1fs", time.perf_counter() - started)
