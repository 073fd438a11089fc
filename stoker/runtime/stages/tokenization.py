"""The tokenize stage, where every branch of a job joins: its prompt built and tokenized from its records, handed
over to inference exactly once (against the records' revision), held while the inference queue is too full
(`stoker.runtime.handoff.wait_for_room`), then enqueued.

Also the ends a job's preprocessing can come to early, after which it goes on to inference with what it has: a
killed stage (`run_rescue`, the chord's errback) or a spent budget (`cut_off`, the reaper's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from stoker.adapters.store.keys import input_ref
from stoker.adapters.tracing import mark_failed, stage_span
from stoker.core.cached_prompt import CachedPrompt
from stoker.core.cachekeys import PipelineContext, prompt_address
from stoker.core.errors import DeadlineExceeded, StageKilled, StokerError
from stoker.core.jobs import ErrorInfo, InputRecord, Job, JobClass, final_status, input_failure, settle_video
from stoker.core.model import ModelRequest
from stoker.core.prompting import attachment_for, build_prompt, offered_tools
from stoker.runtime.context import WorkerContext
from stoker.runtime.handoff import fail_unfinished, wait_for_room
from stoker.runtime.stage import follower_wait, through_cache, time_limit

log = logging.getLogger(__name__)

#: Tries at a hand-over whose records keep changing; the last one hands over regardless.
HANDOFF_ATTEMPTS = 8


def run_tokenize(ctx: WorkerContext, job_id: str) -> dict[str, Any]:
    """Assemble the chat prompt from the user's prompt and every input, tokenize it, hand it to inference (its span
    says how many tokens, or why it failed)."""
    with stage_span("tokenize", {"stoker.job_id": job_id}) as span:
        outcome = tokenize_job(ctx, job_id)
        span.set_attribute("stoker.prompt_tokens", int(outcome.get("prompt_tokens", 0)))
        if "failed" in outcome:
            mark_failed(span, str(outcome["failed"]))
        return outcome


def run_rescue(ctx: WorkerContext, job_id: str, failed_task_id: str) -> dict[str, Any]:
    """A stage of the job died beyond what it could catch (hard time limit, lost worker): inputs still unfinished
    are marked failed, and the job goes on to tokenize with what it has."""
    killed = StageKilled(f"task {failed_task_id} was killed")
    if not fail_unfinished(ctx, job_id, killed):
        return {"job_id": job_id, "skipped": True}
    log.warning("job %s rescued after task %s was killed", job_id, failed_task_id)
    return tokenize_job(ctx, job_id)


def tokenize_job(ctx: WorkerContext, job_id: str, backpressure: bool = True) -> dict[str, Any]:
    """Hand the job over (`hand_over`) and send it to the inference queue. With `backpressure`, the job waits here
    while the inference queue is above its high watermark (bounded by its deadline)."""
    handed = hand_over(ctx, job_id)
    if not isinstance(handed, HandedOver):
        return handed
    if backpressure:
        wait_for_room(ctx, job_id, handed.deadline, handed.job_class)
    ctx.outbox.enqueue_inference(job_id, handed.prompt_tokens, handed.deadline, handed.job_class)
    return handed.outcome()


@dataclass(frozen=True)
class HandedOver:
    """A job whose model request is stored, exactly once: what its inference message carries."""

    job_id: str
    prompt_tokens: int
    deadline: float | None
    job_class: JobClass

    def outcome(self) -> dict[str, Any]:
        """The tokenize stage's outcome for this job."""
        return {"job_id": self.job_id, "prompt_tokens": self.prompt_tokens}


def hand_over(ctx: WorkerContext, job_id: str) -> HandedOver | dict[str, Any]:
    """Build and tokenize the job's prompt from its records, and store it as the job's model request, exactly once;
    no message is sent. The stage's outcome when the job does not go on to the model (skipped, failed, rendered).

    The hand-over is checked against the records' revision: a stage that wrote a record meanwhile makes the
    prompt be built again, so the job's record always shows what the model was given.
    """
    store = ctx.store
    store.jobs.mark_started(job_id)
    for attempt in range(HANDOFF_ATTEMPTS):
        job, rev = store.jobs.load_for_handoff(job_id)
        if job is None or job.terminal or job.status == "inferring":
            return {"job_id": job_id, "skipped": True}
        if _settle_videos(ctx, job_id, job.inputs):
            continue
        ended = _ends_before_model(ctx, job)
        if ended is not None:
            return ended
        scope = ctx.cache_scope(job.tenant)
        try:
            context = ctx.pipeline_context()
            with time_limit(ctx.settings.tokenize_soft_s, "tokenize"):
                request = _model_request(ctx, context, job, scope)
        except Exception as exc:  # the job must end, whatever went wrong
            return _tokenize_failed(ctx, job_id, exc)
        outcome = store.jobs.hand_off(job_id, request, None if attempt == HANDOFF_ATTEMPTS - 1 else rev)
        if outcome == "stale":
            continue
        if outcome == "done":
            return {"job_id": job_id, "skipped": True}
        _remember_inputs(ctx, context, job.inputs, scope)
        deadline = store.watch.clock(job_id).deadline or None
        return HandedOver(job_id, len(request.prompt_ids), deadline, job.job_class)
    return {"job_id": job_id, "skipped": True}


