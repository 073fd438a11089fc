"""A batch's life on the device: loaded, run, written.

A batch is loaded (`load_batch`: one pipelined round trip for all its jobs), run (`run_batch`: the model, and
nothing else: no Redis, no spans, no logging per job) and written (`write_batch`: results, stamps, counters in
pipelined round trips, then spans, metrics and the log line of each job). The pipeline's consumer
(`stoker.runtime.feeder.Feeder`) does the three in three threads so the device never waits; the synchronous baseline
(`tasks.baseline`, benchmarks only) calls them one after another in its one thread.

A batch here is a device batch, as a bare "batch" is everywhere in stoker's code; OpenAI's Batch API object is an
`OpenAIBatch` (`stoker.core.openai_batches`, docs/architecture.md#names).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from opentelemetry.propagate import extract

from stoker.adapters.metrics import BATCH_SECONDS, BATCH_SIZE, BATCH_WAIT_SECONDS, DEVICE_IDLE_GAP_SECONDS
from stoker.adapters.store.jobs import Ending, Pending, Queued
from stoker.adapters.tracing import mark_failed, tracer
from stoker.core.errors import DeadlineExceeded, InferenceFailed, StokerError
from stoker.core.jobs import (
    BatchInfo,
    ChoiceInfo,
    ErrorInfo,
    Job,
    ResultInfo,
    compute_timings,
    final_status,
    preprocess_share,
)
from stoker.core.model import Continued, ModelRequest, Outcome, Prediction, Predictor, run_predictor, sampling_groups
from stoker.core.tenancy import DEFAULT_TENANT
from stoker.runtime.context import WorkerContext
from stoker.runtime.monitoring import log_job
from stoker.runtime.seams import Message
from stoker.runtime.watchdog import BatchWatchdog, RunningBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchItem:
    """One job in a batch: its model request and the record it was loaded with (and its message, if any)."""

    job_id: str
    pending: Pending
    message: Message | None = None
    #: When its message reached this consumer (a batch's wait for company, if any, counts from there).
    arrived: float = 0.0
    #: An answer that goes on: when its first call started (its wait and its time on the device count from there).
    first_started: float | None = None

    @property
    def request(self) -> ModelRequest:
        """What the model gets (a batch line's marked as background work)."""
        request = replace(self.pending.request, job_id=self.job_id)
        return replace(request, background=True) if self.pending.job.job_class == "batch" else request


@dataclass
class RanBatch:
    """A batch that came back from the device: when it ran, and one outcome per item."""

    id: str
    items: list[BatchItem]
    started: float
    ended: float
    #: `Continued`: the answer goes on in a later batch (`settle` takes those items out before it is written).
    outcomes: list[Outcome]
    #: The device's idle time before this batch while work was waiting (None: it had nothing to do).
    idle_gap_s: float | None = None
    #: The watchdog already failed these jobs: their answers are dropped.
    overdue: bool = False
    #: Backend calls it took: 1 for a real batch, more when it failed and its items ran one by one.
    calls: int = 1
    #: Sampling groups it was split into, for a backend that cannot mix sampling parameters in one call.
    groups: int = 1


def load_batch(ctx: WorkerContext, job_ids: Sequence[str], also: Sequence[Queued] = ()) -> list[BatchItem]:
    """The jobs still waiting for the model, loaded in one round trip (with `also` before the reads). A job with no
    request left (a redelivered message of a job that ended) is skipped; one whose deadline passed is failed here,
    before the model."""
    loaded = ctx.store.jobs.load_pending(list(dict.fromkeys(job_ids)), also)
    now = time.time()
    items = []
    for job_id, pending in loaded.items():
        if pending is None:
            log.info("job %s has no pending request; skipping", job_id)
        elif pending.deadline and now >= pending.deadline:
            expire(ctx, job_id, now)
        else:
            items.append(BatchItem(job_id, pending))
    return items


def run_batch(
    ctx: WorkerContext, items: list[BatchItem], watchdog: BatchWatchdog, idle_gap_s: float | None = None
) -> RanBatch:
    """Run the model once over the batch (items one by one only if the batch fails). Touches nothing but the
    device: the watchdog and the busy clock are in memory."""
    batch_id = uuid.uuid4().hex[:12]
    with device_turn(ctx):
        started = time.time()
        watchdog.begin(batch_id, [i.job_id for i in items])
        ctx.device_clock.begin()
        calls: list[int] = []
        predictor = ctx.predictor
        groups = sampling_groups([i.request for i in items], predictor.mixes_sampling)
        try:
            outcomes = predict_grouped(predictor, [i.request for i in items], groups, calls)
        finally:
            ctx.device_clock.end()
            ran = watchdog.end()
        ended = time.time()
    overdue = bool(ran and ran.overdue)
    return RanBatch(batch_id, items, started, ended, outcomes, idle_gap_s, overdue, len(calls), len(groups))


def predict_grouped(
    predictor: Predictor, requests: list[ModelRequest], groups: list[list[int]], calls: list[int]
) -> list[Outcome]:
    """Each sampling group as one call (isolated on failure); the outcomes back in the requests' order."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    for group in groups:
        answered = predict_isolated(predictor, [requests[i] for i in group], calls)
        for position, outcome in zip(group, answered, strict=True):
            outcomes[position] = outcome
    return [o for o in outcomes if o is not None]


def settle(ran: RanBatch) -> tuple[RanBatch, list[BatchItem]]:
    """The batch as it is to be written (the items whose answers are done, or failed), and the items whose
    answers go on, each with its request continued. A batch the watchdog already failed continues nothing."""
    done: list[tuple[BatchItem, Prediction | StokerError]] = []
    going_on: list[BatchItem] = []
    for item, outcome in zip(ran.items, ran.outcomes, strict=True):
        if not isinstance(outcome, Continued):
            done.append((item, outcome))
        elif ran.overdue:
            done.append((item, InferenceFailed("the batch ran past its budget", stage="infer")))
        else:
            request = item.pending.request.continued(outcome)
            first = item.first_started or ran.started
            going_on.append(replace(item, pending=replace(item.pending, request=request), first_started=first))
    settled = replace(ran, items=[i for i, _ in done], outcomes=[o for _, o in done])
    return settled, going_on


def write_batch(ctx: WorkerContext, ran: RanBatch, consumer: str | None = None) -> None:
    """Every job's result, its stamps, the batch's counters and (for a `consumer` in the registry) its letting go
    of the batch's jobs, in one pipelined round trip; then spans, metrics and log lines."""
    store = ctx.store
    model = ctx.predictor.name
    endings = [_ending(ran, item, _final(o), model) for item, o in zip(ran.items, ran.outcomes, strict=True)]
    busy_s = ran.ended - ran.started
    also: list[Queued] = [
        partial(
            store.stats.queue_batch,
            queue="infer",
            size=len(ran.items),
            busy_s=busy_s,
            gap_s=ran.idle_gap_s,
            calls=ran.calls,
        )
    ]
    if consumer is not None:  # after the endings: a job is let go of only once it is written
        also.append(partial(store.consumers.queue_release, consumer=consumer, job_ids=[i.job_id for i in ran.items]))
    written = store.jobs.finish_many([] if ran.overdue else endings, also=also) or [False] * len(endings)
    _observe(ran)
    for item, outcome, ending, fresh in zip(ran.items, ran.outcomes, endings, written, strict=True):
        _span(ran, item, _final(outcome))
        if fresh:
            log_job(_ended_job(item.pending, ending))
    late = " (past its budget: results dropped)" if ran.overdue else ""
    log.info("batch %s: %d jobs in %.0f ms%s", ran.id, len(ran.items), (ran.ended - ran.started) * 1000, late)


def fail_batch(ctx: WorkerContext, items: Sequence[BatchItem], exc: BaseException) -> None:
    """A batch that broke outside the model (a bug, a contract violation): its jobs fail now, structured, rather
    than wait for the reaper. Raises if even that cannot be written (the caller then hands the messages back)."""
    log.error("batch of %d failed outside the model: %r", len(items), exc)
    error = ErrorInfo(**InferenceFailed(f"the batch failed: {type(exc).__name__}", stage="infer").to_dict())
    endings = [Ending(i.job_id, i.pending.job.tenant or DEFAULT_TENANT, "failed", error=error) for i in items]
    ctx.store.jobs.finish_many(endings)


def expire(ctx: WorkerContext, job_id: str, now: float) -> None:
    """A job whose deadline passed before its batch: it fails, never reaching the model."""
    late = DeadlineExceeded("the deadline passed while the job waited for the model", stage="infer_queue")
    if ctx.store.jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict())):
        log.info("job %s dropped before the model: its deadline passed", job_id)


