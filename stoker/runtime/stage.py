"""How a stage task maps what happens to an input record: timing, structured errors, never a crashed chord."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from celery import current_task
from celery.exceptions import SoftTimeLimitExceeded
from opentelemetry.trace import Span

from stoker.adapters.cache import COST_FIELD
from stoker.adapters.metrics import QUEUE_WAIT_SECONDS, STAGE_FAILURES, STAGE_SECONDS, cache_label
from stoker.adapters.tracing import mark_failed, stage_span
from stoker.core.cachekeys import CacheAddress
from stoker.core.errors import (
    AsrFailed,
    AsrTimeout,
    BrokerUnavailable,
    DeadlineExceeded,
    FetchTimeout,
    ImageDecodeTimeout,
    InputExpired,
    OcrFailed,
    OcrTimeout,
    StageTimeout,
    StokerError,
    WorkerLost,
)
from stoker.core.jobs import QUEUE_SUFFIX, ErrorInfo, InputRecord
from stoker.core.media import ContentHash
from stoker.core.queues import SENT_HEADER
from stoker.runtime.context import WorkerContext

log = logging.getLogger(__name__)

#: What a soft time limit means, per stage.
_TIMEOUTS: dict[str, type[StokerError]] = {
    "decode": ImageDecodeTimeout,
    "ocr": OcrTimeout,
    "transcribe": AsrTimeout,
    "fetch": FetchTimeout,
}
#: What a stage's own time limits raise (`time_limit`); Celery's soft limit raises SoftTimeLimitExceeded.
_LIMIT_ERRORS = (StageTimeout, OcrTimeout)
#: What an unexpected exception means, per stage.
_CRASHES: dict[str, type[StokerError]] = {"ocr": OcrFailed, "transcribe": AsrFailed}

#: Single-flight lease, renewed while its holder works: a killed holder's twins take over within this.
LEASE_S = 3.0


@contextlib.contextmanager
def input_stage(record: InputRecord, stage: str) -> Iterator[InputRecord]:
    """Run one stage for one input: record its queue wait and run time, and turn any failure into a failed input."""
    _record_queue_wait(record, stage)
    started = time.perf_counter()
    attributes = {"stoker.content_hash": record.content_hash[:16], "stoker.bytes": record.size_bytes}
    with stage_span(stage, attributes) as span:
        try:
            with _run_stage(record, stage, started):
                yield record
        finally:
            _describe(span, record, stage)


def _describe(span: Span, record: InputRecord, stage: str) -> None:
    """What the stage made of the input, on its span: cache hit, size of what it read, error code.

    Observability never fails a stage: whatever the features hold, a bad value is skipped.
    """
    try:
        if stage in record.cache_hit:
            span.set_attribute("stoker.cache_hit", record.cache_hit[stage])
        features = record.features or {}
        width, height, seconds = features.get("width"), features.get("height"), features.get("duration_s")
        if isinstance(width, int) and isinstance(height, int):
            span.set_attribute("stoker.pixels", width * height)
        if isinstance(seconds, (int, float)):
            span.set_attribute("stoker.media_seconds", float(seconds))
        if record.error is not None and record.status == "failed":
            mark_failed(span, record.error.code)
    except Exception:
        log.exception("could not describe the %s span", stage)


@contextlib.contextmanager
def _run_stage(record: InputRecord, stage: str, started: float) -> Iterator[InputRecord]:
    """Time the stage and map whatever goes wrong onto the input record (transient errors propagate)."""
    try:
        yield record
    except (SoftTimeLimitExceeded, *_LIMIT_ERRORS) as exc:
        if waiting_on_store(exc):  # the store's outage used the time, not the input: retried like one (`tasks.retry`)
            raise BrokerUnavailable(f"the store did not answer within {stage}'s time limit", stage=stage) from exc
        timeout = _TIMEOUTS.get(stage, StageTimeout)
        late = exc if isinstance(exc, StokerError) else timeout(f"{stage} exceeded its time limit", stage=stage)
        late.stage = late.stage or stage
        _fail(record, late)
    except StokerError as exc:
        if not exc.permanent:
            raise  # transient: the task retries with backoff (`tasks.retry`)
        exc.stage = exc.stage or stage
        _fail(record, exc)
    except redis.RedisError as exc:  # the store stayed away past the client's own retries
        raise BrokerUnavailable(f"the store cannot be reached during {stage}", stage=stage) from exc
    except Exception as exc:  # a stage bug must fail this input, not the whole job
        log.exception("stage %s crashed on input %s", stage, record.index)
        _fail(record, _CRASHES.get(stage, StokerError)(f"{type(exc).__name__}: {exc}", stage=stage))
    finally:
        seconds = time.perf_counter() - started
        record.timings_ms[stage] = round(seconds * 1000, 2)
        STAGE_SECONDS.labels(stage, cache_label(record.cache_hit.get(stage))).observe(seconds)
        if record.error is not None and record.status == "failed":
            STAGE_FAILURES.labels(stage, record.error.code).inc()


def waiting_on_store(exc: BaseException) -> bool:
    """Whether a time limit fired while its stage waited on a Redis client call (a store that is down or slow).

    The frames the limit interrupted say so; a stage whose own work ran out of time is never inside the client.
    """
    return any(
        frame.f_globals.get("__name__", "").startswith("redis.") for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def _record_queue_wait(record: InputRecord, stage: str) -> None:
    """How long this stage's message waited in the broker, from the publish time it carries."""
    request = current_task.request if current_task else None
    sent = getattr(request, SENT_HEADER, None) if request is not None else None
    if sent is None:
        return
    wait = max(time.time() - float(sent), 0.0)
    record.timings_ms[f"{stage}{QUEUE_SUFFIX}"] = round(wait * 1000, 2)
    QUEUE_WAIT_SECONDS.labels(stage).observe(wait)