def cut_off(ctx: WorkerContext, job_id: str) -> dict[str, Any]:
    """The job's preprocessing budget is spent: fail what is unfinished and go to inference with the rest."""
    with stage_span("cutoff", {"stoker.job_id": job_id}, parent=ctx.store.jobs.trace_context(job_id)):
        fail_unfinished(ctx, job_id, DeadlineExceeded("the job's preprocessing budget ran out first"))
        return tokenize_job(ctx, job_id, backpressure=False)  # the reaper must not stall on one job


def _settle_videos(ctx: WorkerContext, job_id: str, inputs: list[InputRecord]) -> bool:
    """Settle every video input; True if a record changed (and the job must be read again)."""
    changed = False
    for record in inputs:
        if settle_video(record):
            changed |= ctx.store.jobs.put_input(
                job_id, input_ref(record.index), record.model_copy(update={"frames": None})
            )
    return changed


def _ends_before_model(ctx: WorkerContext, job: Job) -> dict[str, Any] | None:
    """How a job that never reaches the model ends here (one failing on its input, a render), or None."""
    if _fails_on_input(ctx, job):
        return {"job_id": job.id, "failed": "input"}
    if job.chat is not None and job.chat.render:
        return _end_render(ctx, job)
    return None


def _fails_on_input(ctx: WorkerContext, job: Job) -> bool:
    """A chat that asked to fail on an unreadable input (`stoker_on_input_error: fail`) and has one ends `failed`
    with that input's error here: it never reaches the model."""
    failure = input_failure(job.inputs) if job.chat and job.chat.on_input_error == "fail" else None
    if failure is None:
        return False
    ctx.store.jobs.finish(job.id, "failed", error=failure)
    log.info("job %s failed on its input: %s", job.id, failure.code)
    return True


def _end_render(ctx: WorkerContext, job: Job) -> dict[str, Any]:
    """A render ends where its pictures' renderings are cached: its answer is those renderings, which the API
    assembles, so it never reaches the inference queue (every path to the hand-off, the chord's, a rescue's, the
    reaper's cut-off, ends it here)."""
    ctx.store.jobs.finish(job.id, final_status(job.inputs))
    return {"job_id": job.id, "rendered": True}


def _tokenize_failed(ctx: WorkerContext, job_id: str, exc: Exception) -> dict[str, Any]:
    error = exc if isinstance(exc, StokerError) else StokerError(f"{type(exc).__name__}: {exc}", stage="tokenize")
    log.error("tokenize failed for job %s", job_id, exc_info=exc)
    ctx.store.jobs.finish(job_id, "failed", error=ErrorInfo(**error.to_dict()))
    return {"job_id": job_id, "failed": error.code}


def _remember_inputs(ctx: WorkerContext, context: PipelineContext, inputs: list[InputRecord], scope: str) -> None:
    """Cache the finished inputs whole, so a job of the same scope repeating them skips preprocessing."""
    ctx.cache.publish_context(context)
    for record in inputs:
        # One job's URL is not content.
        ctx.cache.put_input(context.identity, record.model_copy(update={"url": None}), scope)


def _model_request(ctx: WorkerContext, context: PipelineContext, job: Job, scope: str) -> ModelRequest:
    """The model request for this job's prompt material (a chat's every turn): the prompt from the cache when it
    was built before."""
    attachments = [attachment_for(r) for r in job.inputs]
    turns = job.chat.turns if job.chat else None
    tools = offered_tools(job.chat)
    trim = job.chat is not None and job.chat.truncate  # else a prompt over the context is refused

    def compute() -> dict[str, Any]:
        tokenizer = ctx.prompt_tokenizer
        system = context.system
        built = build_prompt(tokenizer, job.prompt, attachments, context.budget, turns, system, tools, trim=trim)
        return CachedPrompt.of(built).to_dict()

    address = prompt_address(context, job.prompt, attachments, scope, turns, tools, trim=trim)
    value = through_cache(ctx, None, address, compute, follower_wait(ctx.settings.tokenize_soft_s))
    return CachedPrompt.from_dict(value).request(scope, job.chat, job.id)