def _final(outcome: Outcome) -> Prediction | StokerError:
    """An outcome as written: an answer that was to go on and is written instead (a caller that does not
    `settle`) fails, never stored half-done."""
    if isinstance(outcome, Continued):
        return InferenceFailed("the answer was not finished", stage="infer")
    return outcome


def predict_isolated(
    predictor: Predictor, requests: list[ModelRequest], calls: list[int] | None = None
) -> list[Outcome]:
    """Run the batch; if it fails, retry each request alone so one bad item fails alone. Each backend call
    appends its size to `calls`."""
    if calls is not None:
        calls.append(len(requests))
    try:
        answered = list(run_predictor(predictor, requests))
        if len(answered) != len(requests):
            raise InferenceFailed(f"the backend answered {len(answered)} of {len(requests)} requests", stage="infer")
        return answered
    except StokerError as exc:
        if len(requests) == 1:
            log.warning("inference failed: %s", exc)
            return [exc]
        log.warning("batch of %d failed (%s); retrying items one by one", len(requests), exc.code)
    except Exception:
        if len(requests) == 1:
            log.exception("inference failed")
            return [InferenceFailed("the model failed on this request", stage="infer")]
        log.exception("batch of %d failed; retrying items one by one", len(requests))
    outcomes: list[Outcome] = []
    for request in requests:
        outcomes.extend(predict_isolated(predictor, [request], calls))
    return outcomes


