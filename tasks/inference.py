"""The inference consumer: a celery-batches task that runs one model call per collected batch."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any

from celery.signals import celeryd_after_setup
from celery.worker.request import Request
from celery_batches import Batches, SimpleRequest
from celery_batches.trace import apply_batches_task
from opentelemetry.propagate import extract
from opentelemetry.trace import Span

from stoker.adapters.metrics import BATCH_SECONDS, BATCH_SIZE, BATCH_WAIT_SECONDS
from stoker.adapters.tracing import mark_failed, tracer
from stoker.core.batching import BatchPolicy, Waiting, plan_batch
from stoker.core.errors import DeadlineExceeded, InferenceFailed, StokerError
from stoker.core.jobs import BatchInfo, ErrorInfo, ResultInfo, final_status
from stoker.core.model import ModelRequest, Prediction, Predictor, run_predictor
from tasks import monitoring, resources
from tasks.watchdog import BatchWatchdog, RunningBatch
from tasks.worker import app

log = logging.getLogger(__name__)
_settings = resources.settings()


@dataclass(frozen=True)
class BatchItem:
    """One job in a batch, with its model request."""

    job_id: str
    request: ModelRequest
    preprocessed_at: float
    trace: dict[str, str] | None = None


def _infer_span(item: BatchItem, batch_id: str, size: int) -> Span:
    """The job's inference span: one batch serves many traces, so each job's span hangs off its stored context."""
    attributes: dict[str, str | int] = {"stoker.stage": "infer", "stoker.batch_id": batch_id, "stoker.batch_size": size}
    attributes["stoker.prompt_tokens"] = len(item.request.prompt_ids)
    return tracer.start_span("stage infer", context=extract(item.trace or {}), attributes=attributes)


class DeviceBatches(Batches):  # type: ignore[misc]
    """celery-batches driven by stoker's batching policy, flushing only when the device is free.

    Plain celery-batches flushes whatever arrived each interval, even while the model is busy, so under load the
    pool queues many tiny batches. Here every request waits until the policy (`plan_batch`: size, token budget,
    wait since the first arrival, deadlines) says its batch goes, and never while a batch runs: the device runs
    back to back on batches as large as the queue allows. Requests whose deadline passed are answered and
    acked without reaching the model.
    """

    abstract = True

    def __init__(self) -> None:
        super().__init__()
        self._busy = threading.Event()
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[Waiting, Request]] = {}
        self.running: Collection[Request] = ()
        self.policy = BatchPolicy(
            max_batch_size=_settings.max_batch_size,
            max_batch_tokens=_settings.max_batch_tokens,
            max_wait_s=_settings.max_wait_ms / 1000,
        )

    def _do_flush(self) -> None:
        with self._lock:
            now = time.time()
            for request in _take(self._buffer, self._buffer.qsize()):
                self._waiting[request.id] = (_as_waiting(request, now), request)
            plan = plan_batch([w for w, _ in self._waiting.values()], now, self.policy, not self._busy.is_set())
            expired = [self._waiting.pop(w.key)[1] for w in plan.expired]
            batch = [self._waiting.pop(w.key)[1] for w in plan.run]
            if not self._waiting and not batch:
                self._stop_timer()
        for request in expired:
            _drop_expired(request)
        if batch:
            self._busy.set()
            try:
                self.flush(batch)
            except Exception:
                self._busy.clear()
                raise

    def _stop_timer(self) -> None:
        timer: Any = getattr(self, "_tref", None)
        if timer is not None:
            timer.cancel()
        self._tref = None

    def give_back(self) -> None:
        """Before the process is replaced: ack the running batch (its jobs have ended) and requeue the rest."""
        for request in self.running:
            request.acknowledge()
        with self._lock:
            waiting = [r for _, r in self._waiting.values()] + _take(self._buffer, self._buffer.qsize())
            self._waiting.clear()
        for request in waiting:
            request.reject(requeue=True)

    def flush(self, requests: Collection[Request]) -> Any:
        """Run one batch in the pool; ack its messages and free the device when it returns."""
        serializable = ([SimpleRequest.from_request(r) for r in requests],)

        def on_return(_: Any) -> None:
            for request in requests:
                request.acknowledge()
            self.running = ()
            self._busy.clear()

        self.running = requests
        return self._pool.apply_async(apply_batches_task, (self, serializable, 0, None), callback=on_return)


def _as_waiting(request: Request, now: float) -> Waiting:
    """What the policy needs to know of a request: its size and deadline travel in the message."""
    kwargs = request.kwargs or {}
    tokens, deadline = kwargs.get("prompt_tokens"), kwargs.get("deadline")
    return Waiting(request.id, int(tokens or 0), now, float(deadline) if deadline else None)


def _drop_expired(request: Request) -> None:
    """A request whose deadline passed before its batch: the job fails, the message is done with."""
    job_id = str((request.kwargs or {}).get("job_id"))
    try:
        _expire(job_id, time.time())
        resources.store().stats.count_drained("infer")
    finally:
        request.acknowledge()


def _expire(job_id: str, now: float) -> None:
    late = DeadlineExceeded("the deadline passed while the job waited for the model", stage="infer_queue")
    if resources.store().jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict())):
        log.info("job %s dropped before the model: its deadline passed", job_id)


def _take(buffer: Queue[Request], limit: int) -> list[Request]:
    items: list[Request] = []
    while len(items) < limit:
        try:
            items.append(buffer.get_nowait())
        except Empty:
            break
    return items


#: How often the consumer looks at what waits: well inside max_wait_ms, cheap when nothing does.
TICK_S = min(_settings.max_wait_ms / 4000, 0.01)


@app.task(
    base=DeviceBatches,
    name="stoker.infer",
    flush_every=_settings.max_batch_size,
    flush_interval=TICK_S,
    acks_late=True,
    ignore_result=True,
)
def infer(requests: list[SimpleRequest]) -> None:
    """Serve one batch of jobs; messages are acked when this returns, after every result is written."""
    serve_batch([str(r.kwargs["job_id"]) for r in requests])


def serve_batch(job_ids: Sequence[str]) -> None:
    """Load the batch's requests, run the model once, write each job's result."""
    store = resources.store()
    items = _load_items(job_ids)
    store.stats.count_drained("infer", len(job_ids))
    if not items:
        return
    batch_id, started = uuid.uuid4().hex[:12], time.time()
    for item in items:
        store.jobs.stamp(item.job_id, "infer_start", at=started)
    spans = [_infer_span(item, batch_id, len(items)) for item in items]
    watchdog.begin(batch_id, [i.job_id for i in items])
    monitoring.device.begin()
    try:
        outcomes = predict_isolated(resources.predictor(), [i.request for i in items])
    finally:
        monitoring.device.end()
        ran = watchdog.end()
    ended = time.time()
    store.stats.add_device_time(ended - started)
    BATCH_SIZE.observe(len(items))
    BATCH_SECONDS.observe(ended - started)
    for item, outcome, span in zip(items, outcomes, spans, strict=True):
        if isinstance(outcome, StokerError):
            mark_failed(span, outcome.code)
        span.end()
        store.jobs.stamp(item.job_id, "infer_end", at=ended)
        BATCH_WAIT_SECONDS.observe(max(started - item.preprocessed_at, 0.0))
        batch = BatchInfo(id=batch_id, size=len(items), wait_ms=round((started - item.preprocessed_at) * 1000, 2))
        _finish(item.job_id, outcome, batch)
        monitoring.log_finished(item.job_id)
    late = " (past its budget: results dropped)" if ran and ran.overdue else ""
    log.info("batch %s: %d jobs in %.0f ms%s", batch_id, len(items), (ended - started) * 1000, late)


def _load_items(job_ids: Sequence[str]) -> list[BatchItem]:
    """Jobs still waiting for the model; a redelivered message of a finished job has no request left.

    A job whose deadline passed while it waited is dropped here, before the model: no one is waiting for it.
    """
    store = resources.store()
    items = []
    now = time.time()
    for job_id in dict.fromkeys(job_ids):
        request = store.jobs.get_request(job_id)
        if request is None:
            log.info("job %s has no pending request; skipping", job_id)
            continue
        clock = store.watch.clock(job_id)
        if clock.deadline and now >= clock.deadline:
            _expire(job_id, now)
            continue
        items.append(BatchItem(job_id, request, clock.preprocessed or now, store.jobs.trace_context(job_id)))
    return items


def predict_isolated(predictor: Predictor, requests: list[ModelRequest]) -> list[Prediction | StokerError]:
    """Run the batch; if it fails, retry each request alone so one bad item fails alone."""
    try:
        return list(run_predictor(predictor, requests))
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
    outcomes: list[Prediction | StokerError] = []
    for request in requests:
        outcomes.extend(predict_isolated(predictor, [request]))
    return outcomes


def _finish(job_id: str, outcome: Prediction | StokerError, batch: BatchInfo) -> None:
    store = resources.store()
    if isinstance(outcome, StokerError):
        store.jobs.finish(job_id, "failed", error=ErrorInfo(**outcome.to_dict()), batch=batch)
        return
    job = store.jobs.load_job(job_id)
    status = final_status(job.inputs) if job else "succeeded"
    result = ResultInfo(
        text=outcome.text,
        model=resources.predictor().name,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
    )
    store.jobs.finish(job_id, status, result=result, batch=batch)


def _fail_overdue(batch: RunningBatch) -> None:
    """The batch ran past its budget: its jobs fail now (a late return changes nothing)."""
    late = InferenceFailed(f"batch {batch.id} ran past its {watchdog.budget_s:.0f}s budget", stage="infer")
    for job_id in batch.job_ids:
        resources.store().jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict()))


#: Exit status of an inference worker that gave up on a wedged device; its supervisor starts a fresh one.
WEDGED_EXIT = 75


def _replace_worker(batch: RunningBatch) -> None:
    """The device is wedged: hand the queued messages back and exit, so a fresh process takes over."""
    try:
        infer.give_back()
    finally:
        logging.shutdown()
        os._exit(WEDGED_EXIT)


watchdog = BatchWatchdog(_settings.infer_batch_timeout_s, _settings.infer_wedge_grace_s, _fail_overdue, _replace_worker)


@celeryd_after_setup.connect
def _preload(sender: str, instance: Any, **_: Any) -> None:
    """Load the model when this worker consumes the inference queue, before the first batch arrives."""
    if {"infer", "sync"} & set(instance.app.amqp.queues.consume_from or {}):
        resources.predictor()
        watchdog.watch()
        monitoring.watch_device(_settings.device_sample_s)