@contextlib.contextmanager
def time_limit(seconds: float, stage: str) -> Iterator[None]:
    """A soft limit tighter than the task's own (SIGALRM in this pool child), raised as the stage's timeout."""

    def expire(*_: Any) -> None:
        raise _TIMEOUTS.get(stage, StageTimeout)(f"{stage} exceeded its {seconds:.1f}s limit", stage=stage)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _fail(record: InputRecord, exc: StokerError) -> None:
    record.status = "failed"
    record.error = ErrorInfo(**exc.to_dict())


def run_input_stage(
    ctx: WorkerContext,
    job_id: str,
    ref: str,
    stage: str,
    work: Callable[[WorkerContext, str, InputRecord], None],
    *,
    opens_job: bool = False,
    done: Callable[[InputRecord], bool] | None = None,
) -> dict[str, Any]:
    """The skeleton of every per-input stage task: read the record, check there is work (`why_no_work`, and what it
    found written by `write_no_work`; `done` says a redelivered message already did it), run `work(ctx, job_id,
    record)` as the stage (`input_stage`: timings, span, failures onto the record), write the record, and hand over
    to the next stage. `opens_job`: the first stage of a branch moves the job to preprocessing."""
    store = ctx.store
    if opens_job:
        store.jobs.mark_started(job_id)
    record = store.jobs.get_input(job_id, ref)
    if record is None:
        return handoff(job_id, ref, record)
    skipped = why_no_work(ctx, job_id, record, stage)
    if skipped is not None:
        write_no_work(ctx, job_id, ref, record, skipped)
        return handoff(job_id, ref, record)
    if done is not None and done(record):
        return handoff(job_id, ref, record)
    with input_stage(record, stage):
        work(ctx, job_id, record)
    store.jobs.put_input(job_id, ref, record)
    return handoff(job_id, ref, record)


def handoff(job_id: str, ref: str, record: InputRecord | None) -> dict[str, Any]:
    """What a stage passes to the next one in its chain: where the record is, and how it stands."""
    return {"job_id": job_id, "ref": ref, "status": record.status if record else "skipped"}


def runnable(record: InputRecord | None) -> bool:
    """Whether a stage still has work on this record (it exists, and nothing failed or skipped it)."""
    return record is not None and record.status not in ("failed", "skipped")