def _ending(ran: RanBatch, item: BatchItem, outcome: Prediction | StokerError, model: str) -> Ending:
    started = item.first_started or ran.started
    preprocessed = item.pending.preprocessed or started
    wait_ms = round(max(started - preprocessed, 0.0) * 1000, 2)
    batch = BatchInfo(id=ran.id, size=len(ran.items), wait_ms=wait_ms, groups=ran.groups)
    stamps = {"infer_start": started, "infer_end": ran.ended}
    tenant = item.pending.job.tenant or DEFAULT_TENANT
    if isinstance(outcome, StokerError):
        error = ErrorInfo(**outcome.to_dict())
        return Ending(item.job_id, tenant, "failed", error=error, batch=batch, stamps=stamps)
    result = ResultInfo(
        text=outcome.text,
        model=model,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        finish_reason=outcome.finish_reason,
        logprobs=outcome.logprobs,
        tool_calls=outcome.tool_calls,
        more=[
            ChoiceInfo(text=m.text, finish_reason=m.finish_reason, logprobs=m.logprobs, tool_calls=m.tool_calls)
            for m in outcome.more
        ],
        truncated=item.pending.request.truncated,
    )
    status = final_status(item.pending.job.inputs)
    return Ending(item.job_id, tenant, status, result=result, batch=batch, stamps=stamps, encoder=outcome.encoder)


def _ended_job(pending: Pending, ending: Ending) -> Job:
    """The job as it now stands, for its log line, without reading it back."""
    timings = compute_timings({**pending.stamps, **ending.stamps, "done": time.time()})
    update: dict[str, Any] = {"status": ending.status, "result": ending.result, "error": ending.error}
    update |= {"batch": ending.batch, "timings_ms": timings, "preprocess_share": preprocess_share(timings)}
    return pending.job.model_copy(update=update)


def _observe(ran: RanBatch) -> None:
    BATCH_SIZE.observe(len(ran.items))
    BATCH_SECONDS.observe(ran.ended - ran.started)
    if ran.idle_gap_s is not None:
        DEVICE_IDLE_GAP_SECONDS.observe(ran.idle_gap_s)
    for item in ran.items:
        BATCH_WAIT_SECONDS.observe(max(ran.started - (item.pending.preprocessed or ran.started), 0.0))


def _span(ran: RanBatch, item: BatchItem, outcome: Prediction | StokerError) -> None:
    """The job's inference span, after the fact: one batch serves many traces, so it hangs off the job's context."""
    attributes: dict[str, str | int] = {"stoker.stage": "infer", "stoker.batch_id": ran.id}
    attributes.update({"stoker.batch_size": len(ran.items), "stoker.prompt_tokens": len(item.request.prompt_ids)})
    context = extract(item.pending.trace or {})
    span = tracer.start_span("stage infer", context=context, attributes=attributes, start_time=_ns(ran.started))
    if isinstance(outcome, StokerError):
        mark_failed(span, outcome.code)
    span.end(end_time=_ns(ran.ended))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@contextmanager
def device_turn(ctx: WorkerContext) -> Iterator[None]:
    """This process's turn on the device. A simulated device shared by several processes (`STOKER_SIM_SHARED`,
    the benchmark's sync-pool baseline) takes a lock in Redis, so they get one device between them, not one each."""
    turns = ctx.device_turns()
    with turns.turn() if turns is not None else nullcontext():
        yield


def fail_overdue(ctx: WorkerContext, batch: RunningBatch, budget_s: float) -> None:
    """The batch ran past its budget: its jobs fail now (a late return changes nothing)."""
    late = InferenceFailed(f"batch {batch.id} ran past its {budget_s:.0f}s budget", stage="infer")
    for job_id in batch.job_ids:
        ctx.store.jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict()))