def cache_scope(ctx: WorkerContext, job_id: str) -> str:
    """Whose stage-cache entries this job's stages read and write: its tenant's, from its record (or the one scope
    every tenant shares, when sharing is on)."""
    return ctx.cache_scope(ctx.store.jobs.tenant(job_id))


def through_cache(
    ctx: WorkerContext,
    record: InputRecord | None,
    address: CacheAddress,
    compute: Callable[[], dict[str, Any]],
    wait_s: float,
) -> dict[str, Any]:
    """A stage result from the cache, from a concurrent twin (single flight), or computed here and cached."""
    cache = ctx.cache
    started = time.perf_counter()
    found = cache.get_json(address)
    if found is None:
        with cache.single_flight(address, lease_s=LEASE_S, wait_s=wait_s) as shared:
            if shared is None:
                value = compute()
                cache.put_miss(address, value, time.perf_counter() - started)
                if record is not None:
                    record.cache_hit[address.stage] = False
                return value
            found = shared
    cache.record(address.stage, hit=True, cost_s=float(found.pop(COST_FIELD, 0.0)))
    if record is not None:
        record.cache_hit[address.stage] = True
    return found


def follower_wait(soft_s: float) -> float:
    """How long a stage may wait on a twin computing the same result: well inside its own soft limit."""
    return max(soft_s - 1.0, 0.5)


def input_bytes(ctx: WorkerContext, record: InputRecord, stage: str) -> bytes:
    """An input's bytes from the job store; they outlive every job that uses them."""
    data = ctx.store.blobs.get_blob(ContentHash(record.content_hash))
    if data is None:
        raise InputExpired(f"input bytes expired before {stage}", stage=stage)
    return data


def poisoned(ctx: WorkerContext, stage: str) -> WorkerLost | None:
    """What an input fails with when this message already took its worker down too often (it counts this delivery);
    None when it did not.

    Late acks requeue a task whose worker died; a task that kills every worker it lands on would loop forever.
    """
    request = current_task.request if current_task else None
    if request is None or not request.id:
        return None
    # A retry re-sends the same task id: only deliveries beyond the retries mean a worker died.
    deliveries = ctx.store.deliveries.count_delivery(str(request.id)) - int(request.retries or 0)
    if deliveries <= ctx.settings.max_deliveries:
        return None
    log.error("%s delivered %d times, its worker died each time: giving up", stage, deliveries - 1)
    return WorkerLost(f"{stage} killed its worker {deliveries - 1} times", stage=stage)


def last_try() -> bool:
    """Whether a transient failure now is final: the task's retries are spent, or it was called in-process (the
    synchronous baseline's stages, a test's)."""
    if not current_task or current_task.request.called_directly:
        return True
    return int(current_task.request.retries or 0) >= int(current_task.max_retries or 0)


@dataclass(frozen=True)
class NoWork:
    """Why a stage leaves an input alone. `failure`: what the input fails with (`write_no_work` writes it); None
    when there is nothing to write (already failed or skipped, or its job ended)."""

    failure: StokerError | None = None


def why_no_work(ctx: WorkerContext, job_id: str, record: InputRecord, stage: str) -> NoWork | None:
    """Why this stage has no work on the record, or None when it has: nothing failed or skipped it, its job has not
    ended, the job's preprocessing budget is not spent (or it went on without this input), and the message is not
    poison. It writes no record: it reads the job's gate and, with the gate open, counts the delivery (`poisoned`)."""
    if not runnable(record):
        return NoWork()
    gate = ctx.store.watch.stage_gate(job_id)
    if gate == "ended":
        log.info("job %s ended: %s skipped", job_id, stage)
        return NoWork()
    if gate != "open":
        return NoWork(DeadlineExceeded(f"the job's preprocessing budget was spent before {stage}", stage=stage))
    lost = poisoned(ctx, stage)
    return None if lost is None else NoWork(lost)


def write_no_work(ctx: WorkerContext, job_id: str, ref: str, record: InputRecord, reason: NoWork) -> None:
    """Fail the input as `why_no_work` found and write it; nothing is written when it found no failure."""
    if reason.failure is None:
        return
    _fail(record, reason.failure)
    ctx.store.jobs.put_input(job_id, ref, record)  # refused once the job went to inference: nothing to say
